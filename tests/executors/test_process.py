"""The executor process: it runs what its controller sends and refuses anything else without
harm (malformed frames, instructions from a peer, an output it cannot send), and it exits with its
controller, started by LocalExecutors or by hand (`flowkit executor --connect`, as on another
host)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch

from flowkit.dsl.load import import_flow_file
from flowkit.runtime import Controller, RemoteError
from flowkit.wire.protocol import PROTOCOL_VERSION, Msg, encode
from flowkit.wire.serialize import pack
from tests.harness import dealer, executor_cluster, process_of
from tests.runner import flowdefs

FLOWDEFS = str(Path(flowdefs.__file__))


@pytest.fixture(scope="module")
def cluster():
    """Shared: every test here leaves its executors serving, which is what each checks."""
    with executor_cluster(2, code=[FLOWDEFS]) as started:
        yield started


def test_malformed_frames_get_an_error_reply_and_the_executor_keeps_serving(cluster):
    ctl, (first, _) = cluster
    # talk to the executor's data socket directly, past its gate
    peer = dealer(first.peer_address, secret=ctl.secret)
    tensor_body, _ = pack(torch.zeros(16))
    bad_messages = [
        [b"\x00\xffgarbage"],
        [msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": "run", "tasks": []})],
        encode(Msg.RUN, {"tasks": [{"id": 1, "op": "noop"}]}),  # task misses fields
        encode(Msg.DATA, {"object": 5, "meta": {"body": b"\xc7\x05\x01\x83"}}),  # truncated
        encode(Msg.DATA, {"object": 6, "meta": {"body": tensor_body}}, [b"short"]),  # truncated
    ]
    for message in bad_messages:
        peer.send_multipart(message)
    time.sleep(0.3)
    assert ctl.submit("identity", 11, executor=first.id).result(timeout=5) == 11
    peer.close()


def test_only_the_controller_gives_instructions_and_unknown_ops_fail_on_the_executor(cluster):
    ctl, (first, _) = cluster
    peer = dealer(first.peer_address, secret=ctl.secret)
    task = {"id": 999_999, "op": "sleep", "config": {"seconds": 5}, "inputs": [], "outputs": []}
    peer.send_multipart(encode(Msg.RUN, {"tasks": [task]}))  # a peer may not run tasks
    peer.close()
    # an op the executor does not have, sent as the controller would: a failed completion
    with ctl._driving():
        ctl._dispatcher._send(ctl._dispatcher.executor(first.id), Msg.RUN, {"tasks": [
            {**task, "op": "rm_rf", "id": 999_998}]})
    time.sleep(0.3)
    started = time.monotonic()
    assert ctl.submit("identity", 12, executor=first.id).result(timeout=5) == 12
    assert time.monotonic() - started < 2  # it did not sleep 5 s for the peer


def test_an_output_that_cannot_be_sent_fails_its_task_and_the_executor_keeps_serving(cluster):
    ctl, _ = cluster
    target = f"{import_flow_file(Path(FLOWDEFS)).__name__}:unsendable"
    for _ in range(2):  # on both executors, or twice on one: either way it keeps serving
        with pytest.raises(RemoteError, match="cannot be sent"):
            ctl.submit("python", config={"target": target}).result(timeout=5)
    assert ctl.submit("identity", 3).result(timeout=5) == 3


def test_an_executor_exits_when_its_controller_dies(start_cluster):
    ctl, (only,) = start_cluster(1, ping_interval=0.1, ping_timeout=0.6)
    ctl._heartbeat.stop()  # the controller goes silent without saying shutdown
    assert process_of(ctl, only).wait(timeout=5) == 3


def test_a_hand_started_executor_joins_serves_and_exits_with_its_controller():
    ctl = Controller()
    env = {**os.environ, "FLOWKIT_CONTROLLER": ctl.address,  # --connect from the environment
           **ctl.executor_env()}
    process = subprocess.Popen(
        [sys.executable, "-m", "flowkit", "executor", "--tags", "gpu,train", "--kind", "sim",
         "--name", "by-hand"], env=env, stdin=subprocess.DEVNULL)
    try:
        (info,) = ctl.wait_for_executors(1, timeout=60)
        assert (info.name, info.tags) == ("by-hand", ("gpu", "train"))
        assert {"F", "B", "W", "generate", "noop"} <= info.ops
        stats = ctl.submit("F", config={"seconds": 0.001, "last": True, "tokens": 5},
                           tags=["gpu"])
        assert stats.result(timeout=10).tokens == 5
    finally:
        ctl.shutdown()
        assert process.wait(timeout=10) == 0


def test_executor_without_a_controller_address_is_a_usage_error():
    env = {k: v for k, v in os.environ.items() if k != "FLOWKIT_CONTROLLER"}
    result = subprocess.run([sys.executable, "-m", "flowkit", "executor"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--connect" in result.stderr
