"""The fork server [Note: fork server in executors/forkserver.py]: executors forked from it serve
as started ones do, report how they ended, die with their launcher, write to its streams; a
server refuses strangers and bad requests and keeps serving."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest

from flowkit.runtime import Controller, LocalExecutors
from flowkit.runtime.forkserver import (
    ForkedProcess,
    ForkServer,
    ForkServerRefused,
    start_executor,
    start_server,
)
from flowkit.wire.forkserver import ForkServerError, fingerprint, receive, send

pytestmark = pytest.mark.slow  # end to end: a fork server of its own and the executors it forks


@pytest.fixture(scope="module")
def server():
    started = start_server(("executors.sim",))
    yield started
    started.close()


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_forked_executors_serve_and_report_their_exit(server, monkeypatch):
    monkeypatch.setenv("FLOWKIT_FORKSERVER", server.path)
    with Controller() as ctl, LocalExecutors(ctl, 2, kind="sim") as infos:
        launcher_processes = [p for p in ctl._processes.values()]
        assert all(isinstance(p, ForkedProcess) for p in launcher_processes)
        assert ctl.submit("identity", 7, executor=infos[1].id).result(timeout=10) == 7
        victim = launcher_processes[0]
        assert victim.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            victim.wait(timeout=0.01)
        victim.kill()
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert ctl.submit("identity", 8, executor=infos[1].id).result(timeout=10) == 8


def test_without_a_server_executors_start_as_processes(monkeypatch):
    monkeypatch.setenv("FLOWKIT_FORKSERVER", "off")
    with Controller() as ctl, LocalExecutors(ctl, 1) as infos:
        assert all(isinstance(p, subprocess.Popen) for p in ctl._processes.values())
        assert ctl.submit("identity", 1, executor=infos[0].id).result(timeout=10) == 1


def test_a_server_that_is_not_there_falls_back_to_processes(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("FLOWKIT_FORKSERVER", str(tmp_path / "nothing"))
    with Controller() as ctl, LocalExecutors(ctl, 1) as infos:
        assert all(isinstance(p, subprocess.Popen) for p in ctl._processes.values())
        assert ctl.submit("identity", 2, executor=infos[0].id).result(timeout=10) == 2
    assert "without a fork server: no fork server at" in caplog.text


def test_a_child_writes_to_the_launchers_streams_and_exits_with_the_executors_code(server):
    read, write = os.pipe()
    with open(os.devnull, "r+b") as devnull:
        child = server.start(["--connect", "not-an-address"], dict(os.environ),
                             (devnull.fileno(), write, write))
    os.close(write)
    with os.fdopen(read) as output:
        text = output.read()
    assert child.wait(timeout=30) == 2  # click's usage error
    assert "is not a controller address" in text


def test_a_child_dies_with_its_launcher(server, tmp_path):
    """A launcher killed with SIGKILL takes its forked executors with it, as the parent-death
    signal does for started ones."""
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        from flowkit.runtime import Controller, LocalExecutors
        with Controller() as ctl, LocalExecutors(ctl, 1, kind="sim") as infos:
            print(infos[0].pid, flush=True)
            time.sleep(600)
    """))
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "FLOWKIT_FORKSERVER": server.path})
    pid = int(launcher.stdout.readline())
    assert not _gone(pid, 0.2)
    launcher.kill()
    launcher.wait()
    launcher.stdout.close()
    assert _gone(pid, 10), "the forked executor outlived its launcher"


def test_the_executors_a_launcher_had_forked_are_found_through_the_server(server, tmp_path,
                                                                          monkeypatch):
    """executor_processes(pid) of a `flowkit run` whose executors a shared server forked (the
    suite's CLI runs, killed by tests): the server says which children each launcher asked
    for; a process that asked for none has none."""
    from flowkit.runtime.forkserver import executor_processes

    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent("""
        import time
        from flowkit.runtime import Controller, LocalExecutors
        with Controller() as ctl, LocalExecutors(ctl, 2, kind="sim") as infos:
            print(*sorted(e.pid for e in infos), flush=True)
            time.sleep(600)
    """))
    monkeypatch.setenv("FLOWKIT_FORKSERVER", server.path)
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                text=True)
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert executor_processes(launcher.pid) == {pids[0]: "exec-0", pids[1]: "exec-1"}
        with subprocess.Popen(["sleep", "60"]) as stranger:
            assert executor_processes(stranger.pid) == {}
            stranger.kill()
        os.kill(pids[0], signal.SIGKILL)
        assert _gone(pids[0], 10)
        deadline = time.monotonic() + 10  # until the server reaped it
        while pids[0] in executor_processes(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert executor_processes(launcher.pid) == {pids[1]: "exec-1"}
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


@pytest.mark.parametrize("question", [True, "1234", -5, 1, 1 << 40, None])
def test_a_bad_question_for_children_is_refused_and_the_server_keeps_serving(server,
                                                                             question):
    with _connected(server.path) as sock:
        send(sock, {"hello": fingerprint()})
        assert receive(sock)[0] == {"ok": True}
        send(sock, {"children_of": question})
        assert "children_of is a process id" in receive(sock)[0]["refused"]
        send(sock, {"children_of": os.getpid()})
        assert receive(sock)[0] == {"children": []}


def _connected(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    sock.settimeout(10)
    return sock


def test_a_server_refuses_another_import_path(server):
    with _connected(server.path) as sock:
        send(sock, {"hello": {**fingerprint(), "pythonpath": "/elsewhere"}})
        reply, _ = receive(sock)
    assert "this server imports" in reply["refused"]


def test_a_server_started_that_refuses_this_process_is_an_error_at_once_not_at_the_timeout():
    """A launcher run from another checkout's folder (the server imports the flowkit there):
    the server's refusal ends the start, which must not wait out its timeout for a server
    that will never answer otherwise."""
    started = time.monotonic()
    with pytest.raises(ForkServerRefused, match="this server imports"):
        start_server(env={"PYTHONPATH": "/elsewhere"}, timeout=600)
    assert time.monotonic() - started < 300  # refused once listening, not after 600 s


@pytest.mark.parametrize("packet, refusal", [
    (b"\xc1\xc1", "not a msgpack message"),
    (msgpack.packb([1, 2]), "a map with string keys"),
    (msgpack.packb({"start": {}}), "the first message is a hello alone"),
])
def test_a_stranger_is_refused_and_the_server_keeps_serving(server, packet, refusal):
    with _connected(server.path) as sock:
        sock.sendall(packet)
        reply, _ = receive(sock)
    assert refusal in reply["refused"]
    with open(os.devnull, "r+b") as devnull:
        child = server.start(["--help"], dict(os.environ), (devnull.fileno(),) * 3)
    assert child.wait(timeout=30) == 0


@pytest.mark.parametrize("request_, streams, refusal", [
    ({"argv": ["--help"], "env": {}, "cwd": "/", "watch": os.getpid()}, 2, "3 descriptors"),
    ({"argv": ["--help"], "env": {}, "cwd": "/"}, 3, "names argv, env, cwd and watch"),
    ({"argv": [1], "env": {}, "cwd": "/", "watch": os.getpid()}, 3, "argv is a list"),
    ({"argv": [], "env": {"A=B": "c"}, "cwd": "/", "watch": os.getpid()}, 3, "env maps"),
    ({"argv": [], "env": {}, "cwd": "/no/such/folder", "watch": os.getpid()}, 3, "not a folder"),
    ({"argv": [], "env": {}, "cwd": "/", "watch": True}, 3, "watch is the pid"),
])
def test_a_bad_start_is_refused_and_the_server_keeps_serving(server, request_, streams,
                                                               refusal):
    with _connected(server.path) as sock, open(os.devnull, "r+b") as devnull:
        send(sock, {"hello": fingerprint()})
        assert receive(sock)[0] == {"ok": True}
        socket.send_fds(sock, [msgpack.packb({"start": request_})], [devnull.fileno()] * streams)
        reply, _ = receive(sock)
        assert refusal in reply["refused"]
        send(sock, {"start": {"argv": ["--help"], "env": dict(os.environ), "cwd": "/",
                              "watch": os.getpid()}}, (devnull.fileno(),) * 3)
        assert "started" in receive(sock)[0]


def test_a_refused_start_raises_and_start_executor_falls_back(server, monkeypatch):
    monkeypatch.setenv("FLOWKIT_FORKSERVER", server.path)
    with pytest.raises(ForkServerError, match="env maps"):
        server.start(["--help"], {"": "x"}, (0, 1, 2))
    assert start_executor(["--help"], {"": "x"}) is None
    with pytest.raises(ForkServerError, match="no fork server at"):
        ForkServer(server.path + ".missing")


@pytest.mark.parametrize("fork", ["off", "server"])
def test_an_executor_computes_on_the_threads_it_was_given(server, monkeypatch, tmp_path, fork):
    """--executor-threads reaches torch in a forked executor as in a fresh one (torch read
    the server's OMP_NUM_THREADS as it loaded)."""
    from pathlib import Path

    from flowkit.dsl.load import import_flow_file

    code = tmp_path / "threads_op.py"
    code.write_text("from flowkit.dsl import op\n\n\n@op\ndef threads() -> int:\n"
                    "    import torch\n    return torch.get_num_threads()\n")
    target = f"{import_flow_file(Path(code)).__name__}:threads"
    monkeypatch.setenv("FLOWKIT_FORKSERVER", "off" if fork == "off" else server.path)
    for threads in (1, 2):
        with Controller() as ctl, LocalExecutors(ctl, 1, kind="sim", code=[str(code)],
                                                 threads=threads):
            assert ctl.submit("python", config={"target": target}).result(timeout=30) == threads


def test_a_launcher_refuses_a_server_of_another_user(server, monkeypatch):
    """The server would see the executors' environment, the run's secret included: a server
    socket owned by another user is refused before anything is sent."""
    import flowkit.runtime.forkserver as client

    monkeypatch.setattr(client.os, "getuid", lambda: os.geteuid() + 12345)
    with pytest.raises(ForkServerError, match="runs as user .*not as this one"):
        ForkServer(server.path)


def test_a_dead_child_not_yet_reaped_is_no_executor():
    """A zombie keeps its process name until its parent reaps it: listing it as an executor
    let the chaos bench spend a kill on a process already dead."""
    from flowkit.runtime.forkserver import _children

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while _state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(child.pid) == "Z"
    assert child.pid not in _children(os.getpid())
    child.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_launcher_that_closes_its_connection_warns_of_nothing(server, caplog):
    """The reader thread sees the connection end, not a descriptor closed under its read (the
    `[Errno 9] Bad file descriptor` line that ended runs)."""
    caplog.set_level(logging.WARNING)
    before = set(threading.enumerate())
    client = ForkServer(server.path)
    (reader,) = set(threading.enumerate()) - before
    client.close()
    reader.join(5)
    assert not reader.is_alive() and not client.alive
    assert caplog.records == []
