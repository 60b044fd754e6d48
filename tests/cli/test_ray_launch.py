"""The Ray launcher [Note: Ray executors in flowkit/runtime/raylaunch.py] on a local Ray head on
loopback, started once for the module: flows under `--launcher ray` reach the parameters of the
same runs on local executors (float64); a killed actor fails the step at once, naming its
executor, and leaves no process or segment; restarts replace it; what Ray cannot do is a clear
error, not a hang."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from flowkit.cli._flows import load_checked_flow
from flowkit.planner.lower import lower_flow
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.flowrun import FlowRunError, FlowRunner
from flowkit.runner.setup import executor_tags
from flowkit.runtime import Controller, ExecutorLost
from flowkit.runtime.launch import LaunchError
from flowkit.runtime.raylaunch import RayExecutors, RaySettings
from flowkit.wire.shm import leftover_segments
from tests.cli.runs import GRPO, PRETRAIN, metrics_lines, refused, run_ok
from tests.harness import requires

requires("ray", "ray")
pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

TORCH = ("--executors", "torch")
STEPS = "8"  # pretraining: enough steps (~0.1 s each) for a kill to land while it runs


@pytest.fixture(scope="module", autouse=True)
def ray_head():
    """A local Ray head on loopback for the module; launchers use it as it is. Ray is imported
    here, not to collect the module (tests.harness.requires says why)."""
    import ray

    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="WARNING")
    yield
    ray.shutdown()


def _weights(folder: Path, model: str) -> dict:
    return torch.load(folder / f"{model}.pt", weights_only=True)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), max((a[k] - b[k]).abs().max().item()
                                                         for k in a)


def _run_both(tmp_path: Path, flow: str, model: str, *args: str) -> tuple[dict, dict]:
    """The weights `flow` trains with local executors and with Ray actors."""
    found = []
    for launcher in ("local", "ray"):
        folder = tmp_path / launcher
        run_ok(flow, *TORCH, *args, "--launcher", launcher, "--save-weights", str(folder))
        found.append(_weights(folder, model))
    return found[0], found[1]


@pytest.fixture(scope="module")
def local_pretrain(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("local-pretrain")
    run_ok(PRETRAIN, *TORCH, "--steps", STEPS, "--save-weights", str(folder))
    return _weights(folder, "gpt")


def test_pipeline_pretraining_under_ray_reaches_the_local_parameters(tmp_path, local_pretrain):
    run_ok(PRETRAIN, *TORCH, "--steps", STEPS, "--launcher", "ray", "--save-weights",
           str(tmp_path))
    _same(local_pretrain, _weights(tmp_path, "gpt"))


def test_two_replicas_under_ray_reach_the_local_parameters(tmp_path):
    """Replicas' groups rendezvous at the peer address an actor advertises, as local ones do."""
    local, under_ray = _run_both(tmp_path, PRETRAIN, "gpt", "--steps", "2", "--stages", "1",
                                 "--replicas", "2")
    _same(local, under_ray)


def test_grpo_under_ray_reaches_the_local_parameters(tmp_path):
    # --no-fuse: microbatches in the items' order, so the float64 sums are bit-reproducible
    local, under_ray = _run_both(tmp_path, GRPO, "actor", "--no-fuse", "--steps", "2")
    _same(local, under_ray)


def _executor_processes(address: str) -> list[int]:
    """Executor processes still running for the controller at `address`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"executors" in command and address.encode() in command:
            found.append(int(entry.name))
    return found


def test_a_killed_actor_fails_the_step_long_before_the_ping_timeout_naming_it_and_leaves_nothing():
    plan = lower_flow(load_checked_flow(PRETRAIN))
    with Controller() as ctl:
        launcher = RayExecutors(ctl, 2, kind="sim", tags=executor_tags(plan, 2, None))
        pids = [e.pid for e in launcher.start()]
        # slow simulated ops: the step takes seconds, so the kill lands in it
        runner = FlowRunner(ctl, plan, sim_costs=SimCosts.parse("F=0.2,B=0.2,W=0.2"))
        killed: dict[str, float] = {}

        def kill() -> None:
            import ray

            time.sleep(0.6)
            killed["at"] = time.monotonic()
            ray.kill(launcher.actors["exec-1"])

        threading.Thread(target=kill).start()
        try:
            with pytest.raises((FlowRunError, ExecutorLost)) as failure:
                runner.run_step(0)
            failed = time.monotonic()
        finally:
            ctl.shutdown()
            launcher.stop()
    # Ray's death notice, not the 30 s ping timeout: under 1 s on a quiet machine, but Ray's own
    # notice took 2.4 s on a loaded one (CI, two test workers), so the bound is a third of it
    assert failed - killed["at"] < 10.0
    # whichever notice comes first names it: Ray's actor death, or the controller's own sight of
    # the executor process killed with its actor (-9); never the heartbeat timeout
    message = str(failure.value)
    assert "exec-1" in message and "no heartbeat" not in message
    assert "Ray actor died" in message or "process exited with code -9" in message
    assert _executor_processes(ctl.address) == []
    assert leftover_segments(pids) == []


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _ours(pid: int) -> bool:
    """Whether process `pid` descends from this test process (the local Ray head it started
    and so its workers do): the machine may run other flowkit executors."""
    while pid > 1:
        pid = _parent(pid)
        if pid == os.getpid():
            return True
    return False


def _kill_actor_process(name: str, metrics: Path) -> int:
    """SIGKILL the Ray worker process of executor `name`'s actor (the executor's parent), as
    when a worker or its node dies; the steps `metrics` held then. The newest such executor:
    an earlier test's may still be on its way out."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            if not (b"executors" in command and name.encode() in command
                    and _ours(int(entry.name))):
                continue
            started = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[19])
            found.append((started, _parent(int(entry.name))))
        except (OSError, ValueError):
            continue
    if not found:
        raise AssertionError(f"no executor process named {name} under this test's Ray")
    os.kill(max(found)[1], signal.SIGKILL)
    return len(metrics_lines(metrics))


def test_restarts_replace_a_dead_actor_and_the_run_ends_as_without_faults(tmp_path,
                                                                         local_pretrain):
    metrics = tmp_path / "m.jsonl"

    killed = []

    def kill_after_a_step() -> None:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        killed.append(_kill_actor_process("exec-0", metrics))

    killer = threading.Thread(target=kill_after_a_step)
    killer.start()
    run_ok(PRETRAIN, *TORCH, "--steps", STEPS, "--launcher", "ray", "--max-restarts", "1",
           "--metrics", str(metrics), "--save-weights", str(tmp_path / "w"))
    killer.join()
    lines = metrics_lines(metrics)
    assert killed and killed[0] < len(lines), "the run ended before the kill"
    assert lines[-1]["restarts"] == 1
    _same(local_pretrain, _weights(tmp_path / "w", "gpt"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_ray_address_is_a_usage_error_before_anything_starts():
    address = f"127.0.0.1:{_free_port()}"
    output = refused(PRETRAIN, "--launcher", "ray", "--ray-address", address)
    assert f"no Ray cluster answers at {address}" in output and "--ray-address" in output


def test_ray_options_without_the_ray_launcher_are_a_usage_error():
    output = refused(PRETRAIN, "--ray-strategy", "SPREAD")
    assert "--ray-strategy is for --launcher ray" in output


def test_without_ray_installed_the_error_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    output = refused(PRETRAIN, "--launcher", "ray")
    assert "pip install 'flowkit[ray]'" in output


def test_gpu_bundles_on_a_cluster_without_gpus_are_an_error_after_the_timeout_not_a_hang():
    with Controller() as ctl:
        launcher = RayExecutors(ctl, 2, device="cuda",
                                settings=RaySettings(placement_timeout=1.0))
        started = time.monotonic()
        with pytest.raises(LaunchError) as failure:
            launcher.start()
    assert time.monotonic() - started < 10
    assert "2 x {'GPU': 1.0}" in str(failure.value) and "the cluster has" in str(failure.value)
    from ray.util import placement_group_table

    states = {g["state"] for g in placement_group_table().values()}
    assert states <= {"REMOVED"}, states  # the pending group was removed, like every other


def test_the_launch_bench_times_both_launchers_side_by_side():
    from benchmarks.launch import run_launch_bench

    figures = run_launch_bench(executors=1, rounds=1, kind="base")
    assert figures["fresh_start_s"] > 0 and figures["ray_start_s"] > 0
    assert figures["ray_start_ratio"] == figures["ray_start_s"] / figures["fresh_start_s"]
    assert figures["ray_replace_s"] > 0
    assert figures["ray_init_s"] is None  # the module's Ray, used as it is


def test_an_executor_that_exits_before_connecting_is_an_error_naming_it_at_once():
    with Controller() as ctl:
        launcher = RayExecutors(ctl, 1, kind="no-such-kind", startup_timeout=30)
        started = time.monotonic()
        with pytest.raises(LaunchError) as failure:
            launcher.start()
    assert time.monotonic() - started < 15  # not the start-up timeout
    assert "executor exec-0 ended before it connected" in str(failure.value)
    assert "exited with code 2" in str(failure.value)  # click's usage error: --kind
