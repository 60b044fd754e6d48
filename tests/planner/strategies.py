"""Random planner inputs the property tests share."""

from hypothesis import strategies as st

cost = st.floats(0.05, 5.0, allow_nan=False)


def draw_shares(draw, p: int) -> dict[str, list[float]]:
    """F, B and W of each of `p` device shares, uneven, as a `@st.composite` draws them."""
    share = st.lists(cost, min_size=p, max_size=p)
    return {"F": draw(share), "B": draw(share), "W": draw(share)}
