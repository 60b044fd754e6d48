"""Figures of Qi, Wan, Huang, Lin: "Zero Bubble Pipeline Parallelism", ICLR 2024."""

# Table 9's profiles (model, p, m, T_F, T_B, T_W, T_comm), then the bubble rates Table 5 prints
# for them: 1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p
TABLE5 = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1585, 0.1083, 0.1585, 0.0433),
    ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626, 0.1985, 0.1242, 0.0837, 0.1242, 0.0039),
    ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762, 0.1240, 0.0674, 0.0444, 0.0674, 0.0026),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.2347, 0.1323, 0.0698, 0.1323, 0.0029),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.2552, 0.1397, 0.0672, 0.1397, 0.0066),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.2646, 0.1421, 0.0641, 0.1421, 0.0038),
]
TABLE5_IDS = [f"{r[0]}-p{r[1]}-m{r[2]}" for r in TABLE5]

# The ZB repository's ZB-V (sail-sg/zero-bubble-pipeline-parallelism,
# megatron/core/pipeline_parallel/zerobubble/scheduler/zbv.py: PipelineGraph, the best of its
# fill_f/fill_b tries, chunk costs T/2), its per-device order simulated by flowkit's simulator:
# the bubble rate each reaches, memory p. On Table 9's profiles (TABLE5's rows, in order):
ZBV_REPOSITORY_TABLE5 = [0.0703, 0.0543, 0.0298, 0.0403, 0.0498, 0.0531]
# On the settings of the repository's own tests (tests/unit_tests/pipeline_parallel/
# test_pass.py: F = B = W = 1000 a chunk, comm 10, the memory of h = 4096, a = 8, s = 4096):
# (p, m, bubble rate)
ZBV_REPOSITORY_TESTS = [(4, 4, 0.1131), (4, 8, 0.0029), (4, 16, 0.0015), (2, 2, 0.0783),
                        (2, 4, 0.0017), (8, 4, 0.3896), (8, 8, 0.1295), (8, 16, 0.0041)]
