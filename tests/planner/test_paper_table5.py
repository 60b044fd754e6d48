"""Zero Bubble paper, Table 5 (bubble rates) from its Table 9 profiles; figures in ANCHORS.md.

The paper's digits come out of our simulator unchanged when comm is charged once on every edge
between devices (F to the next stage's F, B to the previous stage's B), 1F1B runs the fused
backward (so upstream waits for B+W downstream), and ZB-H1/ZB-H2 are the fixed orders of
[Note: handcrafted zero-bubble orders]. The bubble rate is the paper's: (max stage span -
m(F+B+W)) / max stage span, which is ours because every device is equally busy here.
"""

import pytest

from flowkit.planner import Costs, simulate
from flowkit.planner.schedules import build_schedule

# model, p, m, T_F, T_B, T_W, T_comm, then the printed 1F1B, ZB-H1, ZB-H2 bubble rates
TABLE5 = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1585, 0.1083),
    ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626, 0.1985, 0.1242, 0.0837),
    ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762, 0.1240, 0.0674, 0.0444),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.2347, 0.1323, 0.0698),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.2552, 0.1397, 0.0672),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.2646, 0.1421, 0.0641),
]


@pytest.mark.parametrize(
    ("model", "p", "m", "F", "B", "W", "comm", "r1f1b", "rh1", "rh2"),
    TABLE5,
    ids=[f"{r[0]}-p{r[1]}-m{r[2]}" for r in TABLE5],
)
def test_bubble_rates_match_table5(model, p, m, F, B, W, comm, r1f1b, rh1, rh2):
    costs = Costs.uniform(p, F=F, B=B, W=W, comm=comm)
    for kind, printed in (("1f1b", r1f1b), ("zb-h1", rh1), ("zb-h2", rh2)):
        result = simulate(build_schedule(kind, devices=p, microbatches=m, costs=costs), costs)
        assert round(result.bubble_rate, 4) == pytest.approx(printed, abs=1e-12), kind
