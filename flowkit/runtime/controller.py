"""The controller: one process that dispatches tasks to executors and resolves their futures.

[Note: caller-driven IO] Whoever needs the socket drives it: a user thread inside `submit` or
`result` takes the IO lock and sends and receives itself, so a round trip costs what a bare zmq
echo costs plus bookkeeping, with no hand-off between threads (each hand-off is tens of
microseconds on a busy machine). A background thread drives only when no user thread has for a
moment, so completions, callbacks and frees progress while the user computes. Heartbeats live on
a socket and thread of their own, so a user thread that holds the lock for long never makes an
executor think its controller died.

Both ROUTERs are servers behind a gate: with keys CurveZMQ, admitting only known public keys
[Note: authenticated transport in flowkit/wire/auth.py]; without, PLAIN, admitting only holders
of the run's secret [Note: strangers stop at the handshake].
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import zmq

from flowkit.runtime.dispatch import Dispatcher, Listener, NoExecutor
from flowkit.runtime.futures import Future, new_condition
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.auth import CONTROLLER, Gate, Keys, check_bind, curve_server, plain_server
from flowkit.wire.hello import SECRET_ENV, Origin, new_secret, write_secret_file
from flowkit.wire.limits import (
    CONTROL_FRAME_BYTES,
    CONTROL_RCVHWM,
    CONTROL_SNDHWM,
    bound_inbound,
)
from flowkit.wire.liveness import (
    ConnectionWatch,
    zmtp_heartbeats,
    zmtp_quiet_server,
    zmtp_timeout_s,
)
from flowkit.wire.protocol import Msg, ProtocolError, decode, encode, send_frames
from flowkit.wire.refs import Gather
from flowkit.wire.refusals import Refusals
from flowkit.wire.schema import shown
from flowkit.wire.serialize import SerializeError
from flowkit.wire.task import MAX_ITEMS, MAX_WINDOW, TaskSpec

__all__ = ["BindError", "Controller", "NoExecutor"]

log = logging.getLogger("flowkit.controller")

# Python heartbeats only find processes that are alive but hung [Note: liveness in
# flowkit/wire/liveness.py]: a local executor that dies is seen at once by its exit, a Ray one
# by Ray's report, a closed connection by libzmq. Silence this long means lost, and an executor
# whose controller is silent this long exits; 1.5 s, then 5 s, lost sound executors (and made
# them exit) on a loaded machine or while a huge message held the controller's threads.
_PING_TIMEOUT_S = 30.0

# a closed connection of a local executor waits this long for its process's exit code, which
# says more (the kernel closes a dying process's sockets a moment before it can be reaped)
_EXIT_GRACE_S = 0.2
_QUIET_S = 0.002  # the background thread drives after user threads left it alone this long
_OVERDUE_S = 0.004  # ... or once nothing has read the router for this long [Note: overdue pumps]
_HOT_S = 0.0005  # how long a waiting user watches the router before sleeping in poll

# [Note: overdue pumps] The background thread leaves the IO lock to user threads while they
# call in (each of its wake-ups would take the GIL from them), and drives once they have been
# quiet for _QUIET_S. A user thread that never pauses that long (a runner submitting a
# step's thousands of generation calls in turns, with its reactions between) then starved it:
# nothing read the router, so the turns had nothing to react to, and the first finished
# sample's downstream ops waited for the last call to go out (15 % of generation's makespan
# after the first sample, 6-10 % since: `flowkit bench scale --samples 16384`, 2026-11-27). So
# the router is read at least every _OVERDUE_S: once a pump is overdue, the
# background thread takes the lock between two user calls, reads what is there without
# waiting in poll, and gives it back.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: IntFlag arithmetic is slow
_NOBLOCK = int(zmq.NOBLOCK)


class BindError(OSError):
    """The controller's address cannot be bound: taken by another process, or not this
    machine's. The text names the address and what to give instead."""

    def __init__(self, address: str, error: zmq.ZMQError) -> None:
        scheme, _, rest = address.partition("://")
        free = f"{scheme}://{rest.rpartition(':')[0]}:0" if scheme == "tcp" else None
        why = {errno.EADDRINUSE: "is in use by another process",
               errno.EADDRNOTAVAIL: "is not an address of this machine"}.get(
            error.errno, f"cannot be bound ({error.strerror})")
        fix = f": give another port, or {free} for any free one" if free else (
            ": give another address")
        super().__init__(error.errno, f"the controller's address {address} {why}{fix}")


class Controller:
    """`with Controller() as ctl: ctl.wait_for_executors(2); ctl.submit("noop").result()`.

    `keys` (Keys.load(DIR)) makes every socket authenticate and encrypt; a `bind` beyond
    loopback needs them, or `insecure=True` [Note: authenticated transport]. Executors join
    with the run's `secret` (random unless given) [Note: joining a run in wire/hello.py]."""

    def __init__(self, *, bind: str = "tcp://127.0.0.1:0", ping_interval: float = 0.2,
                 ping_timeout: float = _PING_TIMEOUT_S, keys: Keys | None = None,
                 insecure: bool = False, max_frame_bytes: int = CONTROL_FRAME_BYTES,
                 secret: bytes | None = None) -> None:
        check_bind(bind, keys=keys, insecure=insecure, who="the controller")
        if not 1 << 16 <= max_frame_bytes <= 1 << 40:
            raise ValueError(f"max_frame_bytes={max_frame_bytes}: give 64 KiB to 1 TiB")
        self.max_frame_bytes = max_frame_bytes  # [Note: bounds] in flowkit/wire/limits.py
        if keys is not None:
            keys.secret(CONTROLLER)  # a missing secret is an error before anything binds
        self.keys, self.insecure = keys, insecure
        self.secret = secret or new_secret()
        self.condition = new_condition()
        self._zmq = zmq.Context()
        # the gate is bound before any server: libzmq admits anyone while no gate is there
        self._gate = (Gate(self._zmq, keys, owner="the controller") if keys is not None else
                      Gate(self._zmq, secret=self.secret, owner="the controller"))
        try:
            self._router = self._socket(zmq.ROUTER, bind, server="quiet")
        except BindError:
            self._zmq.destroy(linger=0)  # nothing else holds it yet
            raise
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # [Note: a full send queue]
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._heartbeat = _Heartbeat(self, _sibling(bind), ping_interval, ping_timeout)
        self._wake_in = self._socket(zmq.PULL, f"inproc://flowkit-wake-{id(self)}")
        self._wake_out = self._zmq.socket(zmq.PUSH)
        self._wake_out.connect(f"inproc://flowkit-wake-{id(self)}")
        self._wake_lock = threading.Lock()
        # Reentrant: a Ctrl-C that lands between taking it and the `try` that gives it back
        # leaves it with the main thread, which must still drive the run's shutdown (fetch
        # the weights, stop the executors); a plain lock hung it there for good
        self._io_lock = threading.RLock()
        self._drive = _Driving(self)  # holds no state of its own: one serves every call
        self._wanted = 0  # user threads waiting for the IO lock
        self._last_user = 0.0
        self._last_pump = 0.0  # when a pump last read the router [Note: overdue pumps]
        self._lost: deque = deque()  # (executor id, reason) from the heartbeat thread
        self._released: deque = deque()  # ids of futures the user dropped [Note: object lifetime]
        self._processes: dict[int, Any] = {}
        self._stopping = False
        self._batching = 0  # > 0 inside `batch()`: submit queues without sending
        self.messages_in = self.messages_out = 0  # on the router: what the control plane moved
        self._dispatcher = Dispatcher(owner=self, send_raw=self._send_raw,
                                      ping_interval=ping_interval, ping_timeout=ping_timeout,
                                      heartbeat_address=self._heartbeat.address,
                                      max_frame_bytes=max_frame_bytes, secret=self.secret)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_in, zmq.POLLIN)
        self._gate.start()
        self._heartbeat.start()
        self._background = threading.Thread(target=self._drive_in_background,
                                            name="flowkit-controller", daemon=True)
        self._background.start()

    def _socket(self, kind: int, bind: str, *, server: str = "") -> zmq.Socket:
        """A socket bound to `bind`; `server`: "quiet" (the executors' bulk traffic, no PINGs
        of ours) or "pinging" (the heartbeats), both behind the gate [Note: liveness]."""
        sock = self._zmq.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # Every connection's queues are bounded, in and out [Note: bounds in wire/limits.py];
        # a full one out is refused, not dropped in silence [Note: a full send queue]
        bound_inbound(sock, max_frame=self.max_frame_bytes, rcvhwm=CONTROL_RCVHWM)
        sock.setsockopt(zmq.SNDHWM, CONTROL_SNDHWM)
        if server:
            zmtp_quiet_server(sock)
            if server == "pinging":
                zmtp_heartbeats(sock)
            if self.keys is not None:
                curve_server(sock, self.keys, CONTROLLER)
            else:
                plain_server(sock)
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise BindError(bind, exc) from None
        # a socket has one monitor: without keys the heartbeat socket's is its ConnectionWatch
        if server and (self._gate.curve or server == "quiet"):
            self._gate.watch(sock)
        return sock

    def executor_options(self) -> list[str]:
        """What a launcher adds to `python -m executors` for this controller's executors:
        `--keys DIR`, or `--insecure` [Note: authenticated transport in wire/auth.py]."""
        frames = ([] if self.max_frame_bytes == CONTROL_FRAME_BYTES else
                  ["--max-frame-bytes", str(self.max_frame_bytes)])  # [Note: bounds]
        if self.keys is not None:
            return ["--keys", str(self.keys.folder.resolve()), *frames]
        return ["--insecure", *frames] if self.insecure else frames

    def executor_env(self) -> dict[str, str]:
        """What a launcher adds to its executors' environment: the run's secret, which must
        not be on argv, where any local user reads it [Note: joining a run]."""
        return {SECRET_ENV: self.secret.hex()}

    def write_secret(self, path: str | os.PathLike) -> str:
        """Write the run's secret to a new 0600 file for executors started by hand
        (`flowkit executor --secret-file PATH`); returns the path."""
        return str(write_secret_file(path, self.secret))

    # -- public API (any thread) ---------------------------------------------------------------
    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(event, payload)` for executor_joined, executor_lost, task_submitted,
        task_done and task_failed, on whichever thread drives IO: keep it short."""
        with self._driving():
            self._dispatcher.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener` (a run that shared this controller has ended)."""
        with self._driving():
            self._dispatcher.remove_listener(listener)

    def watch_process(self, process: Any) -> None:
        """Treat the exit of this local executor process (a Popen) as that executor's loss."""
        self._processes[process.pid] = process

    def report_lost(self, executor_id: int, reason: str) -> None:
        """A launcher's word that this executor is gone (its Ray actor died, say): its futures
        fail now with `reason`, not at the heartbeat timeout, which remains the second path."""
        self._heartbeat.lost.add(executor_id)  # one report: the heartbeat need not repeat it
        self._lose(executor_id, reason)

    def executors(self) -> list[ExecutorInfo]:
        with self.condition:
            return self._dispatcher.executors()

    def wait_for_executors(self, count: int, timeout: float = 60.0) -> list[ExecutorInfo]:
        with self.condition:
            if not self.condition.wait_for(lambda: len(self._dispatcher.executors()) >= count,
                                           timeout):
                raise TimeoutError(f"{len(self._dispatcher.executors())} of {count} executors "
                                   f"connected to {self.address} within {timeout} s")
            return self._dispatcher.executors()

    def quiesce(self, timeout: float) -> None:
        """Wait until no live executor has a task outstanding: after a lost executor, the
        tasks that did not depend on it finish (those that did were cancelled), so that state
        can be reloaded with nothing left to change it."""
        self.wait_until(lambda: not any(e.outstanding > 0 for e in self._dispatcher.executors()),
                        timeout, what="waiting for the executors' tasks to end")

    def cancel_pending(self, reason: str) -> int:
        """Fail every task not yet done with `TaskCancelled(reason)` and have its executor drop
        it: a run on a shared controller leaves nothing behind when it fails. Returns how
        many were pending."""
        with self._driving():
            count = self._dispatcher.cancel_pending(reason)
        self._dispatcher.run_callbacks()
        return count

    def submit(self, op: str, *inputs: Any, config: dict | None = None,
               executor: int | None = None, tags: Iterable[str] = (), outputs: int = 1,
               meta: dict | None = None, lane: str | None = None,
               report_key: str | None = None,
               on_part: Callable[[Future], Any] | None = None,
               trace_key: str | None = None, window: int | None = None,
               handled_by_caller: bool = False) -> Any:
        """Run `op` on an executor; returns its output future (a tuple when `outputs` != 1).

        Inputs are futures (their objects move executor to executor), `Item`s and `Gather`s of
        them (flowkit/wire/refs.py), or plain values. Tasks with the same `lane` run on their
        executor in submission order [Note: lanes]. `report_key` names a record field whose
        value for each item of a list output comes back in `future.keys`; `trace_key` one whose
        value for each output item joins the task's `meta["items"]`, which its span in a trace
        shows [Note: traced items in executors/tasks.py]. With `on_part` the op
        streams (ops that can: see OpContext.emit in executors/optable.py): each item it yields is
        passed to `on_part(future)` on the IO thread the moment it arrives, the list of them all
        being the task's result as usual; with `window` it runs at most that many items ahead
        of those its consumers are done with [Note: stream credits in runtime/credits.py]:
        an item's consumers are those submitted by the time `on_part` returns, or with
        `handled_by_caller` by the time the caller passes the item to `handled`. The callbacks
        of one message run in order, the task's own after its items', but a thread that waits
        on the result (not a callback) may wake before the last item's `on_part` has run."""
        if window is not None and (on_part is None or not 1 <= window <= MAX_WINDOW):
            raise ValueError(f"submit: window={window!r} needs on_part and 1 to {MAX_WINDOW}")
        spec = TaskSpec(op, config or {}, lane=lane, report_key=report_key,
                        trace_key=trace_key, stream=on_part is not None, window=window)
        with self._driving():
            futures = self._dispatcher.submit(spec, inputs, outputs=outputs, executor_id=executor,
                                         tags=frozenset(tags), meta=meta or {},
                                         hold=self._batching > 0, on_part=on_part,
                                         handled_by_caller=handled_by_caller)
        self._dispatcher.run_callbacks()
        return futures[0] if outputs == 1 else futures

    def submit_items(self, op: str, *inputs: Any, per_item: Sequence[int],
                     config: dict | None = None, executor: int | None = None,
                     tags: Iterable[str] = (), outputs: int = 1, meta: dict | None = None,
                     report_key: str | None = None, trace_key: str | None = None,
                     on_items: Callable[[tuple[int, int]], Any] | None = None) -> list:
        """Run `op` once per item, all of them in one task on one executor [Note: batched tasks
        in flowkit/wire/task.py]; returns each item's output future (a tuple when `outputs`
        != 1), in order. The inputs at the positions `per_item` are sequences, one input per
        item (futures, `Item`s, ...); the others are every item's. One message goes out and one
        completion comes back for them all; if an item fails, the futures of every item not
        yet answered fail. While the task runs long, the items it has finished are answered
        early [Note: early items in executors/process.py]: their futures resolve, and
        `on_items((first, count))` hears of them on the IO thread."""
        if outputs < 1:
            raise ValueError(f"submit_items: each item has at least one output, not {outputs}")
        rows = [inputs[j] for j in per_item] if per_item else []
        count = len(rows[0]) if rows else 0
        if not rows or any(len(row) != count for row in rows) or not 1 <= count <= MAX_ITEMS:
            raise ValueError(f"submit_items: per_item must name inputs that are sequences of "
                             f"one value per item, 1 to {MAX_ITEMS} of them, all as long; got "
                             f"lengths {[len(row) for row in rows]}")
        wired = [Gather(value) if j in per_item else value for j, value in enumerate(inputs)]
        spec = TaskSpec(op, config or {}, report_key=report_key, trace_key=trace_key,
                        items=count, per_item=tuple(per_item))
        with self._driving():
            futures = self._dispatcher.submit(spec, tuple(wired), outputs=count * outputs,
                                         executor_id=executor, tags=frozenset(tags),
                                         meta=meta or {}, hold=self._batching > 0,
                                         on_items=on_items)
        self._dispatcher.run_callbacks()
        if outputs == 1:
            return list(futures)
        return [futures[i:i + outputs] for i in range(0, len(futures), outputs)]

    def handled(self, parts: Iterable[Future]) -> None:
        """The caller has submitted the consumers of these streamed items (or decided they
        wait): a windowed task's credit for them follows their consumers [Note: stream
        credits in runtime/credits.py]. Any thread; the next pump acts on it."""
        self._dispatcher.credits.handled.extend(part.id for part in parts)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the tasks submitted inside until the block ends, then send each executor its
        share in one message: a whole plan goes out at once, so no executor starts its first
        op while the controller is still submitting its second."""
        self._batching += 1
        try:
            yield
        finally:
            self._batching -= 1
            if not self._batching:
                with self._driving():
                    self._dispatcher.flush()

    def put(self, value: Any, *, executor: int | None = None) -> Future:
        """Place `value` on an executor (the least loaded, unless named) as a future."""
        with self._driving():
            future = self._dispatcher.put(value, executor)
        self._dispatcher.run_callbacks()
        return future

    def fetch(self, future: Future, timeout: float | None = None) -> Any:
        """The value of a resolved future, copied from the executor holding it."""
        with self._driving():
            request, slot = self._dispatcher.fetch(future.id)
        try:
            self.wait_until(lambda: slot[0], timeout, what=f"fetching {future!r}")
        finally:
            if not slot[0]:  # an answered request is forgotten already
                with self._driving():
                    self._dispatcher.forget_fetch(request)
        if slot[2] is not None:
            raise slot[2]
        return slot[1]

    def fetch_many(self, futures: Sequence[Future], timeout: float | None = None) -> list:
        """The values of resolved futures, in their order: every request out at once, so that
        many small values cost one round trip's wait, not one each."""
        with self._driving():
            asked = [self._dispatcher.fetch(future.id) for future in futures]
        try:
            self.wait_until(lambda: all(slot[0] for _, slot in asked), timeout,
                            what=f"fetching {len(asked)} values")
        finally:
            unanswered = [request for request, slot in asked if not slot[0]]
            if unanswered:
                with self._driving():
                    for request in unanswered:
                        self._dispatcher.forget_fetch(request)
        for _, slot in asked:
            if slot[2] is not None:
                raise slot[2]
        return [slot[1] for _, slot in asked]

    def release(self, object_id: int) -> None:
        """For a dropped future's `__del__` [Note: object lifetime]: any thread, any lock held."""
        self._released.append(object_id)

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None, *,
                   what: str = "waiting") -> None:
        """Drive IO (or, if another thread drives, sleep on the condition) until `predicate`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"{what} took over {timeout} s")
            slice_s = 0.05 if remaining is None else min(0.05, remaining)
            if self._stopping:
                raise RuntimeError(f"{what}: the controller shut down")
            if self._io_lock.acquire(blocking=False):
                try:
                    self._pump(slice_s, until=predicate)
                finally:
                    self._last_user = time.monotonic()
                    self._io_lock.release()
                self._dispatcher.run_callbacks()
            else:
                with self.condition:
                    if not predicate():
                        self.condition.wait(slice_s)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._stopping:
            return
        with self._driving():
            self._stopping = True
            self._dispatcher.flush()
            self._dispatcher.shutdown_all()
        self._background.join(timeout)
        self._heartbeat.stop()
        self._gate.stop()
        for sock in (self._router, self._wake_in, self._wake_out):
            sock.close(linger=0)
        self._zmq.term()

    # -- driving IO ----------------------------------------------------------------------------
    def _driving(self) -> _Driving:
        return self._drive

    def _pump(self, timeout_s: float, until: Callable[[], bool] | None = None) -> None:
        """Send what is queued, wait (up to `timeout_s`) for messages or a wake-up, handle all
        that arrived, run queued commands. Holds the IO lock."""
        if until is not None or not self._batching:  # a user waiting inside batch() needs it
            self._dispatcher.flush()
        # a question to a zmq socket is a syscall or two, zmq_poll a dozen: poll only if need be
        ready = until is not None and self._watch_router()
        if not ready:
            ready = any(sock is self._router for sock, _ in
                        self._poller.poll(int(timeout_s * 1000)))
        self._last_pump = time.monotonic()
        if self._wake_pending:  # set, under the lock, before the wake-up is sent
            with self._wake_lock:
                while self._wake_in.poll(0):
                    self._wake_in.recv()
                self._wake_pending = False
        self._run_commands()
        if ready:
            self._drain_router(until)

    def _watch_router(self) -> bool:
        """Whether a message came while a waiting user watched for a moment before sleeping in
        poll ([Note: hot polling] in executors/process.py): a short task's answer is that near."""
        router, end = self._router, time.perf_counter() + _HOT_S
        while not router.getsockopt(_EVENTS) & _POLLIN:
            if self._wanted or self._lost or time.perf_counter() > end:
                return False
            os.sched_yield()
        return True

    def _drain_router(self, until: Callable[[], bool] | None = None) -> None:
        """Handle the messages the router holds (one at least) or, for a user, until `until`."""
        router = self._router
        for _ in range(4096):
            envelope = router.recv(copy=False)  # a Frame: it knows where the message came from
            parts = router.recv_multipart()
            identity = envelope.bytes
            self.messages_in += 1
            try:
                header, frames = decode(parts)
                self._dispatcher.on_message(identity, header, frames, self._origin(envelope)
                                       if header["t"] == Msg.HELLO else _ANYWHERE)
            except KeyboardInterrupt:  # Ctrl-C, in a user thread that drives: the user's
                raise
            except (ProtocolError, SerializeError) as exc:
                self._reject(identity, exc)
            except BaseException as exc:  # noqa: BLE001 - [Note: a message never kills IO]
                self._reject(identity, exc)  # its traceback logged with it
            if self._wanted or until is not None and until():
                return  # what is left goes to the next driver (a user blocked on the lock, soon)
            # EVENTS costs less than the zmq.Again a non-blocking recv raises when empty
            if not router.getsockopt(_EVENTS) & _POLLIN:
                return

    def _reject(self, identity: bytes, exc: BaseException) -> None:
        """[Note: a message never kills IO] Whatever handling a message raises, SystemExit
        included, rejects that message alone and the IO thread goes on: an executor of the run
        hears why; a stranger (no valid HELLO on this connection) hears nothing, and its
        refusals are counted and logged a line a while [Note: refusals in wire/refusals.py]."""
        known = isinstance(exc, (ProtocolError, SerializeError))
        executor = self._dispatcher.executor_at(identity)

        def reason() -> str:
            return shown(str(exc) if known else f"{type(exc).__name__}: {exc}", 300)

        def line() -> str:
            who = shown(identity) if executor is None else executor.describe()
            text = f"rejected a message from {who}: {reason()}"
            return text if known else "".join([text, "\n", *traceback.format_exception(exc)])

        kind = type(exc).__name__
        self._dispatcher.refusals.warn(
            f"{kind} from a stranger" if executor is None else f"{kind} from {executor.name}",
            line)
        if executor is not None:
            self._send_raw([identity, *encode(Msg.ERROR, {"reason": reason()})])

    def _origin(self, envelope: zmq.Frame) -> Origin:
        """Where a HELLO came from: the peer's address (tcp only), and with keys the name the
        connection's key is pinned to [Note: joining a run in wire/hello.py]."""
        host = _property(envelope, "Peer-Address") if self.address.startswith("tcp://") else None
        user = _property(envelope, "User-Id") if self.keys is not None else None
        return Origin(host=host or None, user_id=user or "")

    def _send_raw(self, parts: list) -> None:
        # Small messages go by copy: a zero-copy send makes pyzmq track the buffer's release
        # through a thread of its own, which costs more than copying a few hundred bytes.
        try:
            send_frames(self._router, parts, copy=len(parts) <= 2, flags=_NOBLOCK)
        except zmq.ZMQError as exc:  # [Note: a full send queue]
            self._undeliverable(parts[0], exc)
            return
        self.messages_out += 1

    def _undeliverable(self, identity: bytes, exc: zmq.ZMQError) -> None:
        """[Note: a full send queue] The router's queue to each connection holds at most
        CONTROL_SNDHWM messages, and the router refuses (ROUTER_MANDATORY) rather than drop in
        silence: a live executor's libzmq empties its queue as fast as it fills, so one that
        stays full belongs to a peer that does not read, and an executor that does not read is
        lost. A connection that is gone (EHOSTUNREACH) loses what was sent to it, as before."""
        executor = self._dispatcher.executor_at(identity)
        if exc.errno != zmq.EAGAIN or executor is None:
            return
        self._lose(executor.id, f"it does not read what is sent to it: its queue of "
                                f"{CONTROL_SNDHWM:,} messages is full")

    def _run_commands(self) -> None:
        released, lost = self._released, self._lost
        while released:
            self._dispatcher.release(released.popleft())
        while lost:
            self._dispatcher.lose(*lost.popleft())
        self._dispatcher.credits.check()  # [Note: stream credits] in runtime/credits.py

    def _lose(self, executor_id: int, reason: str) -> None:
        """For the heartbeat thread, which must not block on the IO lock: the next driver acts."""
        self._lost.append((executor_id, reason))
        self._wake()

    def _exit_code(self, pid: int) -> int | None:
        """The exit code of a watched local executor process; None while it runs, or if
        unwatched."""
        process = self._processes.get(pid)
        return None if process is None else process.poll()

    _wake_pending = False

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_pending or self._stopping:
                return
            self._wake_pending = True
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # closing down: nobody is left to wake
                pass

    def _drive_in_background(self) -> None:
        while not self._stopping:
            # sleep out the quiet period: each wake-up takes the GIL from the user thread;
            # but not past an overdue pump [Note: overdue pumps]
            now = time.monotonic()
            quiet_left = self._last_user + _QUIET_S - now
            overdue_in = self._last_pump + _OVERDUE_S - now
            busy = self._wanted or quiet_left > 0
            if busy and overdue_in > 0:
                time.sleep(min(quiet_left if quiet_left > 0 else _QUIET_S / 2, overdue_in))
                continue
            if not self._io_lock.acquire(timeout=0.05):
                continue
            try:
                if not self._stopping:
                    self._pump(0.0 if busy else 0.02)  # a busy user's lock back at once
            except BaseException:  # noqa: BLE001 - no KeyboardInterrupt reaches this thread
                # this thread must outlive any one failure: runs wait on events that only
                # its callbacks deliver, so its death would hang them until their timeout
                if not self._stopping:
                    log.exception("the controller's IO thread failed; it goes on")
                    time.sleep(0.1)  # a failure that repeats must not spin
            finally:
                self._io_lock.release()
            self._dispatcher.run_callbacks()


class _Driving:
    """Hold the IO lock for a user call; interrupt the background thread's poll to get it."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl

    def __enter__(self) -> None:
        ctl = self.ctl
        if ctl._io_lock.acquire(False):
            return
        ctl._wanted += 1
        try:  # a Ctrl-C meanwhile must not leave the background thread waiting for ever
            ctl._wake()
            ctl._io_lock.acquire()
        finally:
            ctl._wanted -= 1

    def __exit__(self, *exc: Any) -> None:
        self.ctl._last_user = time.monotonic()
        self.ctl._io_lock.release()


class _Heartbeat(threading.Thread):
    """Answers executors' pings on a socket of its own and declares lost the executors that
    are silent, whose process exited or whose heartbeat connection closed [Note: liveness]."""

    def __init__(self, ctl: Controller, bind: str, interval: float, timeout: float) -> None:
        super().__init__(name="flowkit-heartbeat", daemon=True)
        self.ctl, self.interval, self.timeout = ctl, interval, timeout
        self.sock = ctl._socket(zmq.ROUTER, bind, server="pinging")
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        # a socket has one monitor, and with keys the gate's watches the handshakes: then a
        # closed connection is seen by the process's exit or the ping timeout alone
        self.connections = (None if ctl._gate.curve else
                            ConnectionWatch(self.sock, on_failed=ctl._gate.failed))
        self.last_seen: dict[int, float] = {}
        self.lost: set[int] = set()
        self.refusals = Refusals(log)  # its own: the IO thread's is not for this thread
        # executor id -> the connection (fd) its first ping came on, and back: only that one
        # keeps it alive, and its closing is the executor's loss
        self.fd_of: dict[int, int] = {}
        self.executor_on: dict[int, int] = {}
        self.closed_at: dict[int, float] = {}  # executor id -> when its connection closed
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=1.0)
        if self.connections is not None:
            self.connections.close()
        self.sock.close(linger=0)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.connections is not None:
            poller.register(self.connections.socket, zmq.POLLIN)
        while not self._stop_event.is_set():
            if poller.poll(int(self.interval * 500)):
                self._answer_pings()
                self._closed_connections()
            self._check()

    def _answer_pings(self) -> None:
        pong = encode(Msg.PING)
        while True:
            try:
                identity, *frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            executor = self._executor_of_ping([frame.bytes for frame in frames])
            if executor is None or executor in self.lost or not frames:
                continue
            fd = frames[0].get(zmq.SRCFD)
            if self.fd_of.setdefault(executor, fd) != fd:
                continue  # another connection speaking for it: not its own heartbeat
            self.executor_on[fd] = executor
            self.last_seen[executor] = time.monotonic()
            self.sock.send_multipart([identity, *pong])

    def _closed_connections(self) -> None:
        for opened, fd in self.connections.changes() if self.connections is not None else ():
            executor = self.executor_on.pop(fd, None)  # a new connection on a reused fd too
            if executor is None or opened:
                continue
            self.fd_of.pop(executor, None)
            self.closed_at.setdefault(executor, time.monotonic())

    def _check(self) -> None:
        now = time.monotonic()
        for executor in self.ctl.executors():
            if executor.id in self.lost:
                continue
            code = self.ctl._exit_code(executor.pid)
            seen = self.last_seen.get(executor.id, executor.last_seen)
            closed = self.closed_at.get(executor.id)
            if code is not None:
                reason = f"its process exited with code {code}"
            elif closed is not None and now - closed > _EXIT_GRACE_S:
                reason = ("its heartbeat connection closed (its process or host is gone, or "
                          f"it was silent to libzmq for {zmtp_timeout_s():g} s)")
            elif now - seen > self.timeout:
                reason = f"no heartbeat for {now - seen:.1f} s"
            else:
                continue
            self.lost.add(executor.id)
            self.ctl._lose(executor.id, reason)


    def _executor_of_ping(self, parts: list) -> int | None:
        """The executor a ping is from, if it carries that executor's token (its WELCOME's):
        nobody else can keep a hung executor alive. Other pings get no answer."""
        try:
            header, _ = decode(parts)
        except ProtocolError:
            return None
        executor, token = header.get("executor"), header.get("token")
        expected = self.ctl._dispatcher.ping_token(executor) if type(executor) is int else None
        if header["t"] == Msg.PING and expected is not None and type(token) is str and \
                hmac.compare_digest(token.encode("ascii", "replace"), expected.encode()):
            return executor
        self.refusals.warn("ping", f"ignored a ping for executor {shown(executor)}: it is no "
                           f"live executor's, or lacks its token")
        return None


def _property(frame: zmq.Frame, name: str) -> str | None:
    try:
        return frame.get(name)
    except zmq.ZMQError:  # not set for this connection (inproc; User-Id without a gate)
        return None


_ANYWHERE = Origin()  # any message but a HELLO: where it came from is not asked


def _sibling(bind: str) -> str:
    """An endpoint next to `bind` for the heartbeat socket: same host, any port."""
    if bind.startswith("tcp://"):
        host = bind[len("tcp://"):].rsplit(":", 1)[0]
        return f"tcp://{host}:0"
    if bind.startswith("ipc://"):
        return f"{bind}-heartbeat-{os.getpid()}"
    return f"inproc://flowkit-heartbeat-{id(bind)}"
