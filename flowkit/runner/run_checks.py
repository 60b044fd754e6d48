"""What a Run refuses before any executor starts, each in one line that says how to fix it:
GPUs the machine lacks or replicas that would share one, stages beyond a model's layers, missing
checkpoint files, and the controller's keys and address."""

from __future__ import annotations

from typing import Any

from flowkit.dsl import Flow
from flowkit.dsl.models import checkpoint_problems, stages_problems
from flowkit.runner.config import RunConfig, RunConfigError
from flowkit.runtime.devices import DeviceError, local_devices
from flowkit.wire.auth import InsecureBindError, Keys, KeysError, check_bind

__all__ = ["check_checkpoints", "check_devices", "check_stages", "run_keys"]


def check_devices(spec: str, count: int, plan: Any) -> None:
    """The local executors' devices, refused here, before any executor starts, where the
    machine lacks the GPUs asked for or the replicas of a model would share one (NCCL runs
    one rank of a group a GPU) [Note: one GPU per executor in flowkit/runtime/devices.py]."""
    try:
        devices = local_devices(spec, count)
    except DeviceError as exc:
        raise RunConfigError("device", str(exc)) from None
    models = {n.model.name: n.model for n in plan if n.model is not None}
    for model in models.values():
        shared = _shared_gpu(model.stages, model.replicas, devices)
        if shared is not None:
            raise RunConfigError(
                "replicas", f"model {model.name!r} trains as {model.replicas} replicas, and "
                f"--device {spec} puts two of them (executors {shared[0]} and {shared[1]}, "
                "the same stage) on one GPU: NCCL runs one rank of a replica group a GPU; "
                "give one GPU per executor (--device cuda) or fewer replicas")


def check_stages(flow: Flow, config: RunConfig) -> None:
    """A model cut into more stages than it has layers, before anything starts: `stages` when
    the run's setting cut it, the flow's own otherwise."""
    for problem in stages_problems(flow):
        raise RunConfigError("stages" if config.stages is not None else "flow", problem)


def _shared_gpu(stages: int, replicas: int, devices: list) -> tuple[int, int] | None:
    """Two executors of one stage's replica group on one GPU, if any: replica r of a model
    trains on the executors r x stages ... (r + 1) x stages - 1, as flowkit/runner/replicas.py
    places them."""
    for stage in range(stages):
        seen: dict[str, int] = {}
        for replica in range(replicas):
            index = replica * stages + stage
            if index >= len(devices) or devices[index].gpu is None:
                continue
            gpu = devices[index].env["CUDA_VISIBLE_DEVICES"]
            if gpu in seen:
                return seen[gpu], index
            seen[gpu] = index
    return None


def check_checkpoints(flow: Flow) -> None:
    for problem in checkpoint_problems(flow):
        raise RunConfigError("flow", problem)


def run_keys(config: RunConfig) -> Keys | None:
    """The controller's keys, and its address checked against them [Note: authenticated
    transport in flowkit/wire/auth.py]."""
    settings = config.controller
    try:
        keys = None if settings.keys is None else Keys.load(settings.keys)
        if keys is not None:
            keys.secret("controller")
    except KeysError as exc:
        raise RunConfigError("controller.keys", str(exc)) from None
    if not settings.bind.startswith(("tcp://", "ipc://")):
        raise RunConfigError("controller.bind", f"{settings.bind!r} is not a zmq address: give "
                             "tcp://HOST:PORT (PORT 0: any free port) or ipc://PATH")
    try:
        check_bind(settings.bind, keys=keys, insecure=settings.insecure, who="the controller")
    except InsecureBindError as exc:
        raise RunConfigError("controller.bind", str(exc)) from None
    return keys
