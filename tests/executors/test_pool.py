"""The suite's shared executors (tests.harness.ExecutorPool): a cluster handed out again is each
executor `reset` (executors/optable.py), so a test cannot see what the one before it left."""

from __future__ import annotations

from executors.optable import _reset
from tests.harness import op_context


def test_reset_drops_what_ops_left_in_the_context():
    ctx = op_context()
    ctx.state["torch_models"], ctx.background["generate:m"] = {"m": object()}, object()
    assert _reset(ctx) == 2
    assert (ctx.state, ctx.background) == ({}, {})
    assert _reset(ctx) == 0


def test_a_cluster_handed_out_again_holds_nothing_of_the_test_before(pool):
    ctl, (executor,) = pool.cluster(1, kind="torch", name_prefix="pool-test")
    assert ctl.submit("countdown", config={"count": 2}, executor=executor.id).result(
        timeout=60) is not None  # it leaves its Background in the executor's context

    again, (same,) = pool.cluster(1, kind="torch", name_prefix="pool-test")
    assert (again, same.pid) == (ctl, executor.pid)  # the same process, not a new one
    assert ctl.submit("reset", executor=same.id).result(timeout=60) == 0  # the pool's did
