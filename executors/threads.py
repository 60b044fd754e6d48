"""The executor's two helper threads: the watch that serves its sockets while an op runs long,
and the heartbeat that tells the controller it lives (and exits when the controller is gone).
Both work on an executors.process.Executor, which they only use, never import."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from flowkit.wire.liveness import ConnectionWatch
from flowkit.wire.protocol import Msg, encode

__all__ = ["CompletionWatch", "Heartbeat"]

log = logging.getLogger("flowkit.executor")

HOLD_BACK_S = 0.001
# a closed control connection gives the serving loop this long to end on a shutdown it read
_SHUTDOWN_GRACE_S = 0.5  # the longest a finished task's completion waits behind another op


class CompletionWatch(threading.Thread):
    """Serves the sockets while an op runs long: every HOLD_BACK_S it takes them for a moment,
    sends the completions waiting behind the op and handles what has arrived (objects peers
    ask for, new tasks, frees), so one slow op does not stall data other executors need. It
    never holds them while waiting, so the op thread gets them back at once when the op ends.
    It ticks while ops keep starting and sleeps once a tick saw none: each wake-up takes the GIL
    from the op thread, and a burst of tiny ops wakes it once, not once an op."""

    def __init__(self, executor: Any) -> None:
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
            self.armed.wait(None if self.idle else HOLD_BACK_S)
            self.armed.clear()
            seq, running = executor.op_seq, executor.in_op
            # the op seen at the last tick still runs: it has run at least HOLD_BACK_S
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
                executor.answer_early_items()
                executor._flush_completions()
                for sock in (executor.control, executor.peer):
                    executor._drain(sock, peer=sock is executor.peer)


class Heartbeat(threading.Thread):
    """Pings the controller on its own socket; exits the process when its connection to the
    controller closes [Note: liveness in flowkit/wire/liveness.py] or the controller goes
    quiet for the (long) ping timeout."""

    def __init__(self, executor: Any, address: str, interval: float, timeout: float) -> None:
        super().__init__(name="flowkit-heartbeat", daemon=True)
        self.executor, self.address = executor, address
        self.interval, self.timeout = interval, timeout
        self.control = ConnectionWatch(executor.control)  # made here: the main thread's socket
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2 * self.interval + 1)

    def run(self) -> None:
        sock = self.executor.client_socket("controller")
        sock.connect(self.address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.control.socket, zmq.POLLIN)
        ping = encode(Msg.PING, {"executor": self.executor.executor_id,
                                 "token": self.executor.ping_token})  # its WELCOME's
        last_heard = time.monotonic()
        try:
            while not self._stop_event.is_set():
                sock.send_multipart(ping)
                deadline = time.monotonic() + self.interval
                while (remaining := deadline - time.monotonic()) > 0:
                    if self._stop_event.is_set():
                        return
                    ready = dict(poller.poll(int(remaining * 1000) + 1))
                    if sock in ready:
                        while sock.poll(0):
                            sock.recv_multipart()
                        last_heard = time.monotonic()
                    if self.control.socket in ready and self._control_closed():
                        return
                if time.monotonic() - last_heard > self.timeout:
                    log.error("controller at %s silent for %.1f s: exiting",
                              self.executor.connect_address, self.timeout)
                    self._exit_now()
        finally:
            sock.close(linger=0)
            self.control.close()

    def _control_closed(self) -> bool:
        """Whether the control connection closed; if so, and the serving loop does not end
        by itself (the controller's last word may be a shutdown), exit."""
        if all(opened for opened, _ in self.control.changes()):
            return False
        if self._stop_event.wait(_SHUTDOWN_GRACE_S):
            return True
        log.error("the connection to the controller at %s closed: exiting",
                  self.executor.connect_address)
        self._exit_now()
        return True

    def _exit_now(self) -> None:
        self.executor.run_cleanup_hooks()
        os._exit(3)
