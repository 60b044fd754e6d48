"""Settings an executor reads from its environment, without torch: on/off switches, and which
GPU its device is, for the controller to find executors that share one."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["gpu_identity", "switch"]

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off setting from the environment: 1/true/yes/on or 0/false/no/off, anything else
    (or nothing) the default."""
    word = environ.get(name, "").strip().lower()
    return True if word in _ON else False if word in _OFF else default


def gpu_identity(device: str, host: str, environ: Mapping[str, str]) -> str | None:
    """Which of its host's GPUs `device` is ("HOST/ENTRY", the CUDA_VISIBLE_DEVICES entry or
    the ordinal), reported to the controller so that it picks how weights reach the executors
    on GPUs [Note: weight sync paths in flowkit/runner/weight_sync.py]; None for a CPU, or for
    an ordinal this process cannot see. The launchers name every executor's GPU one way; one
    named two ways (an ordinal here, a UUID there) would look like two GPUs: CUDA IPC missed,
    or a broadcast that NCCL refuses (it sees one GPU twice) and `--weight-sync host` avoids.
    A reader checks the GPU's own UUID before it opens anything shared on it."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    if not (index or "0").isdigit():
        return None
    ordinal = int(index or 0)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return f"{host}/{ordinal}"
    entries = [entry.strip() for entry in visible.split(",")]
    return f"{host}/{entries[ordinal]}" if ordinal < len(entries) and entries[ordinal] else None
