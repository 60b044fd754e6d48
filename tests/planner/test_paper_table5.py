"""The bubble rates of Table 5 of the Zero Bubble paper (Qi, Wan, Huang, Lin: "Zero Bubble
Pipeline Parallelism", ICLR 2024) from the profiles of its Table 9.

The paper's digits come out of our simulator unchanged when comm is charged once on every edge
between devices (F to the next stage's F, B to the previous stage's B), 1F1B runs the fused
backward (so upstream waits for B+W downstream), and ZB-H1/ZB-H2 are the fixed orders of
[Note: handcrafted zero-bubble orders]. The bubble rate is the paper's: (max stage span -
m(F+B+W)) / max stage span, which is ours because every device is equally busy here.
"""

import pytest

from flowkit.planner import Costs, simulate
from flowkit.planner.schedules import build_schedule
from tests.planner.paper import TABLE5, TABLE5_IDS


@pytest.mark.parametrize(
    ("model", "p", "m", "F", "B", "W", "comm", "r1f1b", "rh1", "rh2"),
    [row[:10] for row in TABLE5],
    ids=TABLE5_IDS,
)
def test_bubble_rates_match_table5(model, p, m, F, B, W, comm, r1f1b, rh1, rh2):
    costs = Costs.uniform(p, F=F, B=B, W=W, comm=comm)
    for kind, printed in (("1f1b", r1f1b), ("zb-h1", rh1), ("zb-h2", rh2)):
        result = simulate(build_schedule(kind, devices=p, microbatches=m, costs=costs), costs)
        assert round(result.bubble_rate, 4) == pytest.approx(printed, abs=1e-12), kind
