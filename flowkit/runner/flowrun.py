"""Run a flow on executors, step by step, following the planner's lowering rules
([Note: lowering by granularity] in flowkit/planner/lower.py). A step's items, node states and
reactions to completions are its `StepRun` (steprun.py); the runner holds what lasts across
steps: the models' placement and training (model_training.py), length estimates, the weights each
step's generation reads.

The design: [Note: asynchronous steps] below.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from flowkit.dsl import Granularity
from flowkit.ops import rounds_of
from flowkit.planner.lower import Call, NodePlan
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.balance import Balancer, LengthEstimates
from flowkit.runner.bubble_fill import BubbleFill, bubble_scorers
from flowkit.runner.checkpoints.adaptor import RunnerCheckpoints
from flowkit.runner.feedback import Feedback
from flowkit.runner.fusedtrain import FusedTraining, fuse_groups
from flowkit.runner.model_training import ModelTraining
from flowkit.runner.partial import CarryOver, PartialRollouts
from flowkit.runner.quota import group_quotas
from flowkit.runner.sampling_rounds import checked_round_nodes
from flowkit.runner.second_round import checked_second_rounds
from flowkit.runner.sources_ahead import SourcesAhead, is_source
from flowkit.runner.steprun import TRAINING_CALLS, StepReport, StepRun
from flowkit.runner.stepstate import BalancedCalls, FlowRunError, Streams, Wiring
from flowkit.runner.submission import Submission
from flowkit.runner.training_tasks import model_spec
from flowkit.runtime.controller import Controller
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["FlowRunError", "FlowRunner", "StepReport", "check_async"]

_BURST = 4096  # reactions run before the steps look at what they touched, at most


# [Note: asynchronous steps] Synchronously, step k starts when step k-1 has ended: its generation
# reads the weights step k-1's optimizer step made. With a staleness bound η (`staleness=η`,
# `flowkit run --async --max-staleness η`) steps k+1 .. k+η are open while step k runs, and a node
# that reads weights fed back from an earlier step (generation, value and score inference) is
# admitted once the newest weights are at most η versions older than its step's: step s needs
# version >= s - η. That is AReaL's admission control (Fu et al. 2025): samples trained plus in
# flight never exceed (η + version + 1) x the batch. Weight loads reach a running engine between
# its iterations, each token recording its version, so no trained token lags the weights it
# updates by more than η. Training runs step after step; η = 0 is the synchronous run, operation
# for operation; with η >= 1 a loss with a proximal policy uses the decoupled objective (its
# LossSpec's `decoupled`). A step's training starts in its own `run_step` call, never between two
# ([Note: checkpoints of asynchronous runs] in flowkit/runner/checkpoints/open_steps.py). In full:
# docs/rl.md, "Asynchronous RL: bounded staleness and partial rollouts".


class FlowRunner:
    """Runs a lowered flow's steps through `ctl`; model ops go to executors with the model's
    tags, a model's pipeline stage s always to the same one. `staleness`: run asynchronously
    with that bound [Note: asynchronous steps] (None: synchronously); `steps`: how many steps
    the run has, so an asynchronous one starts no step past its end."""

    def __init__(self, ctl: Controller, plan: list[NodePlan], *,
                 sim_costs: SimCosts | None = None, step_timeout: float = 600.0,
                 fuse: bool = True, balance: bool = True, staleness: int | None = None,
                 steps: int | None = None, fill_bubbles: bool = False,
                 weight_sync: str = "auto") -> None:
        if staleness is not None:
            check_async(plan, staleness)
            plan = _with_proximal(plan) if staleness >= 1 else plan
        partial = _partial_rollouts(plan, staleness)
        rounds = checked_round_nodes(plan, partial)  # [Note: sampling rounds]
        second_rounds = checked_second_rounds(plan, partial, rounds, fuse=fuse)
        plan = [_without_take(node) if node.resumable is not None else node for node in plan]
        self.ctl, self.plan, self.sim_costs = ctl, plan, sim_costs
        self.staleness, self.steps = staleness, steps
        self.fuse, self.weight_sync = fuse, weight_sync  # [Note: weight sync paths]
        self.step_timeout = step_timeout
        consumers: dict[str, list[str]] = defaultdict(list)
        self.report_keys: dict[str, str] = {}
        for node in plan:
            for rule in node.inputs:
                if not rule.feedback:
                    consumers[rule.src].append(node.name)
                if rule.group_key is not None:
                    self.report_keys[rule.src] = rule.group_key
        for node in plan:
            _ask_item_tokens(node, self.report_keys)
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # every open step's reactions
        self.open: dict[int, StepRun] = {}
        # what the steps read of earlier ones, and the admission gate [Note: asynchronous steps]
        self.feedback = Feedback(plan, staleness, self.open)
        # training executors' bubbles lent to scoring [Note: bubble filling in bubble_fill.py]
        self.bubble_fill = BubbleFill(self.events, self._fill, bubble_scorers(plan)) \
            if fill_bubbles else None
        self.carry_over = CarryOver(self.open)  # [Note: partial rollouts in partial.py]
        # balance=False: calls of ops with a Workload go where the dispatcher's count says,
        # in arrival order, the baseline of length-aware dispatch [Note: length-aware dispatch]
        self.workloads = {node.name: self._workload(node) for node in plan
                          if balance and node.workload is not None and node.call is Call.PER_ITEM}
        self.placement = self._place_models()
        # model ops name the model's whole copy [Note: one model, many holders in
        # executors/torch/models/built.py], a simulator its costs
        op_configs = {node.name: {**model_spec(node.model, 1), **node.config,
                                  **(sim_costs.config_for(node.op) if sim_costs else {})}
                      for node in plan if node.model is not None}
        self.wiring = Wiring(plan=plan, consumers=consumers, report_keys=self.report_keys,
                             group_keyed=frozenset(rule.src for node in plan
                                                   for rule in node.inputs
                                                   if rule.group_key is not None),
                             op_configs=op_configs, fuse=fuse, step_timeout=step_timeout)
        # called after each burst of reactions: what waits on the steps without holding them
        # up (a checkpoint of an asynchronous run, [Note: checkpoints that do not drain])
        self.watchers: list[Callable[[], None]] = []
        self.last_run: StepRun | None = None  # the step running, or the last one run
        self.step = 0  # the step running, or the next one
        self.resumed = Streams()  # the feedback a resumed run starts from
        self.profiles: dict[tuple[str, int], Any] = {}  # (model, stages) -> profiled costs
        self.training = {node.model.name: self._training(node.model) for node in plan
                         if node.call is Call.PIPELINE}
        for name, training in self.training.items():  # [Note: bubble filling in bubble_fill.py]
            mine = {e.id for e in training.executors}
            if any(mine & {e.id for e in other.executors}
                   for other_name, other in self.training.items() if other_name != name):
                training.bubble_fill = None  # its bubbles hold another model's ops
        self.fusions = [FusedTraining(group, [self.training[name] for name in names])
                        for group, names in fuse_groups(plan).items()]
        # what its checkpoints copy, and a resumed run takes back [Note: run checkpoints in
        # flowkit/runner/checkpoints/format.py]
        self.checkpoints = RunnerCheckpoints(self)
        trainers = frozenset(e.id for model in self.training for e in self.placement[model])
        self.submission = Submission(
            wiring=self.wiring, ctl=ctl, events=self.events, workloads=self.workloads,
            trainers=trainers, bubble_fill=self.bubble_fill, partial=partial,
            quotas=group_quotas(plan), rounds=rounds, second_rounds=second_rounds,
            carry_over=self.carry_over,
            checkpoints=self.checkpoints, staleness=staleness,
            attempt=uuid.uuid4().hex[:8])  # in request names: unique to this runner
        sources = [node for node in plan if is_source(node)]
        if not staleness and steps is not None and sources:  # [Note: sources ahead]
            submission = self.submission
            submission.ahead = SourcesAhead(sources, submission.send_source, self.events,
                                            ctl.handled)

    def _workload(self, node: NodePlan) -> BalancedCalls:
        """Ask for what length-aware dispatch learns from without fetching anything: the key
        of each input item (from its producer) and the size of each output item, as report
        keys, unless a group_by already needs the producer's or the node's own."""
        workload = node.workload
        lead = next(r for r in node.inputs if not r.feedback
                    and r.granularity is Granularity.STREAM)
        keyed = self.report_keys.setdefault(lead.src, workload.key) == workload.key
        sized = self.report_keys.setdefault(node.name, workload.size) == workload.size
        source = next(n for n in self.plan if n.name == lead.src).call is Call.SOURCE
        return BalancedCalls(lead, keyed, sized, source, LengthEstimates())

    def _training(self, model: Any) -> ModelTraining:
        users = [(node.op, frozenset(node.tags)) for node in self.plan
                 if node.model is not None and node.model.name == model.name
                 and node.call not in TRAINING_CALLS]
        steps = [node for node in self.plan if node.call is Call.STEP
                 and node.model is not None and node.model.name == model.name]
        return ModelTraining(self.ctl, model, self.placement[model.name], users=users,
                             sim_costs=self.sim_costs, fuse=self.fuse,
                             timeout=self.step_timeout, profiles=self.profiles, steps=steps,
                             bubble_fill=self.bubble_fill, weight_sync=self.weight_sync)

    def _fill(self, executor: int, seconds: float) -> list:
        """A bubble of `seconds` on `executor`: the open steps' held scoring, oldest step first
        [Note: bubble filling]; the futures that end the tasks sent."""
        ends: list = []
        for step in sorted(self.open):
            if seconds <= 0:
                break
            seconds -= self.open[step].lending.fill(executor, seconds, self.bubble_fill, ends)
        return ends

    @property
    def trained(self) -> dict[str, tuple]:
        """model -> (schedule, spec) of the last step's backprop of it."""
        return {name: t.trained for name, t in self.training.items() if t.trained is not None}

    # -- the last step run, as the reports and tests read it -----------------------------------
    @property
    def states(self) -> dict:
        return self.last_run.states if self.last_run is not None else {}

    @property
    def balancers(self) -> dict[str, Balancer | None]:
        return self.last_run.balancers if self.last_run is not None else {}

    @property
    def previous(self) -> Streams:
        """The outputs of the last step that ended."""
        run = self.last_run
        return run.streams if run is not None and run.closed else self.resumed

    def resume_feedback(self, step: int, streams: Streams) -> None:
        """What a resumed run's step `step` reads as feedback (checkpoints/restore.py)."""
        self.step, self.resumed = step, streams
        self.feedback.resume(step, streams)

    # -- placement -----------------------------------------------------------------------------
    def _place_models(self) -> dict[str, list[ExecutorInfo]]:
        placement: dict[str, list[ExecutorInfo]] = {}
        followers = {name: names[0] for names in fuse_groups(self.plan).values()
                     for name in names[1:]}
        for node in self.plan:
            model = node.model
            if model is None or model.name in placement or model.name in followers:
                continue
            able = [e for e in self.ctl.executors()
                    if set(model.tags) <= set(e.tags) and "F" in e.ops]
            if not able:
                raise FlowRunError(f"no executor holds model {model.name!r}: it needs tags "
                                   f"{list(model.tags)} and the pipeline ops; start executors "
                                   f"with those tags (flowkit run --tags ...)")
            # by name, not by id (the order executors connected in): a resumed run places each
            # stage where the checkpointed run had it [Note: run checkpoints in
            # flowkit/runner/checkpoints/format.py]
            able.sort(key=lambda e: (e.name, e.id))
            offset = len(placement)  # spread the models' first stages over the executors
            slots = model.stages * model.replicas  # [Note: replicas] in replicas.py
            if model.replicas > 1 and len(able) < slots:
                raise FlowRunError(
                    f"model {model.name!r} trains as {model.replicas} replicas of "
                    f"{model.stages} stage(s): that needs {slots} executors with tags "
                    f"{list(model.tags)}, one for each replica's stage, and {len(able)} are "
                    f"there: start {slots} (flowkit run --num-executors {slots}) or train with "
                    "fewer replicas")
            placement[model.name] = [able[(offset + s) % len(able)] for s in range(slots)]
        for node in self.plan:
            if node.model is not None and node.model.name in followers:
                placement[node.model.name] = self._follow(node.model,
                                                          placement[followers[node.model.name]])
        return placement

    def _follow(self, model: Any, leader: list[ExecutorInfo]) -> list[ExecutorInfo]:
        """A fused model's executors: its stages on its group leader's, the other way round
        [Note: fused training in fusedtrain.py]."""
        if model.stages > len(leader):
            raise FlowRunError(
                f"model {model.name!r} trains fused in {model.stages} stages on the executors "
                f"of the group's first model, which has {len(leader)}: give it at most "
                f"{len(leader)} stages (each stage of a fused model needs an executor of its "
                "own)")
        executors = [leader[len(leader) - 1 - s] for s in range(model.stages)]
        for executor in executors:
            if not set(model.tags) <= set(executor.tags) or "F" not in executor.ops:
                raise FlowRunError(
                    f"model {model.name!r} trains fused with the model on executor "
                    f"{executor.name!r}, which lacks its tags {list(model.tags)} or the "
                    "pipeline ops: give the fused models the same tags")
        return executors

    # -- steps ---------------------------------------------------------------------------------
    def run_step(self, step: int) -> StepReport:
        """Step `step` to its end; asynchronously, the steps after it within the staleness
        bound run alongside and go on in the next call."""
        self.step = step
        run = self._open(step)
        if not run.trains:  # opened ahead: its training waited for the step before to end
            run.start_training()
        self.last_run = run
        sources = self.submission.ahead
        if sources is not None:  # [Note: sources ahead in sources_ahead.py]
            sources.after(step, step + 1 if step + 1 < self.steps else None)
        for ahead in range(step + 1, step + 1 + (self.staleness or 0)):
            if self.steps is None or ahead < self.steps:
                self._open(ahead)
        deadline = time.monotonic() + self.step_timeout
        while not run.closed:
            try:
                self.run_reactions(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise FlowRunError(f"step {step} did not finish in {self.step_timeout} s; "
                                   f"still open: {', '.join(run.open_nodes())}") from None
            if sources is not None:
                sources.look(run.node_closed)
        del self.open[step]
        # the next step trains in the next call, not here: between two calls nothing trains,
        # so a checkpoint holds the weights of this step [Note: checkpoints of asynchronous
        # runs in flowkit/runner/checkpoints/open_steps.py]
        return run.report()

    def run_reactions(self, timeout: float) -> None:
        """Run the next reaction (queue.Empty if none comes within `timeout`; none is waited
        for while a step has nodes to look at) and every one queued behind it, then let the
        open steps look at the nodes they touched [Note: batched per-item calls in
        stepbatching.py]."""
        events = self.events
        if any(run.touched for run in self.open.values()):  # a turn left to take: no wait
            try:
                events.get_nowait()()
            except queue.Empty:
                pass
        else:
            events.get(timeout=timeout)()
        for _ in range(_BURST):
            try:
                event = events.get_nowait()
            except queue.Empty:
                break
            event()
        with self.ctl.batch():  # what the reactions made ready goes out in one message each
            for run in list(self.open.values()):
                run.progress_touched()
        submission = self.submission
        if submission.handled_parts:  # settled: their consumers are submitted, or they wait
            # [Note: stream credits] in runtime/credits.py
            self.ctl.handled(submission.handled_parts)
            submission.handled_parts = []
        for watcher in list(self.watchers):
            watcher()

    def _open(self, step: int) -> StepRun:
        run = self.open.get(step)
        if run is None:
            trains = not any(other < step for other in self.open)
            if trains:
                for training in self.training.values():
                    training.start_step(step)
            run = self.open[step] = StepRun(self.submission, self.feedback, self.training, step,
                                            trains=trains)
            run.start()
        return run

    def save_weights(self, folder: Path) -> list[Path]:
        """Each model trained so far (an interrupted step included), its stages' weights
        merged by the unsplit model's names, to `folder`/NAME.pt: a checkpoint a model
        config's `checkpoint` key starts from (a Hugging Face model: the folder `folder`/NAME;
        a LoRA model's adapters: NAME.lora.pt, or a peft adapter folder, which no model config
        starts from). Needs executors that save weights (torch)."""
        saves = [t.save(folder) for _, t in sorted(self.training.items()) if t.last_trained]
        return [Path(future.result(timeout=self.step_timeout)) for future in saves]


def check_async(plan: list[NodePlan], staleness: Any) -> None:
    """Why `plan` cannot run asynchronously with this bound, before anything starts."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise FlowRunError(f"the staleness bound must be a whole number >= 0 (0: on-policy, "
                           f"the synchronous result), got {staleness!r}")
    steps = {node.name for node in plan if node.call is Call.STEP}
    synced = [node.name for node in plan if node.call not in TRAINING_CALLS
              and any(rule.feedback and rule.src in steps for rule in node.inputs)]
    if not synced:
        raise FlowRunError(
            "an asynchronous run needs a feedback edge that syncs weights from an optimizer "
            "step to the ops that generate or score with them (flow.feedback(...).bind("
            "step.weights)): this flow has none, so its steps have nothing to overlap")
    # [Note: sampling rounds in sampling_rounds.py], [Note: second rounds in second_round.py]
    for field, what, setting in (
            ("group_rounds", "rounds=) samples in rounds", "rounds (a recipe's filter_rounds)"),
            ("group_second_round", "second_round=) samples a group again",
             "the second round (adaptive second_round)")):
        within = sorted({node.name for node in plan for rule in node.inputs
                         if getattr(rule, field, None)})
        if within:
            raise FlowRunError(f"{', '.join(within)}: group_by(..., {what} within a step, "
                               f"which runs synchronously only: drop {setting} or run "
                               "synchronously")
    if staleness >= 1:
        rounds = [node.name for node in plan if node.call is Call.PIPELINE
                  and rounds_of(node.config) > 1]
        if rounds:
            raise FlowRunError(
                f"{', '.join(rounds)} train in several minibatch rounds (epochs x minibatches) "
                "per step; asynchronous steps with a staleness bound >= 1 need one optimizer "
                "step per step (their proximal policy is the weights before it): set epochs "
                "and minibatches to 1, or use --max-staleness 0")


def _partial_rollouts(plan: list[NodePlan], staleness: int | None
                      ) -> dict[str, PartialRollouts]:
    """The nodes with partial rollouts (a resumable op given its `take`), checked."""
    found = {}
    for node in plan:
        declared = node.resumable
        take = None if declared is None else node.config.get(declared.take)
        if take is None:
            continue
        if staleness is None or staleness < 1:
            raise FlowRunError(
                f"{node.name} takes the first {take} groups of an over-provisioned step and "
                "carries the rest into the next (partial rollouts): carried samples are a "
                "version stale at least, so run asynchronously with --max-staleness >= 1, or "
                f"drop `{declared.take}` (oversample) to run synchronously")
        if node.call is not Call.PER_ITEM or node.many != (True,):
            raise FlowRunError(f"{node.name}: `{declared.take}` (partial rollouts) is a "
                               "setting of a generating op called per prompt, whose call "
                               "makes a group")
        drop = declared.stale is not None and node.config.get(declared.stale) == "drop"
        found[node.name] = PartialRollouts(int(take), node.items_per_call(), declared,
                                           drop_stale=drop)
    return found


def _without_take(node: NodePlan) -> NodePlan:
    """The node's executor config: how many calls a step takes is the runner's."""
    take = node.resumable.take
    return attrs.evolve(node, config={k: v for k, v in node.config.items() if k != take})


def _with_proximal(plan: list[NodePlan]) -> list[NodePlan]:
    """The backprops whose loss takes a proximal policy, with it on for stale samples."""
    return [attrs.evolve(node, config=node.loss_spec.with_proximal(node.config))
            if node.call is Call.PIPELINE and node.loss_spec is not None else node
            for node in plan]


def _ask_item_tokens(node: NodePlan, report_keys: dict[str, str]) -> None:
    """A backprop with `microbatch_tokens` has its items' producer report their tokens [Note:
    token-budget microbatches in token_microbatches.py]; a producer that reports another
    field already cannot."""
    if node.call is not Call.PIPELINE or node.config.get("microbatch_tokens") is None:
        return
    lead = next(rule for rule in node.inputs if not rule.feedback)
    if node.item_tokens is None:
        raise FlowRunError(f"{node.name!r} has microbatch_tokens, but its op declares no field "
                           "that says an item's tokens (ModelOp.item_tokens)")
    field = report_keys.setdefault(lead.src, node.item_tokens)
    if field != node.item_tokens:
        raise FlowRunError(f"{node.name!r} forms microbatches by tokens, which its items' "
                           f"producer {lead.src!r} would report as {node.item_tokens!r}, but it "
                           f"reports {field!r} already: give {node.name!r} microbatches instead")
