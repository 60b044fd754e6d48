"""One step of a flow as it runs: its item streams and node states (stepstate.py), and the
reactions to its completions. The runner (flowrun.py) owns what lasts across steps (executors,
trained models, length estimates) and, in an asynchronous run, several steps at once
[Note: asynchronous steps in flowrun.py].

A per-item op is submitted the moment its item exists, a group the moment its last member is
in, a barrier when every producer has closed ([Note: lowering by granularity] in
flowkit/planner/lower.py); each trained model's backprop and optimizer step go to its
`ModelTraining` (flowtrain.py). A per-item node whose calls a step makes or ends otherwise
(partial rollouts, replay) has a call policy (calls.py) that the step asks at each turn.

[Note: batched per-item calls] A per-item op's ready items go out together: everything that is
ready when the node is looked at, up to _BATCH_ITEMS a task and spread over the executors that
run the op, as batched tasks ([Note: batched tasks] in flowkit/wire/task.py), each answered by
one completion and handled by one reaction. Reactions only mark the nodes they touch; the run
looks at those once the reactions queued so far have run (`settle`). A node keeps at most
_BATCHES_IN_FLIGHT of its tasks per executor able to run it on the way: ready items beyond
that wait (`held`) until one of its tasks ends, and then go together (adaptive batching, as an
inference server's dynamic batcher does). So the first finished sample goes downstream at once,
and under load the items that come meanwhile coalesce into as few tasks as the executors can
take, rather than into as many as the controller happens to react. Calls whose items stream,
are balanced or have a call policy stay one task each.

A step reads its run through a `StepContext`, which the runner implements: the flow's wiring,
the admission gate, the feedback, the call policies (and the carry-over ledger behind them),
the trainings and the event queue.
"""

from __future__ import annotations

import functools
import math
import queue
import time
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from flowkit.dsl import Granularity, Metrics
from flowkit.ops.records import mean_loss, mean_values
from flowkit.planner.lower import Call, InputRule, NodePlan
from flowkit.runner.balance import Balancer
from flowkit.runner.calls import CallPolicy
from flowkit.runner.fill import BubbleFill
from flowkit.runner.flowtrain import ModelTraining
from flowkit.runner.partial import carried_key
from flowkit.runner.pipeline import measure
from flowkit.runner.stepstate import (
    BalancedCalls,
    FlowRunError,
    NodeState,
    Streams,
    Wiring,
    sorted_lineages,
)
from flowkit.runtime.controller import Controller
from flowkit.wire.refs import Gather, Item

__all__ = ["StepContext", "StepReport", "StepRun", "TRAINING_CALLS"]

TRAINING_CALLS = (Call.PIPELINE, Call.STEP)  # a model's backprop and optimizer step
# [Note: batched per-item calls]: at most this many items a task, and a burst of ready items is
# spread over the executors in tasks of at least _SPLIT_ITEMS
_BATCH_ITEMS, _SPLIT_ITEMS = 256, 16
_BATCHES_IN_FLIGHT = 2  # a node's tasks on the way per executor before its ready items wait
_CALLS_PER_TURN = 64  # balanced calls sent between two bursts of reactions
_FILL_TASK_S = 0.1  # predicted seconds of a scoring task while bubbles are filled
# A streaming call runs at most this many items ahead of the items whose consumers are done
# [Note: stream credits in flowkit/runtime/credits.py]: a bound on what a slow consumer lets
# queue up, far above what a generation call streams between two reactions.
STREAM_WINDOW = 1024


@attrs.frozen
class StepReport:
    step: int
    elapsed_s: float
    timing_s: dict[str, float]  # per node: first op start to last op end
    metrics: dict[str, Any]  # loss, bubble rate, ... from the step's outputs
    warnings: tuple[str, ...] = ()  # what the user should act on, from the runner and reporters


class StepContext(Protocol):
    """What a step asks of the run it belongs to (flowrun.FlowRunner implements it)."""

    wiring: Wiring
    ctl: Controller
    events: queue.SimpleQueue  # every open step's reactions, run one at a time by the run
    handled_parts: list  # streamed items the steps took in since they last settled
    training: dict[str, ModelTraining]  # model -> its training
    workloads: dict[str, BalancedCalls]  # nodes whose calls are balanced by predicted work

    def balancer(self, name: str, plan: NodePlan) -> Balancer | None:
        """This step's balancer of node `name`'s calls."""

    def admits(self, step: int, plan: NodePlan) -> bool:
        """The admission gate: whether step `step`'s node may run with the weights there are
        [Note: asynchronous steps in flowrun.py]."""

    def produced(self, run: StepRun, node: str, port: str) -> None:
        """`run` added an item to (node, port)."""

    def feedback_refs(self, plan: NodePlan, step: int) -> dict[str, Any]:
        """The node's inputs fed back from an earlier step."""

    def call_policies(self, step: int) -> dict[str, CallPolicy]:
        """The step's per-item nodes whose calls are made or ended otherwise."""

    def abort_calls(self, plan: NodePlan, requests: Sequence[str], step: int) -> list[Any]:
        """Cut the named calls of `plan`'s node short; the futures of the aborts."""

    @property
    def bubble_fill(self) -> BubbleFill | None:
        """The lending of training executors' bubbles, when the run fills them."""


class StepRun:
    """Step `step` of the run `ctx`. `trains`: its backprops and optimizer steps may run (an
    asynchronous run trains its steps one after another, in order)."""

    def __init__(self, ctx: StepContext, step: int, *, trains: bool) -> None:
        self.ctx, self.wiring, self.step, self.trains = ctx, ctx.wiring, step, trains
        self.started = time.time()
        self.streams = Streams()
        self.states = {node.name: NodeState(node) for node in self.wiring.plan}
        self.warnings: list[str] = []
        self.incomplete_groups: dict[str, int] = {}  # node -> groups flushed short
        self.balancers: dict[str, Balancer | None] = {
            name: ctx.balancer(name, self.states[name].plan) for name in ctx.workloads}
        self.policies = ctx.call_policies(step)
        self.touched: dict[str, None] = {}  # nodes to look at once the queued reactions ran
        self._able: dict[str, int] = {}  # node -> executors that run its op

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
        for training in self.ctx.training.values():
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
        fill = self.ctx.bubble_fill
        if fill is not None and state.plan.scores and futures[0].timing is not None:
            fill.learn(name, futures[0].timing[1] - futures[0].timing[0], 1)
        balancer = self.balancers.get(name)
        policy = self.policies.get(name) if register else None
        if policy is not None and not policy.done(lineage, futures[0], _Site(self, state)):
            register = False  # not this step's: its items go elsewhere or nowhere
            if balancer is not None:
                balancer.closed(lineage)  # cut short: its sizes teach nothing
        if register and balancer is not None:
            self._balanced_done(name, lineage, futures[0])
        if register:
            self._register_outputs(state.plan, lineage, outputs)
        self._touch(name)

    def _on_batch_items(self, name: str, batch: _Batch, first: int, count: int) -> None:
        """Items a batched task finished early ([Note: early items] in executors/process.py):
        into the node's streams now, so a slow item holds back no other."""
        if first != batch.registered:
            return  # answered out of order, which the dispatcher refuses: the end brings them
        start, _ = batch.outputs[first][0].timing
        state = self.states[name]
        state.first_start = min(start, state.first_start or start)
        self._register_batch(state, batch, first + count)

    def _on_batch_done(self, name: str, batch: _Batch) -> None:
        """A batched task is done: its items not yet in, into the node's streams."""
        state = self.states[name]
        state.pending -= 1
        last = batch.outputs[-1][0]
        error = last.exception()
        if error is not None:
            raise FlowRunError(f"step {self.step}: op {name!r} failed: {error}") from error
        start, end = last.timing
        state.first_start = min(start, state.first_start or start)
        state.last_end = max(end, state.last_end or end)
        fill = self.ctx.bubble_fill
        if fill is not None and state.plan.scores:
            fill.learn(name, end - start, len(batch.lineages))
        self._register_batch(state, batch, len(batch.lineages))

    def _register_batch(self, state: NodeState, batch: _Batch, upto: int) -> None:
        """A batch's items not yet in the node's streams, up to item `upto`, into them."""
        for i in range(batch.registered, upto):
            self._register_outputs(state.plan, batch.lineages[i], batch.outputs[i])
        batch.registered = upto
        self._touch(state.plan.name)

    def _touch(self, name: str) -> None:
        """`name` has new outputs or work done: it and its consumers are looked at in `settle`
        [Note: batched per-item calls]."""
        touched = self.touched
        touched[name] = None
        for consumer in self.wiring.consumers[name]:
            touched[consumer] = None

    def settle(self) -> None:
        """Look at the nodes the reactions since the last call touched, in the flow's order;
        a node with calls left to send touches itself again, for the next turn."""
        touched, self.touched = self.touched, {}
        for node in self.wiring.plan:
            if node.name in touched:
                self.progress(node.name)

    def _on_part(self, name: str, lineage: tuple, part: Any) -> None:
        """Item j of a streaming call [Note: streaming ops in executors/optable.py]: into the
        node's stream at once, so per-item consumers start on it before the call ends."""
        state = self.states[name]
        j = state.streamed[lineage]
        state.streamed[lineage] += 1
        if state.first_item is None and part.timing is not None:
            state.first_item = part.timing[1]
        balancer = self.balancers.get(name)
        if balancer is not None and self.ctx.workloads[name].sized:
            balancer.finished(lineage, part.keys[0] if part.keys else None)
        (port,) = state.plan.outputs
        key = part.keys[0] if part.keys else None
        self.streams[(name, port)].add(lineage + (j,), part, self._key(name, lineage, key))
        self.ctx.handled_parts.append(part)  # credited once the run has looked at it
        for consumer in self.wiring.consumers[name]:
            self.touched[consumer] = None

    def _balanced_done(self, name: str, lineage: tuple, future: Any) -> None:
        """A balanced call is done: the sizes of its items that did not stream, then its
        open work is off its executor."""
        balancer = self.balancers[name]
        keys = getattr(future, "keys", None) or []
        if self.ctx.workloads[name].sized:
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
                    key = keys[j] if keys else None
                    stream.add(lineage + (j,), Item(future, j), self._key(plan.name, lineage, key))
            else:
                key = self._key(plan.name, lineage, keys[0] if keys else None)
                stream.add(lineage, future, key)
            self.ctx.produced(self, plan.name, port)

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
        if not self.ctx.admits(self.step, plan):
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
            self.ctx.training[plan.model.name].feed(state, self.streams, live, inputs_closed,
                                                       functools.partial(self._watch, state))
        elif not state.started and inputs_closed:
            state.started = True
            if plan.call is Call.STEP:
                stats = [Gather(self.streams.of(r).ordered()) for r in live]
                self.ctx.training[plan.model.name].optimizer_step(
                    plan, stats, functools.partial(self._watch, state))
            else:
                self._submit_once(state)
        if inputs_closed and state.pending == 0 and not state.backlog and not state.held and (
                state.started or plan.call in (Call.PER_ITEM, Call.PER_GROUP)):
            policy = self.policies.get(name)
            if policy is not None and not policy.may_close():
                return  # e.g. the step before may still carry calls over to this one
            if plan.call is Call.PER_ITEM:
                self._check_all_paired(state, live)
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
        workload = self.ctx.workloads.get(state.plan.name)
        if workload is not None and workload.hold and not self.streams.of(workload.lead).closed:
            return
        lead = self.streams.of(streaming[0])
        policy = self.policies.get(state.plan.name)
        if policy is not None and not policy.submit(_Site(self, state, streaming[0]),
                                                    lead.closed):
            return  # e.g. how many of its own prompts the step runs is not known yet
        gathered = {rule.port: Gather(self.streams.of(rule).ordered()) for rule in barriers}
        ready = []
        for lineage in self._arrived_since(state, streaming):
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
                self._send_ready(state, ready, [rule.port for rule in streaming])
                return
            for lineage, refs in ready:
                self._submit(state, lineage, refs)
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
            self._submit(state, lineage, refs, executor=balancer.assign(lineage, key))
        if state.backlog:
            self.touched[state.plan.name] = None

    def _send_ready(self, state: NodeState, ready: list[tuple[tuple, dict]],
                    varying: list[str]) -> None:
        """Calls (lineage, refs) that are ready, with those held before, as batched tasks, or
        held until one of the node's tasks ends if enough are on the way [Note: batched
        per-item calls]; `varying`: the ports whose refs differ from call to call."""
        if state.held:
            ready, state.held = state.held + ready, []
        if not ready:
            return
        state.varying = varying
        cap = self._fill_cap(state.plan)
        if cap:  # [Note: bubble filling in fill.py]: what waits, a bubble may take
            own = state.pending - state.lent  # the tasks on its own executors
            room = max(0, _BATCHES_IN_FLIGHT * self._able_count(state.plan) - own)
            sent = min(len(ready), room * cap)
            for begin in range(0, sent, cap):
                self._submit_chunk(state, ready[begin:begin + cap], varying)
            state.held = ready[sent:]
            if state.held:
                self.ctx.bubble_fill.waiting_items()
            return
        if state.pending >= _BATCHES_IN_FLIGHT * self._able_count(state.plan):
            state.held = ready
        elif len(ready) > 1:
            self._submit_batches(state, ready, varying)
        else:
            self._submit(state, *ready[0])

    def _submit_batches(self, state: NodeState, ready: list[tuple[tuple, dict]],
                        varying: list[str]) -> None:
        """`ready` (lineage, refs) as batched tasks, spread over the executors that run the op
        [Note: batched per-item calls]."""
        plan = state.plan
        able = self._able_count(plan)
        count = len(ready)
        pieces = max(math.ceil(count / _BATCH_ITEMS), min(able, count // _SPLIT_ITEMS), 1)
        size = math.ceil(count / pieces)
        for begin in range(0, count, size):
            self._submit_chunk(state, ready[begin:begin + size], varying)

    def _submit_chunk(self, state: NodeState, chunk: list[tuple[tuple, dict]],
                      varying: list[str], executor: int | None = None) -> Any:
        """Calls (lineage, refs) as one task, batched unless there is one; the future that
        ends it."""
        if len(chunk) == 1:
            return self._submit(state, *chunk[0], executor=executor)
        refs = {port: ref for port, ref in chunk[0][1].items() if port not in varying}
        refs.update({port: [item_refs[port] for _, item_refs in chunk] for port in varying})
        return self._submit_batch(state, [lineage for lineage, _ in chunk], refs, varying,
                                  executor=executor)

    def fill(self, executor: int, seconds: float, bubble_fill: BubbleFill,
             ends: list) -> float:
        """Give the held items of this step's scoring nodes to `executor` for a bubble of
        `seconds` [Note: bubble filling in fill.py], adding to `ends` the future that ends
        each task sent; the seconds they are predicted to take."""
        used = 0.0
        for name, state in self.states.items():
            if state.closed or not state.held or not self._lendable(state.plan):
                continue
            count = min(len(state.held), _BATCH_ITEMS,
                        bubble_fill.items_for(name, seconds - used))
            if count < 1:
                continue
            chunk, state.held = state.held[:count], state.held[count:]
            end = self._submit_chunk(state, chunk, state.varying, executor=executor)
            ends.append(end)
            state.filled += count
            state.lent += 1  # not its own executors' room [Note: bubble filling]
            end.add_done_callback(lambda _, state=state: self.ctx.events.put(
                functools.partial(_returned, state)))
            used += bubble_fill.predicted(name, count)
        return used

    def _lendable(self, plan: NodePlan) -> bool:
        """Whether a node's calls may run in a trainer's bubble (fill.py `lendable`)."""
        fill = self.ctx.bubble_fill
        return fill is not None and plan.name in fill.nodes

    def _fill_cap(self, plan: NodePlan) -> int:
        """Items a task of a scoring node while the run fills bubbles: about _FILL_TASK_S of
        them at its learned cost, so that its own executors take no more than they start soon
        and the rest waits for whichever frees first, one of them or a bubble; 0: not such a
        node, or its cost is not known yet (its first tasks teach it)."""
        fill = self.ctx.bubble_fill
        if not self._lendable(plan) or not fill.lending:
            return 0
        one = fill.one_item.get(plan.name) or fill.item_seconds.get(plan.name)
        return max(1, min(_BATCH_ITEMS, fill.items_for(plan.name, _FILL_TASK_S))) if one else 0

    def _able_count(self, plan: NodePlan) -> int:
        """How many executors run `plan`'s op (looked up once a node)."""
        able = self._able.get(plan.name)
        if able is None:
            tags = frozenset(plan.tags)
            able = self._able[plan.name] = max(1, sum(
                1 for e in self.ctx.ctl.executors() if e.runs(plan.op, tags)))
        return able

    def _submit_batch(self, state: NodeState, lineages: list[tuple], refs: dict[str, Any],
                      varying: list[str], executor: int | None = None) -> Any:
        """One batched task of `lineages`' calls; `refs` holds a list of their refs for each
        port in `varying`, and the refs every call shares for the others."""
        plan, ctx = state.plan, self.ctx
        refs.update(ctx.feedback_refs(plan, self.step))
        ports = [rule.port for rule in plan.inputs if rule.port in refs]
        outputs = max(1, len(plan.outputs))
        batch, events = _Batch(lineages), ctx.events
        futures = ctx.ctl.submit_items(
            plan.op, *(refs[p] for p in ports),
            per_item=[j for j, port in enumerate(ports) if port in varying],
            config=self._config(plan, (), None, ports), tags=plan.tags, outputs=outputs,
            executor=executor,
            meta={"node": plan.name, "step": self.step, "batch_items": len(lineages)},
            report_key=self.wiring.report_keys.get(plan.name), trace_key=plan.trace_key,
            on_items=lambda early: events.put(
                functools.partial(self._on_batch_items, plan.name, batch, *early)))
        batch.outputs = [f if outputs > 1 else (f,) for f in futures]
        state.pending += 1
        # the last item's future: when it is done, every item's is (or failed with it)
        batch.outputs[-1][0].add_done_callback(lambda _: events.put(
            functools.partial(self._on_batch_done, plan.name, batch)))
        return batch.outputs[-1][0]

    def _arrived_since(self, state: NodeState, streaming: list[InputRule]) -> list[tuple]:
        """The lineages that may have become callable since the last call, in the order the
        lead input's items arrived: its new items, and the waiting ones whose partner came.
        Each input's arrivals are read from a cursor, so a step's pairing is linear in its
        items, never a rescan of every arrival on every progress call."""
        touched = set()
        for index, rule in enumerate(streaming):
            stream = self.streams.of(rule)
            where = (rule.src, rule.src_port)
            new = stream.arrivals[state.cursors.get(where, 0):]
            state.cursors[where] = len(stream.arrivals)
            if index == 0:  # the lead: its items are the calls, in its order
                for lineage in new:
                    if lineage not in state.submitted and lineage not in state.unpaired:
                        state.unpaired[lineage] = state.arrived
                        state.arrived += 1
                        touched.add(lineage)
            else:
                touched.update(lin for lin in new if lin in state.unpaired)
        return sorted(touched, key=state.unpaired.__getitem__)

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
        """Each group the moment its last member is in; the groups complete at once go
        together, as a per-item op's ready items do [Note: batched per-item calls]."""
        (rule,) = [r for r in live if r.granularity is Granularity.GROUPED]
        stream, ready = self.streams.of(rule), []
        for lineage in stream.arrivals[state.seen:]:
            key = stream.keys.get(lineage)
            members = state.groups[key]
            members.append(lineage)
            if rule.group_size is not None and len(members) == rule.group_size:
                ready.append(self._group_call(state, rule, key))
        state.seen = len(stream.arrivals)
        if closed:  # what is left: groups of unknown size, or cut short
            if rule.group_size is not None and state.groups:
                self._warn_incomplete(state.plan.name, rule, state.groups)
            ready += [self._group_call(state, rule, key) for key in list(state.groups)]
        if self._streams_parts(state.plan) or state.plan.name in self.policies:
            for lineage, refs in ready:  # a policy hears of each call [Note: group quota]
                self._submit(state, lineage, refs)
        else:
            self._send_ready(state, ready, [rule.port])

    def _warn_incomplete(self, node: str, rule: InputRule, groups: dict) -> None:
        sizes = sorted({len(members) for members in groups.values()})
        self.incomplete_groups[node] = len(groups)
        self.warnings.append(
            f"{node}: {len(groups)} group(s) by {rule.group_key!r} had {', '.join(map(str, sizes))}"
            f" of {rule.group_size} items when the step's inputs ended; they ran incomplete. "
            f"Make group_by's size the number of items per {rule.group_key!r}")

    def _group_call(self, state: NodeState, rule: InputRule, key: Any) -> tuple[tuple, dict]:
        """The call (lineage, refs) of the group `key`, its members in lineage order."""
        members = sorted_lineages(state.groups.pop(key))
        items = self.streams.of(rule).items
        return (key,), {rule.port: Gather([items[m] for m in members])}

    def _submit_once(self, state: NodeState) -> None:
        refs = {rule.port: Gather(self.streams.of(rule).ordered())
                for rule in state.plan.inputs if not rule.feedback}
        self._submit(state, (), refs)

    # -- submitting ----------------------------------------------------------------------------
    def _submit(self, state: NodeState, lineage: tuple, refs: dict[str, Any], *,
                executor: int | None = None, extra: dict | None = None,
                meta: dict | None = None) -> Any:
        plan, ctx = state.plan, self.ctx
        refs.update(ctx.feedback_refs(plan, self.step))
        ports = [rule.port for rule in plan.inputs if rule.port in refs]
        meta = {"node": plan.name, "step": self.step, **(meta or {})}
        outputs = max(1, len(plan.outputs))
        config = self._config(plan, lineage, extra, ports)
        on_part = self._part_watch(plan, lineage)
        futures = ctx.ctl.submit(plan.op, *(refs[p] for p in ports), config=config,
                                 executor=executor, tags=plan.tags, outputs=outputs,
                                 meta=meta, report_key=self.wiring.report_keys.get(plan.name),
                                 on_part=on_part, trace_key=plan.trace_key,
                                 window=None if on_part is None else STREAM_WINDOW,
                                 handled_by_caller=on_part is not None)
        self._watch(state, lineage, futures if outputs > 1 else (futures,), register=True)
        return futures[0] if outputs > 1 else futures

    def _config(self, plan: NodePlan, lineage: tuple, extra: dict | None,
                ports: list[str]) -> dict:
        """The config of a call of `plan`'s op on inputs `ports` (a model op's sampling config
        afresh: its call policy may change it per call)."""
        if plan.op == "python":
            fn_config = {**plan.config, "step": self.step} if plan.takes_step else plan.config
            return {"target": plan.target, "config": fn_config, "ports": ports,
                    "outputs": list(plan.outputs), "many": list(plan.many)}
        config = {**self.wiring.op_configs[plan.name], "step": self.step}
        policy = self.policies.get(plan.name)
        if policy is not None:
            config.update(policy.config(lineage))
        config.update(extra or {})
        return config

    def _streams_parts(self, plan: NodePlan) -> bool:
        """Whether a call's items go downstream each as it is yielded: one output of many
        items, in a fused run (unfused, consumers wait for the whole stream anyway), of a call
        that is not a group's. A group is complete when it is called, so its items come as fast
        as the op computes them; its calls go batched instead, and a batched task that runs
        long still answers the groups it has finished [Note: early items]."""
        policy = self.policies.get(plan.name)
        return self.wiring.fuse and plan.many == (True,) and plan.call is not Call.PER_GROUP \
            and (policy is None or policy.streams_parts)  # a partial-rollout group goes whole

    def _part_watch(self, plan: NodePlan, lineage: tuple) -> Any:
        """The call's items, each as it is yielded, if it streams them (`_streams_parts`)."""
        if not self._streams_parts(plan):
            return None
        events = self.ctx.events
        return lambda part: events.put(functools.partial(self._on_part, plan.name, lineage, part))

    def _watch(self, state: NodeState, lineage: tuple, futures: tuple, *,
               register: bool, outputs: tuple | None = None) -> None:
        """When `futures` are done, account for them and (with `register`) add them, or
        `outputs` in their place, to the node's output streams."""
        state.pending += 1
        events = self.ctx.events
        shown = futures if outputs is None else outputs
        futures[0].add_done_callback(lambda _: events.put(
            functools.partial(self._on_done, state.plan.name, lineage, futures, register, shown)))

    # -- reporting -----------------------------------------------------------------------------
    def report(self) -> StepReport:
        timing = {name: s.last_end - s.first_start for name, s in self.states.items()
                  if s.first_start is not None and s.last_end is not None}
        metrics: dict[str, Any] = {}
        runs = [run for state in self.states.values() if state.pipeline is not None
                for run in state.pipeline.runs]
        predicted = [v for t in self.ctx.training.values()
                     for v in t.predicted_bubble.values()]
        for name, state in self.states.items():
            if state.pipeline is not None:  # over every round's microbatches, if in rounds
                losses = [f.result() for run in state.pipeline.runs for f in run.losses]
                metrics[f"{name}/loss"], metrics[f"{name}/tokens"] = mean_loss(losses)
                metrics.update({f"{name}/{key}": value
                                for key, value in mean_values(losses).items()})
                if state.pipeline.optimizer_steps > 1:
                    metrics[f"{name}/optimizer_steps"] = state.pipeline.optimizer_steps
        for state in self.states.values():
            if state.plan.reports:
                metrics.update(self._reported(state.plan))
        for training in self.ctx.training.values():
            synced = training.sync_bytes(self.wiring.step_timeout)
            if synced is not None:
                metrics[f"{training.model.name}/sync_bytes"] = synced
            metrics.update(training.activation_memory(self.wiring.step_timeout))
        for node, count in self.incomplete_groups.items():
            metrics[f"{node}/incomplete_groups"] = count
        if self.ctx.bubble_fill is not None:  # [Note: bubble filling in fill.py]
            for name, state in self.states.items():
                if state.plan.scores:
                    metrics[f"{name}/bubble_items"] = state.filled
        for policy in self.policies.values():
            metrics.update(policy.metrics(self.wiring.step_timeout))
        for node, balancer in self.balancers.items():
            if balancer is not None:
                metrics.update(balancer.end_step(node))
        if runs:
            # over every executor's pipeline ops, whichever model they belong to: two models'
            # pipelines sharing executors fill each other's bubbles
            measured = measure((f.location, f.timing) for run in runs
                               for f in run.futures.values())
            metrics["bubble_rate"] = measured["bubble_rate"]
            # the step's pipeline ops, first start to last end: the training part of the step
            metrics["pipeline_makespan_s"] = measured["makespan"]
            metrics["predicted_bubble_rate"] = max(predicted) if predicted else None
        return StepReport(step=self.step, elapsed_s=time.time() - self.started, timing_s=timing,
                          metrics=metrics, warnings=tuple(self.warnings))

    def _reported(self, plan: NodePlan) -> dict[str, float]:
        """The values of a reporter's Metrics items this step (small: fetched to here)."""
        values: dict[str, float] = {}
        timeout = self.wiring.step_timeout
        for port in plan.outputs:
            for ref in self.streams[(plan.name, port)].ordered():
                item = ref.future.result(timeout=timeout)[ref.index] \
                    if isinstance(ref, Item) else ref.result(timeout=timeout)
                if isinstance(item, Metrics):
                    values.update(item.values)
                    self.warnings.extend(item.warnings)
        return values


class _Batch:
    """A batched task's calls as the step handles them: their lineages, each one's output
    futures, and how many are in the node's streams already (answered early, in order)."""

    __slots__ = ("lineages", "outputs", "registered")

    def __init__(self, lineages: list[tuple]) -> None:
        self.lineages, self.outputs, self.registered = lineages, [], 0


class _Site:
    """A node of a step as its call policy acts on it (calls.CallSite)."""

    def __init__(self, run: StepRun, state: NodeState, lead: InputRule | None = None) -> None:
        self.run, self.state, self.lead = run, state, lead

    def submit(self, lineage: tuple, lead: Any, *, extra: dict | None = None,
               meta: dict | None = None) -> None:
        """The call goes where the node's balancer says, as the step's own calls do."""
        run, state = self.run, self.state
        state.submitted.add(lineage)
        name, executor = state.plan.name, None
        balancer = run.balancers.get(name)
        if balancer is not None:
            workload = run.ctx.workloads[name]
            keys = run.streams.of(workload.lead).keys if workload.keyed else {}
            executor = balancer.assign(lineage, keys.get(lineage))
        run._submit(state, lineage, {self.lead.port: lead}, executor=executor, extra=extra,
                    meta=meta)

    def abort(self, requests: Sequence[str]) -> list[Any]:
        run, state = self.run, self.state
        aborts = run.ctx.abort_calls(state.plan, requests, run.step)
        for abort in aborts:
            run._watch(state, (), (abort,), register=False)
        return aborts

    def lead_items(self) -> list[tuple[tuple, Any]]:
        stream = self.run.streams.of(self.lead)
        return [(lineage, stream.items[lineage]) for lineage in stream.arrivals]

    def touch(self) -> None:
        self.run._touch(self.state.plan.name)


def _returned(state: NodeState) -> None:
    """A task lent a trainer's bubble ended [Note: bubble filling in fill.py]."""
    state.lent -= 1

