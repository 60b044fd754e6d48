"""One step of a flow as it runs: its item streams and node states (stepstate.py), and the
reactions to its completions. The runner (flowrun.py) owns what lasts across steps (executors,
trained models, length estimates) and, in an asynchronous run, several steps at once
[Note: asynchronous steps in flowrun.py].

A per-item op is submitted the moment its item exists, a group the moment its last member is
in, a barrier when every producer has closed ([Note: lowering by granularity] in
flowkit/planner/lower.py); each trained model's backprop and optimizer step go to its
`ModelTraining` (model_training.py). A per-item node whose calls a step makes or ends otherwise
(partial rollouts, replay) has a call policy (call_policy.py) that the step asks at each turn.

Its ready per-item calls go out batched ([Note: batched per-item calls] in stepbatching.py);
held scoring items may go to a trainer's bubble (steplending.py); what it reports when it ends is
stepreport.py's.

A step is given what it needs of its run, three objects the runner (flowrun.py) builds once: the
`Submission` its calls go out through (submission.py), the `Feedback` of earlier steps with the
admission gate (feedback.py), and the trainings. It owns its item streams and node states: it
alone writes them; a model's training reads a backprop's inputs through an `Inputs` view
(stepstate.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from flowkit.dsl import Granularity
from flowkit.planner.lower import Call, InputRule, NodePlan
from flowkit.runner.balance import Balancer
from flowkit.runner.call_policy import StepSite
from flowkit.runner.feedback import Feedback
from flowkit.runner.model_training import ModelTraining
from flowkit.runner.partial import carried_key
from flowkit.runner.stepbatching import ItemBatching
from flowkit.runner.steplending import BubbleLending
from flowkit.runner.stepreport import StepReport, step_report
from flowkit.runner.stepstate import (
    FlowRunError,
    Inputs,
    NodeState,
    Streams,
    arrived_since,
    check_all_paired,
    sorted_lineages,
)
from flowkit.runner.submission import Submission, function_config, streams_parts
from flowkit.wire.refs import Gather, Item

__all__ = ["StepReport", "StepRun", "TRAINING_CALLS"]

TRAINING_CALLS = (Call.PIPELINE, Call.STEP)  # a model's backprop and optimizer step
_CALLS_PER_TURN = 64  # balanced calls sent between two bursts of reactions


class StepRun:
    """Step `step` of a run, given what it needs of the run: `submission` (the flow's wiring,
    the controller and what the step's calls go out through), `feedback` (what earlier steps
    fed back, and the admission gate on it) and `trainings` (model -> its ModelTraining).
    `trains`: its backprops and optimizer steps may run (an asynchronous run trains its steps
    one after another, in order). It owns its streams and node states; nothing else writes
    them."""

    def __init__(self, submission: Submission, feedback: Feedback,
                 trainings: Mapping[str, ModelTraining], step: int, *, trains: bool) -> None:
        self.submission, self.feedback, self.trainings = submission, feedback, trainings
        self.wiring, self.step, self.trains = submission.wiring, step, trains
        self.started = time.time()
        self.streams = Streams()
        self.states = {node.name: NodeState(node) for node in self.wiring.plan}
        self.warnings: list[str] = []
        self.incomplete_groups: dict[str, int] = {}  # node -> groups flushed short
        self.balancers: dict[str, Balancer | None] = {
            name: submission.balancer(name, self.states[name].plan)
            for name in submission.workloads}
        self.policies = submission.call_policies(step)
        self.touched: dict[str, None] = {}  # nodes to look at once the queued reactions ran
        self.batching = ItemBatching(self)  # [Note: batched per-item calls in stepbatching.py]
        self.lending = BubbleLending(self)  # [Note: bubble filling in bubble_fill.py]

    @property
    def closed(self) -> bool:
        return all(state.closed for state in self.states.values())

    def node_closed(self, name: str) -> bool:
        return self.states[name].closed

    def open_nodes(self) -> list[str]:
        return [name for name, state in self.states.items() if not state.closed]

    def outputs(self, name: str) -> dict[tuple, Any]:
        """A node's items of its one output port, by lineage."""
        (port,) = self.states[name].plan.outputs
        return dict(self.streams[(name, port)].items)

    def start(self) -> None:
        for node in self.wiring.plan:
            self.progress(node.name)

    def start_training(self) -> None:
        """The previous step's training is done: this step's may run."""
        self.trains = True
        for training in self.trainings.values():
            training.start_step(self.step)
        for node in self.wiring.plan:
            if node.call in TRAINING_CALLS:
                self.progress(node.name)

    def receive_carried(self, name: str, calls: list) -> None:
        """Calls the step before carried over [Note: partial rollouts in partial.py]."""
        policy = self.policies.get(name)
        if policy is not None:
            policy.receive(calls, closed=self.states[name].closed)
        self.progress(name)

    # -- completions ---------------------------------------------------------------------------
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
        fill = self.submission.bubble_fill
        if fill is not None and state.plan.scores and futures[0].timing is not None:
            fill.learn(name, futures[0].timing[1] - futures[0].timing[0], 1)
        balancer = self.balancers.get(name)
        policy = self.policies.get(name) if register else None
        if policy is not None and not policy.done(lineage, futures[0], StepSite(self, state)):
            register = False  # not this step's: its items go elsewhere or nowhere
            if balancer is not None:
                balancer.closed(lineage)  # cut short: its sizes teach nothing
        if register and balancer is not None:
            self._balanced_done(name, lineage, futures[0])
        if register:
            self.register_outputs(state.plan, lineage, outputs)
        self.touch(name)

    def touch(self, name: str) -> None:
        """`name` has new outputs or work done: it and its consumers are looked at in
        `progress_touched` [Note: batched per-item calls in stepbatching.py]."""
        touched = self.touched
        touched[name] = None
        for consumer in self.wiring.consumers[name]:
            touched[consumer] = None

    def progress_touched(self) -> None:
        """Look at the nodes the reactions since the last call touched, in the flow's order;
        a node with calls left to send touches itself again, for the next turn."""
        touched, self.touched = self.touched, {}
        for node in self.wiring.plan:
            if node.name in touched:
                self.progress(node.name)

    def _on_part(self, name: str, lineage: tuple, part: Any, credited: bool = False) -> None:
        """Item j of a streaming call [Note: streaming ops in executors/optable.py]: into the
        node's stream at once, so per-item consumers start on it before the call ends
        (`credited`: a source called ahead took it in already, sources_ahead.py)."""
        state = self.states[name]
        j = state.streamed[lineage]
        state.streamed[lineage] += 1
        if state.first_item is None and part.timing is not None:
            state.first_item = part.timing[1]
        balancer = self.balancers.get(name)
        if balancer is not None and self.submission.workloads[name].sized:
            balancer.finished(lineage, part.keys[0] if part.keys else None)
        (port,) = state.plan.outputs
        key = part.keys[0] if part.keys else None
        self.streams[(name, port)].add(lineage + (j,), part, self._key(name, lineage, key))
        if not credited:  # credited once the run has looked at it
            self.submission.handled_parts.append(part)
        for consumer in self.wiring.consumers[name]:
            self.touched[consumer] = None

    def _balanced_done(self, name: str, lineage: tuple, future: Any) -> None:
        """A balanced call is done: the sizes of its items that did not stream, then its
        open work is off its executor."""
        balancer = self.balancers[name]
        keys = getattr(future, "keys", None) or []
        if self.submission.workloads[name].sized:
            for size in keys[self.states[name].streamed.get(lineage, 0):]:
                balancer.finished(lineage, size)
        balancer.closed(lineage)

    def register_outputs(self, plan: NodePlan, lineage: tuple, futures: tuple) -> None:
        for port, many, future in zip(plan.outputs, plan.many, futures):
            stream = self.streams[(plan.name, port)]
            keys = getattr(future, "keys", None) or []  # a Gather in a future's place has none
            if many and getattr(future, "count", None) is not None:
                streamed = self.states[plan.name].streamed.get(lineage, 0)  # already in
                for j in range(streamed, future.count):
                    key = keys[j] if keys else None
                    stream.add(lineage + (j,), Item(future, j), self._key(plan.name, lineage, key))
            else:
                key = self._key(plan.name, lineage, keys[0] if keys else None)
                stream.add(lineage, future, key)
            self.feedback.produced(self.step, self.streams, plan.name, port)

    def _key(self, name: str, lineage: tuple, key: Any) -> Any:
        return carried_key(lineage, key) if name in self.wiring.group_keyed else key

    # -- deciding what can run -----------------------------------------------------------------
    def progress(self, name: str) -> None:
        state = self.states[name]
        if state.closed:
            return
        plan = state.plan
        if plan.call in TRAINING_CALLS and not self.trains:
            return
        if not self.feedback.admits(self.step, plan):
            return  # generation waits for weights recent enough [Note: asynchronous steps]
        live = [rule for rule in plan.inputs if not rule.feedback]
        inputs_closed = all(self.streams.of(r).closed for r in live)
        if not (self.wiring.fuse or inputs_closed):
            return
        if plan.call is Call.PER_ITEM:
            self._submit_items(state, live)
        elif plan.call is Call.PER_GROUP:
            self._submit_groups(state, live, inputs_closed)
        elif plan.call is Call.PIPELINE:
            # the backprop reads its inputs, never the step's state [Note: streamed
            # microbatches in model_training.py]
            state.pipeline = self.trainings[plan.model.name].feed(
                plan, Inputs(self.streams, live), inputs_closed,
                functools.partial(self.watch, state))
            state.started = state.pipeline is not None and state.pipeline.submitted
        elif not state.started and inputs_closed:
            state.started = True
            if plan.call is Call.STEP:
                stats = [Gather(self.streams.of(r).ordered()) for r in live]
                self.trainings[plan.model.name].optimizer_step(
                    plan, stats, functools.partial(self.watch, state))
            else:
                self._submit_once(state)
        if inputs_closed and state.pending == 0 and not state.backlog and not state.held and (
                state.started or plan.call in (Call.PER_ITEM, Call.PER_GROUP)):
            policy = self.policies.get(name)
            if policy is not None and not policy.may_close():
                return  # e.g. the step before may still carry calls over to this one
            if plan.call is Call.PER_ITEM:
                check_all_paired(self.streams, state, live)
            state.closed = True
            if policy is not None:
                policy.closed()
            for port in plan.outputs:
                self.streams[(name, port)].closed = True
            for consumer in self.wiring.consumers[name]:
                self.progress(consumer)

    def _submit_items(self, state: NodeState, live: list[InputRule]) -> None:
        if state.backlog:
            self._submit_backlog(state)
            if state.backlog:
                return  # what arrived meanwhile is read once the backlog is out
        streaming = [r for r in live if r.granularity is Granularity.STREAM]
        barriers = [r for r in live if r.granularity is not Granularity.STREAM]
        if any(not self.streams.of(r).closed for r in barriers):
            return
        workload = self.submission.workloads.get(state.plan.name)
        if workload is not None and workload.hold and not self.streams.of(workload.lead).closed:
            return
        lead = self.streams.of(streaming[0])
        policy = self.policies.get(state.plan.name)
        if policy is not None and not policy.submit(StepSite(self, state, streaming[0]),
                                                    lead.closed):
            return  # e.g. how many of its own prompts the step runs is not known yet
        gathered = {rule.port: Gather(self.streams.of(rule).ordered()) for rule in barriers}
        ready = []
        for lineage in arrived_since(self.streams, state, streaming):
            if lineage in state.submitted:  # called meanwhile another way (a call policy's)
                del state.unpaired[lineage]
                continue
            refs = {}
            for rule in streaming:
                ref = self.streams.of(rule).items.get(lineage)
                if ref is None:
                    break
                refs[rule.port] = ref
            else:
                del state.unpaired[lineage]
                state.submitted.add(lineage)
                if policy is not None and not policy.admit(len(lead.arrivals), lineage):
                    continue  # never called, or called later by the policy
                refs.update(gathered)
                ready.append((lineage, refs))
        balancer = self.balancers.get(state.plan.name)
        if balancer is None:
            if policy is None and not self._streams_parts(state.plan):
                self.batching.send_ready(state, ready, [rule.port for rule in streaming])
                return
            for lineage, refs in ready:
                self.submit(state, lineage, refs)
            return
        keys = self.streams.of(workload.lead).keys if workload.keyed else {}
        by_lineage = dict(ready)
        state.backlog.extend((lineage, key, by_lineage[lineage]) for lineage, key in
                             balancer.order([(lin, keys.get(lin)) for lin, _ in ready]))
        self._submit_backlog(state)

    def _submit_backlog(self, state: NodeState) -> None:
        """The next _CALLS_PER_TURN of a balanced node's calls, longest first, each to the
        executor with the least work open then; the rest wait for the next turn, so that the
        reactions to the first calls' samples run meanwhile (a step's thousands of generation
        calls would otherwise hold back the first sample's downstream ops while they go out)."""
        balancer = self.balancers[state.plan.name]
        turn, state.backlog = state.backlog[:_CALLS_PER_TURN], state.backlog[_CALLS_PER_TURN:]
        for lineage, key, refs in turn:
            self.submit(state, lineage, refs, executor=balancer.assign(lineage, key))
        if state.backlog:
            self.touched[state.plan.name] = None

    def _submit_groups(self, state: NodeState, live: list[InputRule], closed: bool) -> None:
        """Each group the moment its last member is in (or when its policy says: [Note: second
        rounds in second_round.py]); the groups complete at once go together, as a per-item
        op's ready items do [Note: batched per-item calls in stepbatching.py]."""
        (rule,) = [r for r in live if r.granularity is Granularity.GROUPED]
        stream, ready = self.streams.of(rule), []
        policy = self.policies.get(state.plan.name)
        forms = getattr(policy, "ready", None)
        new, state.seen = stream.arrivals[state.seen:], len(stream.arrivals)
        if forms is not None:  # the policy forms the groups
            arrivals = [(lin, stream.keys.get(lin)) for lin in new]
            ready = [self._group_of(rule, key, members) for key, members in
                     forms(arrivals, closed)]
        else:
            for lineage in new:
                key = stream.keys.get(lineage)
                members = state.groups[key]
                members.append(lineage)
                if rule.group_size is not None and len(members) == rule.group_size:
                    ready.append(self._group_of(rule, key, state.groups.pop(key)))
            if closed:  # what is left: groups of unknown size, or cut short
                if rule.group_size is not None and state.groups:
                    self._warn_incomplete(state.plan.name, rule, state.groups)
                ready += [self._group_of(rule, key, state.groups.pop(key))
                          for key in list(state.groups)]
        if self._streams_parts(state.plan) or policy is not None:
            for lineage, refs in ready:  # a policy hears of each call [Note: group quota]
                self.submit(state, lineage, refs)
        else:
            self.batching.send_ready(state, ready, [rule.port])

    def _warn_incomplete(self, node: str, rule: InputRule, groups: dict) -> None:
        sizes = sorted({len(members) for members in groups.values()})
        self.incomplete_groups[node] = len(groups)
        self.warnings.append(
            f"{node}: {len(groups)} group(s) by {rule.group_key!r} had {', '.join(map(str, sizes))}"
            f" of {rule.group_size} items when the step's inputs ended; they ran incomplete. "
            f"Make group_by's size the number of items per {rule.group_key!r}")

    def _group_of(self, rule: InputRule, key: Any, members: list) -> tuple[tuple, dict]:
        """The call (lineage, refs) of the group `key` of `members`, in lineage order."""
        items = self.streams.of(rule).items
        return (key,), {rule.port: Gather([items[m] for m in sorted_lineages(members)])}

    def _submit_once(self, state: NodeState) -> None:
        refs = {rule.port: Gather(self.streams.of(rule).ordered())
                for rule in state.plan.inputs if not rule.feedback}
        self.submit(state, (), refs)

    # -- submitting ----------------------------------------------------------------------------
    def submit(self, state: NodeState, lineage: tuple, refs: dict[str, Any], *,
               executor: int | None = None, extra: dict | None = None,
               meta: dict | None = None) -> Any:
        plan, submission = state.plan, self.submission
        ahead = None if submission.ahead is None or plan.call is not Call.SOURCE else \
            submission.ahead.take(self.step, plan.name)
        several = len(plan.outputs) > 1
        if ahead is not None:  # [Note: sources ahead in sources_ahead.py]
            futures = ahead.futures
            route = functools.partial(self._on_part, plan.name, lineage, credited=True)
            self.watch(state, lineage, futures if several else (futures,), register=True,
                       ended=functools.partial(ahead.adopt, route))
            return futures[0] if several else futures
        refs.update(self.feedback.refs(plan, self.step))
        ports = [rule.port for rule in plan.inputs if rule.port in refs]
        futures = submission.send(plan, self.step, [refs[p] for p in ports],
                                  self.config(plan, lineage, extra, ports), executor=executor,
                                  meta=meta, on_part=self._part_watch(plan, lineage))
        self.watch(state, lineage, futures if several else (futures,), register=True)
        return futures[0] if several else futures

    def config(self, plan: NodePlan, lineage: tuple, extra: dict | None,
                ports: list[str]) -> dict:
        """The config of a call of `plan`'s op on inputs `ports` (a model op's sampling config
        afresh: its call policy may change it per call)."""
        if plan.op == "python":
            return function_config(plan, self.step, ports, extra)
        config = {**self.wiring.op_configs[plan.name], "step": self.step}
        policy = self.policies.get(plan.name)
        if policy is not None:
            config.update(policy.config(lineage))
        config.update(extra or {})
        return config

    def _streams_parts(self, plan: NodePlan) -> bool:
        """Whether a call's items go downstream each as it is yielded (submission.py)."""
        return streams_parts(self.wiring.fuse, plan, self.policies.get(plan.name))

    def _part_watch(self, plan: NodePlan, lineage: tuple) -> Any:
        """The call's items, each as it is yielded, if it streams them (`_streams_parts`)."""
        if not self._streams_parts(plan):
            return None
        events = self.submission.events
        return lambda part: events.put(functools.partial(self._on_part, plan.name, lineage, part))

    def watch(self, state: NodeState, lineage: tuple, futures: tuple, *,
              register: bool, outputs: tuple | None = None,
              ended: Callable[[Callable[[], None]], None] | None = None) -> None:
        """When `futures` are done, account for them and (with `register`) add them, or
        `outputs` in their place, to the node's output streams; `ended(then)`: how else to
        learn of their end (a source called ahead, whose reactions run `then` after its
        items)."""
        state.pending += 1
        events = self.submission.events
        shown = futures if outputs is None else outputs
        then = functools.partial(self._on_done, state.plan.name, lineage, futures, register,
                                 shown)
        if ended is not None:
            ended(then)
        else:
            futures[0].add_done_callback(lambda _: events.put(then))

    def report(self) -> StepReport:
        """What the step reports now that it has ended (stepreport.py)."""
        return step_report(self)
