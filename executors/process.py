"""The executor process: connects to a controller, runs tasks from the op table, keeps the objects
its tasks produce, and moves them straight to the executors that consume them.

One thread serves the sockets and runs ops (so a no-op costs microseconds, not a thread hand-off);
a second thread only exchanges heartbeats on a socket of its own, so a long op never makes the
controller think this executor died, and a dead controller makes this process exit by itself;
a third serves the sockets while an op runs long (both in executors/threads.py). A task, and how
its outputs are described to the controller, is executors/tasks.py; the objects it holds are in
executors/store.py, its pushes to peers in executors/peers.py. With keys, every socket is
a CurveZMQ client or server and the peer socket is behind a gate [Note: authenticated transport
in flowkit/wire/auth.py].
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket as pysocket
import threading
import time
import traceback
from collections import defaultdict, deque
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from executors.optable import Deferred, OpContext, OpTable
from executors.peers import Peers
from executors.settings import gpu_identity
from executors.store import ObjectStore
from executors.tasks import (
    MERGED_ITEMS,
    Task,
    check_streamed,
    failure_text,
    merged,
    merges_with,
    run_items,
    shares_of,
    split_outputs,
    summarize_completion,
    summarize_output,
)
from executors.threads import CompletionWatch, Heartbeat
from flowkit.wire.auth import (
    CONTROLLER,
    EXECUTOR,
    Gate,
    Keys,
    check_bind,
    curve_client,
    curve_server,
    plain_client,
    plain_server,
)
from flowkit.wire.collection import promote_new_imports
from flowkit.wire.hello import HelloRefused, peer_tag
from flowkit.wire.limits import (
    CONTROL_FRAME_BYTES,
    DATA_FRAME_BYTES,
    DATA_RCVHWM,
    DATA_SNDHWM,
    bound_inbound,
)
from flowkit.wire.liveness import zmtp_heartbeats, zmtp_quiet_server
from flowkit.wire.protocol import Msg, ProtocolError, decode, encode, part_id, send_frames
from flowkit.wire.refs import resolve
from flowkit.wire.refusals import Refusals
from flowkit.wire.schema import shown
from flowkit.wire.serialize import (
    SerializeError,
    declare_modules,
    nbytes_of,
    pack,
    unpack,
)
from flowkit.wire.task import RejectedTask

__all__ = ["Executor"]

log = logging.getLogger("flowkit.executor")

# [Note: hot polling] After any work the loop polls without sleeping for _HOT_SECONDS: the next
# instruction or peer request usually follows within microseconds, and waking from a sleeping
# poll costs tens to hundreds of microseconds on a busy or virtual machine, more than a round trip.
_HOT_SECONDS = 0.001
_TINY_OP_S = 0.00005
_SERVE_EVERY_S = 0.001  # of tasks run back to back [Note: serving between tasks]
_MERGE_LOOKAHEAD = 64  # waiting tasks looked at for a scoring task's merge [Note: merged tasks]
_UNBOUNDED = 1 << 62  # the credit of a stream that waits for none any more
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: IntFlag arithmetic is slow
# a HELLO's connection refused: by the gate (at once), or handshakes failing this many times
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                     zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_RETRIES = 3


class Executor:
    """Serve one controller until it says shutdown or stops answering."""

    def __init__(self, *, connect: str, name: str, ops: OpTable, tags: tuple[str, ...] = (),
                 device: str = "cpu", resources: dict | None = None,
                 peer_host: str = "127.0.0.1", host_id: str | None = None,
                 keys: Keys | None = None, insecure: bool = False,
                 max_frame_bytes: int = CONTROL_FRAME_BYTES,
                 secret: bytes | None = None) -> None:
        """`secret`: the run's, which the controller asks of every HELLO [Note: joining a run
        in flowkit/wire/hello.py]."""
        from flowkit.wire.shm import host_id as default_host_id

        check_bind(f"tcp://{peer_host}:0", keys=keys, insecure=insecure,
                   who="this executor's data socket")
        if keys is not None:
            keys.secret(EXECUTOR)  # a missing secret is an error before anything binds
        if secret is None:
            raise ValueError("an executor joins a run with the run's secret: start it with the "
                             "launcher, or by hand with `flowkit executor --secret-file PATH`")
        self.keys, self.secret = keys, secret
        self.ping_token = ""  # the WELCOME's: the controller answers only pings that carry it
        self.max_frame_bytes = max_frame_bytes  # [Note: bounds] in flowkit/wire/limits.py
        self.connect_address, self.name, self.ops = connect, name, ops
        self.host_id = host_id or default_host_id()  # [Note: hosts] in flowkit/wire/shm.py
        self.ctx = OpContext(name=name, device=device, tags=tuple(tags))
        self.resources = dict(resources or {})
        # which GPU it is on, for the way weights reach it [Note: weight sync paths]
        gpu = gpu_identity(device, self.host_id, os.environ)
        if gpu is not None:
            self.resources.setdefault("gpu", gpu)
        # its own context: the gate's ZAP handler and monitors are the context's, and an
        # executor started in a process that has other sockets (a test's) must leave them as
        # they were
        self.zmq = zmq.Context()
        self.control = self.client_socket(CONTROLLER)
        # the gate is bound before the peer socket: libzmq admits anyone while none is there
        self.gate = (Gate(self.zmq, keys, owner=f"executor {name}") if keys is not None else
                     Gate(self.zmq, secret=secret, owner=f"executor {name}"))
        self.peer = self.zmq.socket(zmq.ROUTER)
        self.peer.setsockopt(zmq.LINGER, 0)
        bound_inbound(self.peer, max_frame=DATA_FRAME_BYTES, rcvhwm=DATA_RCVHWM)
        self.peer.setsockopt(zmq.SNDHWM, DATA_SNDHWM)
        # no PINGs of its own; a peer's handshake silent mid-frame is dropped, its partial
        # frame freed [Note: liveness]
        zmtp_quiet_server(self.peer)
        self.refusals = Refusals(log)  # [Note: refusals] in flowkit/wire/refusals.py
        if keys is not None:
            curve_server(self.peer, keys, EXECUTOR)
        else:
            plain_server(self.peer)
        port = self.peer.bind_to_random_port(f"tcp://{peer_host}")
        self.gate.watch(self.peer)
        self.gate.start()
        self.peer_address = f"tcp://{peer_host}:{port}"
        self.executor_id: int | None = None
        self.cleanup_hooks: list = []  # run before exit, even when the controller died
        self.store = ObjectStore()  # the objects held here (executors/store.py)
        # pushes to peers (executors/peers.py); its DATA carries the run's tag, and a peer's
        # must [Note: joining a run]
        self.peers = Peers(self.store, self.client_socket, host_id=self.host_id,
                           tag=peer_tag(secret),
                           cleanup_hooks=self.cleanup_hooks)
        self.waiting: dict[int, Task] = {}
        self.blocked: dict[int, list[Task]] = defaultdict(list)  # object id -> tasks needing it
        self.ready: deque[Task] = deque()
        self.lanes: dict[str, deque[Task]] = defaultdict(deque)  # [Note: lanes]
        self.completions: list[dict] = []
        self.deferred: dict[int, tuple[Task, Deferred]] = {}  # [Note: deferred ops]
        self.typical_op_s = 0.0  # a moving average of op time [Note: completion batching]
        self.socket_lock = threading.Lock()
        self.op_seq, self.in_op = 0, False
        self.batch_running: Task | None = None  # a batched task's op runs [Note: early items]
        self.parts: dict[int, tuple] = {}  # task id -> (task, first index, descriptions) to send
        # streaming tasks with a window, running: the op thread waits on `credit` for their
        # credits [Note: stream credits in flowkit/runtime/credits.py]
        self.windowed: dict[int, Task] = {}
        self.credit = threading.Condition()
        self.watch = CompletionWatch(self)
        self.running = True
        self._handlers = {
            Msg.RUN: self._on_run, Msg.SEND: self._on_send, Msg.PUT: self._on_object,
            Msg.DATA: self._on_object, Msg.OBJECTS: self._on_objects,
            Msg.FETCH: self._on_fetch, Msg.FREE: self._on_free,
            Msg.CANCEL: self._on_cancel, Msg.CREDIT: self._on_credit,
            Msg.SHUTDOWN: self._on_shutdown,
            Msg.ERROR: self._on_error, Msg.PING: lambda header, frames: None,
        }

    # -- lifecycle -----------------------------------------------------------------------------
    def serve(self, *, hello_timeout: float = 30.0) -> int:
        """Register, then serve until shutdown (exit code 0) or controller loss (exit code 3)."""
        try:
            welcome = self._register(hello_timeout)
        except HelloRefused as exc:
            log.error("the controller at %s refused this executor: %s", self.connect_address,
                      exc)
            return 2
        if welcome is None:
            log.error("no controller answered at %s within %.0f s%s", self.connect_address,
                      hello_timeout, " (does it use the same --keys DIR?)" if self.keys else
                      " (if it runs with --keys DIR, give this executor those keys too)")
            return 2
        self.executor_id = welcome["executor"]
        self.ping_token = welcome.get("ping_token", "")
        load_declared_modules(welcome.get("modules"))
        if type(welcome.get("max_frame_bytes")) is int:  # what the controller takes in
            self.max_frame_bytes = welcome["max_frame_bytes"]
        heartbeat = Heartbeat(self, welcome.get("heartbeat_address", self.connect_address),
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

    def client_socket(self, server: str) -> zmq.Socket:
        """A DEALER to the controller or to a peer (`server`: its role), with keys a CURVE
        client [Note: authenticated transport]; connecting is the caller's."""
        sock = self.zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        zmtp_heartbeats(sock)  # [Note: liveness in flowkit/wire/liveness.py]
        # what comes back on it: the controller's instructions and values (a peer sends none),
        # frames bounded; no high-water mark: a full queue here would only move the messages
        # into the controller's unbounded send queue, and flow control costs every batch
        bound_inbound(sock, max_frame=self.max_frame_bytes, rcvhwm=0)
        if self.keys is not None:
            curve_client(sock, self.keys, server)
        else:
            plain_client(sock, self.secret)
        return sock

    def close(self) -> None:
        self.run_cleanup_hooks()
        self.gate.stop()
        for sock in (self.control, self.peer):
            sock.close(linger=0)
        self.peers.close()

    def run_cleanup_hooks(self) -> None:
        for hook in self.cleanup_hooks:
            try:
                hook()
            except Exception:  # cleanup must go on for the hooks after a failing one
                log.exception("cleanup hook failed")

    def _register(self, timeout: float) -> dict | None:
        """Connect and say HELLO: the WELCOME, None when no controller answered within
        `timeout`, or HelloRefused. libzmq reports a failed handshake once and does not
        reconnect after the gate refused one, so the monitor is attached before the connection
        is made, and the HELLO is built before it and queued without blocking: a refusal that
        came first would leave a blocking send no peer to wait for."""
        hello = {"name": self.name, "tags": list(self.ctx.tags), "ops": self.ops.names(),
                 "pid": os.getpid(), "host": pysocket.gethostname(), "host_id": self.host_id,
                 "device": self.ctx.device, "secret": self.secret.hex(),
                 "resources": self.resources, "peer_address": self.peer_address}
        monitor = self.control.get_monitor_socket(_HANDSHAKE_FAILED,
                                                  addr=f"inproc://flowkit-hello-{id(self)}")
        try:
            self.control.connect(self.connect_address)
            try:
                self.control.send_multipart(encode(Msg.HELLO, hello), flags=zmq.NOBLOCK)
            except zmq.Again:  # the connection is gone already: the monitor says why
                pass
            if not self._answered(monitor, timeout):
                return None
        finally:
            self.control.disable_monitor()
            monitor.close(linger=0)
        header, _ = decode(self.control.recv_multipart())
        if header["t"] == Msg.ERROR and header.get("refused"):
            raise HelloRefused(header["reason"])
        if header["t"] != Msg.WELCOME:
            raise ProtocolError(f"expected welcome, got {header['t']!r}")
        return header

    def _answered(self, monitor: zmq.Socket, timeout: float) -> bool:
        """Whether the controller answered within `timeout`; HelloRefused at once when its gate
        refuses this executor's credentials, or its handshakes fail again and again (libzmq
        would retry them until the timeout)."""
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline, failed = time.monotonic() + timeout, 0
        while (left := deadline - time.monotonic()) > 0:
            if dict(poller.poll(int(left * 1000))).get(self.control):
                return True
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                failed += 1 if event != zmq.EVENT_HANDSHAKE_FAILED_AUTH else _RETRIES
            if failed >= _RETRIES:
                raise HelloRefused(f"its gate refused the connection: {self._refused_as()}"
                                   f" (give the executor the secret file, or --keys DIR, "
                                   f"of this run's controller)")
        return False

    def _refused_as(self) -> str:
        return ("keys not among the controller's allowed ones, or not its keys" if self.keys
                else "a wrong secret, not this run's")

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.peer, zmq.POLLIN)
        hot_until = 0.0
        while self.running:
            # [Note: hot polling]: stay awake briefly after work.
            hot = time.monotonic() < hot_until
            busy = bool(self.ctx.background) and any(  # none on most executors
                bg.busy() for bg in self.ctx.background.values())
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
            # after the completions went out: a collection must not hold them back
            promote_new_imports()  # [Note: imports promoted] in flowkit/wire/collection.py

    def _drain(self, sock: zmq.Socket, *, peer: bool, ready: bool = False,
               all_queued: bool = False) -> None:
        # Read what is queued until there are tasks to run (then run them, and tell of them,
        # before asking for more), or with `all_queued` all of it [Note: serving between
        # tasks]. Control messages are small, and plain bytes cost less than
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
            # tasks to run: run them first (the watch, serving during an op, reads on)
            if self.ready and not self.in_op and not all_queued:
                return

    def _handle(self, parts: list, *, peer: bool = False) -> None:
        try:
            header, frames = decode(parts)
            handler = self._handlers.get(header["t"])
            if handler is None:
                raise ProtocolError(f"an executor does not take {header['t']!r} messages")
            if peer and header["t"] not in (Msg.DATA, Msg.OBJECTS):
                # only the controller gives instructions; peers only bring objects
                raise ProtocolError(f"a peer may only send data, not {header['t']!r}")
            handler(header, frames)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - [Note: a message never kills IO]
            self._reject(exc, peer=peer)

    def _reject(self, exc: BaseException, *, peer: bool) -> None:
        """[Note: a message never kills IO] in flowkit/runtime/controller.py: whatever a message
        makes a handler raise, SystemExit included, rejects that message and this executor
        serves on. The controller hears of its own rejected messages; what a peer sent (maybe
        a stranger flooding the data socket) is counted and logged a line a while, and never
        relayed to the controller's log [Note: refusals in flowkit/wire/refusals.py]."""
        known = isinstance(exc, (ProtocolError, SerializeError))

        def reason() -> str:
            return shown(str(exc) if known else f"{type(exc).__name__}: {exc}", 300)

        if peer:
            self.refusals.warn(f"peer {type(exc).__name__}",
                               lambda: f"rejected a message from a peer: {reason()}")
            return
        text = reason()
        log.warning("rejected a message: %s", text, exc_info=None if known else exc)
        self._send(Msg.ERROR, {"reason": text})  # the controller's log tells of it

    def _send(self, kind: str, fields: dict | None = None, frames: list = ()) -> None:
        # zero-copy only pays for big frames (see Controller._send_raw)
        send_frames(self.control, encode(kind, fields, frames), copy=not frames)

    # -- handlers ------------------------------------------------------------------------------
    def _on_run(self, header: dict, frames: list) -> None:
        for spec in header["specs"]:  # decoded and checked [Note: a task on the wire]
            if type(spec) is RejectedTask:
                self._complete_failed(spec.id, f"malformed task: {spec.reason}", "")
                continue
            task = Task(spec, self.ops.get(spec.op))
            if task.fn is None:
                self._complete_failed(spec.id, f"unknown op {spec.op!r}: this executor runs "
                                      f"{', '.join(self.ops.names())}", "")
                continue
            objects, unclaimed = self.store.objects, self.store.unclaimed
            for object_id in task.object_ids():
                if unclaimed:
                    self.store.claim(object_id)
                if object_id not in objects:
                    task.missing += 1
                    self.blocked[object_id].append(task)
            self.waiting[task.spec.id] = task
            if task.spec.lane is not None:
                lane = self.lanes[task.spec.lane]
                lane.append(task)
                if len(lane) > 1:
                    continue  # runs when the tasks before it in its lane have
            if task.missing == 0:
                self.ready.append(task)

    def _on_object(self, header: dict, frames: list) -> None:
        meta, object_id = header["meta"], header["object"]
        if not isinstance(meta.get("body"), bytes):
            raise ProtocolError(f"{header['t']}: meta must carry the value's msgpack body")
        from_peer = header["t"] == Msg.DATA
        if from_peer:
            self.peers.check(header)
        self._take(header["t"], object_id, meta, frames, from_peer=from_peer)

    def _on_objects(self, header: dict, frames: list) -> None:
        """A peer's small objects [Note: objects in batches]: each taken as its own DATA
        message would be; one refused (already here, unreadable) is refused once the others
        are in, and the tasks waiting for it fail saying why."""
        self.peers.check(header)
        refused = []
        for entry in header["objects"]:
            try:
                # a plain body only: what else an entry says (a frame layout) is not read
                self._take(Msg.OBJECTS, entry["object"], {"body": entry["body"]}, [],
                           from_peer=True)
            except (ProtocolError, SerializeError) as exc:
                refused.append(str(exc))
        if refused:
            raise ProtocolError(f"objects: {len(refused)} of {len(header['objects'])} refused: "
                                f"{refused[0]}")

    def _take(self, kind: str, object_id: int, meta: dict, frames: list, *,
              from_peer: bool) -> None:
        """Keep an arriving object: `meta` holds its msgpack body (and, from a peer, how its
        frames travelled)."""
        if from_peer and object_id in self.store.objects:
            raise ProtocolError(f"{kind}: object {object_id} is here already; a peer cannot "
                                "replace it")
        try:
            if "layout" in meta:  # from a peer: shared-memory handles and chunks (wire/shm.py)
                frames = self.peers.transport().decode(meta, frames)
            if from_peer and object_id not in self.blocked:
                self.store.hold_unclaimed(object_id, len(meta["body"]) + nbytes_of(frames))
            value = unpack(meta["body"], frames)
        except (ProtocolError, SerializeError) as exc:
            self.store.claim(object_id)  # not held after all
            # the tasks that wait for it fail now, saying why, rather than wait for ever
            self._fail_waiting_for(object_id, f"{kind} of input object {object_id} could not "
                                              f"be read: {shown(str(exc))}")
            raise
        finally:
            # unpack's hook is a closure that refers to itself, so the list lingers until the
            # cyclic GC runs; emptied, it cannot delay giving a segment back to its sender
            frames.clear()
        self._store(object_id, value)

    def _fail_waiting_for(self, object_id: int, error: str) -> None:
        for task in self.blocked.pop(object_id, ()):
            if self.waiting.pop(task.spec.id, None) is not None:
                if task.spec.lane is not None:
                    self._leave_lane(task)
                self._complete_failed(task.spec.id, error, "")

    def _on_send(self, header: dict, frames: list) -> None:
        objects = header["objects"]
        if any(type(object_id) is not int for object_id in objects):
            raise ProtocolError(f"send: objects must be object ids, got {objects!r:.80}")
        # a controller that names no host id means another host: frames reach any peer
        target = (header["address"], header.get("host_id", ""))
        for object_id in objects:
            self.peers.send(object_id, *target)

    def _on_fetch(self, header: dict, frames: list) -> None:
        object_id = header["object"]
        if object_id not in self.store.objects:
            self._send(Msg.VALUE, {"request": header["request"], "meta": {},
                                   "error": f"object {object_id} is not on {self.name}"})
            return
        body, out = pack(self.store.objects[object_id])
        largest = max([len(body), *(memoryview(f).nbytes for f in out)])
        if largest > self.max_frame_bytes:  # it would cost this executor its connection
            self._send(Msg.VALUE, {"request": header["request"], "meta": {}, "error": (
                f"object {object_id} has a frame of {largest} bytes, more than the "
                f"controller takes in ({self.max_frame_bytes}: Controller(max_frame_bytes=) "
                "or flowkit run --max-frame-mib); keep it on the executors, or save it there")})
            return
        self._send(Msg.VALUE, {"request": header["request"], "meta": {"body": body}}, out)

    def _on_free(self, header: dict, frames: list) -> None:
        for object_id in header["objects"]:
            self.store.free(object_id)
            self.peers.forget(object_id)

    def _on_cancel(self, header: dict, frames: list) -> None:
        cancelled = set(header["tasks"])
        with self.credit:  # a cancelled stream waits for no credit
            for task_id in cancelled & set(self.windowed):
                self.windowed.pop(task_id).credited = _UNBOUNDED
            self.credit.notify_all()
        for task_id in cancelled & set(self.deferred):
            self.deferred.pop(task_id)[1].cancel()
        for task_id in cancelled:
            task = self.waiting.pop(task_id, None)
            if task is not None and task.spec.lane is not None:
                self._leave_lane(task)
        self.ready = deque(t for t in self.ready if t.spec.id not in cancelled)

    def _on_credit(self, header: dict, frames: list) -> None:
        task = self.windowed.get(header["task"])
        if task is not None:  # else ended meanwhile
            with self.credit:
                task.credited = max(task.credited, header["credited"])
                self.credit.notify_all()

    def _on_shutdown(self, header: dict, frames: list) -> None:
        self.running = False
        with self.credit:
            self.credit.notify_all()

    def _on_error(self, header: dict, frames: list) -> None:
        log.warning("controller rejected a message: %s", header["reason"])

    # -- running tasks -------------------------------------------------------------------------
    def _store(self, object_id: int, value: Any) -> None:
        self.store.objects[object_id] = value
        if self.peers.waiting:
            self.peers.stored(object_id)
        for task in self.blocked.pop(object_id, ()):
            task.missing -= 1
            if task.missing == 0 and task.spec.id in self.waiting and self._heads_lane(task):
                self.ready.append(task)

    def _heads_lane(self, task: Task) -> bool:
        return task.spec.lane is None or self.lanes[task.spec.lane][0] is task

    def _leave_lane(self, task: Task) -> None:
        """Take `task` out of its lane; the next one runs once its inputs are in."""
        lane = self.lanes[task.spec.lane]
        was_head = lane[0] is task
        lane.remove(task)
        if not lane:
            del self.lanes[task.spec.lane]
        elif was_head and lane[0].missing == 0:
            self.ready.append(lane[0])

    def _run_ready(self) -> None:
        ready, waiting, spent = self.ready, self.waiting, 0.0
        while ready:
            task = ready.popleft()
            if waiting.pop(task.spec.id, None) is None:
                continue  # cancelled meanwhile
            # [Note: completion batching] Completions go out in one message per burst of tiny
            # tasks (dispatch throughput). Once tasks take real time, the _CompletionWatch
            # sends the last task's completion as soon as the next op is under way: describing
            # and sending it stays off the next op's critical path. A long op in a burst of tiny
            # ones (the long tail) must not hold back the finished ones either: the watch sends
            # them once the op has run _HOLD_BACK_S. `flowkit bench dispatch` times the round
            # trip and the ops/s this keeps.
            if self.completions and self.typical_op_s > _TINY_OP_S:
                self.watch.send_now = True
            partners = self._merging(task)  # [Note: merged tasks] in executors/tasks.py
            took = self._run_merged([task, *partners]) if partners else self._run(task)
            self.typical_op_s += 0.2 * (took - self.typical_op_s)
            if task.spec.lane is not None:
                self._leave_lane(task)
            spent += took
            if spent > _SERVE_EVERY_S and ready:
                spent = 0.0
                self._serve_between_tasks()

    def _serve_between_tasks(self) -> None:
        """[Note: serving between tasks] A burst of short tasks (a rollout executor's hundreds
        of generation calls) would keep the messages queued behind it waiting until the last
        one ran, a peer's push of the step's first sample among them. Every _SERVE_EVERY_S of
        tasks the completions so far go out and what has arrived is handled: pushes, fetches,
        frees and credits at once, new tasks behind those already ready
        (tests/runtime/test_batched_tasks.py pushes in the middle of 20,000 no-ops)."""
        self._flush_completions()
        self._drain(self.control, peer=False, all_queued=True)
        self._drain(self.peer, peer=True, all_queued=True)

    def _merging(self, task: Task) -> list[Task]:
        """The ready tasks that run in one call with `task`, taken out of the queue [Note:
        merged tasks in executors/tasks.py]."""
        if task.spec.items is None or task.spec.lane is not None \
                or not self.ops.merges(task.spec.op):
            return []
        partners, items = [], task.spec.items
        # the next few waiting tasks only: a burst of thousands is not scanned at each one
        for other in list(itertools.islice(self.ready, _MERGE_LOOKAHEAD)):
            if other.spec.id not in self.waiting or not merges_with(task, other):
                continue
            if items + other.spec.items > MERGED_ITEMS:
                break
            self.ready.remove(other)
            del self.waiting[other.spec.id]
            partners.append(other)
            items += other.spec.items
        return partners

    def _run_merged(self, tasks: list[Task]) -> float:
        """Run batched `tasks` as one call and queue each one's completion [Note: merged
        tasks]; returns how long it took."""
        start = time.time()
        for task in tasks:
            task.start = start
        try:
            together, args = merged(tasks, [self._args(task) for task in tasks])
            results = self._call(together, args, early=False)
        except Exception:  # each alone, so that only a task whose items fail fails
            return time.time() - start + sum(self._run(task) for task in tasks)
        end = time.time()
        for task, outputs in zip(tasks, shares_of(tasks, results)):
            task.busy = (end - start) / len(tasks)  # [Note: placement by load] each its share
            self._complete(task, outputs, end)
        return end - start

    def _args(self, task: Task) -> list:
        objects = self.store.objects
        if task.plain:
            return [objects[i] for i in task.spec.inputs]
        return [resolve(ref, objects) for ref in task.spec.inputs]

    def _run(self, task: Task) -> float:
        """Run `task` and queue its completion; returns how long the op took."""
        start = task.start = time.time()
        try:
            args = self._args(task)
            result = self._call(task, args)
            if isinstance(result, Deferred):  # it completes later [Note: deferred ops]
                result.bind(_DeferredSink(self, task))
                self.deferred[task.spec.id] = (task, result)
                task.busy = time.time() - start  # what it held [Note: placement by load]
                return task.busy
            if task.spec.items is not None:  # the items' outputs [Note: batched tasks]
                outputs = result
            else:
                outputs = split_outputs(result, len(task.spec.outputs), task.spec.op)
            if task.spec.stream:
                check_streamed(task, outputs[0])
        except Exception as exc:
            self._complete_failed(task.spec.id, failure_text(exc), traceback.format_exc(),
                                  start=start)
            return time.time() - start
        end = time.time()
        self._complete(task, outputs, end)
        return end - start

    def _finish_deferred(self, task: Task, result: Any) -> None:
        """A deferred task's result, from its Background's step (sockets released)."""
        with self.socket_lock:
            if self.deferred.pop(task.spec.id, None) is None:
                return  # cancelled meanwhile
            try:
                outputs = split_outputs(result, len(task.spec.outputs), task.spec.op)
                if task.spec.stream:
                    check_streamed(task, outputs[0])
            except TypeError as exc:
                self._complete_failed(task.spec.id, f"{type(exc).__name__}: {exc}", "",
                                      start=task.start)
                return
            self._complete(task, outputs, time.time())

    def _fail_deferred(self, task: Task, error: BaseException) -> None:
        with self.socket_lock:
            if self.deferred.pop(task.spec.id, None) is not None:
                tb = "".join(traceback.format_exception(error))
                self._complete_failed(task.spec.id, f"{type(error).__name__}: {error}", tb,
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
                if self.parts:
                    self.send_parts()  # what this iteration finished goes now

    def _emit(self, task: Task, value: Any) -> None:
        """Item `value` of a streaming task, yielded by its op: kept as an object of its own
        [Note: part ids in flowkit/wire/protocol.py] and told of with the items yielded with
        it [Note: parts in batches]. Runs on the op thread, which holds the sockets only for
        the moment it stores the item."""
        index = len(task.streamed)
        described = summarize_output(part_id(task.spec.outputs[0], index), value,
                                     task.spec.report_key, task.spec.trace_key, self.store.bodies)
        described.setdefault("nbytes", 0)  # None's description leaves it out
        task.streamed.append(described)
        with self.socket_lock:
            self._store(described["id"], value)
            self.parts.setdefault(task.spec.id, (task, index, []))[2].append(described)
        if task.spec.window is not None:
            self.windowed.setdefault(task.spec.id, task)  # its credits count from now
            self._wait_for_credit(task)

    def _wait_for_credit(self, task: Task) -> None:
        """[Note: stream credits] in flowkit/runtime/credits.py: a streaming task with a
        window runs at most that many items ahead of those its consumers are done with; past
        it the op waits here (its thread, the sockets served meanwhile by the watch) for the
        controller's CREDIT. Its items so far go out first: they are what earns the credit."""
        window = task.spec.window
        if len(task.streamed) - task.credited < window:
            return
        with self.socket_lock:
            if self.parts or self.peers.outbox:
                self.send_parts()
        with self.credit:
            while len(task.streamed) - task.credited >= window and self.running:
                self.credit.wait(0.1)

    def send_parts(self) -> None:
        """[Note: parts in batches] The items streaming tasks yielded since the last call, in one
        message (PARTS for one task, STREAMS for several): a rollout engine's decoding iteration
        finishes many samples of many calls at once, and a message for each was most of the
        controller's traffic. Sent after each background step and op, by the watch while an op
        runs long, and always before any completion (a task's parts must reach the controller
        before its end). The small objects waiting for peers go first [Note: objects in
        batches in executors/outbox.py]."""
        if self.peers.outbox:  # the objects told of may be what a peer waits for
            self.peers.flush()
        parts, self.parts = self.parts, {}
        if not parts:
            return
        now = time.time()
        bodies = [{"task": task.spec.id, "index": first, "start": task.start, "outputs": outputs}
                  for task, first, outputs in parts.values()]
        if len(bodies) == 1:
            self._send(Msg.PARTS, {**bodies[0], "end": now})
        else:  # a rollout engine's iteration ends samples of many calls: one message for all
            self._send(Msg.STREAMS, {"end": now, "tasks": bodies})

    def _call(self, task: Task, args: list, *, early: bool = True) -> Any:
        """Run one op; while it runs the sockets belong to the watch, which takes them over if
        the op turns out long [Note: completion batching], and answers a batched task's items
        done so far unless not `early` (a merged call's, whose task is no real one)."""
        self.op_seq += 1
        self.in_op = True
        self.ctx.emit = (lambda value: self._emit(task, value)) if task.spec.stream else None
        batched = task.spec.items is not None
        self.batch_running = task if batched and early else None
        self.socket_lock.release()
        self.watch.op_started()
        try:
            if batched:
                result = run_items(task, self.ctx, args, self.ops.batched(task.spec.op))
            else:
                result = task.fn(self.ctx, *args, **task.spec.config)
            for hook in self.ops.op_end_hooks:  # its device's work done before its end is read
                hook(self.ctx)
            return result
        finally:
            self.in_op = False
            self.ctx.emit = None
            self.socket_lock.acquire()
            self.batch_running = None

    def answer_early_items(self) -> None:
        """[Note: early items] While a batched task runs long, the watch (holding the sockets)
        answers the items it has finished so far, in one ITEMS message: one slow item holds
        back neither the others nor the work downstream of them."""
        task = self.batch_running
        if task is None:
            return
        done = len(task.results)  # whole items: the op thread extends it an item at a time
        if done <= task.answered:
            return
        spec, first = task.spec, task.answered
        pairs = list(zip(spec.outputs[first:done], task.results[first:done]))
        try:
            outputs = [summarize_output(i, v, spec.report_key, spec.trace_key, self.store.bodies)
                       for i, v in pairs]
        except SerializeError:
            self.batch_running = None  # answered no more early: its completion says why
            return
        for object_id, value in pairs:
            self._store(object_id, value)
        task.answered = done
        per_item = len(spec.outputs) // spec.items
        self._send(Msg.ITEMS, {"task": spec.id, "first": first // per_item, "start": task.start,
                               "end": time.time(), "outputs": outputs})

    def _complete(self, task: Task, outputs: list, end: float) -> None:
        """Keep a finished task's outputs and queue its completion."""
        spec = task.spec
        self.windowed.pop(spec.id, None)
        # a batched task's items answered early are stored and told of [Note: early items]
        pairs = list(zip(spec.outputs, outputs, strict=True))[task.answered:]
        for object_id, value in pairs:
            self._store(object_id, value)
        # described when sent: packing them to learn their size can wait for the flush
        done = {"task": spec.id, "ok": True, "start": task.start, "end": end, "outputs": pairs,
                "report_key": spec.report_key, "trace_key": spec.trace_key,
                "streamed": task.streamed}
        if task.busy is not None:  # [Note: placement by load in flowkit/runtime/dispatch.py]
            done["busy"] = task.busy
        self.completions.append(done)

    def _complete_failed(self, task_id: int, error: str, tb: str, *,
                         start: float = 0.0) -> None:
        self.windowed.pop(task_id, None)
        self.completions.append({"task": task_id, "ok": False, "error": error, "traceback": tb,
                                 "start": start or time.time(), "end": time.time()})

    def _flush_completions(self) -> None:
        if self.parts or self.peers.outbox:
            self.send_parts()
        if self.completions:
            items, self.completions = self.completions, []
            bodies = self.store.bodies
            self._send(Msg.DONE, {"items": [summarize_completion(item, bodies) for item in items]})


_MAX_MODULES = 1024
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}(\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,15}")


def load_declared_modules(names: Any) -> None:
    """[Note: record registry] in flowkit/wire/serialize.py: the modules whose records the
    controller sends, declared now (its instruction, not a value's) and each imported when the
    first record of it arrives; a flow file is loaded with --code and never imported by name.
    Only the controller this executor was told to join sends WELCOME, and then only module
    names: at most _MAX_MODULES dotted identifiers, nothing that names a file or a path."""
    if not isinstance(names, list) or len(names) > _MAX_MODULES or not all(
            type(n) is str and _MODULE_NAME.fullmatch(n) for n in names):
        raise ProtocolError(f"welcome: modules must be a list of at most {_MAX_MODULES} "
                            f"dotted module names, got {shown(names)}")
    declare_modules(names)


class _DeferredSink:
    """Where a Deferred's items and result go: the executor, for one task."""

    __slots__ = ("executor", "task")

    def __init__(self, executor: Executor, task: Task) -> None:
        self.executor, self.task = executor, task

    def emit(self, item: Any) -> None:
        if self.task.spec.stream:  # else its items all come in the result
            self.executor._emit(self.task, item)

    def done(self, result: Any) -> None:
        self.executor._finish_deferred(self.task, result)

    def fail(self, error: BaseException) -> None:
        self.executor._fail_deferred(self.task, error)
