"""The fork server: `python -m executors.forkserver --socket PATH [--preload torch,...]`, a
process that imports what executors need once and then forks each executor a launcher asks for
(flowkit/runtime/forkserver.py is the launcher's side; flowkit/wire/forkserver.py the messages).

[Note: fork server] An executor process spends ~2 s of a core importing torch (~3.5 s
more for transformers' model code) before it serves. The local launcher asks this server
instead, which has imported them once: a child is a fork that runs `python -m executors ARGV` in
the launcher's cwd, environment and standard streams, in a session of its own, and dies with the
launcher (a pidfd watch in place of the parent-death signal). The server itself only imports:
no thread of its own and no torch work, so a fork copies nothing half-done. `flowkit bench
launch`: 2 torch executors up in 0.11x the time of fresh processes, a restart in 0.13x.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import importlib
import os
import select
import selectors
import signal
import socket
import sys
import threading
import traceback
import weakref
from typing import Any

from flowkit.wire.forkserver import (
    ForkServerError,
    check_pid,
    check_start,
    fingerprint,
    peer_uid,
    receive,
    send,
)
from flowkit.wire.shm import sweep

__all__ = ["ForkServer", "main"]

_PR_SET_NAME = 15

def preload(modules: list[str]) -> None:
    """Import the executor and `modules` (a kind's, `executors.torch`, brings torch; those not
    installed are skipped), then freeze them out of the collector's walks, so that
    collections in the children leave the shared pages shared."""
    import executors.process  # noqa: F401
    import executors.serve  # noqa: F401
    from executors.kinds import GROUP
    from executors.optable import installed_entries

    for group in (GROUP, "flowkit.ops"):
        installed_entries(group)

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()


class ForkServer:
    """Serves start requests on a Unix socket at `path` from processes of this user whose
    hello matches this process's fingerprint, one thread, until killed."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.greeted: set[socket.socket] = set()
        self.owner: dict[int, socket.socket] = {}  # child pid -> the connection that asked
        self.launcher: dict[int, int] = {}  # child pid -> the pid it dies with (its launcher)
        self.wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)
        signal.set_wakeup_fd(wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        self.selector.register(self.wakeup_read, selectors.EVENT_READ)
        self.own_fds = [self.listener.fileno(), self.wakeup_read, wakeup_write]
        self.fingerprint = fingerprint()

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj == self.wakeup_read:
                    os.read(self.wakeup_read, 4096)
                    self._reap()
                else:
                    self._serve(key.fileobj)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        if peer_uid(conn) != os.getuid():
            conn.close()  # another user's process: not a word
            return
        self.selector.register(conn, selectors.EVENT_READ)

    def _serve(self, conn: socket.socket) -> None:
        try:
            message, fds = receive(conn)
        except (ForkServerError, OSError) as exc:
            self._reply(conn, {"refused": str(exc)})
            return
        if message is None:
            self._drop(conn)
            return
        try:
            if conn not in self.greeted:
                self._greet(conn, message, fds)
            elif set(message) == {"start"}:
                self._reply(conn, {"started": self._fork(check_start(message["start"], fds),
                                                         fds, conn)})
            elif set(message) == {"children_of"} and not fds:
                launcher = check_pid(message["children_of"], "children_of")
                self._reply(conn, {"children": sorted(
                    pid for pid, watched in self.launcher.items() if watched == launcher)})
            else:
                raise ForkServerError(f"unknown message {sorted(message)[:4]}")
        except ForkServerError as exc:
            for fd in fds:
                os.close(fd)
            self._reply(conn, {"refused": str(exc)})

    def _greet(self, conn: socket.socket, message: dict, fds: list[int]) -> None:
        if fds or set(message) != {"hello"}:
            raise ForkServerError("the first message is a hello alone")
        if message["hello"] != self.fingerprint:
            raise ForkServerError(f"this server imports {self.fingerprint}, not "
                                  f"{str(message['hello'])[:500]}")
        self.greeted.add(conn)
        self._reply(conn, {"ok": True})

    def _fork(self, request: dict[str, Any], fds: list[int], conn: socket.socket) -> int:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child writes this process's buffered output again
        try:
            pid = os.fork()
        except OSError as exc:
            raise ForkServerError(f"fork failed: {exc}") from None
        if pid == 0:
            closing = [*self.own_fds, *(key.fd for key in self.selector.get_map().values())]
            if isinstance(self.selector, selectors.EpollSelector):
                closing.append(self.selector.fileno())
            become_executor(request, fds, closing)  # never returns
        for fd in fds:
            os.close(fd)
        self.owner[pid] = conn
        self.launcher[pid] = request["watch"]
        return pid

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sweep([pid])  # a child killed (SIGKILL, the OOM killer) could not unlink its own
            conn = self.owner.pop(pid, None)
            self.launcher.pop(pid, None)
            if conn is not None:
                self._reply(conn, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def _reply(self, conn: socket.socket, message: dict) -> None:
        try:
            send(conn, message)
        except OSError:  # the launcher is gone; its children die with it
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if conn.fileno() >= 0:
            self.selector.unregister(conn)
            conn.close()
        self.greeted.discard(conn)
        for pid in [pid for pid, owner in self.owner.items() if owner is conn]:
            del self.owner[pid]


def become_executor(request: dict[str, Any], fds: list[int], closing: list[int]) -> None:
    """In the forked child: the launcher's streams, cwd and environment, a session of its own,
    death with the launcher, then `python -m executors ARGV`; exits, never returns."""
    code = 1
    try:
        name_process(request["argv"])
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        for fd in set(closing):
            try:
                os.close(fd)
            except OSError:
                pass
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        die_with(request["watch"])
        _leave_the_servers_finalizers()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _threads_as_asked()
        sys.path[0] = request["cwd"]  # as `python -m` started in that folder has it
        from executors.serve import executor

        sys.argv = ["python -m executors", *request["argv"]]
        executor.main(args=request["argv"], prog_name="python -m executors")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - the child's end: printed, as Python would
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what an interpreter's exit runs (os._exit skips it)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _leave_the_servers_finalizers() -> None:
    """The weakref finalizers of what the server imported (torch's operator libraries: 6 % of
    a ten-step executor's CPU at its exit, in `py-spy record --subprocesses` of the fork server
    under a tests/cli/flows/tiny_layouts.py run; a temporary folder's removal) are the
    server's: the child's exit frees its copy of those objects without them."""
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        finalizer.atexit = False


def name_process(argv: list[str]) -> None:
    """The executor's --name as this process's name (ps -o comm, top; 15 bytes at most): its
    command line is still the server's."""
    if "--name" not in argv[:-1]:
        return
    name = argv[argv.index("--name") + 1].encode()[:15]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def _threads_as_asked() -> None:
    """torch's compute threads as OMP_NUM_THREADS now says: torch read the server's as it
    loaded, and a fresh process would read the launcher's."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def die_with(pid: int) -> None:
    """SIGKILL this process when process `pid` ends (its launcher), as the parent-death signal
    does for a direct child (flowkit/runtime/spawn.py)."""
    try:
        watched = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([watched], [], [])
        _unlink_own_segments()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="flowkit-launcher-watch", daemon=True).start()


def _unlink_own_segments() -> None:
    """[Note: segments of a killed run] This process's shared-memory segments, unlinked as it
    dies with its launcher: the SIGKILL that follows leaves nothing to clean up after it. A
    segment another thread makes meanwhile is left, for the next run's sweep_stale."""
    try:
        sweep([os.getpid()])
    except Exception:  # noqa: BLE001 - dying anyway: the next run's sweep_stale is the backstop
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m executors.forkserver",
                                     description="Fork executors from one process that has "
                                     "imported what they need.")
    parser.add_argument("--socket", required=True, help="The Unix socket to serve on.")
    parser.add_argument("--preload", default="", help="Comma-separated modules to import.")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    preload([m for m in args.preload.split(",") if m])
    ForkServer(args.socket).serve()


if __name__ == "__main__":
    main()
