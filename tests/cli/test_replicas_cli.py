"""`flowkit run --replicas`: a model trained by two replicas of its pipeline from the command
line, checkpointed, and resumed at the same or another replica count, sharded optimizer states
included, to the run that went on [Note: resuming at another replica count in
flowkit/runner/replicas.py]; the settings that cannot work are refused in one line before
anything starts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.cli.runs import PRETRAIN, metrics_lines, refused, run_ok

STEPS = "3"
COUNTS = {"2": ("--replicas", "2"), "1": ("--replicas", "1"),
          "zero2": ("--replicas", "2", "--shard-optimizer")}


def _run(folder, *flags: str) -> tuple[dict, list[float]]:
    """The weights and the per-step losses of a run of the tiny float64 pretraining."""
    run_ok(PRETRAIN, "--executors", "torch", "--steps", STEPS, "--save-weights",
           str(folder / "w"), "--metrics", str(folder / "m.jsonl"), *flags)
    (path,) = (folder / "w").glob("*.pt")
    losses = [line["backprop/loss"] for line in metrics_lines(folder / "m.jsonl")]
    return torch.load(path, weights_only=True), losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each count's run, a checkpoint after every step."""
    found = {}
    for name, flags in COUNTS.items():
        folder = tmp_path_factory.mktemp(f"replicas-{name}")
        weights, losses = _run(folder, *flags, "--checkpoint-dir", str(folder / "ck"),
                               "--checkpoint-every", "1")
        found[name] = (folder / "ck", weights, losses)
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [
    ("2", "2"), ("2", "1"), ("1", "2"),
    # sharded states merged for one replica, or for two that do not shard, and cut for two
    ("zero2", "1"), ("zero2", "2"), ("1", "zero2")])
def test_a_checkpoint_resumes_at_the_same_or_another_replica_count(runs, tmp_path, before,
                                                                   after):
    """The resumed run ends with the parameters and the losses of the run that went on as the
    checkpoint's (float64, 1e-10)."""
    root, whole, losses = runs[before]
    step = sorted(root.iterdir())[0]  # not the last: the resumed run has a step to take
    resumed, resumed_losses = _run(tmp_path, *COUNTS[after], "--resume", str(step))
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=1e-10)
    assert resumed_losses[-1] == pytest.approx(losses[-1], abs=1e-10)


@pytest.mark.slow
def test_each_replica_checkpoints_its_own_shard_of_the_optimizer_states(runs):
    root, _, _ = runs["zero2"]
    step = sorted(root.iterdir())[-1]
    held = []  # each file's parameters with AdamW moments, by unsplit name
    for part in sorted((step / "executors").iterdir()):
        with safe_open(str(part), "pt") as file:
            (entry,) = [m for m in json.loads(file.metadata()["flowkit"])["models"]
                        if m["trains"]]
            assert entry["shards"], part
            held.append({k.rpartition("/exp_avg/")[2] for k in file.keys() if "/exp_avg/" in k})
    # exec-0 and exec-2 hold stage 0 of replicas 0 and 1, exec-1 and exec-3 stage 1: each
    # replica keeps a part of the stage's optimizer states, none all of them, and the two
    # parts are the whole stage's
    assert len(held) == 4
    for first, second in ((held[0], held[2]), (held[1], held[3])):
        assert first and second and not first & second


def test_fewer_microbatches_than_replicas_are_refused():
    out = refused(PRETRAIN, "--replicas", "8", "--executors", "torch")
    assert "runs 4 microbatch(es) a step" in out and "--microbatches 8" in out
