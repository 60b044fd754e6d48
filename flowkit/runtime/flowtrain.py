"""The model-training part of running a flow: a backprop's microbatches fed to its pipeline
schedule (streamed or at a barrier), the optimizer step across stages, the weight sync that
follows it, and saving weights. `FlowRunner` (flowkit/runtime/flowrun.py) mixes it in; the
state it reads (streams, placement, the step) is the runner's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from flowkit.planner import Action, Costs, Kind, simulate
from flowkit.planner.lower import Call, InputRule, NodePlan
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simcosts import SimCosts
from flowkit.runtime.pipeline import PipelineRun, StreamedSchedule, stage_costs_config
from flowkit.runtime.records import ExecutorInfo
from flowkit.runtime.refs import Gather
from flowkit.runtime.training import (
    SUM_FORM_LOSSES,
    device_shares,
    model_spec,
    pipeline_config,
    profile_stages,
    submit_exports,
    submit_optimizer_step,
    submit_weight_sync,
)

if TYPE_CHECKING:
    from flowkit.runtime.flowrun import _NodeState

__all__ = ["TrainingSteps", "lineage_order"]


@attrs.define
class _Feeding:
    """A backprop's schedule being fed microbatches [Note: streamed microbatches]."""

    submitter: StreamedSchedule
    sizes: list[int]  # planned items per microbatch
    streamed: bool  # microbatches form as items arrive, not after the inputs close
    next_mb: int = 0
    taken: set = attrs.field(factory=set)  # lineages already in a microbatch
    # what arrived, kept as it comes so each event looks only at the new items
    seen: int = 0  # the first input's arrivals looked at
    waiting: list = attrs.field(factory=list)  # arrived there, not yet on every other input
    pool: list = attrs.field(factory=list)  # on every input, in no microbatch yet

    @property
    def run(self) -> PipelineRun:
        return self.submitter.run


class TrainingSteps:
    """FlowRunner's backprop (Call.PIPELINE) and optimizer-step (Call.STEP) nodes."""

    # -- a model's backprop --------------------------------------------------------------------
    # [Note: streamed microbatches] A backprop cuts its items into the configured number of
    # microbatches and runs them under a pipeline schedule. As a barrier (the first step, a
    # loss that needs the batch's size, or --no-fuse) it waits for every item. Streamed (a loss
    # in SUM_FORM_LOSSES, from the second step on) it plans for as many items as the last step
    # had, forms microbatch k from the next items to arrive once there are enough of them, and
    # submits the schedule's actions as far as the formed microbatches allow; only the forwards
    # of stage 0 and the last stage read a microbatch, so F/B/W of early microbatches run while
    # later samples are still being generated. The last microbatch takes what is left when the
    # inputs close (and if fewer items came than planned, the ones not yet formed share the
    # rest; one may be empty). The loss is a sum over tokens that the optimizer step divides by
    # the step's total, so the gradient does not depend on how the items were cut.
    def _feed_pipeline(self, state: _NodeState, live: list[InputRule], closed: bool) -> None:
        """Form microbatches from the items that are in and submit what of the schedule they
        let run; with every input closed, the rest."""
        plan = state.plan
        if state.pipeline is None:
            expected = self.item_counts.get(plan.name) if self._streams(plan) else None
            if expected is None and not closed:
                return  # a barrier: the microbatches are cut from every item
            count = len(self._complete(live)) if expected is None else expected
            self._start_pipeline(state, live, count)
        feeding: _Feeding = state.pipeline
        if feeding.next_mb < len(feeding.sizes):
            self._form_microbatches(feeding, live, closed)
        feeding.submitter.advance()
        if feeding.submitter.done and not state.started:
            state.started = True
            self.item_counts[plan.name] = len(feeding.taken)

    def _form_microbatches(self, feeding: _Feeding, live: list[InputRule], closed: bool) -> None:
        """Feed the next microbatches that the items in let form: each its planned size, the
        last (or, once the inputs close, every one left) from what remains."""
        _take_arrivals(feeding, self.streams, live)
        pool = feeding.pool
        if not feeding.streamed:
            pool.sort(key=lineage_order)  # a barrier cuts the items in their lineages' order
        while feeding.next_mb < len(feeding.sizes):
            mb, left = feeding.next_mb, len(feeding.sizes) - feeding.next_mb
            if closed:  # the rest, spread over the microbatches still to form
                size = len(pool) // left + (1 if len(pool) % left else 0)
            elif mb == len(feeding.sizes) - 1 or len(pool) < feeding.sizes[mb]:
                break  # the last microbatch takes whatever is left when the inputs close
            else:
                size = feeding.sizes[mb]
            chosen, pool = pool[:size], pool[size:]
            feeding.taken.update(chosen)
            feeding.submitter.feed(mb, tuple(
                Gather([self.streams[(r.src, r.src_port)].items[lin] for lin in chosen])
                for r in live))
            feeding.next_mb += 1
        feeding.pool = pool

    def _streams(self, plan: NodePlan) -> bool:
        """Whether a backprop may start before its inputs close: when fusing, and when its loss
        is normalized once at the optimizer step, so a microbatch needs no batch total."""
        return self.fuse and plan.config.get("loss") in SUM_FORM_LOSSES

    def _complete(self, live: list[InputRule]) -> list[tuple]:
        """Lineages every input port has, in the order the first port's items arrived."""
        lead = self.streams[(live[0].src, live[0].src_port)]
        others = [self.streams[(r.src, r.src_port)].items for r in live[1:]]
        return [lin for lin in lead.arrivals if all(lin in items for items in others)]

    def _start_pipeline(self, state: _NodeState, live: list[InputRule], items: int) -> None:
        """The schedule for `items` items in the configured number of microbatches, ready to
        be fed; each submitted action is watched, the last stage's forwards for their stats."""
        plan = state.plan
        executors = self.placement[plan.model.name]
        count = max(1, min(int(plan.config.get("microbatches") or 1), items or 1))
        sizes = [len(_chunk(range(items), count, mb)) for mb in range(count)]
        kind = plan.config.get("schedule") or "1f1b"
        first = self.streams[(live[0].src, live[0].src_port)]

        def sample() -> Gather:  # the first microbatch: formed, for a barrier
            return Gather([first.items[lin] for lin in self._complete(live)[:sizes[0]]])

        stage_costs, schedule = self._plan_schedule(plan, executors, kind, count, sample)
        spec = model_spec(plan.model, schedule.num_stages)
        sim = self.sim_costs or SimCosts()
        config_for = pipeline_config(
            stage_costs_config(stage_costs, activation_bytes=sim.activation_bytes), spec,
            sizes, plan.config)
        last = schedule.num_stages - 1

        def watch(action: Action, future: Any) -> None:
            is_loss = action.kind is Kind.F and action.stage == last
            self._watch(state, (action.microbatch,) if is_loss else (), (future,),
                        register=is_loss)

        submitter = StreamedSchedule(self.ctl, schedule, executors, config_for=config_for,
                                     lane=plan.model.name,
                                     meta={"node": plan.name, "step": self.step},
                                     on_submit=watch)
        streamed = plan.name in self.item_counts and self._streams(plan)
        state.pipeline = _Feeding(submitter=submitter, sizes=sizes, streamed=streamed)
        self.trained[plan.model.name] = (schedule, spec)
        self.predicted_bubble[plan.name] = simulate(schedule, stage_costs).bubble_rate

    def _plan_schedule(self, plan: NodePlan, executors: list[ExecutorInfo], kind: str,
                       count: int, sample: Callable[[], Any]) -> tuple[Costs, Any]:
        """The schedule for this step, from the simulator's costs or, on executors that can
        measure (torch), from F/B/W times profiled once per model and stage count."""
        limit = plan.config.get("memory_limit")
        devices = len(executors)
        if self.sim_costs is not None or not all("profile_stage" in e.ops for e in executors):
            costs = (self.sim_costs or SimCosts()).stage_costs(devices)
            schedule = self._schedule(kind, devices, count, costs, limit)
            return costs.for_placement(schedule.placement), schedule
        placement = self._schedule(kind, devices, count, Costs.uniform(devices), limit).placement
        key = (plan.model.name, placement.num_stages)
        if key not in self.profiles:
            self.profiles[key] = profile_stages(
                self.ctl, executors, placement, model_spec(plan.model, placement.num_stages),
                sample(), lane=plan.model.name, timeout=self.step_timeout)
        stage_costs = self.profiles[key]
        schedule = self._schedule(kind, devices, count, device_shares(stage_costs, placement),
                                  limit)
        return stage_costs, schedule

    def _schedule(self, kind: str, devices: int, count: int, costs: Costs,
                  limit: float | None) -> Any:
        """Built once per input: `auto` searches, which must not cost every step its time."""
        key = (kind, devices, count, costs, limit)
        if key not in self.schedules:
            self.schedules[key] = build_schedule(kind, devices=devices, microbatches=count,
                                                 costs=costs, memory_limit=limit)
        return self.schedules[key]

    def _submit_step(self, state: _NodeState) -> None:
        """The optimizer step across the model's stages, each in its device's lane (after its
        W ops); stage 0 reads every microbatch's stats and reports the step."""
        plan = state.plan
        name = plan.model.name
        if name not in self.trained:
            raise _error()(f"step {self.step}: {plan.name!r} steps model {name!r}, but no "
                               "backprop of it ran in this step to make its gradients")
        schedule, spec = self.trained[name]
        stats = [Gather(self.streams[(r.src, r.src_port)].ordered())
                 for r in plan.inputs if not r.feedback]
        config = {**plan.config, **self._cost_config("optimizer_step"), "step": self.step}
        quiet, report = submit_optimizer_step(
            self.ctl, schedule, self.placement[name], spec, stats, config, lane=name,
            meta={"node": plan.name, "step": self.step}, outputs=len(plan.outputs))
        for future in quiet:
            self._watch(state, (), (future,), register=False)
        report = report if len(plan.outputs) > 1 else (report,)
        registered = report
        if "weights" in plan.outputs:
            loads = self._sync_weights(plan, schedule, spec, report[plan.outputs.index("weights")])
            for future in loads:
                self._watch(state, (), (future,), register=False)
            if loads:  # the next step's generation waits for the weights on its executor
                registered = tuple(Gather(loads) if port == "weights" else future
                                   for port, future in zip(plan.outputs, report))
        self._watch(state, (), report, register=True, outputs=registered)

    def _sync_weights(self, plan: NodePlan, schedule: Any, spec: dict, version: Any) -> list:
        """Submit the trained model's new weights to every executor that may generate or score
        with it in this flow (where the executors can load weights: torch, not the simulator)."""
        name = plan.model.name
        users = [node for node in self.plan if node.model is not None
                 and node.model.name == name and node.call not in (Call.PIPELINE, Call.STEP)]
        targets = {e.id: e for node in users for e in self.ctl.executors()
                   if e.runs(node.op, frozenset(node.tags))}
        if not targets or not all("load_weights" in e.ops for e in targets.values()):
            return []
        return submit_weight_sync(self.ctl, schedule, self.placement[name], spec, version,
                                  list(targets.values()), lane=name,
                                  meta={"node": f"{plan.name}/sync", "step": self.step})

    # -- saving --------------------------------------------------------------------------------
    def save_weights(self, folder: Any) -> list:
        """Each model trained in the last step, its stages' weights merged by the unsplit
        model's names, to `folder`/NAME.pt: a checkpoint a model config's `checkpoint` key
        starts from. Needs executors that export weights (torch)."""
        from pathlib import Path

        from executors.torch.weights import save_checkpoint

        written = []
        for name, (schedule, spec) in sorted(self.trained.items()):
            executors = self.placement[name]
            if not all("export_weights" in e.ops for e in executors):
                raise _error()(f"the executors of model {name!r} cannot export weights: "
                                   "save them from torch executors (--executors torch)")
            exports = submit_exports(self.ctl, schedule, executors, spec, lane=name,
                                     meta={"node": "save", "step": self.step})
            dicts = [future.result(timeout=self.step_timeout) for future in exports]
            written.append(save_checkpoint(Path(folder) / f"{name}.pt", dicts))
        return written



def _chunk(items: list, count: int, index: int) -> list:
    """The index-th of `count` contiguous, near-equal slices of `items`."""
    base, extra = divmod(len(items), count)
    start = index * base + min(index, extra)
    return items[start:start + base + (1 if index < extra else 0)]


def _take_arrivals(feeding: _Feeding, streams: dict, live: list[InputRule]) -> None:
    """Move the lineages every input now has into the pool, looking only at new arrivals of
    the first input and those still waiting for a partner."""
    lead = streams[(live[0].src, live[0].src_port)]
    feeding.waiting += lead.arrivals[feeding.seen:]
    feeding.seen = len(lead.arrivals)
    others = [streams[(r.src, r.src_port)].items for r in live[1:]]
    still = []
    for lin in feeding.waiting:
        (feeding.pool if all(lin in items for items in others) else still).append(lin)
    feeding.waiting = still


def lineage_order(lineage: tuple) -> tuple:
    """Sort lineages whose parts mix ints and strings (group keys) without comparing the two."""
    return tuple((isinstance(part, str), part) for part in lineage)


def _error() -> type:
    from flowkit.runtime.flowrun import FlowRunError  # the runner's error, defined with it

    return FlowRunError
