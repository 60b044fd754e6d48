"""Run a flow on executors, step by step, following the planner's lowering rules
([Note: lowering by granularity] in flowkit/planner/lower.py). A step's items, node states and
reactions to completions are its `StepRun` (steprun.py); the runner holds what lasts across
steps: the models' placement and training (flowtrain.py), length estimates, the weights each
step's generation reads.

[Note: asynchronous steps] Synchronously, step k starts when step k-1 has ended: its generation
reads the weights step k-1's optimizer step made. With a staleness bound η (`staleness=η`,
`flowkit run --async --max-staleness η`) steps k+1 .. k+η are open while step k runs, and a
node that reads weights fed back from an earlier step (generation, value and score inference)
is admitted once the newest weights are at most η versions older than the weights its step's
training will update: step s's at version s (one optimizer step per step), so version
>= s - η, the newest weights then. That is AReaL's admission control (Fu et al. 2025, "AReaL:
a large-scale asynchronous reinforcement learning system"): samples trained plus samples in
flight never exceed (η + version + 1) x the batch. Weight loads reach a running engine between
its iterations, so sequences in flight go on under the new weights, each token recording its
version; no trained token's version lags the weights it updates by more than η. Training runs
step after step in order (a step's backprop starts when the step before has ended). With η = 0
step k's generation waits for step k-1's weights: the synchronous run, operation for
operation. With η >= 1 the backprops use the decoupled objective for stale samples (the
`decoupled` loss knob). A step's training starts in its own `run_step` call, never between two:
what a checkpoint at that boundary holds of the open steps is [Note: checkpoints of
asynchronous runs] in asyncstate.py.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs

from flowkit.dsl import Granularity
from flowkit.ops import rounds_of
from flowkit.planner.lower import Call, InputRule, NodePlan
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.balance import Balancer, LengthEstimates
from flowkit.runner.flowtrain import ModelTraining
from flowkit.runner.partial import STALE_SEGMENTS, Carried, PartialRollouts
from flowkit.runner.steprun import TRAINING_CALLS, StepReport, StepRun
from flowkit.runner.stepstate import FlowRunError, Streams
from flowkit.runner.training import model_spec
from flowkit.runtime.controller import Controller
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["FlowRunError", "FlowRunner", "StepReport", "check_async"]

POLICY_LOSSES = ("grpo", "ppo")  # the losses the decoupled objective applies to


@attrs.frozen
class _Workload:
    """A node whose calls are balanced by predicted work [Note: length-aware dispatch]."""

    lead: InputRule  # the input whose items are the calls (the prompts)
    keyed: bool  # its items' keys are the workload's key (else no history: all alike)
    sized: bool  # the node's output keys are its items' sizes (else nothing is learned)
    # the calls' items all come from one source call: wait for its end (its items arrive
    # together anyway) so the step's calls can be sent longest first
    hold: bool
    estimates: LengthEstimates  # across steps


class FlowRunner:
    """Runs a lowered flow's steps through `ctl`; model ops go to executors with the model's
    tags, a model's pipeline stage s always to the same one. `staleness`: run asynchronously
    with that bound [Note: asynchronous steps] (None: synchronously); `steps`: how many steps
    the run has, so an asynchronous one starts no step past its end."""

    def __init__(self, ctl: Controller, plan: list[NodePlan], *,
                 sim_costs: SimCosts | None = None, step_timeout: float = 600.0,
                 fuse: bool = True, balance: bool = True, staleness: int | None = None,
                 steps: int | None = None) -> None:
        if staleness is not None:
            check_async(plan, staleness)
            plan = _decoupled(plan) if staleness >= 1 else plan
        self.partial = _partial_rollouts(plan, staleness)
        plan = [_without_partial(node) if "take" in node.config else node for node in plan]
        self.ctl, self.plan, self.sim_costs = ctl, plan, sim_costs
        self.staleness, self.steps = staleness, steps
        # fuse=False: every op waits for its producers to finish (stage by stage, a barrier
        # between stages), the baseline that sample-level fusion is measured against
        self.fuse = fuse
        self.step_timeout = step_timeout
        self.consumers: dict[str, list[str]] = defaultdict(list)
        self.report_keys: dict[str, str] = {}
        self.fed_back: set[tuple[str, str]] = set()  # (node, port) read by a later step
        for node in plan:
            for rule in node.inputs:
                if rule.feedback:
                    self.fed_back.add((rule.src, rule.src_port))
                else:
                    self.consumers[rule.src].append(node.name)
                if rule.group_key is not None:
                    self.report_keys[rule.src] = rule.group_key
        # the producers of grouped items: a carried call's keys are made its own there
        self.group_keyed = {rule.src for node in plan for rule in node.inputs
                            if rule.group_key is not None}
        self.carried: dict[int, dict[str, list[Carried]]] = {}  # for steps not open yet
        # a resumed asynchronous run's open steps: step -> node -> lineage -> the saved
        # rollouts of that call, and the partial-rollout metrics they report
        # [Note: checkpoints of asynchronous runs in asyncstate.py]
        self.replay: dict[int, dict[str, dict[tuple, Any]]] = {}
        self.replay_metrics: dict[int, dict[str, dict]] = {}
        self.attempt = uuid.uuid4().hex[:8]  # in request names: unique to this runner
        # the nodes admission control holds back [Note: asynchronous steps]
        self.gated = [node.name for node in plan if node.call not in TRAINING_CALLS
                      and any(rule.feedback for rule in node.inputs)]
        # (node, port) -> step -> that step's streams, for the steps after it
        self.produced_at: dict[tuple[str, str], dict[int, Streams]] = defaultdict(dict)
        # balance=False: calls of ops with a Workload go where the dispatcher's count says,
        # in arrival order, the baseline of length-aware dispatch [Note: length-aware dispatch]
        self.workloads = {node.name: self._workload(node) for node in plan
                          if balance and node.workload is not None and node.call is Call.PER_ITEM}
        self.placement = self._place_models()
        # a model op's config, but the step: built once, not per item on the dispatch path;
        # model ops name the model's whole copy [Note: one model, many holders in
        # executors/torch/held.py], a simulator its costs
        self.op_configs = {node.name: {**model_spec(node.model, 1), **node.config,
                                       **(sim_costs.config_for(node.op) if sim_costs else {})}
                           for node in plan if node.model is not None}
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # every open step's reactions
        self.open: dict[int, StepRun] = {}
        self.last_run: StepRun | None = None  # the step running, or the last one run
        self.step = 0  # the step running, or the next one
        self.resumed = Streams()  # the feedback a resumed run starts from
        self.profiles: dict[tuple[str, int], Any] = {}  # (model, stages) -> profiled costs
        self.training = {node.model.name: self._training(node.model) for node in plan
                         if node.call is Call.PIPELINE}

    def _workload(self, node: NodePlan) -> _Workload:
        """Ask for what length-aware dispatch learns from without fetching anything: the key
        of each input item (from its producer) and the size of each output item, as report
        keys, unless a group_by already needs the producer's or the node's own."""
        workload = node.workload
        lead = next(r for r in node.inputs if not r.feedback
                    and r.granularity is Granularity.STREAM)
        keyed = self.report_keys.setdefault(lead.src, workload.key) == workload.key
        sized = self.report_keys.setdefault(node.name, workload.size) == workload.size
        source = next(n for n in self.plan if n.name == lead.src).call is Call.SOURCE
        return _Workload(lead, keyed, sized, source, LengthEstimates())

    def _training(self, model: Any) -> ModelTraining:
        users = [(node.op, frozenset(node.tags)) for node in self.plan
                 if node.model is not None and node.model.name == model.name
                 and node.call not in TRAINING_CALLS]
        steps = [node for node in self.plan if node.call is Call.STEP
                 and node.model is not None and node.model.name == model.name]
        return ModelTraining(self.ctl, model, self.placement[model.name], users=users,
                             sim_costs=self.sim_costs, fuse=self.fuse,
                             timeout=self.step_timeout, profiles=self.profiles, steps=steps)

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
        """What a resumed run's step `step` reads as feedback (checkpoint.py)."""
        self.step, self.resumed = step, streams
        for key in self.fed_back:
            if key in streams:
                self.produced_at[key] = {step - 1: streams}

    # -- placement -----------------------------------------------------------------------------
    def _place_models(self) -> dict[str, list[ExecutorInfo]]:
        placement = {}
        for node in self.plan:
            model = node.model
            if model is None or model.name in placement:
                continue
            able = [e for e in self.ctl.executors()
                    if set(model.tags) <= set(e.tags) and "F" in e.ops]
            if not able:
                raise FlowRunError(f"no executor holds model {model.name!r}: it needs tags "
                                   f"{list(model.tags)} and the pipeline ops; start executors "
                                   f"with those tags (flowkit run --tags ...)")
            # by name, not by id (the order executors connected in): a resumed run places each
            # stage where the checkpointed run had it [Note: run checkpoints in checkpoint.py]
            able.sort(key=lambda e: (e.name, e.id))
            offset = len(placement)  # spread the models' first stages over the executors
            placement[model.name] = [able[(offset + s) % len(able)] for s in range(model.stages)]
        return placement

    def balancer(self, name: str, plan: NodePlan) -> Balancer | None:
        """A step's balancer of node `name`'s calls, over the estimates of every step."""
        config = self.op_configs[name]
        able = [e.id for e in self.ctl.executors() if e.runs(plan.op, frozenset(plan.tags))]
        if not able:
            return None  # the dispatcher says why when the first call is submitted
        return Balancer(self.workloads[name].estimates, able,
                        count=config.get(plan.workload.count, 1),
                        budget=config.get(plan.workload.budget, 1))

    # -- steps ---------------------------------------------------------------------------------
    def run_step(self, step: int) -> StepReport:
        """Step `step` to its end; asynchronously, the steps after it within the staleness
        bound run alongside and go on in the next call."""
        self.step = step
        run = self._open(step)
        if not run.trains:  # opened ahead: its training waited for the step before to end
            run.start_training()
        self.last_run = run
        for ahead in range(step + 1, step + 1 + (self.staleness or 0)):
            if self.steps is None or ahead < self.steps:
                self._open(ahead)
        deadline = time.monotonic() + self.step_timeout
        while not run.closed:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise FlowRunError(f"step {step} did not finish in {self.step_timeout} s; "
                                   f"still open: {', '.join(run.open_nodes())}") from None
            event()
        del self.open[step]
        # the next step trains in the next call, not here: between two calls nothing trains,
        # so a checkpoint holds the weights of this step [Note: checkpoints of asynchronous
        # runs in asyncstate.py]
        return run.report()

    def _open(self, step: int) -> StepRun:
        run = self.open.get(step)
        if run is None:
            trains = not any(other < step for other in self.open)
            if trains:
                for training in self.training.values():
                    training.start_step(step)
            run = self.open[step] = StepRun(self, step, trains=trains)
            run.start()
        return run

    # -- feedback and admission [Note: asynchronous steps] -------------------------------------
    def produced(self, run: StepRun, node: str, port: str) -> None:
        """`run` added an item to (node, port): if later steps read it, they may go on."""
        key = (node, port)
        if key not in self.fed_back:
            return
        earlier = self.produced_at[key]
        earlier[run.step] = run.streams
        for old in [s for s in earlier if s < run.step - 1]:
            del earlier[old]  # a step reads the newest weights only
        for later in sorted(s for s in self.open if s > run.step):
            for name in self.gated:
                self.open[later].progress(name)

    def _newest(self, rule: InputRule, step: int) -> tuple[int, Streams | None]:
        """(version, streams) of the newest production of `rule`'s port before `step`."""
        produced = self.produced_at.get((rule.src, rule.src_port), {})
        earlier = [s for s in produced if s < step]
        if not earlier:
            return 0, None
        newest = max(earlier)
        return newest + 1, produced[newest]

    def admits(self, run: StepRun, plan: NodePlan) -> bool:
        if self.staleness is None or plan.name not in self.gated:
            return True
        return all(self._newest(rule, run.step)[0] >= run.step - self.staleness
                   for rule in plan.inputs if rule.feedback)

    def feedback_refs(self, plan: NodePlan, step: int) -> dict[str, Any]:
        """Inputs fed by an earlier step: the newest item of the producing port, if any."""
        refs = {}
        for rule in plan.inputs:
            if rule.feedback:
                _, streams = self._newest(rule, step)
                stream = None if streams is None else streams.get((rule.src, rule.src_port))
                if stream is not None and stream.items:
                    refs[rule.port] = stream.ordered()[-1]
        return refs

    # -- partial rollouts [Note: partial rollouts in partial.py] ---------------------------------
    def carry(self, node: str, step: int, calls: list[Carried]) -> None:
        """`step`'s node `node` is done: its carried calls to the step after it."""
        following = self.open.get(step + 1)
        if following is not None:
            following.receive_carried(node, calls)
        elif calls:
            self.carried.setdefault(step + 1, {}).setdefault(node, []).extend(calls)

    def take_carried(self, node: str, step: int) -> list[Carried]:
        return self.carried.get(step, {}).pop(node, [])

    @property
    def pending_calls(self) -> int:
        """Calls carried past the last step run, not yet in any open step."""
        return sum(len(calls) for by_node in self.carried.values() for calls in by_node.values())

    def carry_settled(self, node: str, step: int) -> bool:
        """No step before `step` may still carry calls of `node` over to it."""
        before = self.open.get(step - 1)
        return before is None or before.states[node].closed

    def freshness(self, step: int) -> dict[str, Any]:
        """What a carried call resumed in `step` is told of staleness: its oldest token's
        version may be no older than `min_version`."""
        bound = self.staleness or 0
        return {"min_version": step - bound}

    def abort_calls(self, plan: NodePlan, requests: list[str], step: int) -> list[Any]:
        """Ask every engine that may run `plan`'s calls to abort these requests; each reply
        is [samples, tokens] cut."""
        targets = [e for e in self.ctl.executors()
                   if e.runs(plan.op, frozenset(plan.tags)) and "generation" in e.ops]
        return [self.ctl.submit("generation", config={"action": "abort", "requests": requests},
                                executor=e.id, meta={"node": f"{plan.name}/abort", "step": step})
                for e in targets]

    def save_weights(self, folder: Path) -> list[Path]:
        """Each model trained so far (an interrupted step included), its stages' weights
        merged by the unsplit model's names, to `folder`/NAME.pt: a checkpoint a model
        config's `checkpoint` key starts from. Needs executors that save weights (torch)."""
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
    """The nodes with partial rollouts (a `take` setting), checked."""
    found = {}
    for node in plan:
        take = node.config.get("take")
        if take is None:
            continue
        if staleness is None or staleness < 1:
            raise FlowRunError(
                f"{node.name} takes the first {take} groups of an over-provisioned step and "
                "carries the rest into the next (partial rollouts): carried samples are a "
                "version stale at least, so run asynchronously with --max-staleness >= 1, or "
                "drop `take` (oversample) to run synchronously")
        if node.call is not Call.PER_ITEM or node.many != (True,):
            raise FlowRunError(f"{node.name}: `take` (partial rollouts) is a setting of a "
                               "generating op called per prompt, whose call makes a group")
        stale = node.config.get("stale_segments") or "recompute"
        if stale not in STALE_SEGMENTS:
            raise FlowRunError(f"{node.name}: stale_segments={stale!r}; it is one of "
                               f"{', '.join(STALE_SEGMENTS)}")
        found[node.name] = PartialRollouts(int(take), stale, int(node.config.get("n", 1)))
    return found


def _without_partial(node: NodePlan) -> NodePlan:
    """The node's executor config: `take` is the runner's; a carried call is told what to do
    with stale samples."""
    config = {k: v for k, v in node.config.items() if k != "take"}
    config["stale_segments"] = config.get("stale_segments") or "recompute"
    return attrs.evolve(node, config=config)


def _decoupled(plan: list[NodePlan]) -> list[NodePlan]:
    """The backprops of policy losses with the decoupled objective for stale samples."""
    return [attrs.evolve(node, config={**node.config, "decoupled": True})
            if node.call is Call.PIPELINE and node.config.get("loss") in POLICY_LOSSES else node
            for node in plan]
