"""The controller's bookkeeping: executors, tasks, objects and their futures.

Pure state and decisions, no threads: the Controller calls its methods (only these touch its
dicts) holding its IO lock, and everything leaves through `send_raw`. Tasks go to executors ahead
of their data (each names the object ids it reads and writes); producers are told to push objects
straight to consuming executors; failures propagate to every task downstream; an object is freed
once its last consumer is done and nobody holds its future.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

from flowkit.runtime.credits import StreamCredits
from flowkit.runtime.futures import ExecutorLost, Future, Owner, RemoteError, TaskCancelled
from flowkit.runtime.registry import ExecutorInfo, ObjectRecord, TaskRecord
from flowkit.runtime.replies import check_sender, completion_problem, usual_completion
from flowkit.wire.hello import HelloRefused, Origin, check_hello, check_origin, check_secret
from flowkit.wire.limits import CONTROL_FRAME_BYTES
from flowkit.wire.protocol import Msg, ProtocolError, encode, part_id
from flowkit.wire.refs import Gather, Item, object_ids
from flowkit.wire.refusals import Refusals
from flowkit.wire.schema import shown
from flowkit.wire.serialize import SerializeError, declared_modules, pack, unpack
from flowkit.wire.task import TaskSpec

__all__ = ["Dispatcher", "NoExecutor"]

log = logging.getLogger("flowkit.controller")

Listener = Callable[[str, dict], Any]


_NO_ORIGIN = Origin()  # a message handed over directly, not off a socket
_HELLOS_REMEMBERED = 4096  # connections whose HELLO was refused and answered [Note: refusals]


class NoExecutor(RuntimeError):
    """No connected executor can run the op with the tags asked for."""


class _FailedUnrecorded(Exception):
    """A task input is a future failed at its own submit (NoExecutor: say its executor was
    just lost), which never had an object record: the task is cancelled, naming why."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Dispatcher:
    def __init__(self, *, owner: Owner, send_raw: Callable[[list], None],
                 ping_interval: float, ping_timeout: float, heartbeat_address: str,
                 secret: bytes, max_frame_bytes: int = CONTROL_FRAME_BYTES) -> None:
        self.condition = owner.condition
        self._secret = secret  # the run's: a HELLO without it is refused [Note: joining a run]
        self.refusals = Refusals(log)
        self._owner = owner  # of the futures made here
        self._send_raw = send_raw
        self.ping_interval, self.ping_timeout = ping_interval, ping_timeout
        self.heartbeat_address = heartbeat_address
        self.max_frame_bytes = max_frame_bytes
        self._ids = itertools.count(1)
        self._executors: dict[int, ExecutorInfo] = {}
        self._by_identity: dict[bytes, int] = {}
        self._hellos_refused: dict[bytes, None] = {}  # connections answered once, oldest first
        self._tasks: dict[int, TaskRecord] = {}
        self._objects: dict[int, ObjectRecord] = {}
        # (op, node) -> its tasks' typical seconds on an executor [Note: placement by load]
        self._typical: dict[tuple, float] = {}
        # Pending futures only: a future is dropped from here once resolved, so the user's last
        # reference decides when it is released ([Note: object lifetime] in futures.py).
        self._futures: dict[int, Future] = {}
        self._fetches: dict[int, list] = {}  # unanswered: request -> [done, value, error, holder]
        self._outbox: dict[int, list[dict]] = defaultdict(list)  # encoded TaskSpecs
        self._frees: dict[int, list[int]] = defaultdict(list)
        self._pushes: dict[tuple[int, int], list[int]] = defaultdict(list)  # (from, to) -> ids
        self._frees_sent = 0.0
        self._callbacks: deque = deque()  # (fn, future): a deque, as it is drained unlocked
        self.credits = StreamCredits(self._tasks, self._objects, self._executors, self._send)
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    # -- views ---------------------------------------------------------------------------------
    def executors(self) -> list[ExecutorInfo]:
        return [e for e in self._executors.values() if e.alive]

    def executor(self, executor_id: int) -> ExecutorInfo | None:
        return self._executors.get(executor_id)

    # -- sending -------------------------------------------------------------------------------
    def _send(self, executor: ExecutorInfo, kind: str, fields: dict, frames: list = ()) -> None:
        self._send_raw([executor.identity, *encode(kind, fields, frames)])

    def flush(self, executor_id: int | None = None) -> None:
        """Send queued tasks (all, or one executor's) and frees, one message per executor; the
        pushes their inputs need go first, one message per producer and consumer."""
        if self._pushes:
            self._send_pushes()
        if self.credits.due:
            self.credits.send()
        if not self._outbox and not self._frees:
            return
        targets = [executor_id] if executor_id is not None else list(self._outbox)
        for target in targets:
            tasks = self._outbox.pop(target, None)
            executor = self._executors[target]
            if tasks and executor.alive:
                self._send(executor, Msg.RUN, {"tasks": tasks})
        if executor_id is None and self._frees_due():
            for target, objects in self._frees.items():
                executor = self._executors[target]
                if executor.alive:
                    self._send(executor, Msg.FREE, {"objects": objects})
            self._frees.clear()
            self._frees_sent = time.monotonic()

    def _send_pushes(self) -> None:
        """[Note: batched pushes] A producer is told in one SEND message every object to push
        to one consumer, not one message an object: a batched task's inputs are hundreds."""
        for (source_id, target_id), objects in self._pushes.items():
            source, target = self._executors[source_id], self._executors[target_id]
            if source.alive:
                self._send(source, Msg.SEND, {"objects": objects, "to": target.id,
                                              "address": target.peer_address,
                                              "host_id": target.host_id})  # [Note: hosts]
        self._pushes.clear()

    def _frees_due(self) -> bool:
        """Frees go out in batches: a message per freed object would double the traffic of a
        stream of small tasks, and holding a few freed objects a little longer costs nothing."""
        if not self._frees:
            return False
        waiting = sum(len(objects) for objects in self._frees.values())
        return waiting >= _FREE_BATCH or time.monotonic() - self._frees_sent >= _FREE_DELAY_S

    def _emit(self, event: str, payload: dict) -> None:
        for listener in self._listeners:
            try:
                listener(event, payload)
            except Exception:
                log.exception("listener failed on %s", event)

    def run_callbacks(self) -> None:
        """Run the callbacks of futures resolved so far; never under the IO lock (they submit)."""
        callbacks = self._callbacks
        while True:
            try:  # no "while callbacks": another thread may take the last one after the check
                fn, future = callbacks.popleft()
            except IndexError:
                return
            try:
                fn(future)
            except Exception:
                log.exception("future callback failed")

    # -- messages from executors ---------------------------------------------------------------
    def on_message(self, identity: bytes, header: dict, frames: list,
                   origin: Origin = _NO_ORIGIN) -> None:
        """Handle one decoded message from `identity`; ProtocolError if it is malformed or not
        the sender's to send. `origin`: where a HELLO came from, as the transport says."""
        kind = header["t"]
        if kind == Msg.HELLO:
            try:
                self._on_hello(identity, header, origin)
            except ProtocolError as exc:
                self._refuse_hello(identity, header, exc)
            return
        executor_id = self._by_identity.get(identity)
        if executor_id is None:
            raise ProtocolError(f"{kind!r} from an executor that never said hello")
        executor = self._executors[executor_id]
        executor.last_seen = time.monotonic()
        if kind == Msg.DONE:
            self._on_done(executor, header["items"])
        elif kind == Msg.PARTS:
            self._on_part(executor, header, header["outputs"])
        elif kind == Msg.STREAMS:
            self._on_streams(executor, header["tasks"])
        elif kind == Msg.PART:
            self._on_part(executor, header, [header["output"]])
        elif kind == Msg.ITEMS:
            self._on_items(executor, header)
        elif kind == Msg.VALUE:
            self._on_value(executor, header, frames)
        elif kind == Msg.ERROR:  # an executor's own reason, bounded [Note: refusals]
            self.refusals.warn(f"{executor.name} rejected", lambda: (
                f"{executor.describe()} rejected a message: {shown(header['reason'], 400)}"))
        else:
            raise ProtocolError(f"a controller does not take {kind!r} messages")

    def _on_hello(self, identity: bytes, header: dict, origin: Origin) -> None:
        """Admit an executor [Note: joining a run in flowkit/wire/hello.py], or HelloRefused."""
        check_secret(header, self._secret)
        check_hello(header)
        check_origin(header, origin)
        self._check_unique(identity, header["name"])
        executor = ExecutorInfo(
            id=next(self._ids), name=header["name"], tags=tuple(header["tags"]),
            ops=frozenset(header["ops"]), pid=header["pid"], host=header.get("host", ""),
            host_id=header.get("host_id", ""),
            device=header.get("device", "cpu"), peer_address=header.get("peer_address", ""),
            identity=identity, resources=header.get("resources", {}),
            last_seen=time.monotonic(), ping_token=secrets.token_hex(16))
        with self.condition:
            self._executors[executor.id] = executor
            self._by_identity[identity] = executor.id
            self.condition.notify_all()
        self._send(executor, Msg.WELCOME, {"executor": executor.id,
                                           "ping_interval": self.ping_interval,
                                           "ping_timeout": self.ping_timeout,
                                           "heartbeat_address": self.heartbeat_address,
                                           "ping_token": executor.ping_token,
                                           # [Note: record registry] in wire/serialize.py
                                           "modules": declared_modules(),
                                           "max_frame_bytes": self.max_frame_bytes})
        self._emit("executor_joined", {"executor": executor})

    def _check_unique(self, identity: bytes, name: str) -> None:
        """HelloRefused if this connection joined already, or a live executor has this name (a
        replacement of a lost one may take its name)."""
        known = self._by_identity.get(identity)
        if known is not None and self._executors[known].alive:
            raise HelloRefused(f"this connection joined already, as "
                               f"{self._executors[known].describe()}")
        if any(e.alive and e.name == name for e in self._executors.values()):
            raise HelloRefused(f"executor name {shown(name)} is a live executor's: names are "
                               f"unique (a replacement joins once the one it replaces is lost)")

    def ping_token(self, executor_id: int) -> str | None:
        """The token a live executor's pings carry (from any thread: one dict read)."""
        executor = self._executors.get(executor_id)
        return executor.ping_token if executor is not None and executor.alive else None

    def executor_at(self, identity: bytes) -> ExecutorInfo | None:
        """The live executor that said hello on this connection, if any."""
        executor = self._executors.get(self._by_identity.get(identity, 0))
        return executor if executor is not None and executor.alive else None

    def _refuse_hello(self, identity: bytes, header: dict, exc: ProtocolError) -> None:
        """No WELCOME, no record; a warning (one a while per kind) and, the first time on a
        connection, an ERROR that tells a misconfigured executor why, so it exits saying so
        rather than wait; a connection that says HELLO again hears nothing [Note: refusals]."""
        reason = str(exc)
        self.refusals.warn(f"hello {reason[:40]}", lambda: (
            f"refused an executor calling itself {shown(header.get('name'), 60)}: {reason}"))
        if identity in self._hellos_refused:
            return
        if len(self._hellos_refused) >= _HELLOS_REMEMBERED:
            self._hellos_refused.pop(next(iter(self._hellos_refused)))
        self._hellos_refused[identity] = None
        self._send_raw([identity, *encode(Msg.ERROR, {"reason": reason, "refused": True})])

    def _on_done(self, executor: ExecutorInfo, items: list) -> None:
        """Completions of the sender's own tasks, each checked before it counts; those of any
        other task are ignored, and a malformed one refused, the message then refused as a
        whole once the sender's well-formed ones have counted."""
        tasks, inflight, refused, foreign = self._tasks, executor.inflight, [], []
        sender = executor.id
        with self.condition:
            for item in items:
                task_id = item.get("task") if type(item) is dict else None
                if type(task_id) is not int:
                    refused.append(shown(item, 80))
                    continue
                task = tasks.get(task_id)
                if task is None or task.state != "pending":
                    continue
                if task.executor != sender:
                    foreign.append(task.id)
                    continue
                ok, outputs = item.get("ok"), item.get("outputs", ())
                if not (ok is True and usual_completion(task, item, outputs)):
                    problem = completion_problem(task, item)
                    if problem:  # the other completions still count
                        refused.append(problem)
                        continue
                executor.outstanding -= 1
                inflight.pop(task.id, None)
                task.start, task.end = item.get("start", 0.0), item.get("end", 0.0)
                self._learned(task, executor, item)
                if ok:
                    self._complete(task, executor, outputs)
                else:
                    self._fail_task(task, RemoteError(
                        f"op {task.op!r} failed on {executor.describe()}: {item.get('error')}"
                        f"{RemoteError.MARK}{item.get('traceback', '')}",
                        op=task.op, executor=executor.name,
                        remote_traceback=item.get("traceback", "")))
            self.condition.notify_all()
        if refused:
            raise ProtocolError(f"done: {len(refused)} completion(s) refused: {refused[0]}")
        if foreign:
            raise ProtocolError(f"done: {shown(foreign)} are not tasks sent to "
                                f"{executor.describe()}; ignored")

    def _on_part(self, executor: ExecutorInfo, header: dict, outputs: list) -> None:
        """Items a streaming task yielded, from item `index` on: each an object of its own on
        `executor` [Note: part ids], handed to the task's `on_part` as a done future."""
        task = self._tasks.get(header["task"])
        check_sender(task, executor, "part")
        if task is None or task.state != "pending" or task.on_part is None:
            return  # failed or cancelled meanwhile: the part goes with the task's objects
        index, end = header["index"], float(header["end"])
        timing = (float(header.get("start", end)), end)
        with self.condition:
            for offset, out in enumerate(outputs):
                if index + offset != task.parts or task.executor != executor.id or \
                        out["id"] != part_id(task.outputs[0], index + offset):
                    raise ProtocolError(f"part {index + offset} of task {task.id} is out of "
                                        f"order, from the wrong executor or misnamed "
                                        f"(id {out['id']})")
                task.parts += 1
                if "trace" in out:
                    _trace(task, out["trace"])
                record = self._objects[out["id"]] = ObjectRecord(
                    out["id"], executor.id, task.id, produced=True,
                    holders=frozenset((executor.id,)), nbytes=out["nbytes"])
                future = Future(record.id, self._owner)
                future.keys, future.timing = out.get("keys"), timing
                self._callbacks += _resolve(future, executor.id, record.nbytes, out)
                if task.window is not None and not task.handled_by_caller:
                    self._callbacks.append((_then_credit(task.on_part, self.credits.checks,
                                                         task, record), future))
                else:
                    self._callbacks.append((task.on_part, future))
            self.condition.notify_all()

    def _on_streams(self, executor: ExecutorInfo, bodies: list) -> None:
        """Several tasks' parts: each as its PARTS message would be; one task's that is not the
        sender's or out of order is refused once the others have counted."""
        refused = []
        for body in bodies:
            try:
                self._on_part(executor, body, body["outputs"])
            except ProtocolError as exc:
                refused.append(str(exc))
        if refused:
            raise ProtocolError(f"streams: {len(refused)} task(s)' items refused: {refused[0]}")

    def _complete(self, task: TaskRecord, executor: ExecutorInfo, outputs: list) -> None:
        task.state = "done"
        executor.completed += 1
        executor.busy_s += max(0.0, task.end - task.start)
        timing = (task.start, task.end)
        for out in outputs:
            if "trace" in out and not task.parts:  # a streamed task's came with its parts
                _trace(task, out["trace"])
            self._produced(task, executor, out, timing)
        self._consumed(task)
        del self._tasks[task.id]  # finished tasks are only remembered by listeners
        if self._listeners:
            self._emit("task_done", {"task": task, "executor": executor})

    def _produced(self, task: TaskRecord, executor: ExecutorInfo, out: dict,
                  timing: tuple[float, float]) -> None:
        """Output `out` (as its executor described it) of `task` exists: its future resolves."""
        record = self._objects.get(out["id"])
        if record is None:
            return
        nbytes = record.nbytes = out.get("nbytes", 0)
        record.produced = True
        record.holders = record.holders | {executor.id} if record.holders else executor.alone
        executor.bytes_out += nbytes
        task.nbytes_out += nbytes
        future = self._futures.pop(record.id, None)
        if future is not None:
            future.count, future.keys = out.get("count"), out.get("keys")
            future.timing = timing
            self._callbacks += _resolve(future, executor.id, nbytes, out)
        self._maybe_free(record)

    def _on_items(self, executor: ExecutorInfo, header: dict) -> None:
        """Items a batched task finished while it runs on [Note: early items in
        executors/process.py]: their futures resolve now, and the task's `on_items` hears of
        them; the task's completion brings the rest."""
        task = self._tasks.get(header["task"])  # whose it is is checked below
        if task is None or task.state != "pending":
            return  # failed or cancelled meanwhile
        outputs, per_item = header["outputs"], len(task.outputs) // (task.items or 1)
        first, answered = header["first"], task.answered
        ids = task.outputs[answered:answered + len(outputs)]
        if task.items is None or task.executor != executor.id or first * per_item != answered \
                or len(outputs) % per_item or [out["id"] for out in outputs] != list(ids):
            raise ProtocolError(f"items {first}.. of task {task.id} are not its next items, "
                                "come from the wrong executor or are misnamed")
        timing = (float(header.get("start", header["end"])), float(header["end"]))
        with self.condition:
            for out in outputs:
                if "trace" in out:
                    _trace(task, out["trace"])
                self._produced(task, executor, out, timing)
            task.answered += len(outputs)
            if task.on_items is not None:
                self._callbacks.append((task.on_items, (first, len(outputs) // per_item)))
            self.condition.notify_all()

    def _on_value(self, executor: ExecutorInfo, header: dict, frames: list) -> None:
        """The answer to a fetch, only from the executor it was asked of."""
        slot = self._fetches.get(header["request"])
        if slot is None:
            return
        if slot[3] != executor.id:
            raise ProtocolError(f"value: request {header['request']} was not sent to "
                                f"{executor.describe()}; ignored")
        del self._fetches[header["request"]]
        with self.condition:
            if "error" in header:
                slot[2] = RemoteError(header["error"])
            else:
                try:
                    slot[1] = unpack(header["meta"]["body"], frames)
                except SerializeError as exc:
                    slot[2] = exc
            slot[0] = True
            self.condition.notify_all()

    # -- commands from user threads ------------------------------------------------------------
    def submit(self, spec: TaskSpec, inputs: tuple, *, outputs: int, executor_id: int | None,
               tags: frozenset, meta: dict, hold: bool = False,
               on_part: Callable[[Future], Any] | None = None,
               on_items: Callable[[tuple[int, int]], Any] | None = None,
               handled_by_caller: bool = False) -> tuple[Future, ...]:
        """Queue the task `spec` describes (given here its id, input refs and output ids) for
        the executor chosen for it, and unless `hold` send that executor its queue when it
        is idle or a batch is full; returns the task's output futures, failed at once when no
        executor runs the op or an input already failed. A streaming spec's items come to
        `on_part`, each as a future of its own, at once; a batched spec's items that finish
        early [Note: early items] are told to `on_items` as (first item, count). With a
        `trace_key` each output item's
        field of that name joins `meta["items"]` [Note: traced items in executors/tasks.py]."""
        op = spec.op
        if spec.stream and outputs != 1:
            raise ValueError(f"a streaming task has one output (a list), not {outputs}")
        futures = (self._new_future(),) if outputs == 1 else tuple(  # one: the usual
            [self._new_future() for _ in range(outputs)])
        try:
            executor = self._choose(op, tags, executor_id)
        except NoExecutor as exc:
            self._fail_futures(futures, exc)
            return futures
        objects = self._objects
        task_id = next(self._ids)
        try:
            refs, input_ids, failed = self._inputs(inputs, executor, task_id)
        except _FailedUnrecorded as unrecorded:
            self._fail_futures(futures, TaskCancelled(
                f"{op!r} not run: an input failed: {unrecorded.error}", op=op))
            return futures
        output_ids = (futures[0].id,) if outputs == 1 else tuple([f.id for f in futures])
        task = TaskRecord(task_id, op, executor.id, input_ids, output_ids, spec.config, meta,
                          on_part=on_part, items=spec.items, on_items=on_items,
                          window=spec.window, handled_by_caller=handled_by_caller,
                          kind=() if spec.stream else (op, meta.get("node") if meta else None))
        # [Note: placement by load] a stream counts as a task, whatever its span
        task.expect = self._typical.get(task.kind, 0.0) if task.kind else 0.0
        self._tasks[task_id] = task
        for object_id in output_ids:
            objects[object_id] = ObjectRecord(object_id, executor.id, task_id)
        if failed is not None:
            with self.condition:
                self._fail_task(task, TaskCancelled(f"{op!r} not run: an input failed: {failed}",
                                                    op=op))
                self.condition.notify_all()
            return futures
        for object_id in input_ids:
            self._route(objects[object_id], executor)
        executor.outstanding += 1
        executor.expected_s += task.expect
        executor.inflight[task_id] = time.monotonic()
        outbox = self._outbox[executor.id]
        outbox.append(spec.encode_as(task_id, refs, output_ids))
        if self._listeners:
            self._emit("task_submitted", {"task": task, "executor": executor})
        # An idle executor gets its task now; a busy one gets tasks in batches.
        if not hold and (executor.outstanding <= 1 or len(outbox) >= _BATCH):
            self.flush(executor.id)
        return futures

    def _inputs(self, inputs: tuple, executor: ExecutorInfo,
                task_id: int) -> tuple[Sequence, Sequence[int], BaseException | None]:
        """(wire refs, object ids read, the error of a failed input) of a task's inputs."""
        if not inputs:
            return (), (), None
        try:
            refs = [self._input_ref(value, executor) for value in inputs]
        except _FailedUnrecorded:
            for object_id in [i for i in self._objects if i > task_id]:
                self._maybe_free(self._objects[object_id])  # the values placed for it
            raise
        input_ids, failed = [], None
        # each object once, however many of its items the task reads (a microbatch reads the
        # 8 samples of each group's list): it is routed, awaited and consumed once
        for object_id in dict.fromkeys(_ids_of(refs)):
            record = self._objects[object_id]
            record.consumers = record.consumers or []
            record.consumers.append(task_id)
            record.pending += 1
            failed = failed or record.error
            input_ids.append(object_id)
        return refs, input_ids, failed

    def _new_future(self) -> Future:
        future = Future(next(self._ids), self._owner)
        self._futures[future.id] = future
        return future

    def _fail_futures(self, futures: tuple, error: BaseException) -> None:
        with self.condition:
            for future in futures:
                self._futures.pop(future.id, None)
                self._callbacks += future._fail(error)
            self.condition.notify_all()

    def put(self, value: Any, executor_id: int | None) -> Future:
        future = self._new_future()
        try:
            executor = self._choose(None, frozenset(), executor_id)
            body, frames = pack(value)
        except (NoExecutor, SerializeError) as exc:
            self._fail_futures((future,), exc)
            return future
        self._place(future.id, executor, body, frames)
        with self.condition:
            self._futures.pop(future.id, None)
            self._callbacks += future._resolve(executor.id, len(body), value)
            self.condition.notify_all()
        return future

    def fetch(self, object_id: int) -> tuple[int, list]:
        """(request, slot): the slot [done, value, error, holder id] fills in when it answers."""
        request, slot = next(self._ids), [False, None, None, None]
        record = self._objects.get(object_id)
        # the producer first: another holder may be one the object is still on its way to
        # (holders are recorded when the push is asked for), which would answer "not here"
        holder = None if record is None else next(
            (self._executors[h] for h in (record.location, *sorted(record.holders))
             if h in self._executors and self._executors[h].alive), None)
        if holder is None:
            slot[2], slot[0] = ExecutorLost(f"object {object_id} is on no live executor"), True
            return request, slot
        slot[3] = holder.id
        self._fetches[request] = slot
        self._send(holder, Msg.FETCH, {"object": object_id, "request": request})
        return request, slot

    def forget_fetch(self, request: int) -> None:
        """The asker gave up (timeout): drop the request, its answer will find no slot."""
        self._fetches.pop(request, None)

    def release(self, object_id: int) -> None:
        record = self._objects.get(object_id)
        if record is not None:
            record.user_released = True
            self._maybe_free(record)

    # -- placement, routing, freeing -----------------------------------------------------------
    def _learned(self, task: TaskRecord, executor: ExecutorInfo, item: dict) -> None:
        """`task` completed: its executor's expected seconds without it, and what its kind
        takes when it succeeded: the seconds it held its executor's op thread, its span unless
        the executor says otherwise (`busy`: a deferred op, a share of a merged call) [Note:
        placement by load]."""
        _unqueued(executor, task)
        busy = item.get("busy")
        took = busy if type(busy) in (float, int) else task.end - task.start
        if task.kind and item.get("ok") is True and 0.0 <= took < _LONGEST_EXPECTED_S:
            typical = self._typical.get(task.kind)
            self._typical[task.kind] = took if typical is None else typical + 0.25 * (
                took - typical)

    def _choose(self, op: str | None, tags: frozenset, executor_id: int | None) -> ExecutorInfo:
        if executor_id is not None:
            executor = self._executors.get(executor_id)
            if executor is None:
                raise NoExecutor(f"executor {executor_id} is not connected")
            if not executor.alive:  # lost: say which, and why, as its tasks' failures do
                raise NoExecutor(f"executor {executor.describe()} was lost: "
                                 f"{executor.lost_reason}")
            if op is not None and op not in executor.ops:
                raise NoExecutor(f"{executor.describe()} does not run op {op!r}")
            return executor
        # The least loaded [Note: placement by load]; between equals, the one whose oldest
        # unfinished task is youngest: an executor stuck in a long op (the long tail of
        # generation) should not get the next.
        best, least = None, 0.0
        for e in self._executors.values():
            if e.alive and (op is None or e.runs(op, tags)):
                load = e.outstanding + e.expected_s / _TASK_S
                if best is None or load < least or load == least and _oldest(e) > _oldest(best):
                    best, least = e, load
        if best is None:
            connected = "; ".join(f"{e.describe()}: {', '.join(sorted(e.ops))}"
                                  for e in self._executors.values() if e.alive) or "none"
            raise NoExecutor(f"no executor runs op {op!r} with tags {sorted(tags)}; "
                             f"connected: {connected}")
        return best

    def _input_ref(self, value: Any, executor: ExecutorInfo) -> Any:
        """The wire form of one task input (flowkit/wire/refs.py)."""
        if isinstance(value, Item):
            return [self._input_object(value.future, executor), int(value.index)]
        if isinstance(value, Gather):
            return {"gather": [self._input_ref(part, executor) for part in value.parts]}
        return self._input_object(value, executor)

    def _input_object(self, value: Any, executor: ExecutorInfo) -> int:
        if isinstance(value, Future):
            if value.id not in self._objects:
                if value._error is not None:  # failed at submit: no executor could run it
                    raise _FailedUnrecorded(value._error)
                # a future from a put that is still queued cannot exist: commands run in order
                raise ProtocolError(f"{value!r} is not known to this controller")
            return value.id
        object_id = next(self._ids)
        body, frames = pack(value)
        self._place(object_id, executor, body, frames)
        self._objects[object_id].user_released = True  # nobody holds a future for it
        return object_id

    def _place(self, object_id: int, executor: ExecutorInfo, body: bytes, frames: list) -> None:
        self._objects[object_id] = ObjectRecord(id=object_id, location=executor.id,
                                                produced=True, holders=frozenset((executor.id,)))
        self._send(executor, Msg.PUT, {"object": object_id, "meta": {"body": body}}, frames)

    def _route(self, record: ObjectRecord, executor: ExecutorInfo) -> None:
        """Have the producer push the object to `executor` (once it exists) unless it is there."""
        if executor.id in record.holders or record.location == executor.id:
            return
        record.holders = record.holders | {executor.id}
        self._pushes[(record.location, executor.id)].append(record.id)  # [Note: batched pushes]

    def _consumed(self, task: TaskRecord) -> None:
        for object_id in task.inputs:
            record = self._objects.get(object_id)
            if record is not None:
                record.pending -= 1
                if record.credit_of:
                    self.credits.consumed(record)
                self._maybe_free(record)

    def _maybe_free(self, record: ObjectRecord) -> None:
        if record.pending > 0 or not record.user_released:
            return
        if not record.produced and record.error is None:
            return  # still to come: free once produced
        for holder in record.holders | {record.location}:
            self._frees[holder].append(record.id)
        del self._objects[record.id]

    # -- failures ------------------------------------------------------------------------------
    def _fail_task(self, task: TaskRecord, error: BaseException) -> None:
        """Fail `task`, its futures, and every task downstream of them. Holds the condition."""
        stack = [(task, error, False)]
        while stack:
            current, reason, downstream = stack.pop()
            if current.state != "pending":
                continue
            if downstream:  # its executor is told once, however many of its inputs failed
                self._cancel_on_executor(current)
            current.state = "failed"
            self._tasks.pop(current.id, None)
            self._emit("task_failed", {"task": current, "error": reason})
            for object_id in current.outputs:
                record = self._objects.get(object_id)
                if record is None or record.produced:  # a batched task's early item stands
                    continue
                record.error = reason
                future = self._futures.pop(object_id, None)
                if future is not None:
                    self._callbacks += future._fail(reason)
                for consumer_id in record.consumers:
                    consumer = self._tasks.get(consumer_id)
                    if consumer is not None and consumer.state == "pending":
                        stack.append((consumer, TaskCancelled(
                            f"{consumer.op!r} not run: its input from {current.op!r} failed: "
                            f"{reason}", op=consumer.op), True))
                self._maybe_free(record)
            self._consumed(current)

    def _cancel_on_executor(self, task: TaskRecord) -> None:
        executor = self._executors[task.executor]
        executor.outstanding -= 1
        _unqueued(executor, task)
        executor.inflight.pop(task.id, None)
        if executor.alive:
            self._send(executor, Msg.CANCEL, {"tasks": [task.id]})

    def cancel_pending(self, reason: str) -> int:
        """Fail every pending task, `TaskCancelled(reason)`, each executor told to drop its
        own: what a run that ended leaves behind on a shared controller's executors. A task
        waiting in a lane for an input that will never come would hold that lane's next task
        for good [Note: lanes]. Returns how many were pending."""
        with self.condition:
            pending = [task for task in self._tasks.values() if task.state == "pending"]
            for task in pending:
                if task.state == "pending":  # not failed meanwhile as another's consumer
                    self._cancel_on_executor(task)
                    self._fail_task(task, TaskCancelled(reason, op=task.op))
            self.condition.notify_all()
        return len(pending)

    def lose(self, executor_id: int, reason: str) -> None:
        executor = self._executors.get(executor_id)
        if executor is None or not executor.alive:
            return
        log.error("lost %s: %s", executor.describe(), reason)
        error = ExecutorLost(f"executor {executor.describe()} was lost: {reason}",
                             executor=executor.name)
        with self.condition:
            executor.alive, executor.lost_reason = False, reason
            for task in list(self._tasks.values()):
                if task.state == "pending" and task.executor == executor.id:
                    self._fail_task(task, error)
            for record in list(self._objects.values()):
                # made there: its copies elsewhere may still be on their way (holders are
                # recorded when a push is asked for), so whoever reads it fails now, and a task
                # submitted later that reads it fails at once, rather than wait for a push
                # that will never come
                made_there = record.location == executor.id or record.holders <= {executor.id}
                if not (record.produced and made_there):
                    continue
                record.error = record.error or error
                if record.consumers:
                    for consumer_id in record.consumers:
                        consumer = self._tasks.get(consumer_id)
                        if consumer is not None and consumer.state == "pending":
                            self._cancel_on_executor(consumer)
                            self._fail_task(consumer, error)
            for request, slot in list(self._fetches.items()):
                if slot[3] == executor.id:
                    del self._fetches[request]
                    slot[2], slot[0] = error, True
            self.condition.notify_all()
        self._emit("executor_lost", {"executor": executor, "reason": reason})

    def shutdown_all(self) -> None:
        for executor in self._executors.values():
            if executor.alive:
                self._send(executor, Msg.SHUTDOWN, {})
        with self.condition:
            for task in list(self._tasks.values()):
                if task.state == "pending":
                    self._fail_task(task, RemoteError("the controller shut down"))
            self.condition.notify_all()
        self.run_callbacks()


_BATCH = 64  # tasks queued for one executor before they go out without waiting for a flush
_NEVER = float("inf")  # an executor with nothing in flight: its oldest task is "infinitely young"


# [Note: placement by load] A task no one pinned goes to the least loaded executor: its tasks
# outstanding, plus the seconds they are expected to take in units of _TASK_S (each kind, (op,
# node), what it held the executor's op thread before, an average; a deferred op or a merged
# call's share says what), so that a 40 ms forward weighs as 9 tasks and ops of microseconds as
# the tasks they are; a stream counts as one task. Counting tasks alone put a group's
# advantages (1 ms) behind a replica's 30 ms backward on the README's Qwen2 GRPO while the other
# executor held two 1 ms rewards, and the step waited. 20 traced steps of it: rewards and
# advantages that waited over 20 ms 5 of 206, against 11 of 211; the step 0.98x (3 alternating
# pairs, 40 steps: 1.05, 0.93, 0.95, within noise); `flowkit bench scale` within noise.
_TASK_S = 0.005
_LONGEST_EXPECTED_S = 60.0  # a longer span is a stall, not what its kind takes


def _unqueued(executor: ExecutorInfo, task: TaskRecord) -> None:
    """`executor`'s expected seconds without `task` (its outstanding count already is): none
    once nothing is outstanding, so rounding never adds up [Note: placement by load]."""
    executor.expected_s = max(0.0, executor.expected_s - task.expect) \
        if executor.outstanding else 0.0


def _oldest(executor: ExecutorInfo) -> float:
    """When the executor's oldest unfinished task was submitted (_NEVER: none is)."""
    return next(iter(executor.inflight.values()), _NEVER)


_NONE_BODY = pack(None)[0]


def _then_credit(on_part: Callable, checks: deque, task: TaskRecord,
                 record: ObjectRecord) -> Callable:
    """`on_part`, then its item's credit check [Note: stream credits in credits.py], in one
    callback: several threads may drain the callbacks at once, and a check run beside an
    on_part that has not yet submitted the item's consumers would find none and credit it."""
    def run(future: Future) -> None:
        try:
            on_part(future)
        finally:
            checks.append((task, record))
    return run


def _resolve(future: Future, executor_id: int, nbytes: int, out: dict) -> Sequence:
    """Resolve `future` with output `out`: the value stays on its executor unless it came in
    the completion, and then it is decoded only if someone asks for it, so a controller that
    only routes items never decodes them. The usual None is known at once."""
    body = out.get("inline")
    if body is None:
        return future._resolve(executor_id, nbytes)
    if body == _NONE_BODY:
        return future._resolve(executor_id, nbytes, None)
    if type(body) is not bytes:
        raise ProtocolError(f"an inline output must be bytes, got {type(body).__name__}")
    return future._resolve(executor_id, nbytes, body=body)


def _trace(task: TaskRecord, values: Any) -> None:
    """Add an output's traced values to the task's meta, which its span copies. The meta dict
    may be the caller's, shared by several tasks, so it is replaced, never changed (a task has
    a few items: copying is cheap). Only for the trace, so a malformed list is dropped with a
    warning, failing nothing."""
    if not isinstance(values, list):
        log.warning("task %s (%s): an output's trace is a %s, not a list; dropped", task.id,
                    task.op, type(values).__name__)
        return
    task.meta = {**task.meta, "items": [*task.meta.get("items", ()), *values]}


def _ids_of(refs: list) -> list[int]:
    if all(type(ref) is int for ref in refs):
        return refs
    return [object_id for ref in refs for object_id in object_ids(ref)]


_FREE_BATCH, _FREE_DELAY_S = 256, 0.02
