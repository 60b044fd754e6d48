"""A rogue executor: a plain pyzmq client on this machine that reaches a run's loopback ports
[Note: joining a run in flowkit/wire/hello.py]. Without the run's secret its connection is
dropped in the handshake [Note: strangers stop at the handshake in flowkit/wire/auth.py]; past
that gate, a HELLO without the secret gets no WELCOME and no task; with it (an insider) it still
cannot take a live executor's name, point peers at another host, answer for another executor's
tasks or fetches, or keep a hung executor alive. Each time the legitimate run goes on to the
results it has without the rogue."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq
import zmq.auth

from flowkit.runtime import Controller
from flowkit.runtime.futures import ExecutorLost
from flowkit.wire.auth import Keys, generate_keys
from flowkit.wire.hello import SECRET_ENV
from flowkit.wire.protocol import Msg, decode, encode
from flowkit.wire.serialize import pack
from tests.harness import dealer, executor_cluster


class Rogue:
    """A bare DEALER that says what it likes to a controller's socket; with `secret`, past the
    gate (the HELLO's own checks are what these tests try)."""

    def __init__(self, address: str, secret: bytes | None) -> None:
        self.sock = dealer(address, secret=secret)

    def send(self, kind: str, fields: dict) -> None:
        self.sock.send_multipart(encode(kind, fields))

    def answers(self, seconds: float) -> list[dict]:
        got = []
        while self.sock.poll(int(seconds * 1000)):
            got.append(decode(self.sock.recv_multipart())[0])
            seconds = 0.2
        return got

    def hello(self, **fields) -> list[dict]:
        self.send(Msg.HELLO, {"name": "rogue", "tags": [], "ops": ["noop", "identity"],
                              "pid": 1, "peer_address": "tcp://127.0.0.1:9", **fields})
        return self.answers(3.0)

    def close(self) -> None:
        self.sock.close()


def _legit_run(ctl, executors) -> list:
    """A small run over both executors: values moved between them, and ten tasks anywhere."""
    a, b = executors
    moved = ctl.submit("identity", ctl.put(7, executor=a.id), executor=b.id)
    return [*(ctl.submit("identity", i).result(timeout=30) for i in range(10)),
            moved.result(timeout=30)]


@pytest.fixture(scope="module")
def run():
    """(controller, its two executors, the results of the legit run without any rogue)."""
    with executor_cluster(2) as (ctl, executors):
        yield ctl, executors, _legit_run(ctl, executors)


@pytest.fixture
def rogue(run):
    made = Rogue(run[0].address, run[0].secret)
    yield made
    made.close()


def _refusal(answers: list[dict]) -> str:
    assert [(a["t"], a.get("refused")) for a in answers] == [(Msg.ERROR, True)], answers
    return answers[0]["reason"]


_INSIDERS = itertools.count()


def _insider(run, rogue: Rogue) -> dict:
    """The rogue joins with the run's secret (an insider), under a name of its own and with
    an op nobody asks for, so no task goes to it: its WELCOME."""
    ctl = run[0]
    (welcome,) = rogue.hello(name=f"insider-{next(_INSIDERS)}", ops=["insider-only"],
                             secret=ctl.secret.hex())
    assert welcome["t"] == Msg.WELCOME
    return welcome


def _still_clean(run) -> None:
    ctl, executors, clean = run
    names = sorted(e.name for e in ctl.executors() if not e.name.startswith("insider"))
    assert names == ["exec-0", "exec-1"]
    assert _legit_run(ctl, executors) == clean


@pytest.mark.parametrize("address", ["address", "heartbeat"])
def test_a_stranger_is_dropped_in_its_handshake_and_nothing_it_sends_is_read(run, address):
    """No password, or another run's: the gate refuses the connection, so not one message of
    the stranger's is queued at the controller (none can fill a queue there)."""
    ctl = run[0]
    target = ctl.address if address == "address" else ctl._heartbeat.address
    refused = ctl._gate.refused
    strangers = [Rogue(target, None), Rogue(target, b"x" * 32)]
    try:
        for stranger in strangers:
            stranger.sock.setsockopt(zmq.SNDTIMEO, 0)
            with pytest.raises(zmq.Again):  # no connection to send on: never one made
                for _ in range(2_000):
                    stranger.send(Msg.HELLO, {"name": "s", "tags": [], "ops": [], "pid": 1,
                                              "secret": ctl.secret.hex()})
        deadline = time.monotonic() + 10
        while ctl._gate.refused < refused + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl._gate.refused >= refused + 2
        assert all(stranger.answers(0.3) == [] for stranger in strangers)
    finally:
        for stranger in strangers:
            stranger.close()
    _still_clean(run)


@pytest.mark.parametrize("secret", [None, "00" * 32, 12345, "not hex at all"])
def test_a_hello_without_the_runs_secret_gets_no_welcome_and_no_task(run, rogue, secret):
    reason = _refusal(rogue.hello(**({} if secret is None else {"secret": secret})))
    assert "secret" in reason
    _still_clean(run)
    assert rogue.answers(0.3) == []  # nothing of the run reached it


def test_a_live_executors_name_is_refused(run, rogue):
    reason = _refusal(rogue.hello(name="exec-0", secret=run[0].secret.hex()))
    assert "'exec-0' is a live executor's" in reason
    _still_clean(run)
    assert rogue.answers(0.3) == []


@pytest.mark.parametrize("fields, said", [
    ({"ops": [[1]]}, "each of ops must be printable text"),
    ({"name": "x" * (64 << 10)}, "name must be printable text of at most 128"),
    ({"name": "exec\x1b[2J"}, "name must be printable text"),
    ({"tags": ["t"] * 10_000}, "at most 64 tags"),
    ({"resources": {"gpus": [1] * 100}}, "resource gpus must be a number or text"),
])
def test_a_hello_out_of_bounds_is_refused_in_one_short_line(run, rogue, fields, said, caplog):
    caplog.set_level(logging.WARNING, logger="flowkit.controller")
    run[0]._dispatcher.refusals._last.clear()  # earlier tests' refusals must not silence this one
    reason = _refusal(rogue.hello(secret=run[0].secret.hex(), **fields))
    assert said in reason and len(reason) < 400
    (line,) = [r.getMessage() for r in caplog.records if "refused an executor" in r.getMessage()]
    assert said in line and len(line) < 600 and "\x1b" not in line
    _still_clean(run)


def test_repeated_refusals_are_logged_once_a_while(run, caplog):
    caplog.set_level(logging.WARNING, logger="flowkit.controller")
    run[0]._dispatcher.refusals._last.clear()
    rogues = [Rogue(run[0].address, run[0].secret) for _ in range(30)]
    for each in rogues:  # all at once, then each one's answer
        each.send(Msg.HELLO, {"name": "rogue", "tags": [], "ops": [], "pid": 1,
                              "secret": "00" * 32})
    for each in rogues:
        assert each.sock.poll(5000)
        assert decode(each.sock.recv_multipart())[0]["refused"]
        each.close()
    assert sum("refused an executor" in r.getMessage() for r in caplog.records) == 1
    _still_clean(run)


@pytest.mark.parametrize("address", ["tcp://192.0.2.7:5555", "tcp://evil.example:5555",
                                     "ipc:///tmp/somewhere"])
def test_a_peer_address_on_another_host_is_refused(run, rogue, address):
    """Else real executors would push task inputs to whatever the rogue names."""
    reason = _refusal(rogue.hello(name="elsewhere", secret=run[0].secret.hex(),
                                  peer_address=address))
    assert "peer address" in reason
    _still_clean(run)


def _task_of(ctl, future) -> int:
    return next(t.id for t in list(ctl._dispatcher._tasks.values()) if future.id in t.outputs)


def test_forged_completions_for_another_executors_task_do_not_count(run, rogue):
    ctl, (a, _), _ = run
    _insider(run, rogue)
    slow = ctl.submit("identity", 5, config={"seconds": 3.0}, executor=a.id)  # past the forgeries
    task = _task_of(ctl, slow)
    output = {"id": slow.id, "nbytes": 1, "inline": pack("forged")[0]}
    forgeries = [
        (Msg.DONE, {"items": [{"task": task, "ok": False, "error": "forged failure"}]}),
        (Msg.DONE, {"items": [{"task": task, "ok": True, "outputs": [output]}]}),
        (Msg.PARTS, {"task": task, "index": 0, "end": 1.0, "outputs": [output]}),
        (Msg.PART, {"task": task, "index": 0, "end": 1.0, "output": output}),
        (Msg.ITEMS, {"task": task, "first": 0, "end": 1.0, "outputs": [output]}),
        (Msg.STREAMS, {"end": 1.0, "tasks": [{"task": task, "index": 0, "outputs": [output]}]}),
    ]
    for kind, fields in forgeries:
        rogue.send(kind, fields)
        (answer,) = rogue.answers(3.0)
        assert answer["t"] == Msg.ERROR and f"{task}" in answer["reason"], answer
    assert slow.result(timeout=30) == 5
    _still_clean(run)


def test_a_forged_value_does_not_answer_a_fetch(run, rogue):
    """The holder is stopped while the fetch waits, so the forgery surely comes first."""
    ctl, (a, _), _ = run
    _insider(run, rogue)
    placed = ctl.put("genuine", executor=a.id)
    os.kill(a.pid, signal.SIGSTOP)
    fetched: list = []
    try:
        fetcher = threading.Thread(target=lambda: fetched.append(ctl.fetch(placed, 30)))
        fetcher.start()
        deadline = time.monotonic() + 10
        while not ctl._dispatcher._fetches and time.monotonic() < deadline:
            time.sleep(0.01)
        (request,) = list(ctl._dispatcher._fetches)
        rogue.send(Msg.VALUE, {"request": request, "meta": {"body": pack("forged")[0]}})
        (answer,) = rogue.answers(3.0)
        assert answer["t"] == Msg.ERROR and "was not sent to" in answer["reason"]
    finally:
        os.kill(a.pid, signal.SIGCONT)
    fetcher.join(30)
    assert fetched == ["genuine"]
    _still_clean(run)


def test_a_ping_for_another_executor_does_not_keep_it_alive(start_cluster):
    """The rogue pings for a hung executor, with no token and with a made-up one: the
    controller answers none of it and declares the executor lost at its heartbeat timeout."""
    ctl, (only,) = start_cluster(1, ping_interval=0.1, ping_timeout=0.8)
    ctl._processes.clear()  # heartbeats alone, as for a remote executor
    future = ctl.submit("sleep", config={"seconds": 30})
    time.sleep(0.2)
    rogue, stop, pongs = Rogue(ctl._heartbeat.address, ctl.secret), threading.Event(), []

    def keep_pinging() -> None:
        while not stop.is_set():
            rogue.send(Msg.PING, {"executor": only.id})
            rogue.send(Msg.PING, {"executor": only.id, "token": "0" * 32})
            pongs.extend(rogue.answers(0.05))

    pinger = threading.Thread(target=keep_pinging)
    pinger.start()
    os.kill(only.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ExecutorLost, match="no heartbeat"):
            future.result(timeout=5)
    finally:
        stop.set()
        pinger.join()
        rogue.close()
        os.kill(only.pid, signal.SIGKILL)
    assert pongs == []


def _executor(ctl, *options: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "executors", "--connect", ctl.address,
                           "--name", "stray", *options], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_an_executor_with_another_runs_secret_exits_saying_so(run):
    ctl = run[0]
    done = _executor(ctl, env={**os.environ, SECRET_ENV: "ab" * 32})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "refused this executor" in lines[0] and "wrong secret" in lines[0]
    _still_clean(run)


def test_a_refusal_in_the_handshake_is_heard_however_late_the_hello_is_built(run, monkeypatch,
                                                                             caplog):
    """libzmq reports a connection's failed handshake once and does not retry it: the executor
    watches the handshake from before it connects and queues its HELLO without blocking, so a
    slow moment after it connects (here the HELLO's encoding, a second late) still hears the
    gate's refusal: no silence, no send blocked on a connection already gone."""
    import executors.process as process
    from executors.optable import OpTable

    encode = process.encode
    monkeypatch.setattr(process, "encode", lambda *a: (time.sleep(1.0), encode(*a))[1])
    stray = process.Executor(connect=run[0].address, name="stray", ops=OpTable(),
                             secret=b"\xab" * 32)
    began, codes = time.monotonic(), []
    with caplog.at_level(logging.ERROR, logger="flowkit.executor"):
        # in a thread, so that a send blocked for good fails this test instead of hanging it
        serving = threading.Thread(target=lambda: codes.append(stray.serve(hello_timeout=8)),
                                   daemon=True)
        serving.start()
        serving.join(timeout=30)
    assert not serving.is_alive(), "the executor is stuck in its HELLO"
    stray.close()
    assert codes == [2] and time.monotonic() - began < 6
    assert "refused this executor" in caplog.text and "wrong secret" in caplog.text
    _still_clean(run)


def test_a_hand_started_executor_joins_with_the_secret_file(run, tmp_path):
    """`flowkit executor --secret-file`: the file the controller wrote, readable by its owner
    alone; the executor joins and serves."""
    ctl = run[0]
    path = ctl.write_secret(tmp_path / "run.secret")
    assert os.stat(path).st_mode & 0o777 == 0o600
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    process = subprocess.Popen([sys.executable, "-m", "executors", "--connect", ctl.address,
                                "--name", "by-hand", "--secret-file", path], env=env,
                               stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while "by-hand" not in {e.name for e in ctl.executors()}:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        (joined,) = [e for e in ctl.executors() if e.name == "by-hand"]
        assert ctl.submit("identity", 11, executor=joined.id).result(timeout=30) == 11
    finally:
        process.kill()
        process.wait()
    ctl.report_lost(joined.id, "the test stopped it")
    deadline = time.monotonic() + 10
    while "by-hand" in {e.name for e in ctl.executors()} and time.monotonic() < deadline:
        time.sleep(0.02)
    _still_clean(run)


def test_a_bad_secret_file_is_one_line(tmp_path):
    (tmp_path / "empty").write_text("")
    done = subprocess.run([sys.executable, "-m", "executors", "--connect", "tcp://127.0.0.1:9",
                           "--secret-file", str(tmp_path / "empty")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "does not hold a run secret" in done.stderr
    assert "Traceback" not in done.stderr



# -- keys pinned to executor names ---------------------------------------------------------------
@pytest.fixture(scope="module")
def pinned_keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys") / "pinned"
    generate_keys(folder, ["exec-0", "exec-1"])
    return Keys.load(folder)


def _stolen(keys: Keys, name: str, address: str) -> Rogue:
    """A rogue holding executor `name`'s key pair (and, an insider, the run's secret)."""
    rogue = Rogue.__new__(Rogue)
    rogue.sock = zmq.Context.instance().socket(zmq.DEALER)
    rogue.sock.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.auth.load_certificate(keys.folder / "executors" / f"{name}.key_secret")
    rogue.sock.curve_publickey, rogue.sock.curve_secretkey = public, secret
    rogue.sock.curve_serverkey = keys.controller_public
    rogue.sock.connect(address)
    return rogue


@pytest.mark.parametrize("speaks_as", ["exec-1", "exec-7"])
def test_a_stolen_executor_key_speaks_for_its_own_executor_only(pinned_keys, speaks_as):
    """Executors with keys pinned to their names run as usual; the holder of exec-0's key
    and of the run's secret can join neither as the live exec-1 nor under a new name."""
    with executor_cluster(2, keys=pinned_keys) as (ctl, executors):
        clean = _legit_run(ctl, executors)
        rogue = _stolen(pinned_keys, "exec-0", ctl.address)
        try:
            reason = _refusal(rogue.hello(name=speaks_as, secret=ctl.secret.hex()))
        finally:
            rogue.close()
        assert "'exec-0''s: a pinned key speaks for its name only" in reason
        assert sorted(e.name for e in ctl.executors()) == ["exec-0", "exec-1"]
        assert _legit_run(ctl, executors) == clean


def test_the_shared_executor_key_may_take_any_name(tmp_path):
    """Without --executors every executor shares one pair, as before: it is not pinned."""
    keys = generate_keys(tmp_path / "shared")
    assert keys.pinned == {} and Keys.load(keys.folder, name="anyone").own_public is None
    with executor_cluster(1, keys=keys, name_prefix="any-name") as (ctl, (only,)):
        assert only.name == "any-name-0"
        assert ctl.submit("identity", 4).result(timeout=30) == 4


def test_keys_generate_writes_a_pinned_pair_per_executor_and_executors_pick_theirs(tmp_path):
    from click.testing import CliRunner

    from flowkit.cli import main

    folder = tmp_path / "keys"
    made = CliRunner().invoke(main, ["keys", "generate", str(folder), "--executors", "2"])
    assert made.exit_code == 0, made.output
    keys = Keys.load(folder)
    assert sorted(keys.pinned.values()) == ["exec-0", "exec-1"] and len(keys.allowed) == 2
    assert all(path.stat().st_mode & 0o777 == 0o600
               for path in (folder / "executors").glob("*.key_secret"))
    bad = CliRunner().invoke(main, ["keys", "generate", str(tmp_path / "k2"),
                                    "--executors", "a,a"])
    assert bad.exit_code == 2 and "distinct executor names" in bad.output
    stranger = CliRunner().invoke(main, ["executor", "--connect", "tcp://127.0.0.1:9",
                                         "--keys", str(folder), "--name", "stranger"])
    assert stranger.exit_code == 2
    assert "holds keys for executors exec-0, exec-1, not for 'stranger'" in stranger.output


def test_flowkit_run_writes_the_secret_for_hand_started_executors_and_says_where(tmp_path):
    from click.testing import CliRunner

    from flowkit.cli import main
    from tests.cli.test_keys_cli import FLOW

    flow, secret = tmp_path / "sums.py", tmp_path / "run.secret"
    flow.write_text(FLOW)
    done = CliRunner().invoke(main, ["run", str(flow), "--no-dashboard", "--steps", "1",
                                     "--secret-file", str(secret)])
    assert done.exit_code == 0, done.output
    assert "flowkit executor --connect tcp://127.0.0.1:" in done.output
    assert f"--secret-file {secret}" in done.output
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text().strip()) == 64


# -- namespace hosts -----------------------------------------------------------------------------
_ROGUE_ON_A_HOST = """
import json, os, sys
import zmq
from flowkit.wire.auth import plain_client
from flowkit.wire.protocol import Msg, decode, encode
address, name, advertised = sys.argv[1:]
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
plain_client(sock, bytes.fromhex(os.environ["SECRET"]))
sock.connect(address)
sock.send_multipart(encode(Msg.HELLO, {"name": name, "tags": [], "ops": ["insider-only"],
                                        "pid": 1, "peer_address": advertised,
                                        "secret": os.environ["SECRET"]}))
answer = decode(sock.recv_multipart())[0] if sock.poll(10000) else {}
print(json.dumps({"t": answer.get("t"), "reason": answer.get("reason")}))
"""


def test_an_insider_on_another_host_cannot_point_peers_at_a_third(namespaces):
    """On namespace hosts: an insider on host b advertising host a's address (where the real
    executor runs) is refused; advertising its own, it joins (the check is the host's)."""
    import json

    from flowkit.runtime.netns import HostExecutors, NamespaceHosts

    with NamespaceHosts(2) as hosts, Controller(bind=hosts.bind, insecure=True) as ctl, \
            HostExecutors(ctl, hosts.hosts[:1]) as (real,):
        clean = ctl.submit("identity", 9, executor=real.id).result(timeout=30)
        a, b = hosts.hosts

        def rogue(name: str, advertised: str) -> dict:
            done = subprocess.run([*b.prefix, sys.executable, "-c", _ROGUE_ON_A_HOST,
                                   ctl.address, name, advertised], capture_output=True,
                                  text=True, timeout=60,
                                  env={**os.environ, "SECRET": ctl.secret.hex()})
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        refused = rogue("elsewhere", f"tcp://{a.address}:5555")
        assert refused["t"] == Msg.ERROR and "not on the host its HELLO came from" in \
            refused["reason"] and b.address in refused["reason"]
        assert rogue("own-host", f"tcp://{b.address}:5555")["t"] == Msg.WELCOME
        assert "elsewhere" not in {e.name for e in ctl.executors()}
        assert ctl.submit("identity", 9, executor=real.id).result(timeout=30) == clean


def test_the_dashboard_shows_executor_names_and_tags_as_they_are_not_as_markup():
    """A HELLO's printable name may still look like rich markup: shown literally, not styled,
    and a stray closing tag breaks nothing."""
    from flowkit.observe import Dashboard, RunStats
    from tests.harness import printed
    from tests.observe.fakes import executor, join

    stats = RunStats()
    join(stats, executor(1, name="[/][blink]x", tags=("[bold]t",)))
    text = printed(Dashboard(stats=stats).render(), width=120)
    assert "[/][blink]x" in text and "[bold]t" in text
