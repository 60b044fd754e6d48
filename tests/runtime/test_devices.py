"""Which device each local executor gets [Note: one GPU per executor]: the environment that pins
it, sharing when asked, and the refusal of more GPUs than the machine has, before anything
starts."""

from __future__ import annotations

import pytest

import flowkit
from flowkit import RunConfig
from flowkit.runner.config import RunConfigError
from flowkit.runtime import Controller, LocalExecutors
from flowkit.runtime.devices import DeviceError, gpu_count, local_devices


def visible(devices):
    return [(d.device, d.env.get("CUDA_VISIBLE_DEVICES")) for d in devices]


def test_a_bare_cuda_gives_each_executor_its_own_gpu_seen_as_cuda0():
    assert visible(local_devices("cuda", 2, gpus=2, environ={})) == [
        ("cuda:0", "0"), ("cuda:0", "1")]


def test_one_named_gpu_is_shared_and_a_list_is_cycled():
    assert visible(local_devices("cuda:0", 3, gpus=1, environ={})) == [("cuda:0", "0")] * 3
    assert visible(local_devices("cuda:1,cpu", 3, gpus=2, environ={})) == [
        ("cuda:0", "1"), ("cpu", None), ("cuda:0", "1")]


def test_gpus_are_counted_within_the_parents_visible_devices():
    got = local_devices("cuda:1,cuda:0", 2, environ={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert visible(got) == [("cuda:0", "5"), ("cuda:0", "4")]
    assert [d.gpu for d in got] == [1, 0]


def test_the_cpu_sets_nothing():
    assert visible(local_devices("cpu", 2, environ={})) == [("cpu", None)] * 2
    assert visible(local_devices("", 1, environ={})) == [("cpu", None)]


def test_more_gpus_than_the_machine_has_is_refused_naming_both_numbers():
    with pytest.raises(DeviceError, match=r"--device cuda asks for 2 GPU\(s\) for 2 executor"
                       r"\(s\).*this machine has 1.*--device cuda:0 to share one GPU"):
        local_devices("cuda", 2, gpus=1, environ={})
    with pytest.raises(DeviceError, match=r"asks for 4 GPU\(s\).*has 2.*cuda:0 to cuda:1 only"):
        local_devices("cuda:3", 1, gpus=2, environ={})
    with pytest.raises(DeviceError, match=r"has 0 \(as the driver shows\).*--device cpu"):
        local_devices("cuda:0", 1, gpus=0, environ={})
    with pytest.raises(DeviceError, match="a GPU is cuda:K with K a number"):
        local_devices("cuda:first", 1, gpus=1, environ={})


def test_gpus_are_counted_from_the_visible_devices_or_the_driver(tmp_path):
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "0,2"}, proc=tmp_path) == 2
    assert gpu_count({"CUDA_VISIBLE_DEVICES": ""}, proc=tmp_path) == 0
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "1,-1,3"}, proc=tmp_path) == 1  # as CUDA reads it
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:ca:00.0"):
        (tmp_path / bus).mkdir()
    assert gpu_count({}, proc=tmp_path) == 3


def test_local_executors_start_pinned_to_their_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with Controller() as ctl:
        executors = LocalExecutors(ctl, 2, kind="torch", device="cuda:0")
        assert [executors._env(i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "3"}] * 2
        assert "cuda:0" in executors._command(1)
        with pytest.raises(DeviceError, match="asks for 2 GPU"):
            LocalExecutors(ctl, 2, kind="torch", device="cuda")


def test_a_run_asking_for_missing_gpus_is_refused_before_executors_start(monkeypatch):
    from examples.grpo_sort import flow  # any flow with a model

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RunConfigError, match="asks for 2 GPU.*has 1") as err:
        flowkit.run(flow, RunConfig(device="cuda", dashboard=False))
    assert err.value.setting == "device"


def test_replicas_that_would_share_a_gpu_are_refused_before_executors_start(monkeypatch):
    from examples.grpo_sort import flow

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RunConfigError, match=r"'actor' trains as 2 replicas, and --device "
                       r"cuda:0 puts two of them \(executors 0 and 2, the same stage\) on one "
                       r"GPU: NCCL runs one rank") as err:
        flowkit.run(flow, RunConfig(device="cuda:0", replicas=2, dashboard=False))
    assert err.value.setting == "replicas"
    # two GPUs cycled over 2 stages x 2 replicas: each stage's replicas share one
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RunConfigError, match=r"executors 0 and 2, the same stage"):
        flowkit.run(flow, RunConfig(device="cuda:0,cuda:1", replicas=2, dashboard=False))
    with pytest.raises(RunConfigError, match="asks for 4 GPU"):  # cuda: 4 executors, 2 GPUs
        flowkit.run(flow, RunConfig(device="cuda", replicas=2, dashboard=False))


def test_replicas_on_their_own_gpus_pass():
    from flowkit.runner.run_checks import _shared_gpu

    # 2 stages x 2 replicas: replica 0 on GPU 0 (executors 0, 1), replica 1 on GPU 1 (2, 3)
    devices = local_devices("cuda:0,cuda:0,cuda:1,cuda:1", 4, gpus=2, environ={})
    assert _shared_gpu(2, 2, devices) is None
    assert _shared_gpu(2, 2, local_devices("cuda:0,cuda:1", 4, gpus=2, environ={})) == (0, 2)
    assert _shared_gpu(2, 2, local_devices("cpu", 4, environ={})) is None
