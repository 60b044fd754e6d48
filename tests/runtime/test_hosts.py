"""Executors on other hosts [Note: hosts in flowkit/wire/shm.py]: host ids decide what shares
memory, bytes to another host go as chunked frames, and on real separate hosts (network
namespaces joined by veth pairs, flowkit/runtime/netns.py) a pipeline trains to the same
parameters as on one host. The namespace tests skip, saying why, where namespaces cannot be made."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from executors.serve import route_source
from flowkit.runtime import Controller
from flowkit.runtime.netns import Host, HostExecutors, NamespaceHosts, unavailable
from flowkit.wire.shm import ENV_HOST_ID, host_id, leftover_segments
from tests.harness import executor_cluster
from tests.torch.test_pipeline_training import _train_plain

MiB = 1 << 20
torch.set_num_threads(1)  # two shared cores: executors and this process one thread each


def _pattern(nbytes: int) -> torch.Tensor:
    """What the built-in op make_tensor makes: byte i is i % 251."""
    return torch.arange(251, dtype=torch.uint8).repeat(nbytes // 251 + 1)[:nbytes]


def _move(ctl, source, target, nbytes: int) -> torch.Tensor:
    made = ctl.submit("make_tensor", config={"nbytes": nbytes}, executor=source.id)
    moved = ctl.submit("identity", made, executor=target.id)
    assert ctl.submit("nbytes", moved, executor=target.id).result(timeout=60) == nbytes
    return moved.result(timeout=60)


# -- host ids ------------------------------------------------------------------------------------
def test_the_host_id_is_the_shared_memory_identity_unless_a_launcher_gives_one(monkeypatch):
    monkeypatch.delenv(ENV_HOST_ID, raising=False)
    default = host_id()
    with open("/proc/sys/kernel/random/boot_id") as file:
        assert default == f"{file.read().strip()}/{os.stat('/dev/shm').st_dev}"
    monkeypatch.setenv(ENV_HOST_ID, "rack4-node17")
    assert host_id() == "rack4-node17"


def test_a_local_controller_gets_loopback_peer_sockets():
    assert route_source("tcp://127.0.0.1:5555") == "127.0.0.1"
    assert route_source("ipc:///tmp/flowkit-x") == "127.0.0.1"


@contextlib.contextmanager
def _hosts_cluster(placement: list[Host], **controller):
    with Controller(**controller) as ctl, HostExecutors(ctl, placement) as infos:
        yield ctl, infos
        pids = [info.pid for info in infos]
    assert leftover_segments(pids) == []


@pytest.mark.slow
def test_executors_with_other_host_ids_move_64_mib_as_chunked_frames_not_shared_memory():
    with _hosts_cluster([Host(id="host-x"), Host(id="host-y")]) as (ctl, (x, y)):
        assert (x.host_id, y.host_id) == ("host-x", "host-y")
        assert torch.equal(_move(ctl, x, y, 64 * MiB), _pattern(64 * MiB))
        assert torch.equal(_move(ctl, y, x, 3 * MiB + 5), _pattern(3 * MiB + 5))
        assert leftover_segments([x.pid, y.pid]) == []  # nothing was lent: it all went as frames


@pytest.mark.slow
def test_receive_buffers_are_reused_only_once_the_tensors_on_them_are_freed():
    with _hosts_cluster([Host(id="host-x"), Host(id="host-y")]) as (ctl, (x, y)):
        kept = []
        for i in range(8):
            value = torch.full((MiB // 4,), float(i), dtype=torch.float64)  # 2 MiB each
            moved = ctl.submit("identity", ctl.put(value, executor=x.id), executor=y.id)
            assert ctl.submit("nbytes", moved, executor=y.id).result(timeout=30) == 2 * MiB
            if i % 2 == 0:
                kept.append((i, moved))  # the odd ones are freed on y: their buffers go back
            time.sleep(0.05)  # frees go out in batches
        for i, moved in kept:
            assert torch.equal(moved.result(timeout=30),
                               torch.full((MiB // 4,), float(i), dtype=torch.float64)), i


@pytest.mark.slow
def test_executors_with_one_host_id_share_memory():
    with _hosts_cluster([Host(id="host-x"), Host(id="host-x")]) as (ctl, (x, y)):
        assert torch.equal(_move(ctl, x, y, 4 * MiB), _pattern(4 * MiB))
        assert leftover_segments([x.pid])  # lent to y


# -- real separate hosts: network namespaces -----------------------------------------------------
def test_a_machine_without_iproute2_is_told_why_there_are_no_namespace_hosts(monkeypatch,
                                                                              tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert unavailable() == "iproute2's `ip` is not installed"


needs_namespaces = pytest.mark.usefixtures("namespaces")


@pytest.fixture(scope="module")
def two_hosts(namespaces):
    """Two namespace hosts, a controller bound on the bridge by its interface name, and a torch
    executor on each host (exec-0 on a, exec-1 on b). Checks that nothing is left after."""
    with NamespaceHosts(2) as hosts:
        with Controller(bind=f"tcp://{hosts.bridge}:0", insecure=True) as ctl, HostExecutors(
                ctl, hosts.hosts, kind="torch", tags=("train",)) as infos:
            processes = [p for p in ctl._processes.values()]
            yield hosts, ctl, infos
    assert hosts.leftovers() == []
    assert all(p.poll() is not None for p in processes)
    assert leftover_segments(p.pid for p in processes) == []


@pytest.mark.slow
@needs_namespaces
def test_the_controller_binds_the_interface_it_is_given_and_executors_join_from_each_host(
        two_hosts):
    hosts, ctl, (a, b) = two_hosts
    assert ctl.address.startswith(f"tcp://{hosts.gateway}:")
    assert [a.host_id, b.host_id] == [host.id for host in hosts.hosts]
    # each binds its data socket on its own host's address, the one it reached the controller from
    assert a.peer_address.startswith(f"tcp://{hosts.hosts[0].address}:")
    assert b.peer_address.startswith(f"tcp://{hosts.hosts[1].address}:")


@needs_namespaces
def test_a_64_mib_tensor_crosses_between_namespace_hosts_both_ways(two_hosts):
    _, ctl, (a, b) = two_hosts
    assert torch.equal(_move(ctl, a, b, 64 * MiB), _pattern(64 * MiB))
    assert torch.equal(_move(ctl, b, a, 5 * MiB + 3), _pattern(5 * MiB + 3))
    assert leftover_segments([a.pid, b.pid]) == []


@needs_namespaces
def test_a_namespace_is_no_host_of_its_own_without_a_host_id(two_hosts):
    """Why the launcher gives host ids: a namespace shares /dev/shm with the machine, so the
    default id inside one is the machine's."""
    hosts, _, _ = two_hosts
    inside = subprocess.run(
        [*hosts.hosts[0].prefix, sys.executable, "-c",
         "from flowkit.wire.shm import host_id; print(host_id())"],
        capture_output=True, text=True, timeout=60, check=True,
        env={k: v for k, v in os.environ.items() if k != ENV_HOST_ID})
    assert inside.stdout.strip() == host_id()


@pytest.mark.slow
@needs_namespaces
def test_a_pipeline_split_across_two_hosts_trains_to_the_one_host_parameters(two_hosts):
    _, ctl, _ = two_hosts
    across, placed = _train(ctl, "zb-h1")
    assert [e.host_id for e in placed] == [host.id for host in two_hosts[0].hosts]
    with executor_cluster(2, kind="torch", tags=("train",)) as (one_host, _):
        local, placed = _train(one_host, "zb-h1")
    assert len({e.host_id for e in placed}) == 1
    losses, params = across
    assert losses == local[0]
    for stage, named in params.items():
        for name, value in named.items():
            assert torch.equal(value, local[1][stage][name]), f"stage {stage} {name}"
    model, plain_losses = _train_plain(torch.float64)  # and both are the plain loop's
    assert losses == pytest.approx(plain_losses, abs=1e-10)


def _train(ctl, schedule: str) -> tuple[tuple[list, dict], list]:
    """(losses, parameters by stage) of pipeline training on `ctl`'s executors, and the
    executors of stage 0 and 1."""
    from dataflows.pretrain import pretrain_flow
    from flowkit.planner.lower import lower_flow
    from flowkit.runner.flowrun import FlowRunner
    from tests.torch import test_pipeline_training as reference

    flow = pretrain_flow(corpus=reference.CORPUS, stages=2, microbatches=reference.MICROBATCHES,
                         schedule=schedule, batch_size=reference.SEQUENCES,
                         seq_len=reference.SEQ_LEN,
                         gpt={**reference.GPT_CONFIG, "dtype": "float64", "seed": 3},
                         model_name="gpt", **reference.HPARAMS)
    runner = FlowRunner(ctl, lower_flow(flow))
    losses = [runner.run_step(step).metrics["backprop/loss"] for step in range(reference.STEPS)]
    _, spec = runner.trained["gpt"]
    placed = runner.placement["gpt"]
    params = {stage: ctl.submit("stage_parameters", config={**spec, "stage": stage},
                                executor=placed[stage].id).result(timeout=30)
              for stage in range(2)}
    return (losses, params), placed


@pytest.mark.slow
@needs_namespaces
def test_hosts_are_removed_when_the_block_fails_leaving_no_process_or_segment():
    with pytest.raises(RuntimeError, match="on purpose"), NamespaceHosts(2) as hosts:
        with Controller(bind=hosts.bind, insecure=True) as ctl, HostExecutors(
                ctl, hosts.hosts) as (a, b):
            processes = list(ctl._processes.values())
            made = ctl.submit("make_tensor", config={"nbytes": 2 * MiB}, executor=a.id)
            ctl.submit("identity", made, executor=b.id).result(timeout=30)
            raise RuntimeError("failed on purpose")
    assert hosts.leftovers() == []
    assert all(p.poll() is not None for p in processes)
    assert leftover_segments(p.pid for p in processes) == []


def _ours(pid: int) -> set[str]:
    """Namespaces and links that process `pid`'s NamespaceHosts made and are still there."""
    from flowkit.runtime.netns import _links, _namespaces

    return {name for name in _namespaces() | _links()
            if name.startswith((f"fk-{pid}-", f"fk{pid}s"))}


def _left_open(then: str) -> subprocess.Popen:
    """A process that makes two namespace hosts, never leaves them, then runs `then`."""
    script = ("from flowkit.runtime.netns import NamespaceHosts\n"
              "NamespaceHosts(2).create()\n"
              f"print('made', flush=True)\n{then}\n")
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "made"
    return process


@pytest.mark.slow
@needs_namespaces
def test_hosts_never_left_are_removed_at_exit_and_after_a_kill_by_the_next_hosts():
    exited = _left_open("import sys; sys.exit(0)")
    assert exited.wait(timeout=30) == 0
    assert _ours(exited.pid) == set()
    killed = _left_open("import time; time.sleep(60)")
    assert _ours(killed.pid)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    with NamespaceHosts(1):
        deadline = time.monotonic() + 10  # a deleted namespace's links go asynchronously
        while _ours(killed.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _ours(killed.pid) == set()
