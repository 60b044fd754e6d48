"""`flowkit run --fsdp`: a model whose stages are sharded over two replicas (FSDP) trains as
two whole replicas do, and its checkpoint resumes with FSDP or at one replica without it; a
whole replicas' checkpoint resumes under FSDP [Note: FSDP checkpoints in
executors/torch/fsdp_rows.py]. The settings that cannot work are refused in one line
before anything starts."""

from __future__ import annotations

import pytest
import torch

from tests.cli.runs import PRETRAIN, metrics_lines, refused, run_ok

STEPS = "3"
COUNTS = {"fsdp2": ("--replicas", "2", "--fsdp"), "2": ("--replicas", "2"),
          "1": ("--replicas", "1")}


def _losses(folder, *flags: str) -> list[float]:
    """The per-step losses of a run of the tiny float64 pretraining."""
    run_ok(PRETRAIN, "--executors", "torch", "--steps", STEPS, "--metrics",
           str(folder / "m.jsonl"), *flags)
    return [line["backprop/loss"] for line in metrics_lines(folder / "m.jsonl")]


def _saved_weights(folder) -> dict:
    (path,) = (folder / "w").glob("*.pt")
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The FSDP and the whole replicas' runs, a checkpoint after every step."""
    found = {}
    for name in ("fsdp2", "2"):
        folder = tmp_path_factory.mktemp(f"fsdp-{name}")
        losses = _losses(folder, *COUNTS[name], "--checkpoint-dir", str(folder / "ck"),
                         "--checkpoint-every", "1", "--keep-checkpoints", STEPS,
                         "--save-weights", str(folder / "w"))
        found[name] = (folder / "ck", losses, _saved_weights(folder))
    return found


@pytest.mark.slow
def test_fsdp_replicas_train_and_save_as_whole_replicas(runs):
    """The losses and the saved weights (FSDP: gathered whole for the export)."""
    assert runs["fsdp2"][1] == pytest.approx(runs["2"][1], abs=1e-10)
    fsdp, whole = runs["fsdp2"][2], runs["2"][2]
    assert fsdp.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(fsdp[name], whole[name], rtol=0, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [("fsdp2", "fsdp2"), ("fsdp2", "1"),
                                               ("2", "fsdp2")])
def test_a_checkpoint_resumes_with_or_without_fsdp(runs, tmp_path, before, after):
    """The resumed run's last step has the loss of the run that went on (float64, 1e-10): the
    weights and AdamW states it resumed from are the checkpoint's (the step after one: its
    first step's update reads the AdamW states)."""
    root, losses, _ = runs[before]
    step = sorted(root.iterdir())[0]
    assert step.name.endswith("1")
    resumed = _losses(tmp_path, *COUNTS[after], "--resume", str(step))
    assert resumed[-1] == pytest.approx(losses[-1], abs=1e-10)


@pytest.mark.parametrize(("flags", "says"), [
    (("--fsdp",), "give --replicas 2 or more"),
    (("--fsdp", "--replicas", "2", "--shard-optimizer"), "leave --shard-optimizer"),
])
def test_fsdp_settings_that_cannot_work_are_refused(flags, says):
    out = refused(PRETRAIN, "--executors", "torch", *flags)
    assert says in out and len(out.strip().splitlines()) == 1, out
