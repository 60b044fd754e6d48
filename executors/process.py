"""The executor process: connects to a controller, runs tasks from the op table, keeps the objects
its tasks produce, and moves them straight to the executors that consume them.

One thread serves the sockets and runs ops (so a no-op costs microseconds, not a thread hand-off);
a second thread only exchanges heartbeats on a socket of its own, so a long op never makes the
controller think this executor died, and a dead controller makes this process exit by itself.
"""

from __future__ import annotations

import logging
import os
import socket as pysocket
import threading
import time
import traceback
from collections import defaultdict, deque
from typing import Any

import zmq

from executors.ops import Deferred, OpContext, OpTable
from flowkit.runtime.protocol import Msg, ProtocolError, decode, encode, part_id, send_frames
from flowkit.runtime.refs import check_ref, object_ids, resolve
from flowkit.runtime.serialize import SerializeError, nbytes_of, pack, unpack

__all__ = ["Executor"]

log = logging.getLogger("flowkit.executor")

_INLINE_LIMIT = 2048  # outputs whose packed form is this small ride in the completion message
# [Note: hot polling] After any work the loop polls without sleeping for _HOT_SECONDS: the next
# instruction or peer request usually follows within microseconds, and waking from a sleeping
# poll costs tens to hundreds of microseconds on a busy or virtual machine, more than a round trip.
_HOT_SECONDS = 0.001
_TINY_OP_S = 0.00005
_HOLD_BACK_S = 0.001  # the longest a finished task's completion waits behind another op
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: IntFlag arithmetic is slow
_NONE_BODY = pack(None)[0]


class _Task:
    __slots__ = ("id", "op", "fn", "config", "inputs", "outputs", "missing", "lane", "plain",
                 "report_key", "stream", "streamed", "start")

    def __init__(self, spec: dict, fn: Any) -> None:
        self.id, self.op, self.fn, self.config = spec["id"], spec["op"], fn, spec["config"]
        self.inputs, self.outputs = spec["inputs"], spec["outputs"]
        self.missing = 0
        # [Note: lanes] Tasks of one lane run in the order they arrived, like a CUDA stream:
        # a pipeline schedule's per-device order is a lane.
        self.lane = spec.get("lane")
        self.plain = not self.inputs or all(type(i) is int for i in self.inputs)  # the usual
        self.report_key = spec.get("report_key")  # a record field to report for each output item
        self.stream = spec.get("stream", False)  # [Note: streaming ops in executors/ops.py]
        self.streamed: list[dict] = []  # the descriptions of the items it streamed
        self.start = 0.0

    def object_ids(self) -> list[int]:
        if self.plain:
            return self.inputs
        return [i for ref in self.inputs for i in object_ids(ref)]

    def check(self) -> None:
        if not self.plain:
            for ref in self.inputs:
                check_ref(ref)
        if self.lane is not None and not isinstance(self.lane, str):
            raise ProtocolError(f"a task's lane must be a string, got {self.lane!r}")
        if self.report_key is not None and not isinstance(self.report_key, str):
            raise ProtocolError(f"report_key must be a field name, got {self.report_key!r}")
        if not isinstance(self.stream, bool) or self.stream and len(self.outputs) != 1:
            raise ProtocolError(f"stream must be true or false, for a task of one output; got "
                                f"{self.stream!r} for {len(self.outputs)} outputs")


class Executor:
    """Serve one controller until it says shutdown or stops answering."""

    def __init__(self, *, connect: str, name: str, ops: OpTable, tags: tuple[str, ...] = (),
                 device: str = "cpu", resources: dict | None = None,
                 peer_host: str = "127.0.0.1") -> None:
        self.connect_address, self.name, self.ops = connect, name, ops
        self.ctx = OpContext(name=name, device=device, tags=tuple(tags))
        self.resources = resources or {}
        self.zmq = zmq.Context.instance()
        self.control = self.zmq.socket(zmq.DEALER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.peer = self.zmq.socket(zmq.ROUTER)
        self.peer.setsockopt(zmq.LINGER, 0)
        port = self.peer.bind_to_random_port(f"tcp://{peer_host}")
        self.peer_address = f"tcp://{peer_host}:{port}"
        self.executor_id: int | None = None
        self.objects: dict[int, Any] = {}
        self.waiting: dict[int, _Task] = {}
        self.blocked: dict[int, list[_Task]] = defaultdict(list)  # object id -> tasks needing it
        self.ready: deque[_Task] = deque()
        self.lanes: dict[str, deque[_Task]] = defaultdict(deque)  # [Note: lanes]
        self.sends: dict[int, list[str]] = defaultdict(list)  # object id -> peer addresses
        self.peers: dict[str, zmq.Socket] = {}
        self.completions: list[dict] = []
        self.deferred: dict[int, tuple[_Task, Deferred]] = {}  # [Note: deferred ops]
        self.typical_op_s = 0.0  # a moving average of op time [Note: completion batching]
        self.socket_lock = threading.Lock()
        self.op_seq, self.in_op = 0, False
        self.watch = _CompletionWatch(self)
        self.running = True
        self.cleanup_hooks: list = []  # run before exit, even when the controller died
        self._handlers = {
            Msg.RUN: self._on_run, Msg.SEND: self._on_send, Msg.PUT: self._on_object,
            Msg.DATA: self._on_object, Msg.FETCH: self._on_fetch, Msg.FREE: self._on_free,
            Msg.CANCEL: self._on_cancel, Msg.SHUTDOWN: self._on_shutdown,
            Msg.ERROR: self._on_error, Msg.PING: lambda header, frames: None,
        }

    # -- lifecycle -----------------------------------------------------------------------------
    def serve(self, *, hello_timeout: float = 30.0) -> int:
        """Register, then serve until shutdown (exit code 0) or controller loss (exit code 3)."""
        self.control.connect(self.connect_address)
        welcome = self._register(hello_timeout)
        if welcome is None:
            log.error("no controller answered at %s within %.0f s", self.connect_address,
                      hello_timeout)
            return 2
        self.executor_id = welcome["executor"]
        heartbeat = _Heartbeat(self, welcome.get("heartbeat_address", self.connect_address),
                               welcome["ping_interval"], welcome["ping_timeout"])
        heartbeat.start()
        self.socket_lock.acquire()  # the loop's, except while an op runs
        self.watch.start()
        try:
            self._loop()
        finally:
            self.watch.stop()
            heartbeat.stop()
            self.close()
        return 0

    def close(self) -> None:
        self.run_cleanup_hooks()
        for sock in (self.control, self.peer, *self.peers.values()):
            sock.close(linger=0)

    def run_cleanup_hooks(self) -> None:
        for hook in self.cleanup_hooks:
            try:
                hook()
            except Exception:  # cleanup must go on for the hooks after a failing one
                log.exception("cleanup hook failed")

    def _register(self, timeout: float) -> dict | None:
        hello = {"name": self.name, "tags": list(self.ctx.tags), "ops": self.ops.names(),
                 "pid": os.getpid(), "host": pysocket.gethostname(), "device": self.ctx.device,
                 "resources": self.resources, "peer_address": self.peer_address}
        self.control.send_multipart(encode(Msg.HELLO, hello))
        if not self.control.poll(int(timeout * 1000)):
            return None
        header, _ = decode(self.control.recv_multipart())
        if header["t"] != Msg.WELCOME:
            raise ProtocolError(f"expected welcome, got {header['t']!r}")
        return header

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.peer, zmq.POLLIN)
        hot_until = 0.0
        while self.running:
            # [Note: hot polling]: stay awake briefly after work.
            hot = time.monotonic() < hot_until
            busy = any(bg.busy() for bg in self.ctx.background.values())
            events = poller.poll(0 if self.ready or hot or busy else 100)
            if events:
                hot_until = time.monotonic() + _HOT_SECONDS
            elif hot:
                os.sched_yield()
            for sock, _ in events:
                self._drain(sock, peer=sock is self.peer, ready=True)
            self._run_ready()
            if busy:
                self._step_background()
            self._flush_completions()

    def _drain(self, sock: zmq.Socket, *, peer: bool, ready: bool = False) -> None:
        # Read what is queued until there are tasks to run (then run them, and tell of them,
        # before asking for more). Control messages are small, and plain bytes cost less than
        # zmq.Frame objects; asking EVENTS is cheaper than the zmq.Again exception a non-blocking
        # recv raises on an empty queue, and not asking (`ready`: a poll just said so) cheaper.
        copy = not peer
        for _ in range(1000):
            if not ready and not sock.getsockopt(_EVENTS) & _POLLIN:
                return
            ready = False
            parts = sock.recv_multipart(copy=copy)
            if peer:
                parts = parts[1:]  # drop the ROUTER's identity frame
            self._handle(parts, peer=peer)
            if self.ready and not self.in_op:  # the watch, serving during an op, reads on
                return

    def _handle(self, parts: list, *, peer: bool = False) -> None:
        try:
            header, frames = decode(parts)
            handler = self._handlers.get(header["t"])
            if handler is None:
                raise ProtocolError(f"an executor does not take {header['t']!r} messages")
            if peer and header["t"] != Msg.DATA:
                # only the controller gives instructions; peers only bring objects
                raise ProtocolError(f"a peer may only send data, not {header['t']!r}")
            handler(header, frames)
        except (ProtocolError, SerializeError) as exc:
            log.warning("rejected a message: %s", exc)
            self._send(Msg.ERROR, {"reason": str(exc)})

    def _send(self, kind: str, fields: dict | None = None, frames: list = ()) -> None:
        # zero-copy only pays for big frames (see Controller._send_raw)
        send_frames(self.control, encode(kind, fields, frames), copy=not frames)

    # -- handlers ------------------------------------------------------------------------------
    def _on_run(self, header: dict, frames: list) -> None:
        for spec in header["tasks"]:
            task = _Task(spec, self.ops.get(spec["op"]))
            if task.fn is None:
                self._complete_failed(task, f"unknown op {task.op!r}: this executor runs "
                                      f"{', '.join(self.ops.names())}", "")
                continue
            try:
                task.check()
            except ProtocolError as exc:
                self._complete_failed(task, f"malformed task: {exc}", "")
                continue
            for object_id in task.object_ids():
                if object_id not in self.objects:
                    task.missing += 1
                    self.blocked[object_id].append(task)
            self.waiting[task.id] = task
            if task.lane is not None:
                lane = self.lanes[task.lane]
                lane.append(task)
                if len(lane) > 1:
                    continue  # runs when the tasks before it in its lane have
            if task.missing == 0:
                self.ready.append(task)

    def _on_object(self, header: dict, frames: list) -> None:
        meta = header["meta"]
        if not isinstance(meta.get("body"), bytes):
            raise ProtocolError(f"{header['t']}: meta must carry the value's msgpack body")
        if "layout" in meta:  # from a peer: shared-memory handles and chunks (runtime/shm.py)
            frames = self._peer_transport().decode(meta, frames)
        try:
            value = unpack(meta["body"], frames)
        finally:
            # unpack's hook is a closure that refers to itself, so the list lingers until the
            # cyclic GC runs; emptied, it cannot delay giving a segment back to its sender
            frames.clear()
        self._store(header["object"], value)

    def _on_send(self, header: dict, frames: list) -> None:
        object_id = header["object"]
        if object_id in self.objects:
            self._push(object_id, header["address"])
        else:
            self.sends[object_id].append(header["address"])

    def _on_fetch(self, header: dict, frames: list) -> None:
        object_id = header["object"]
        if object_id not in self.objects:
            self._send(Msg.VALUE, {"request": header["request"], "meta": {},
                                   "error": f"object {object_id} is not on {self.name}"})
            return
        body, out = pack(self.objects[object_id])
        self._send(Msg.VALUE, {"request": header["request"], "meta": {"body": body}}, out)

    def _on_free(self, header: dict, frames: list) -> None:
        for object_id in header["objects"]:
            self.objects.pop(object_id, None)
            self.sends.pop(object_id, None)

    def _on_cancel(self, header: dict, frames: list) -> None:
        cancelled = set(header["tasks"])
        for task_id in cancelled & set(self.deferred):
            self.deferred.pop(task_id)[1].cancel()
        for task_id in cancelled:
            task = self.waiting.pop(task_id, None)
            if task is not None and task.lane is not None:
                self._leave_lane(task)
        self.ready = deque(t for t in self.ready if t.id not in cancelled)

    def _on_shutdown(self, header: dict, frames: list) -> None:
        self.running = False

    def _on_error(self, header: dict, frames: list) -> None:
        log.warning("controller rejected a message: %s", header["reason"])

    # -- running tasks -------------------------------------------------------------------------
    def _store(self, object_id: int, value: Any) -> None:
        self.objects[object_id] = value
        for address in self.sends.pop(object_id, ()):
            self._push(object_id, address)
        for task in self.blocked.pop(object_id, ()):
            task.missing -= 1
            if task.missing == 0 and task.id in self.waiting and self._heads_lane(task):
                self.ready.append(task)

    def _heads_lane(self, task: _Task) -> bool:
        return task.lane is None or self.lanes[task.lane][0] is task

    def _leave_lane(self, task: _Task) -> None:
        """Take `task` out of its lane; the next one runs once its inputs are in."""
        lane = self.lanes[task.lane]
        was_head = lane[0] is task
        lane.remove(task)
        if not lane:
            del self.lanes[task.lane]
        elif was_head and lane[0].missing == 0:
            self.ready.append(lane[0])

    def _push(self, object_id: int, address: str) -> None:
        sock = self.peers.get(address)
        if sock is None:
            sock = self.peers[address] = self.zmq.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        body, frames = pack(self.objects[object_id])
        meta, wire = self._peer_transport().encode(body, frames, address)
        frames.clear()  # pack's closure cycle holds the list: see _on_object
        sock.send_multipart(encode(Msg.DATA, {"object": object_id, "meta": meta}, wire),
                            copy=False)

    _transport = None  # the PeerTransport, made on first use

    def _peer_transport(self) -> Any:
        """Shared memory to peers on this host, chunked frames to others (runtime/shm.py)."""
        if self._transport is None:
            from flowkit.runtime.shm import PeerTransport

            self._transport = PeerTransport(own_address=self.peer_address)
            # close() and the heartbeat's exit run the hooks: the segments' names go with us
            self.cleanup_hooks.append(self._transport.unlink_all)
        return self._transport

    def _run_ready(self) -> None:
        ready, waiting = self.ready, self.waiting
        while ready:
            task = ready.popleft()
            if waiting.pop(task.id, None) is None:
                continue  # cancelled meanwhile
            # [Note: completion batching] Completions go out in one message per burst of tiny
            # tasks (dispatch throughput). Once tasks take real time, the _CompletionWatch
            # sends the last task's completion as soon as the next op is under way: describing
            # and sending it stays off the next op's critical path (60-80 µs an op here). A
            # long op in a burst of tiny ones (the long tail) must not hold back the finished
            # ones either: the watch sends them once the op has run _HOLD_BACK_S.
            if self.completions and self.typical_op_s > _TINY_OP_S:
                self.watch.send_now = True
            self.typical_op_s += 0.2 * (self._run(task) - self.typical_op_s)
            if task.lane is not None:
                self._leave_lane(task)

    def _run(self, task: _Task) -> float:
        """Run `task` and queue its completion; returns how long the op took."""
        start = task.start = time.time()
        try:
            if task.plain:
                args = [self.objects[i] for i in task.inputs]
            else:
                args = [resolve(ref, self.objects) for ref in task.inputs]
            result = self._call(task, args)
            if isinstance(result, Deferred):  # it completes later [Note: deferred ops]
                result.bind(_DeferredSink(self, task))
                self.deferred[task.id] = (task, result)
                return time.time() - start
            outputs = _split_outputs(result, len(task.outputs), task.op)
            if task.stream:
                _check_streamed(task, outputs[0])
        except Exception as exc:
            self._complete_failed(task, f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                                  start=start)
            return time.time() - start
        end = time.time()
        for object_id, value in zip(task.outputs, outputs, strict=True):
            self._store(object_id, value)
        # described when sent: packing them to learn their size can wait for the flush
        self.completions.append({"task": task.id, "ok": True, "start": start, "end": end,
                                 "outputs": list(zip(task.outputs, outputs)),
                                 "report_key": task.report_key, "streamed": task.streamed})
        return end - start

    def _finish_deferred(self, task: _Task, result: Any) -> None:
        """A deferred task's result, from its Background's step (sockets released)."""
        with self.socket_lock:
            if self.deferred.pop(task.id, None) is None:
                return  # cancelled meanwhile
            try:
                outputs = _split_outputs(result, len(task.outputs), task.op)
                if task.stream:
                    _check_streamed(task, outputs[0])
            except TypeError as exc:
                self._complete_failed(task, f"{type(exc).__name__}: {exc}", "",
                                      start=task.start)
                return
            for object_id, value in zip(task.outputs, outputs, strict=True):
                self._store(object_id, value)
            self.completions.append({"task": task.id, "ok": True, "start": task.start,
                                     "end": time.time(), "outputs": list(zip(task.outputs, outputs)),
                                     "report_key": task.report_key, "streamed": task.streamed})

    def _fail_deferred(self, task: _Task, error: BaseException) -> None:
        with self.socket_lock:
            if self.deferred.pop(task.id, None) is not None:
                tb = "".join(traceback.format_exception(error))
                self._complete_failed(task, f"{type(error).__name__}: {error}", tb,
                                      start=task.start)

    def _step_background(self) -> None:
        """One step of each busy Background, the sockets served meanwhile as during an op;
        a step that raises fails the tasks waiting on it rather than the executor."""
        for name, background in list(self.ctx.background.items()):
            if not background.busy():
                continue
            self.op_seq += 1
            self.in_op = True
            self.socket_lock.release()
            self.watch.op_started()
            try:
                background.step()
            except Exception as exc:
                log.exception("background %s failed", name)
                for task, deferred in list(self.deferred.values()):
                    if not deferred.finished:
                        deferred.finished = True
                        self._fail_deferred(task, RuntimeError(f"{name} failed: {exc}"))
                self.ctx.background.pop(name, None)
            finally:
                self.in_op = False
                self.socket_lock.acquire()

    def _emit(self, task: _Task, value: Any) -> None:
        """Item `value` of a streaming task, yielded by its op: kept as an object of its own
        [Note: part ids in flowkit/runtime/protocol.py] and told of at once. Runs on the op
        thread, which holds the sockets only for the moment it sends."""
        index = len(task.streamed)
        described = _describe(part_id(task.outputs[0], index), value, task.report_key)
        described.setdefault("nbytes", 0)  # None's description leaves it out
        task.streamed.append(described)
        with self.socket_lock:
            self._store(described["id"], value)
            self._send(Msg.PART, {"task": task.id, "index": index, "start": task.start,
                                  "end": time.time(), "output": described})

    def _call(self, task: _Task, args: list) -> Any:
        """Run one op; while it runs the sockets belong to the watch, which takes them over if
        the op turns out long [Note: completion batching]."""
        self.op_seq += 1
        self.in_op = True
        self.ctx.emit = (lambda value: self._emit(task, value)) if task.stream else None
        self.socket_lock.release()
        self.watch.op_started()
        try:
            return task.fn(self.ctx, *args, **task.config)
        finally:
            self.in_op = False
            self.ctx.emit = None
            self.socket_lock.acquire()

    def _complete_failed(self, task: _Task, error: str, tb: str, *, start: float = 0.0) -> None:
        self.completions.append({"task": task.id, "ok": False, "error": error, "traceback": tb,
                                 "start": start or time.time(), "end": time.time()})

    def _flush_completions(self) -> None:
        if self.completions:
            items, self.completions = self.completions, []
            self._send(Msg.DONE, {"items": [_described(item) for item in items]})


class _DeferredSink:
    """Where a Deferred's items and result go: the executor, for one task."""

    __slots__ = ("executor", "task")

    def __init__(self, executor: Executor, task: _Task) -> None:
        self.executor, self.task = executor, task

    def emit(self, item: Any) -> None:
        if self.task.stream:  # else its items all come in the result
            self.executor._emit(self.task, item)

    def done(self, result: Any) -> None:
        self.executor._finish_deferred(self.task, result)

    def fail(self, error: BaseException) -> None:
        self.executor._fail_deferred(self.task, error)


def _split_outputs(result: Any, count: int, op: str) -> list:
    if count == 1:
        return [result]
    if count == 0:
        return []
    if not isinstance(result, (tuple, list)) or len(result) != count:
        raise TypeError(f"op {op!r} must return {count} outputs for this task, got "
                        f"{type(result).__name__}")
    return list(result)


def _check_streamed(task: _Task, result: Any) -> None:
    """A streaming op returns the list of the items it emitted, every one of them [Note:
    streaming ops]; emitting none and returning a list is an op that does not stream."""
    if not task.streamed:
        return
    if not isinstance(result, (list, tuple)) or len(result) != len(task.streamed):
        size = len(result) if isinstance(result, (list, tuple)) else type(result).__name__
        raise TypeError(f"op {task.op!r} emitted {len(task.streamed)} items but returned "
                        f"{size}: a streaming op returns the list of what it emitted")


def _described(item: dict) -> dict:
    """A completion with its outputs described; a task whose output cannot be serialized fails
    (its outputs are not fetchable or movable) with an error that says so."""
    if not item["ok"]:
        return item
    key = item.pop("report_key")
    streamed = item.pop("streamed")
    if streamed:  # its items were described as they went: the list is their sum
        (object_id, _), = item["outputs"]
        item["outputs"] = [{"id": object_id, "count": len(streamed),
                            "nbytes": sum(part["nbytes"] for part in streamed)}]
        return item
    try:
        item["outputs"] = [_describe(i, v, key) for i, v in item["outputs"]]
    except SerializeError as exc:
        return {"task": item["task"], "ok": False, "start": item["start"], "end": item["end"],
                "error": f"its output cannot be sent: {exc}", "traceback": ""}
    return item


def _describe(object_id: int, value: Any, report_key: str | None = None) -> dict:
    """What the controller learns of an output: its size, the value itself when tiny, and for
    a list (a Stream's items) its length and, if asked, each item's `report_key` field, so the
    controller can form groups without fetching the items."""
    if value is None:  # what most ops that only act return
        return {"id": object_id, "inline": _NONE_BODY}  # nbytes 0, the controller's default
    if isinstance(value, (bool, int, float)):
        return {"id": object_id, "nbytes": 0, "inline": pack(value)[0]}
    body, frames = pack(value)
    size = nbytes_of(frames) + len(body)
    out = {"id": object_id, "nbytes": size}
    if isinstance(value, (list, tuple)):
        out["count"] = len(value)
        if report_key is not None:
            out["keys"] = [_key_of(item, report_key) for item in value]
    elif report_key is not None:
        out["keys"] = [_key_of(value, report_key)]
    if not frames and len(body) <= _INLINE_LIMIT:
        out["inline"] = body
    return out


def _key_of(item: Any, field: str) -> Any:
    key = item.get(field) if isinstance(item, dict) else getattr(item, field, None)
    return key if key is None or isinstance(key, (bool, int, float, str)) else str(key)


class _CompletionWatch(threading.Thread):
    """Serves the sockets while an op runs long: every _HOLD_BACK_S it takes them for a moment,
    sends the completions waiting behind the op and handles what has arrived (objects peers
    ask for, new tasks, frees), so one slow op does not stall data other executors need. It
    never holds them while waiting, so the op thread gets them back at once when the op ends.
    It ticks while ops keep starting and sleeps once a tick saw none: each wake-up takes the GIL
    from the op thread, and a burst of tiny ops wakes it once, not once an op."""

    def __init__(self, executor: Executor) -> None:
        super().__init__(name="flowkit-watch", daemon=True)
        self.executor = executor
        self.armed = threading.Event()
        self.idle = True  # asleep until an op starts
        self.send_now = False  # completions wait: flush them as soon as the op is under way
        self.stopping = False

    def stop(self) -> None:
        self.stopping = True
        self.armed.set()
        self.join(timeout=1.0)

    def op_started(self) -> None:  # by the op thread, having counted the op in
        if self.idle or self.send_now:
            self.idle = False
            self.armed.set()

    def run(self) -> None:
        executor, seen = self.executor, -1
        while not self.stopping:
            self.armed.wait(None if self.idle else _HOLD_BACK_S)
            self.armed.clear()
            seq, running = executor.op_seq, executor.in_op
            # the op seen at the last tick still runs: it has run at least _HOLD_BACK_S
            if running and (self.send_now or seq == seen):
                self._serve(seq)
            elif not running and seq == seen:
                self.idle = True
                if executor.op_seq != seq:  # an op started before it could see `idle`
                    self.idle = False
            seen = seq

    def _serve(self, seq: int) -> None:
        executor = self.executor
        with executor.socket_lock:
            self.send_now = False
            if executor.in_op and executor.op_seq == seq and executor.running:
                executor._flush_completions()
                for sock in (executor.control, executor.peer):
                    executor._drain(sock, peer=sock is executor.peer)


class _Heartbeat(threading.Thread):
    """Pings the controller on its own socket; exits the process if the controller goes quiet."""

    def __init__(self, executor: Executor, address: str, interval: float, timeout: float) -> None:
        super().__init__(name="flowkit-heartbeat", daemon=True)
        self.executor, self.address = executor, address
        self.interval, self.timeout = interval, timeout
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2 * self.interval + 1)

    def run(self) -> None:
        sock = self.executor.zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        ping = encode(Msg.PING, {"executor": self.executor.executor_id})
        last_heard = time.monotonic()
        try:
            while not self._stop_event.is_set():
                sock.send_multipart(ping)
                deadline = time.monotonic() + self.interval
                while (remaining := deadline - time.monotonic()) > 0:
                    if self._stop_event.is_set():
                        return
                    if sock.poll(int(remaining * 1000) + 1):
                        while sock.poll(0):
                            sock.recv_multipart()
                        last_heard = time.monotonic()
                if time.monotonic() - last_heard > self.timeout:
                    log.error("controller at %s silent for %.1f s: exiting",
                              self.executor.connect_address, self.timeout)
                    self._exit_now()
        finally:
            sock.close(linger=0)

    def _exit_now(self) -> None:
        self.executor.run_cleanup_hooks()
        os._exit(3)
