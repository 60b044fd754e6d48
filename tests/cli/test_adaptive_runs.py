"""Adaptive sampling end to end on torch executors [Note: adaptive sampling in
dataflows/rl/adaptive.py], float64 and seeded: every prompt at the flow's n gives the fixed-n
run's samples and parameters; groups of varying size train, and a run stopped and resumed from
a checkpoint gives the straight run's curve, parameters and pass-rate history, exactly; with
partial rollouts the books balance call by call; second rounds train and resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataflows.rl.adaptive import Difficulty
from flowkit.runner.checkpoints.controller_state import read_state
from flowkit.runner.checkpoints.format import RUN_STATE, complete_checkpoints
from flowkit.runner.checkpoints.state_codec import allowed_records
from tests.cli.runs import GRPO, conserved, metrics_lines, run_ok

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

# --no-fuse: microbatches are cut in the items' order, so runs are bit-reproducible
TORCH = ("--executors", "torch", "--no-fuse")
CURVE = ("reward_mean", "response_length_mean", "rollout/samples", "rollout/tokens",
         "groups/samples_max", "groups/zero_advantage_fraction")


def _assert_same_curve(want: Path, got: Path) -> None:
    """Step by step the same samples (exactly) and losses (within 1e-12: the float64 sums of
    a group's microbatches may add in another order)."""
    wanted, gotten = metrics_lines(want), metrics_lines(got)
    assert [line["step"] for line in gotten] == [line["step"] for line in wanted]
    for a, b in zip(wanted, gotten):
        assert [b.get(key) for key in CURVE] == [a.get(key) for key in CURVE]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-12)


def _assert_same_weights(want: Path, got: Path) -> None:
    first = torch.load(want / "actor.pt", weights_only=True)
    second = torch.load(got / "actor.pt", weights_only=True)
    assert first.keys() == second.keys() and first
    for key in first:
        assert (first[key] - second[key]).abs().max().item() < 1e-9, key


def _run(tmp_path: Path, flow: str, name: str, *args: str) -> Path:
    metrics = tmp_path / f"{name}.jsonl"
    run_ok(flow, *TORCH, "--metrics", str(metrics), "--save-weights", str(tmp_path / name),
           *args)
    return metrics


def _difficulty(checkpoint: Path) -> Difficulty:
    records = {**allowed_records(), "dataflows.rl.adaptive:Difficulty": Difficulty}
    state = read_state(checkpoint / RUN_STATE, records)
    return state.feedback[("update_difficulty", "out")]


def test_every_prompt_at_n_gives_the_fixed_n_runs_samples_and_update(tmp_path):
    fixed = _run(tmp_path, GRPO, "fixed", "--steps", "3")
    adaptive = _run(tmp_path, f"{GRPO}:adaptive_at_n", "adaptive", "--steps", "3")
    _assert_same_curve(fixed, adaptive)
    assert all(line["rollout/samples"] == 16 for line in metrics_lines(adaptive))
    _assert_same_weights(tmp_path / "fixed", tmp_path / "adaptive")


def test_varying_groups_train_and_resume_with_their_history_exactly(tmp_path):
    straight = _run(tmp_path, f"{GRPO}:adaptive", "straight", "--steps", "4",
                    "--checkpoint-dir", str(tmp_path / "ck1"), "--checkpoint-every", "1")
    resumed = _run(tmp_path, f"{GRPO}:adaptive", "resumed", "--steps", "2",
                   "--checkpoint-dir", str(tmp_path / "ck2"), "--checkpoint-every", "1")
    _run(tmp_path, f"{GRPO}:adaptive", "resumed", "--steps", "4", "--resume",
         str(tmp_path / "ck2"), "--checkpoint-dir", str(tmp_path / "ck2"),
         "--checkpoint-every", "1")
    _assert_same_curve(straight, resumed)
    lines = metrics_lines(straight)
    assert all(line["rollout/samples"] <= 16 for line in lines)  # the step's budget
    assert max(line["groups/samples_max"] for line in lines) > 4  # sizes varied
    _assert_same_weights(tmp_path / "straight", tmp_path / "resumed")
    last = [complete_checkpoints(tmp_path / ck)[-1] for ck in ("ck1", "ck2")]
    assert [p.name for p in last] == ["step-00000004"] * 2
    history = _difficulty(last[0])
    assert history == _difficulty(last[1])
    assert len(history.prompt_ids) == 6 and sum(history.samples) == sum(
        line["rollout/samples"] for line in lines)


def test_asynchronous_steps_fold_every_steps_samples_into_the_difficulty_across_a_resume(
        tmp_path):
    """With --async each step allocates by, and folds into, the step just before's estimates
    (a chained feedback): over a run stopped and resumed, every step's samples are in the
    history once."""
    ck, run_async = tmp_path / "ck", ("--async", "--max-staleness", "1")
    _run(tmp_path, f"{GRPO}:adaptive", "run", "--steps", "2", *run_async,
         "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    _run(tmp_path, f"{GRPO}:adaptive", "run", "--steps", "5", *run_async, "--resume", str(ck),
         "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    lines = metrics_lines(tmp_path / "run.jsonl")
    assert [line["step"] for line in lines] == list(range(5))
    history = _difficulty(complete_checkpoints(ck)[-1])
    assert sum(history.samples) == sum(line["rollout/samples"] for line in lines)


def test_partial_rollouts_with_adaptive_n_keep_their_books_across_a_resume(tmp_path):
    """oversample=1.5 with --async: each call counts its own samples (its prompt's n), so every
    sample started is trained once, dropped or still carried, through a checkpoint and a
    resume that puts the carried calls back; the difficulty holds every trained sample once."""
    ck, run_async = tmp_path / "ck", ("--async", "--max-staleness", "1")
    _run(tmp_path, f"{GRPO}:adaptive_partial", "run", "--steps", "3", *run_async,
         "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    _run(tmp_path, f"{GRPO}:adaptive_partial", "run", "--steps", "6", *run_async,
         "--resume", str(ck), "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    lines = metrics_lines(tmp_path / "run.jsonl")
    assert [line["step"] for line in lines] == list(range(6))
    assert all(line["generate/taken_groups"] == 4 for line in lines)
    assert sum(line["rollout/resumed"] for line in lines) > 0  # calls were carried
    # a call's size is its prompt's n (2 .. 8), not the flow's 4
    assert any(line["rollout/started"] % 4 for line in lines)
    conserved(lines)
    history = _difficulty(complete_checkpoints(ck)[-1])
    assert sum(history.samples) == sum(line["rollout/samples"] for line in lines)


def test_second_rounds_train_and_resume_with_their_history_exactly(tmp_path):
    """[Note: second rounds in flowkit/runner/second_round.py], fused (a second round needs
    it): every prompt's first 4 samples agree, so each is sampled again; the even prompts'
    groups then differ and train on 8 samples. A run stopped and resumed gives the straight
    run's curve, parameters and pass-rate history, which holds both rounds' samples."""
    fused = ("--executors", "torch")
    runs = {}
    for name, steps, resume in (("straight", 3, False), ("resumed", 2, False),
                                ("resumed", 3, True)):
        ck = tmp_path / f"ck-{name}"
        metrics = tmp_path / f"{name}.jsonl"
        run_ok(f"{GRPO}:second_round", *fused, "--metrics", str(metrics), "--save-weights",
               str(tmp_path / name), "--steps", str(steps), "--checkpoint-dir", str(ck),
               "--checkpoint-every", "1", *(("--resume", str(ck)) if resume else ()))
        runs[name] = metrics
    keys = ("rollout/samples", "generate/second_rounds", "grpo_advantages/second_round_kept",
            "groups/samples_max", "groups/zero_advantage_fraction")
    straight, resumed = metrics_lines(runs["straight"]), metrics_lines(runs["resumed"])
    assert [[line[k] for k in keys] for line in resumed] == \
        [[line[k] for k in keys] for line in straight]
    for a, b in zip(straight, resumed):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-9)
    for line in straight:  # prompts 0-3, then 4, 5, 0, 1, then 2-5: two even ones a step
        assert (line["rollout/samples"], line["generate/second_rounds"]) == (32, 4)
        assert (line["grpo_advantages/second_round_kept"], line["groups/samples_max"]) == (2, 8)
        assert line["update_actor/tokens"] > 0
    _assert_same_weights(tmp_path / "straight", tmp_path / "resumed")
    histories = [_difficulty(complete_checkpoints(tmp_path / f"ck-{name}")[-1])
                 for name in ("straight", "resumed")]
    assert histories[0] == histories[1]
    assert sum(histories[0].samples) == sum(line["rollout/samples"] for line in straight)
