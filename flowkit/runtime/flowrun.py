"""Run a flow on executors, step by step, following the planner's lowering rules
([Note: lowering by granularity] in flowkit/planner/lower.py).

The runner reacts to completions: a per-item op is submitted the moment its item exists, a group
the moment its last member is in, a barrier when every producer has closed; the step's items and
node states are in stepstate.py. Each trained model's backprop and optimizer step go to its
`ModelTraining` (flowtrain.py).
"""

from __future__ import annotations

import queue
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from flowkit.dsl import Granularity
from flowkit.ops.records import mean_loss
from flowkit.planner import Costs
from flowkit.planner.lower import Call, InputRule, NodePlan
from flowkit.planner.simcosts import SimCosts
from flowkit.runtime.balance import Balancer, LengthEstimates
from flowkit.runtime.controller import Controller
from flowkit.runtime.flowtrain import ModelTraining
from flowkit.runtime.pipeline import measure
from flowkit.runtime.records import ExecutorInfo
from flowkit.runtime.refs import Gather, Item
from flowkit.runtime.stepstate import FlowRunError, NodeState, Streams, lineage_order
from flowkit.runtime.training import model_spec

__all__ = ["FlowRunError", "FlowRunner", "StepReport"]


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


@attrs.frozen
class StepReport:
    step: int
    elapsed_s: float
    timing_s: dict[str, float]  # per node: first op start to last op end
    metrics: dict[str, Any]  # loss, bubble rate, ... from the step's outputs
    warnings: tuple[str, ...] = ()  # what the user should act on, from the runner and reporters


class FlowRunner:
    """Runs a lowered flow's steps through `ctl`; model ops go to executors with the model's
    tags, a model's pipeline stage s always to the same one."""

    def __init__(self, ctl: Controller, plan: list[NodePlan], *,
                 sim_costs: SimCosts | None = None, step_timeout: float = 600.0,
                 fuse: bool = True, balance: bool = True) -> None:
        self.ctl, self.plan, self.sim_costs = ctl, plan, sim_costs
        # fuse=False: every op waits for its producers to finish (stage by stage, a barrier
        # between stages), the baseline that sample-level fusion is measured against
        self.fuse = fuse
        self.step_timeout = step_timeout
        self.consumers: dict[str, list[str]] = defaultdict(list)
        self.report_keys: dict[str, str] = {}
        for node in plan:
            for rule in node.inputs:
                if not rule.feedback:
                    self.consumers[rule.src].append(node.name)
                if rule.group_key is not None:
                    self.report_keys[rule.src] = rule.group_key
        # balance=False: calls of ops with a Workload go where the dispatcher's count says,
        # in arrival order, the baseline of length-aware dispatch [Note: length-aware dispatch]
        self.workloads = {node.name: self._workload(node) for node in plan
                          if balance and node.workload is not None and node.call is Call.PER_ITEM}
        self.balancers: dict[str, Balancer | None] = {}
        self.placement = self._place_models()
        # a model op's config, but the step: built once, not per item on the dispatch path;
        # model ops name the model's whole copy [Note: one model, many holders in
        # executors/torch/held.py], a simulator its costs
        self.op_configs = {node.name: {**model_spec(node.model, 1), **node.config,
                                       **(sim_costs.config_for(node.op) if sim_costs else {})}
                           for node in plan if node.model is not None}
        self.previous = Streams()  # last step's outputs, for feedback
        self.step = 0  # the step running, or the next one
        self.warnings: list[str] = []  # this step's
        self.incomplete_groups: dict[str, int] = {}
        self.profiles: dict[tuple[str, int], Costs] = {}  # (model, stages) -> profiled costs
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
                 and node.call not in (Call.PIPELINE, Call.STEP)]
        steps = [node for node in self.plan if node.call is Call.STEP
                 and node.model is not None and node.model.name == model.name]
        return ModelTraining(self.ctl, model, self.placement[model.name], users=users,
                             sim_costs=self.sim_costs, fuse=self.fuse,
                             timeout=self.step_timeout, profiles=self.profiles, steps=steps)

    @property
    def trained(self) -> dict[str, tuple]:
        """model -> (schedule, spec) of the last step's backprop of it."""
        return {name: t.trained for name, t in self.training.items() if t.trained is not None}

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

    # -- one step ------------------------------------------------------------------------------
    def run_step(self, step: int) -> StepReport:
        started = time.time()
        self.streams = Streams()
        self.states = {node.name: NodeState(node) for node in self.plan}
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.step = step
        self.warnings: list[str] = []
        self.incomplete_groups: dict[str, int] = {}  # node -> groups flushed short this step
        for training in self.training.values():
            training.start_step(step)
        self.balancers = {name: self._balancer(name, w) for name, w in self.workloads.items()}
        for node in self.plan:
            self._progress(node.name)
        deadline = time.monotonic() + self.step_timeout
        while not all(state.closed for state in self.states.values()):
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                open_nodes = [n for n, s in self.states.items() if not s.closed]
                raise FlowRunError(f"step {step} did not finish in {self.step_timeout} s; "
                                   f"still open: {', '.join(open_nodes)}") from None
            event()
        self.previous = self.streams
        return self._report(step, started)

    def _balancer(self, name: str, workload: _Workload) -> Balancer | None:
        plan, config = self.states[name].plan, self.op_configs[name]
        able = [e.id for e in self.ctl.executors() if e.runs(plan.op, frozenset(plan.tags))]
        if not able:
            return None  # the dispatcher says why when the first call is submitted
        return Balancer(workload.estimates, able, count=config.get(plan.workload.count, 1),
                        budget=config.get(plan.workload.budget, 1))

    def save_weights(self, folder: Path) -> list[Path]:
        """Each model trained so far (an interrupted step included), its stages' weights merged by the unsplit
        model's names, to `folder`/NAME.pt: a checkpoint a model config's `checkpoint` key
        starts from. Needs executors that save weights (torch)."""
        saves = [t.save(folder) for _, t in sorted(self.training.items()) if t.last_trained]
        return [Path(future.result(timeout=self.step_timeout)) for future in saves]

    def _on_done(self, name: str, lineage: tuple, futures: tuple, register: bool,
                 outputs: tuple) -> None:
        state = self.states[name]
        state.pending -= 1
        for future in futures:
            error = future.exception()
            if error is not None:
                raise FlowRunError(f"step {self.step}: op {name!r} failed: {error}") from error
            if future.timing is not None:
                start, end = future.timing
                state.first_start = min(start, state.first_start or start)
                state.last_end = max(end, state.last_end or end)
        if register and self.balancers.get(name) is not None:
            self._balanced_done(name, lineage, futures[0])
        if register:
            self._register_outputs(state.plan, lineage, outputs)
        self._progress(name)
        for consumer in self.consumers[name]:
            self._progress(consumer)

    def _on_part(self, name: str, lineage: tuple, part: Any) -> None:
        """Item j of a streaming call [Note: streaming ops in executors/ops.py]: into the
        node's stream at once, so per-item consumers start on it before the call ends."""
        state = self.states[name]
        j = state.streamed[lineage]
        state.streamed[lineage] += 1
        balancer = self.balancers.get(name)
        if balancer is not None and self.workloads[name].sized:
            balancer.finished(lineage, part.keys[0] if part.keys else None)
        (port,) = state.plan.outputs
        self.streams[(name, port)].add(lineage + (j,), part, part.keys[0] if part.keys else None)
        for consumer in self.consumers[name]:
            self._progress(consumer)

    def _balanced_done(self, name: str, lineage: tuple, future: Any) -> None:
        """A balanced call is done: the sizes of its items that did not stream, then its
        open work is off its executor."""
        balancer = self.balancers[name]
        keys = getattr(future, "keys", None) or []
        if self.workloads[name].sized:
            for size in keys[self.states[name].streamed.get(lineage, 0):]:
                balancer.finished(lineage, size)
        balancer.closed(lineage)

    def _register_outputs(self, plan: NodePlan, lineage: tuple, futures: tuple) -> None:
        for port, many, future in zip(plan.outputs, plan.many, futures):
            stream = self.streams[(plan.name, port)]
            keys = getattr(future, "keys", None) or []  # a Gather in a future's place has none
            if many and getattr(future, "count", None) is not None:
                streamed = self.states[plan.name].streamed.get(lineage, 0)  # already in
                for j in range(streamed, future.count):
                    stream.add(lineage + (j,), Item(future, j), keys[j] if keys else None)
            else:
                stream.add(lineage, future, keys[0] if keys else None)

    # -- deciding what can run -----------------------------------------------------------------
    def _progress(self, name: str) -> None:
        state = self.states[name]
        if state.closed:
            return
        plan = state.plan
        live = [rule for rule in plan.inputs if not rule.feedback]
        inputs_closed = all(self.streams.of(r).closed for r in live)
        if not (self.fuse or inputs_closed):
            return
        if plan.call is Call.PER_ITEM:
            self._submit_items(state, live)
        elif plan.call is Call.PER_GROUP:
            self._submit_groups(state, live, inputs_closed)
        elif plan.call is Call.PIPELINE:
            self.training[plan.model.name].feed(state, self.streams, live, inputs_closed,
                                                partial(self._watch, state))
        elif not state.started and inputs_closed:
            state.started = True
            if plan.call is Call.STEP:
                stats = [Gather(self.streams.of(r).ordered()) for r in live]
                self.training[plan.model.name].optimizer_step(plan, stats, partial(self._watch, state))
            else:
                self._submit_once(state)
        if inputs_closed and state.pending == 0 and (state.started or plan.call in (
                Call.PER_ITEM, Call.PER_GROUP)):
            if plan.call is Call.PER_ITEM:
                self._check_all_paired(state, live)
            state.closed = True
            for port in plan.outputs:
                self.streams[(name, port)].closed = True
            for consumer in self.consumers[name]:
                self._progress(consumer)

    def _submit_items(self, state: NodeState, live: list[InputRule]) -> None:
        streaming = [r for r in live if r.granularity is Granularity.STREAM]
        barriers = [r for r in live if r.granularity is not Granularity.STREAM]
        if any(not self.streams.of(r).closed for r in barriers):
            return
        workload = self.workloads.get(state.plan.name)
        if workload is not None and workload.hold and not self.streams.of(workload.lead).closed:
            return
        lead = self.streams.of(streaming[0])
        ready = []
        for lineage in lead.arrivals:
            if lineage in state.submitted:
                continue
            refs = {}
            for rule in streaming:
                ref = self.streams.of(rule).items.get(lineage)
                if ref is None:
                    break
                refs[rule.port] = ref
            else:
                for rule in barriers:
                    refs[rule.port] = Gather(self.streams.of(rule).ordered())
                state.submitted.add(lineage)
                ready.append((lineage, refs))
        balancer = self.balancers.get(state.plan.name)
        if balancer is None:
            for lineage, refs in ready:
                self._submit(state, lineage, refs)
            return
        keys = self.streams.of(workload.lead).keys if workload.keyed else {}
        by_lineage = dict(ready)
        for lineage, key in balancer.order([(lin, keys.get(lin)) for lin, _ in ready]):
            self._submit(state, lineage, by_lineage[lineage],
                         executor=balancer.assign(lineage, key))

    def _check_all_paired(self, state: NodeState, live: list[InputRule]) -> None:
        streaming = [r for r in live if r.granularity is Granularity.STREAM]
        lead = self.streams.of(streaming[0])
        unpaired = [lin for lin in lead.arrivals if lin not in state.submitted]
        if unpaired:
            ports = ", ".join(f"{r.port} (from {r.src})" for r in streaming)
            raise FlowRunError(
                f"op {state.plan.name!r} is called per item of {ports}, but {len(unpaired)} "
                f"items of {streaming[0].port!r} have no partner in the other inputs: per-item "
                "inputs must come from the same items (e.g. both scored from one generate); "
                "collect() one of them if it is a different stream")

    def _submit_groups(self, state: NodeState, live: list[InputRule], closed: bool) -> None:
        (rule,) = [r for r in live if r.granularity is Granularity.GROUPED]
        stream = self.streams.of(rule)
        for lineage in stream.arrivals[state.seen:]:
            key = stream.keys.get(lineage)
            members = state.groups[key]
            members.append(lineage)
            if rule.group_size is not None and len(members) == rule.group_size:
                self._submit_group(state, rule, key)
        state.seen = len(stream.arrivals)
        if closed:  # what is left: groups of unknown size, or cut short
            if rule.group_size is not None and state.groups:
                self._warn_incomplete(state.plan.name, rule, state.groups)
            for key in list(state.groups):
                self._submit_group(state, rule, key)

    def _warn_incomplete(self, node: str, rule: InputRule, groups: dict) -> None:
        sizes = sorted({len(members) for members in groups.values()})
        self.incomplete_groups[node] = len(groups)
        self.warnings.append(
            f"{node}: {len(groups)} group(s) by {rule.group_key!r} had {', '.join(map(str, sizes))}"
            f" of {rule.group_size} items when the step's inputs ended; they ran incomplete. "
            f"Make group_by's size the number of items per {rule.group_key!r}")

    def _submit_group(self, state: NodeState, rule: InputRule, key: Any) -> None:
        members = sorted(state.groups.pop(key), key=lineage_order)
        stream = self.streams.of(rule)
        self._submit(state, (key,), {rule.port: Gather([stream.items[m] for m in members])})

    def _submit_once(self, state: NodeState) -> None:
        refs = {rule.port: Gather(self.streams.of(rule).ordered())
                for rule in state.plan.inputs if not rule.feedback}
        self._submit(state, (), refs)

    # -- submitting ----------------------------------------------------------------------------
    def _submit(self, state: NodeState, lineage: tuple, refs: dict[str, Any], *,
                executor: int | None = None) -> None:
        plan = state.plan
        refs.update(self._feedback_refs(plan))
        ports = [rule.port for rule in plan.inputs if rule.port in refs]
        meta = {"node": plan.name, "step": self.step}
        outputs = max(1, len(plan.outputs))
        if plan.op == "python":
            fn_config = {**plan.config, "step": self.step} if plan.takes_step else plan.config
            config = {"target": plan.target, "config": fn_config, "ports": ports,
                      "outputs": list(plan.outputs), "many": list(plan.many)}
        else:
            config = {**self.op_configs[plan.name], "step": self.step}  # sampling: afresh
        futures = self.ctl.submit(plan.op, *(refs[p] for p in ports), config=config,
                                  executor=executor, tags=plan.tags, outputs=outputs, meta=meta,
                                  report_key=self.report_keys.get(plan.name),
                                  on_part=self._part_watch(plan, lineage))
        self._watch(state, lineage, futures if outputs > 1 else (futures,), register=True)

    def _part_watch(self, plan: NodePlan, lineage: tuple) -> Any:
        """The call's items, each as it is yielded, when it has one output of many items and
        the run is fused (unfused, consumers wait for the whole stream anyway)."""
        if not (self.fuse and plan.many == (True,)):
            return None
        events = self.events
        return lambda part: events.put(partial(self._on_part, plan.name, lineage, part))

    def _watch(self, state: NodeState, lineage: tuple, futures: tuple, *,
               register: bool, outputs: tuple | None = None) -> None:
        """When `futures` are done, account for them and (with `register`) add them, or
        `outputs` in their place, to the node's output streams."""
        state.pending += 1
        events = self.events
        shown = futures if outputs is None else outputs
        futures[0].add_done_callback(lambda _: events.put(
            partial(self._on_done, state.plan.name, lineage, futures, register, shown)))

    def _feedback_refs(self, plan: NodePlan) -> dict[str, Any]:
        """Inputs fed by the previous step: its last item of the producing port, if any."""
        refs = {}
        for rule in plan.inputs:
            if rule.feedback:
                previous = self.previous.get((rule.src, rule.src_port))
                if previous is not None and previous.items:
                    refs[rule.port] = previous.ordered()[-1]
        return refs

    # -- reporting -----------------------------------------------------------------------------
    def _report(self, step: int, started: float) -> StepReport:
        timing = {name: s.last_end - s.first_start for name, s in self.states.items()
                  if s.first_start is not None and s.last_end is not None}
        metrics: dict[str, Any] = {}
        runs = [run for state in self.states.values() if state.pipeline is not None
                for run in state.pipeline.runs]
        predicted = [v for t in self.training.values() for v in t.predicted_bubble.values()]
        for name, state in self.states.items():
            if state.pipeline is not None:  # over every round's microbatches, if in rounds
                losses = [f.result() for run in state.pipeline.runs for f in run.losses]
                metrics[f"{name}/loss"], metrics[f"{name}/tokens"] = mean_loss(losses)
                if len(state.pipeline.runs) > 1:
                    metrics[f"{name}/optimizer_steps"] = len(state.pipeline.runs)
        for state in self.states.values():
            if state.plan.reports:
                metrics.update(self._reported(state.plan))
        for node, count in self.incomplete_groups.items():
            metrics[f"{node}/incomplete_groups"] = count
        for node, balancer in self.balancers.items():
            if balancer is not None:
                metrics.update(balancer.end_step(node))
        if runs:
            # over every executor's pipeline ops, whichever model they belong to: two models'
            # pipelines sharing executors fill each other's bubbles
            metrics["bubble_rate"] = measure((f.location, f.timing) for run in runs
                                             for f in run.futures.values())["bubble_rate"]
            metrics["predicted_bubble_rate"] = max(predicted) if predicted else None
        return StepReport(step=step, elapsed_s=time.time() - started, timing_s=timing,
                          metrics=metrics, warnings=tuple(self.warnings))

    def _reported(self, plan: NodePlan) -> dict[str, float]:
        """The values of a reporter's Metrics items this step (small: fetched to here)."""
        values: dict[str, float] = {}
        for port in plan.outputs:
            for ref in self.streams[(plan.name, port)].ordered():
                item = ref.future.result(timeout=self.step_timeout)[ref.index] \
                    if isinstance(ref, Item) else ref.result(timeout=self.step_timeout)
                values.update(getattr(item, "values", {}))
                self.warnings.extend(getattr(item, "warnings", ()))
        return values
