"""Elastic runs (`RunConfig.elastic`, `flowkit run --elastic`): lost executors that are not
replaced shrink the run instead of ending it.

The design: [Note: elastic runs] below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from flowkit.dsl import Flow
from flowkit.runner.config import RunConfig, RunConfigError
from flowkit.runner.setup import backprops_of, trained_as
from flowkit.runtime.controller import Controller
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["Elastic", "check_elastic", "layout_for", "relayout", "trained_layout"]


# [Note: elastic runs] An elastic run is a restart ([Note: executor restarts] in
# flowkit/runner/checkpoints/restarts.py) whose replacements do not come: once the launcher may
# replace no more (past --max-restarts, or none allowed), the run waits --elastic-wait seconds
# for executors started by hand to join (they may keep the layout), re-plans the flow on the
# layout the executors it has allow, and restores the newest checkpoint on it as `--resume` on
# another layout does ([Note: layout-free checkpoints] in executors/torch/layout_free.py).
# Fewer replicas first, as many as fit beside the stages (the batch is the same, split over
# fewer: a step computes the same sums); fewer stages only when the executors left cannot hold
# one replica's. So the run from there is the run stopped at that checkpoint and resumed on the
# smaller layout, curve and weights. One layout for every trained model, as --stages and
# --replicas give it, over executors that each carry every tag: other placements are refused.
# Executors that join later (started by hand) grow the run back, up to the layout it started
# with, at the next checkpoint it writes: the run goes on from that checkpoint on the larger
# layout, which changes no sum either.

_QUIESCE_S = 120.0  # as restarts: the survivors' tasks of the failed step end first


def check_elastic(config: RunConfig, shared: bool) -> None:
    """RunConfigError, before any executor starts, for an elastic run that cannot work."""
    if not config.elastic:
        return
    checkpoints = config.checkpoints
    if checkpoints is None or checkpoints.every is None:
        raise RunConfigError("elastic", "--elastic goes on from the newest checkpoint on the "
                             "executors left: give --checkpoint-dir and --checkpoint-every")
    if shared:
        raise RunConfigError("elastic", "an elastic run re-plans the executors it started: "
                             "give no controller, or no elastic")
    if config.tags is not None or config.placement not in (None, "colocated"):
        raise RunConfigError("elastic", "--elastic re-plans over executors that each carry "
                             "every tag: leave --tags and --placement out (colocated)")


def layout_for(full: tuple[int, int], count: int) -> tuple[int, int]:
    """(stages, replicas) of the trained models on `count` executors, for a run whose whole
    layout is `full`: its stages and as many of its replicas as fit, else one replica in as many
    stages as executors."""
    stages, replicas = full
    if count >= stages:
        return stages, max(1, min(replicas, count // stages))
    return max(1, count), 1


def trained_layout(flow: Flow) -> tuple[int, int] | None:
    """(stages, replicas) of the flow's trained models, the most of each; None: it trains
    none."""
    trained = [flow.models[node.model] for node in backprops_of(flow)]
    if not trained:
        return None
    return max(m.stages for m in trained), max(m.replicas for m in trained)


def relayout(flow: Flow, stages: int, replicas: int) -> None:
    """The trained models of `flow` (in place) in `stages` and `replicas`: an FSDP model on
    one replica trains unsharded, which is what it computes anyway."""
    for name in {node.model for node in backprops_of(flow)}:
        model = flow.models[name]
        shard = None if model.shard == "fsdp" and replicas < 2 else model.shard
        flow.models[name] = trained_as(model, stages=stages, replicas=replicas,
                                       shard_optimizer=model.shard_optimizer, shard=shard)


@attrs.define(kw_only=True)
class Elastic:
    """What a run needs to go on with the executors it has [Note: elastic runs]."""

    wait_s: float  # for executors started by hand to join
    replan: Callable[[int], tuple[Any, str]]  # executors -> (a fresh runner, its layout)
    larger: Callable[[int], bool]  # whether that many executors allow a larger layout
    shrinks: int = 0  # recoveries with fewer executors than before
    grows: int = 0  # re-plans on more executors, at a checkpoint

    def go_on(self, controller: Controller, wanted: int, warn: Callable[[str], None]
              ) -> tuple[Any, list[ExecutorInfo]]:
        """(a fresh runner, every executor) on the executors connected once the survivors'
        tasks end and `wanted` are in, or `wait_s` is over."""
        controller.quiesce(_QUIESCE_S)
        if len(controller.executors()) < wanted and self.wait_s > 0:
            warn(f"waiting up to {self.wait_s:g} s for executors started by hand to join")
            try:
                controller.wait_for_executors(wanted, timeout=self.wait_s)
            except TimeoutError:
                pass
        executors = controller.executors()
        runner, layout = self.replan(len(executors))
        if len(executors) < wanted:
            self.shrinks += 1
            warn(f"the run shrinks to {len(executors)} executor"
                 f"{'s' * (len(executors) > 1)}: {layout}")
        else:
            warn(f"executors started by hand took the lost ones' place: {layout}")
        return runner, executors

    def grow(self, controller: Controller, names: frozenset, warn: Callable[[str], None]
             ) -> tuple[Any, list[ExecutorInfo]] | None:
        """(a fresh runner, every executor) on a larger layout when executors started by hand
        joined a run that shrank, and allow one; None otherwise. Called at a checkpoint, with
        no task open: the run goes on from it [Note: elastic runs]."""
        executors = controller.executors()
        if len(executors) <= len(names) or not self.larger(len(executors)):
            return None
        controller.quiesce(_QUIESCE_S)  # nothing of the last step may change what reloads
        runner, layout = self.replan(len(executors))
        self.grows += 1
        warn(f"{len(executors) - len(names)} executor(s) joined: the run grows to "
             f"{len(executors)}: {layout}")
        return runner, executors
