"""The ways weights reach the generating executors [Note: weight sync paths in
flowkit/runner/weight_sync.py]: a broadcast over a process group per stage (gloo here, NCCL
across GPUs) trains as the host path does, with the exporters also loading (colocated, each
the other's receiver) or not (disaggregated), and in an asynchronous run; the choice by what
the executors report; bad settings refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowkit.runner.stepstate import FlowRunError
from flowkit.runner.weight_sync import sync_path
from flowkit.runtime.registry import ExecutorInfo
from tests.cli.runs import GRPO, metrics_lines, refused, run_ok


def _weights(folder: Path) -> dict:
    return torch.load(folder / "actor.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--placement", "colocated"),
                                    ("--placement", "disaggregated"),
                                    ("--placement", "colocated", "--replicas", "2")],
                         ids=["colocated", "disaggregated", "colocated-replicas"])
def test_a_broadcast_sync_trains_as_the_host_path(tmp_path, layout):
    """Colocated, each exporter is the other's receiver; with replicas, a trainer joins its
    weight groups after its step's all-reduce (in its training lane), or the two would wait
    for each other."""
    runs = {}
    for way in ("host", "broadcast"):
        run_ok(GRPO, "--executors", "torch", "--steps", "3", *layout,
               "--weight-sync", way, "--save-weights", str(tmp_path / way),
               "--metrics", str(tmp_path / f"{way}.jsonl"))
        runs[way] = metrics_lines(tmp_path / f"{way}.jsonl")
    host, broadcast = _weights(tmp_path / "host"), _weights(tmp_path / "broadcast")
    assert host.keys() == broadcast.keys()
    for name in host:  # fused runs cut microbatches in finishing order: rounding differs
        torch.testing.assert_close(broadcast[name], host[name], rtol=0, atol=1e-10)
    assert [line["reward_mean"] for line in runs["broadcast"]] == \
        [line["reward_mean"] for line in runs["host"]]
    # the data plane carries the records only: names, shapes, offsets
    for line_host, line_broadcast in zip(runs["host"], runs["broadcast"]):
        assert line_broadcast["actor/sync_bytes"] < line_host["actor/sync_bytes"] / 4


@pytest.mark.slow
def test_a_broadcast_sync_keeps_its_order_in_an_asynchronous_run(tmp_path):
    run_ok(GRPO, "--executors", "torch", "--steps", "4", "--max-staleness", "1",
           "--weight-sync", "broadcast", "--metrics", str(tmp_path / "m.jsonl"))
    lines = metrics_lines(tmp_path / "m.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert all(line["staleness/max"] <= 1 for line in lines)


def test_an_unknown_weight_sync_is_refused():
    assert "'nccl' is not one of 'auto', 'host', 'broadcast'" in refused(
        GRPO, "--weight-sync", "nccl")


def _on(i: int, gpu: str | None) -> ExecutorInfo:
    return ExecutorInfo(id=i, name=f"e{i}", tags=(), ops=frozenset(), pid=i, host="h",
                        device="cpu" if gpu is None else "cuda:0", peer_address="",
                        identity=b"", resources={} if gpu is None else {"gpu": gpu})


@pytest.mark.parametrize(("mode", "gpus", "expected"), [
    ("auto", ["h/0", "h/0", "h/0"], "ipc"),
    ("auto", ["h/0", "h/1", "h/2"], "broadcast"),
    ("auto", ["h/0", "h/1", "h/1"], "host"),  # two targets on one GPU: NCCL takes one rank a GPU
    ("auto", [None, None, None], "host"),
    ("auto", ["h/0", None, "h/1"], "host"),
    ("host", ["h/0", "h/0", "h/0"], "host"),
    ("host", ["h/0", "h/1", "h/2"], "host"),
    ("broadcast", [None, None, None], "broadcast"),  # gloo
    ("broadcast", ["h/0", "h/1", "h/2"], "broadcast"),
])
def test_the_path_follows_the_setting_and_the_gpus_reported(mode, gpus, expected):
    exporter, *targets = [_on(i, gpu) for i, gpu in enumerate(gpus)]
    assert sync_path(mode, [[exporter, *targets]]) == expected


def test_a_broadcast_asked_for_between_executors_on_one_gpu_is_refused_naming_them():
    group = [_on(0, "h/0"), _on(1, "h/0")]
    with pytest.raises(FlowRunError, match="one rank a GPU.*--weight-sync auto"):
        sync_path("broadcast", [group])
