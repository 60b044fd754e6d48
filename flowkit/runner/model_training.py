"""One trained model's part of a flow run: its backprop's pipeline schedule fed with microbatches,
its optimizer step across stages, the weight sync after it, and saving its weights.

A step (steprun.py) owns its streams and node states and calls a `ModelTraining` through
four methods: `start_step`, `feed` (the backprop node, whenever its inputs grow: it reads them
through an `Inputs` view and returns the step's backprop, feeding.py), `optimizer_step` (the
optimizer-step node) and `save`; each submitted future is handed back through the `Watch` it is
given. Its schedules are trainschedule.py's. A backprop with several minibatch rounds also takes
the optimizer steps of all rounds but the last itself [Note: minibatch rounds in
flowkit/ops/minibatches.py].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from flowkit.dsl import Model
from flowkit.ops import rounds_of
from flowkit.planner import (
    Action,
    Costs,
    Kind,
    MemoryModel,
    Schedule,
    simulate,
)
from flowkit.planner.lower import NodePlan
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.bubble_fill import BubbleFill
from flowkit.runner.feeding import (
    Feeding,
    MinibatchRounds,
    chunk,
    form_microbatches,
    inputs_made,
    token_bins,
    train_rounds,
)
from flowkit.runner.pipeline import (
    Gate,
    Lane,
    StreamedSchedule,
    device_lane,
    stage_costs_config,
)
from flowkit.runner.replicas import Replicas, ReplicatedSchedule, replica_lane
from flowkit.runner.stepstate import FlowRunError, Inputs, sorted_lineages
from flowkit.runner.token_microbatches import TokenSlots, first_fit_decreasing, planned_count
from flowkit.runner.training_tasks import (
    model_spec,
    pipeline_config,
    submit_exports,
    submit_optimizer_step,
)
from flowkit.runner.trainschedule import TrainingSchedules
from flowkit.runner.weight_sync import WeightSync
from flowkit.runtime.controller import Controller
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.refs import Gather

__all__ = ["ModelTraining", "Watch"]



class Watch(Protocol):
    """How the step that feeds a training hears of each future it submits: `watch(lineage,
    futures, register=..., outputs=None)` accounts for them and, with `register`, adds them
    (or `outputs` in their place) to the node's outputs under `lineage`."""

    def __call__(self, lineage: tuple, futures: tuple, *, register: bool,
                 outputs: tuple | None = None) -> None: ...


class Fusion(Protocol):
    """The fused training a model's backprop is a member of (fusedtrain.FusedTraining)."""

    predicted: dict[str, float]

    def lanes(self, index: int) -> Callable[[int], str]: ...

    def gate(self, index: int) -> Gate: ...

    def start_step(self, step: int) -> None: ...

    def planned_member(self, index: int, node: str, schedule: Schedule, costs: Costs,
                       limit: float | None, submitter: Any) -> None: ...

    def advance(self) -> None: ...


class ModelTraining:
    """The pipeline training of one model on `executors` (stage s on the device the schedule
    gives it; with replicas, D pipelines one after the other [Note: replicas in
    flowkit/runner/replicas.py]). `users` are the (op, tags) of the flow's other ops with the
    model, which get its weights after each optimizer step. What it learns once (profiled
    costs, built schedules, the last step's item count) it keeps across steps."""

    def __init__(self, ctl: Controller, model: Model, executors: list[ExecutorInfo], *,
                 users: Sequence[tuple[str, frozenset]], sim_costs: SimCosts | None, fuse: bool,
                 timeout: float, profiles: dict, steps: Sequence[NodePlan] = (),
                 bubble_fill: BubbleFill | None = None, weight_sync: str = "auto") -> None:
        self.ctl, self.model, self.executors = ctl, model, executors
        self.users, self.sim_costs, self.fuse, self.timeout = users, sim_costs, fuse, timeout
        self.steps = steps  # the flow's optimizer-step nodes of the model: configure rounds
        self.profiles = profiles  # (model, stages) -> profiled costs, shared with the runner
        self.item_counts: dict[str, int] = {}  # backprop node -> items it trained on last step
        self.token_counts: dict[str, int] = {}  # ... and their tokens, with microbatch_tokens
        self.predicted_bubble: dict[str, float] = {}  # backprop node -> the simulator's
        self.trained: tuple | None = None  # (schedule, spec) of this step's backprop
        self.last_trained: tuple | None = None  # the same of the latest step that trained
        self.rounds: MinibatchRounds | None = None  # this step's backprop, when in rounds
        # backprop node -> this step's Feeding or MinibatchRounds, once planned
        self.backprops: dict[str, Feeding | MinibatchRounds] = {}
        self.synced: list = []  # this step's weight exports to the generating executors
        self.tracked: set[str] = set()  # backprop nodes whose activation memory is reported
        self.flops_unknown = False  # no MFU to report: stop asking (model_flops)
        self.step = 0
        # called before new weights go to the generating executors: an evaluation that runs
        # alongside an asynchronous run finishes on the weights it started with (evaluation.py)
        self.before_sync: Callable[[], None] | None = None
        self.dp = Replicas(ctl, model, executors, sim_costs or SimCosts())
        self.sync = WeightSync(ctl, model.name, weight_sync,  # [Note: weight sync paths]
                               trainer_lanes=(executors, self.dp.devices, self.lane_for))
        self.planning = TrainingSchedules(self)  # this step's schedules, built once an input
        self.replicas, self.devices = self.dp.count, self.dp.devices
        # the fused training it is member `fusion_index` of [Note: fused training]
        self.fusion: Fusion | None = None
        self.fusion_index = 0
        # its pipeline's bubbles lent to scoring [Note: bubble filling in bubble_fill.py]
        self.bubble_fill = bubble_fill

    def join_fusion(self, fusion: Fusion, index: int) -> None:
        """Train as member `index` of `fusion` [Note: fused training in fusedtrain.py]."""
        self.fusion, self.fusion_index = fusion, index

    def lane_for(self, replica: int) -> Lane:
        """The lanes of replica `replica`'s tasks: its own, or the fused group's."""
        if self.fusion is not None:
            return self.fusion.lanes(self.fusion_index)
        return replica_lane(self.model.name, replica)

    def replica(self, index: int) -> list[ExecutorInfo]:
        """The executors of replica `index`, by device."""
        return self.dp.of(index)

    @property
    def groups(self) -> list[str] | None:
        """The replica groups by device, once set up."""
        return self.dp.groups

    def leave_groups(self) -> list:
        return self.dp.leave() + self.sync.leave()

    def start_step(self, step: int) -> None:
        self.step, self.trained, self.rounds, self.synced = step, None, None, []
        self.backprops = {}
        if self.fusion is not None:
            self.fusion.start_step(step)

    def sync_bytes(self, timeout: float) -> int | None:
        """Bytes of this step's weight sync as serialized (one copy of what left the trainers:
        a LoRA model's adapters only), or None without one."""
        if not self.synced:
            return None
        for export in self.synced:
            export.exception(timeout)  # waits for it, fetching nothing
        return sum(export.nbytes for export in self.synced)

    def carried_state(self) -> dict:
        """What it carries from step to step that a run checkpoint keeps (checkpoints/): the
        last schedule trained with, not the model's spec, which the flow gives again."""
        return {"item_counts": dict(self.item_counts), "token_counts": dict(self.token_counts),
                "predicted_bubble": dict(self.predicted_bubble),
                "last_schedule": None if self.last_trained is None else self.last_trained[0]}

    def restore_carried(self, carried: dict) -> None:
        """Take back what `carried_state` gave; the spec is this flow's model's, never one a
        checkpoint file names [Note: run state on disk in
        flowkit/runner/checkpoints/state_codec.py]."""
        self.item_counts.update(carried["item_counts"])
        self.token_counts.update(carried.get("token_counts", {}))
        self.predicted_bubble.update(carried["predicted_bubble"])
        schedule = carried["last_schedule"]
        self.last_trained = None if schedule is None else (
            schedule, model_spec(self.model, schedule.num_stages))

    # -- the backprop --------------------------------------------------------------------------
    # [Note: streamed microbatches] A backprop cuts its items into the configured number of
    # microbatches and runs them under a pipeline schedule. As a barrier (the first step, a
    # loss that needs the batch's size, or --no-fuse) it waits for every item. Streamed (a loss
    # its LossSpec says is in sum form, from the second step on) it plans for as many items as
    # the last step had, forms microbatch k from the next items to arrive once there are enough
    # of them, and submits the schedule's actions as far as the formed microbatches allow; only
    # the forwards of stage 0 and the last stage read a microbatch, so F/B/W of early
    # microbatches run while
    # later samples are still being generated. The last microbatch takes what is left when the
    # inputs close (and if fewer items came than planned, the ones not yet formed share the
    # rest; one may be empty). The loss is a sum over tokens that the optimizer step divides by
    # the step's total, so the gradient does not depend on how the items were cut.
    # A backprop in minibatch rounds (epochs x minibatches > 1) is always a barrier: an epoch
    # shuffles the whole batch [Note: minibatch rounds in flowkit/ops/minibatches.py].
    def feed(self, plan: NodePlan, inputs: Inputs, closed: bool,
             watch: Watch) -> Feeding | MinibatchRounds | None:
        """Form microbatches from the items of `inputs` that are in and submit what of the
        schedule they let run; with every input `closed`, the rest. The backprop of `plan` in
        this step once it is planned (None until then); its `submitted` says when every action
        is out."""
        backprop = self.backprops.get(plan.name)
        if rounds_of(plan.config) > 1:
            if closed and backprop is None:
                backprop = self.backprops[plan.name] = train_rounds(self, plan, inputs, watch)
                self.rounds = backprop
            return backprop
        if backprop is None:
            expected = self.item_counts.get(plan.name) if self._streams(plan) else None
            if expected is None and not closed:
                return None  # a barrier: the microbatches are cut from every item
            count = len(inputs.complete()) if expected is None else expected
            if not closed and self._awaits_profile_sample(plan, inputs, count):
                return None
            backprop = self.backprops[plan.name] = self._start_pipeline(plan, inputs, count,
                                                                        watch)
        feeding: Feeding = backprop
        if feeding.next_mb < len(feeding.sizes):
            form_microbatches(feeding, inputs, closed)
        if self.fusion is None:
            feeding.submitter.advance()
        else:  # a member waiting for another's action goes on once that one is submitted
            self.fusion.advance()
        if feeding.submitter.done and not feeding.counted:
            feeding.counted = True
            if feeding.taken:  # a step with no items (every group filtered out) teaches none:
                self.item_counts[plan.name] = len(feeding.taken)  # the next step is a barrier
                self.token_counts[plan.name] = feeding.tokens_taken
        return feeding

    def _streams(self, plan: NodePlan) -> bool:
        """Whether a backprop may start before its inputs close: when fusing, and when its loss
        is normalized once at the optimizer step, so a microbatch needs no batch total."""
        return self.fuse and plan.loss_spec is not None and plan.loss_spec.summed(plan.config)

    def _awaits_profile_sample(self, plan: NodePlan, inputs: Inputs, items: int) -> bool:
        """Whether a streamed backprop waits to be planned until its first microbatch's items
        are in: planning profiles a stage count not profiled before on such a microbatch. A
        run profiles its layout in its first step, a barrier; a run resumed on another layout
        (another stage count) meets it in a streamed step. Planning later changes nothing the
        step computes: the microbatches are formed from the items in their arrival order."""
        count, sizes, _ = self._microbatch_plan(plan, inputs, items)
        return (len(inputs.complete()) < sizes[0]
                and self.planning.unprofiled(plan, plan.config.get("schedule") or "1f1b", count))

    def _start_pipeline(self, plan: NodePlan, inputs: Inputs, items: int,
                        watch: Watch) -> Feeding:
        """The schedule for `items` items in the configured number of microbatches, ready to
        be fed; each submitted action is watched, the last stage's forwards for their stats."""
        count, sizes, slots = self._microbatch_plan(plan, inputs, items)
        kind = plan.config.get("schedule") or "1f1b"

        def sample() -> Gather:  # the first microbatch's items: in (a barrier's, or
            # those a streamed step waited for: _awaits_profile_sample)
            return inputs.first(inputs.complete()[:sizes[0]])

        # no items in (every group filtered out): one empty microbatch, nothing to profile on
        stage_costs, schedules = self.planning.replicas(plan, kind, count,
                                                        sample if inputs.complete() else None)
        lends = self.bubble_fill is not None and self.replicas == 1 and self.fusion is None
        opened_by: dict = {}  # [Note: bubble filling in bubble_fill.py]: filled in once planned
        submitter = self.replicated(plan, schedules, stage_costs, sizes, watch,
                                     lineage=lambda mb: (mb,),
                                     meta={"node": plan.name, "step": self.step},
                                     opened_by=opened_by)
        self.predicted_bubble[plan.name] = simulate(schedules[0], stage_costs).bubble_rate
        if lends:
            run = submitter.runs[0]
            opened_by.update(self.bubble_fill.plan(
                schedules[0], stage_costs, self.replica(0), started=lambda: bool(run.futures),
                ready=functools.partial(inputs_made, run)))
        if self.fusion is not None:
            self.fusion.planned_member(self.fusion_index, plan.name, schedules[0], stage_costs,
                                       plan.config.get("memory_limit"), submitter)
        streamed = plan.name in self.item_counts and self._streams(plan)
        return Feeding(submitter=submitter, sizes=sizes, streamed=streamed,
                       budget=plan.config.get("microbatch_tokens"), slots=slots)

    def _microbatch_plan(self, plan: NodePlan, inputs: Inputs,
                         items: int) -> tuple[int, list[int], TokenSlots | None]:
        """(microbatches, items in each, their slots by replica with a token budget): the
        configured count, or with `microbatch_tokens` as many as the items' tokens fill (the
        last step's, streamed) [Note: token-budget microbatches in token_microbatches.py]."""
        budget = plan.config.get("microbatch_tokens")
        streamed = self._streams(plan) and plan.name in self.item_counts
        if budget is not None and not streamed:
            return self._token_barrier(inputs, budget)
        count = max(self.replicas, min(int(plan.config.get("microbatches") or 1), items or 1))
        if budget is not None and self.token_counts.get(plan.name):  # as last step's filled
            count = planned_count(self.token_counts[plan.name], budget, self.replicas)
        sizes = [len(chunk(range(items), count, mb)) for mb in range(count)]
        return count, sizes, None if budget is None else TokenSlots.of(count, self.replicas)

    def _token_barrier(self, inputs: Inputs,
                       budget: int) -> tuple[int, list[int], TokenSlots]:
        """`_microbatch_plan` of a barrier with a token budget: every item is in, packed."""
        lineages = sorted_lineages(inputs.complete())
        tokens = inputs.tokens(lineages)
        bins = len(first_fit_decreasing(lineages, tokens, budget))
        count = self.replicas * max(1, -(-bins // self.replicas))  # as many for each replica
        sizes = [0] * count
        for microbatch, chosen in token_bins(lineages, tokens,
                                             TokenSlots.of(count, self.replicas)):
            sizes[microbatch] = len(chosen)
        return count, sizes, TokenSlots.of(count, self.replicas)

    def replicated(self, plan: NodePlan, schedules: list[Schedule], stage_costs: Costs,
                    sizes: list[int], watch: Watch, *, lineage: Callable[[int], tuple],
                    meta: dict, opened_by: dict | None = None) -> ReplicatedSchedule:
        """Each replica's schedule, ready to be fed by global microbatch index (sizes: items per
        global microbatch); each submitted action is watched, the last stage's forwards for
        their stats, registered under `lineage(global microbatch)`."""
        self.dp.set_up(lambda f: watch((), (f,), register=False))
        sim = self.sim_costs or SimCosts()
        tracked = plan.config.get("offload") is not None  # [Note: activation memory reports]
        base = stage_costs_config(stage_costs, activation_bytes=sim.activation_bytes,
                                  memory=MemoryModel(), chunks=schedules[0].placement.chunks)
        if tracked or sim.per_token("F") or sim.per_token("BW"):
            costed = base

            def base(action: Action) -> dict:  # [Note: per-token costs in executors/sim/ops.py]
                per_token = sim.per_token(action.kind.name)
                return {**costed(action), **({"track_memory": True} if tracked else {}),
                        **({"seconds_per_token": per_token} if per_token else {})}

        if tracked:
            self.tracked.add(plan.name)
        spec = model_spec(self.model, schedules[0].num_stages)
        self.dp.check_sharding(schedules[0], spec, self.lane_for,
                               lambda f: watch((), (f,), register=False))
        last, count = schedules[0].num_stages - 1, self.replicas
        submitters = []
        for replica, schedule in enumerate(schedules):
            config_for = self.dp.early_reduce(schedule, pipeline_config(
                base, spec, sizes[replica::count], plan.config, plan.loss_spec, total=sum(sizes),
                reference=plan.reference),
                schedules)

            def on_submit(action: Action, future: Any, replica: int = replica) -> None:
                is_loss = action.kind is Kind.F and action.stage == last
                key = lineage(action.microbatch * count + replica) if is_loss else ()
                watch(key, (future,), register=is_loss)
                if opened_by:  # the bubbles this action opens [Note: bubble filling]
                    self.bubble_fill.watch(opened_by, action, future)

            submitters.append(StreamedSchedule(
                self.ctl, schedule, self.replica(replica), config_for=config_for,
                lane=self.lane_for(replica),
                meta={**meta, "replica": replica} if count > 1 else meta, on_submit=on_submit,
                gate=None if self.fusion is None else self.fusion.gate(self.fusion_index)))
        self.trained = self.last_trained = (schedules[0], spec)
        replicated = ReplicatedSchedule(submitters)
        self.dp.current = replicated.runs
        return replicated

    # -- the optimizer step and what follows it ------------------------------------------------
    def optimizer_step(self, plan: NodePlan, stats: list, watch: Watch) -> None:
        """The optimizer step across the model's stages, each in its device's lane (after its
        W ops); stage 0 reads every microbatch's stats and reports the step. After rounds, it
        is the last round's step: it reads that round's stats, for their normalizer, and the
        earlier rounds' reports, which its report sums up (flowkit.ops.records.step_report)."""
        if self.trained is None:
            raise FlowRunError(f"step {self.step}: {plan.name!r} steps model "
                               f"{self.model.name!r}, but no backprop of it ran in this step "
                               "to make its gradients")
        if self.rounds is not None:
            losses = [f for run in self.rounds.rounds[-1] for f in run.losses]
            stats = [Gather(losses), Gather(self.rounds.reports)]
        report = self.submit_step(plan, stats, watch, outputs=len(plan.outputs))
        registered = report
        if "weights" in plan.outputs:
            loads = self._sync_weights(plan, report[plan.outputs.index("weights")], watch)
            for future in loads:
                watch((), (future,), register=False)
            if loads:  # the next step's generation waits for the weights on its executor
                registered = tuple(Gather(loads) if port == "weights" else future
                                   for port, future in zip(plan.outputs, report))
        watch((), report, register=True, outputs=registered)

    def submit_step(self, plan: NodePlan, stats: list, watch: Watch, *, outputs: int,
                     round_index: int | None = None) -> tuple:
        """Submit one optimizer step with `plan`'s config on every replica, watching the ops
        that report nothing; returns replica 0's reporting stage's `outputs` futures."""
        schedule, spec = self.trained
        cost = self.sim_costs.config_for("optimizer_step") if self.sim_costs else {}
        config = {**plan.config, **cost, "step": self.step}
        meta = {"node": plan.name, "step": self.step, **({} if round_index is None else
                                                         {"round": round_index})}
        reported = None
        for replica in range(self.replicas):
            quiet, report = submit_optimizer_step(
                self.ctl, schedule, self.replica(replica), spec, stats, config,
                lane=self.lane_for(replica),
                meta={**meta, "replica": replica} if self.replicas > 1 else meta,
                outputs=outputs, reports=replica == 0, reduce=self.dp.reduction(schedule),
                step_config=self.dp.sharding(schedule))
            reported = report if replica == 0 else reported
            for future in quiet:
                watch((), (future,), register=False)
        return reported if outputs > 1 else (reported,)

    def _sync_weights(self, plan: NodePlan, version: Any, watch: Watch) -> list:
        """Submit the new weights to every executor that may generate or score with the model
        in this flow (where the executors can load weights: torch, not the simulator)."""
        targets = {e.id: e for op, tags in self.users for e in self.ctl.executors()
                   if e.runs(op, tags)}
        if not targets or not all("load_weights" in e.ops for e in targets.values()):
            return []
        if self.before_sync is not None:
            self.before_sync()
        schedule, spec = self.trained  # replica 0's stages export: every replica holds them
        self.dp.gather_whole(schedule, spec, self.lane_for, {"node": f"{plan.name}/sync"})
        exports, loads = self.sync.submit(
            schedule, self.executors, spec, version, list(targets.values()),
            lane=self.lane_for(0), meta={"node": f"{plan.name}/sync", "step": self.step},
            watch=lambda future: watch((), (future,), register=False))
        self.synced += exports
        return loads

    def save(self, folder: Path) -> Any:
        """A future of the path its stages' weights were written to, merged by the unsplit
        model's names, as `folder`/NAME.pt (a checkpoint a model config's `checkpoint` key
        starts from), or as the folder `folder`/NAME for a model with a format of its own (a
        Hugging Face causal LM's, which `from_pretrained` loads). Each stage's export goes to stage
        0's executor, which writes the file: no tensor comes to the controller."""
        name = self.model.name
        if not all("save_weights" in e.ops for e in self.executors):
            raise FlowRunError(f"the executors of model {name!r} cannot save weights: save "
                               "them from torch executors (--executors torch)")
        schedule, spec = self.last_trained
        self.dp.gather_whole(schedule, spec, self.lane_for, {"node": "save"})
        exports = submit_exports(self.ctl, schedule, self.executors, spec, lane=self.lane_for(0),
                                 meta={"node": "save", "step": self.step})
        first = schedule.placement.device_of(0)
        return self.ctl.submit("save_weights", *exports,
                               config={"path": str(Path(folder).resolve() / f"{name}.pt"),
                                       "spec": spec},
                               executor=self.executors[first].id,
                               lane=device_lane(self.lane_for(0), first),
                               meta={"node": "save", "step": self.step})

