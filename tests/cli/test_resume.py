"""Run checkpoints [Note: run checkpoints in flowkit/runner/checkpoints/format.py]: a synchronous
run stopped and resumed from a checkpoint gives the curve and the final parameters of the run that
was never stopped (float64, seeded), on torch executors (pipeline pretraining, GRPO) and on the
simulator; the resume bugs of other RL frameworks, each a test named after it (those of asynchronous
runs, and the ones only they can have, in test_async_resume.py); bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flowkit.cli import main
from flowkit.runner.checkpoints.format import complete_checkpoints
from tests.cli.runs import GRPO, PRETRAIN, interrupted, one_step_checkpoint
from tests.cli.runs import metrics_lines as _lines
from tests.cli.runs import run_ok as _run


def _curve(path: Path, *keys: str) -> list[tuple]:
    return [(line["step"], *(line.get(key) for key in keys)) for line in _lines(path)]


def _same_weights(a: Path, b: Path) -> None:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert first.keys() == second.keys()
    assert first and all(torch.equal(first[k], second[k]) for k in first), \
        max((first[k] - second[k]).abs().max().item() for k in first)


def _straight_and_resumed(tmp_path: Path, flow: str, *options: str, steps: int, stop: int,
                          weights: bool = True) -> tuple[Path, Path]:
    """Metrics of `steps` steps straight, and of `stop` steps then a resume up to `steps`."""
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    save = ["--save-weights", str(tmp_path / "w1")] if weights else []
    _run(flow, *options, "--steps", str(steps), "--metrics", str(straight), *save)
    checkpoints = tmp_path / "ck"
    _run(flow, *options, "--steps", str(stop), "--metrics", str(resumed),
         "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1")
    save = ["--save-weights", str(tmp_path / "w2")] if weights else []
    output = _run(flow, *options, "--steps", str(steps), "--metrics", str(resumed),
                  "--resume", str(checkpoints), *save)
    assert f"(step {stop} of {steps})" in output
    return straight, resumed


@pytest.mark.slow
def test_pipeline_pretraining_resumed_gives_the_same_losses_and_parameters(tmp_path):
    straight, resumed = _straight_and_resumed(tmp_path, PRETRAIN, "--executors", "torch",
                                              steps=6, stop=3)
    assert _curve(resumed, "loss") == _curve(straight, "loss")
    assert len({loss for _, loss in _curve(straight, "loss")}) == 6  # it trains
    _same_weights(tmp_path / "w1" / "gpt.pt", tmp_path / "w2" / "gpt.pt")


@pytest.mark.slow
@pytest.mark.parametrize("flow", [GRPO, f"{GRPO}:reference_in_forward"])
def test_grpo_on_torch_executors_resumed_gives_the_same_curve_and_parameters(tmp_path, flow):
    # --no-fuse: microbatches are cut in the items' order, not as they arrive, so the run is
    # bit-reproducible (fused, the gradient's float64 sum depends on arrival order); the
    # reference in the forward is held on the last stage's executor and checkpointed there
    straight, resumed = _straight_and_resumed(tmp_path, flow, "--executors", "torch",
                                              "--no-fuse", steps=4, stop=2)
    keys = ("loss", "reward_mean", "response_length_mean")
    assert _curve(resumed, *keys) == _curve(straight, *keys)
    _same_weights(tmp_path / "w1" / "actor.pt", tmp_path / "w2" / "actor.pt")


@pytest.mark.slow
def test_grpo_on_the_simulator_resumed_gives_the_same_curve(tmp_path):
    # --no-fuse as above: fused, which samples share a microbatch follows their finishing
    # order, and the simulator's loss is a token-weighted mean over microbatches
    straight, resumed = _straight_and_resumed(tmp_path, GRPO, "--executors", "sim",
                                              "--no-fuse", steps=4, stop=2, weights=False)
    keys = ("loss", "reward_mean", "response_length_mean", "update_actor/tokens")
    assert _curve(resumed, *keys) == _curve(straight, *keys)


# -- the resume bugs of other frameworks, by name -----------------------------------------------
@pytest.mark.slow
def test_step_counter_not_incremented_twice_after_resume_verl(tmp_path):
    checkpoints, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    _run(PRETRAIN, "--executors", "sim", "--steps", "2", "--metrics", str(metrics),
         "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2")
    _run(PRETRAIN, "--executors", "sim", "--steps", "5", "--metrics", str(metrics),
         "--resume", str(checkpoints), "--checkpoint-dir", str(checkpoints),
         "--checkpoint-every", "1")
    assert [line["step"] for line in _lines(metrics)] == [0, 1, 2, 3, 4]
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["step-00000004",
                                                                   "step-00000005"]


@pytest.mark.slow
def test_no_steps_skipped_at_a_checkpoint_boundary_verl_and_no_cursor_runs_ahead_nemo_rl(
        tmp_path):
    """The sources derive a step's data from the step alone (no cursor to run ahead of the
    work): the resumed run's first step reads the data the straight run's step read, seen in
    the tokens each step trained on and its loss (float64: any other batch differs)."""
    straight, resumed = _straight_and_resumed(tmp_path, PRETRAIN, "--executors", "torch",
                                              steps=4, stop=2, weights=False)
    assert _curve(resumed, "loss", "backprop/tokens") == _curve(straight, "loss",
                                                                "backprop/tokens")


@pytest.mark.slow
def test_metrics_not_duplicated_after_resume(tmp_path):
    """An interrupted run wrote lines past its last checkpoint: the resumed run replaces them,
    so every step has one line, the checkpoint's lines unchanged (their times too)."""
    checkpoints, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    _run(PRETRAIN, "--executors", "sim", "--steps", "4", "--metrics", str(metrics),
         "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2",
         "--keep-checkpoints", "1")  # step 4's: the newest
    before = _lines(metrics)
    # as if the run had died after writing steps 4 and 5's lines, past its checkpoint at 4
    extra = [{**before[-1], "step": 4}, {**before[-1], "step": 5}]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in before + extra))
    _run(PRETRAIN, "--executors", "sim", "--steps", "6", "--metrics", str(metrics),
         "--resume", str(checkpoints))
    after = _lines(metrics)
    assert [line["step"] for line in after] == list(range(6))
    assert after[:4] == before


# -- bad input ------------------------------------------------------------------------------------
def _error(flow: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["run", flow, "--no-dashboard", *args])
    assert result.exit_code == 1, result.output
    return result.output


@pytest.fixture(scope="module")
def pretrain_checkpoint(tmp_path_factory) -> Path:
    return one_step_checkpoint(tmp_path_factory.mktemp("pretrain") / "ck", PRETRAIN, "sim")


def test_resume_from_a_directory_that_is_not_a_checkpoint_names_it(tmp_path):
    (tmp_path / "junk").mkdir()
    output = _error(PRETRAIN, "--executors", "sim", "--resume", str(tmp_path / "junk"))
    assert "not a run checkpoint" in output and "junk" in output


@pytest.mark.slow
def test_resume_from_a_checkpoint_of_another_flow_names_both(pretrain_checkpoint):
    output = _error(GRPO, "--executors", "sim", "--resume", str(pretrain_checkpoint))
    assert "a checkpoint of flow 'pretrain', not of 'grpo'" in output


@pytest.mark.slow
def test_resume_from_a_checkpoint_of_a_model_of_another_shape_names_the_difference(
        pretrain_checkpoint):
    output = _error(f"{PRETRAIN}:wider", "--executors", "sim", "--resume",
                    str(pretrain_checkpoint))
    assert "model 'gpt' differs: n_embd=16 in the checkpoint, 32 in this run" in output


@pytest.mark.slow
def test_resume_with_other_executors_names_them(pretrain_checkpoint):
    output = _error(PRETRAIN, "--executors", "sim", "-n", "3", "--resume",
                    str(pretrain_checkpoint))
    assert "written by executors 2 sim" in output and "this run starts 3 sim" in output


# -- Ctrl-C ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_with_checkpoints_finishes_the_step_checkpoints_it_and_the_resume_goes_on(
        tmp_path):
    metrics, checkpoints = tmp_path / "m.jsonl", tmp_path / "ck"
    # the step running at Ctrl-C finishes and is written: `done` counts it
    output, done = interrupted(PRETRAIN, "--executors", "torch", "--checkpoint-dir",
                               str(checkpoints), metrics=metrics)
    assert f"interrupted at step {done}" in output
    (folder,) = complete_checkpoints(checkpoints)
    assert folder.name == f"step-{done:08d}"
    output = _run(PRETRAIN, "--executors", "torch", "--steps", str(done + 1), "--metrics",
                  str(metrics), "--resume", str(checkpoints))
    assert f"(step {done} of {done + 1})" in output
    assert [line["step"] for line in _lines(metrics)] == list(range(done + 1))
