"""The suite's shared executors (tests.harness.ExecutorPool): a cluster handed out again is each
executor reset (`reset_executor` in executors/optable.py), so a test cannot see what the one
before it left."""

from __future__ import annotations

import pytest

from executors.optable import _reset_executor
from tests.harness import op_context


class _Background:
    def __init__(self, busy: bool) -> None:
        self._busy = busy

    def busy(self) -> bool:
        return self._busy

    def step(self) -> None:
        pass


def test_reset_drops_what_ops_left_in_the_context():
    ctx = op_context()
    ctx.state["torch_models"], ctx.background["generate:m"] = {"m": object()}, _Background(False)
    assert _reset_executor(ctx) == 2
    assert (ctx.state, ctx.background) == ({}, {})
    assert _reset_executor(ctx) == 0


def test_reset_is_refused_while_a_background_still_works_and_drops_nothing():
    ctx = op_context()
    ctx.state["torch_models"], ctx.background["generate:m"] = {"m": object()}, _Background(True)
    with pytest.raises(RuntimeError, match="generate:m still work"):
        _reset_executor(ctx)
    assert set(ctx.state) == {"torch_models"} and set(ctx.background) == {"generate:m"}


def test_a_cluster_handed_out_again_holds_nothing_of_the_test_before(pool):
    ctl, (executor,) = pool.cluster(1, kind="torch", name_prefix="pool-test")
    assert ctl.submit("countdown", config={"count": 2}, executor=executor.id).result(
        timeout=60) is not None  # it leaves its Background in the executor's context

    again, (same,) = pool.cluster(1, kind="torch", name_prefix="pool-test")
    assert (again, same.pid) == (ctl, executor.pid)  # the same process, not a new one
    assert ctl.submit("reset_executor", executor=same.id).result(timeout=60) == 0  # the pool's did
