"""Asynchronous runs [Note: asynchronous steps in flowkit/runner/flowrun.py]: with η = 0 the
synchronous result; with η >= 1 generation runs ahead and no trained token lags the weights it
updates by more than η, read from the metrics; bad settings fail before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from flowkit.cli import main
from tests.cli.runs import GRPO, PRETRAIN, conserved
from tests.cli.runs import metrics_lines as _lines
from tests.cli.runs import refused as _refused
from tests.cli.runs import run_ok as _run


def _weights(folder: Path) -> dict:
    return torch.load(folder / "actor.pt", weights_only=True)


@pytest.mark.slow
def test_async_with_no_staleness_gives_the_synchronous_parameters(tmp_path):
    _run(GRPO, "--executors", "torch", "--steps", "3", "--save-weights", str(tmp_path / "sync"))
    _run(GRPO, "--executors", "torch", "--steps", "3", "--async", "--max-staleness", "0",
         "--save-weights", str(tmp_path / "async"), "--metrics", str(tmp_path / "m.jsonl"))
    sync, asynchronous = _weights(tmp_path / "sync"), _weights(tmp_path / "async")
    assert sync.keys() == asynchronous.keys()
    for name in sync:  # fused runs cut microbatches in finishing order: rounding differs
        torch.testing.assert_close(asynchronous[name], sync[name], rtol=0, atol=1e-10)
    lines = _lines(tmp_path / "m.jsonl")
    assert [line["staleness/max"] for line in lines] == [0, 0, 0]
    assert not any("update_actor/behav_weight_mean" in line for line in lines)  # plain GRPO


@pytest.mark.slow
@pytest.mark.parametrize("bound", [1, 2])
def test_no_trained_token_lags_its_update_by_more_than_the_bound(tmp_path, bound):
    metrics = tmp_path / "m.jsonl"
    _run(GRPO, "--executors", "torch", "--steps", "4", "--max-staleness", str(bound),
         "--metrics", str(metrics))
    lines = _lines(metrics)
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    for line in lines:
        versions = [int(v) for v in line["staleness/versions"]]
        assert line["step"] - bound <= min(versions) and max(versions) <= line["step"]
        assert line["staleness/max"] <= bound
        # the decoupled objective's importance weights, reported per step (cap 5)
        assert 0 < line["update_actor/behav_weight_mean"] <= 5
        assert 0 <= line["update_actor/behav_capfrac"] <= 1
    # generation did run ahead: step 1 trained on samples of the weights before step 0's update
    assert lines[1]["staleness/max"] >= 1


@pytest.mark.slow
def test_a_flow_setting_runs_asynchronously_and_sync_overrides_it(tmp_path):
    flow = tmp_path / "flow.py"
    flow.write_text(Path(GRPO).read_text().replace("source_config={\"digits\": 3})",
                                                   "source_config={\"digits\": 3}, "
                                                   "max_staleness=1)"))
    metrics = tmp_path / "m.jsonl"
    _run(str(flow), "--executors", "sim", "--steps", "3", "--metrics", str(metrics))
    assert max(line["staleness/max"] for line in _lines(metrics)) == 1
    _run(str(flow), "--executors", "sim", "--steps", "3", "--sync", "--metrics", str(metrics))
    assert max(line["staleness/max"] for line in _lines(metrics)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("bound", [0, 1])
def test_the_trace_shows_the_weights_versions_of_every_generated_sample(tmp_path, bound):
    """Each generate span's `items` are its samples' Rollout.version_span: [prompt_id, sample,
    first version, last version, length]. On sim a request samples with the newest weights
    it was given: -1 (the initial ones, as good as version 0) at step 0; at step s, version s
    (step s - 1's update makes it) or, running ahead, one at most `bound` versions older."""
    trace = tmp_path / "t.json"
    _run(GRPO, "--executors", "sim", "--steps", "3", "--max-staleness", str(bound),
         "--trace", str(trace))
    spans = [e for e in json.loads(trace.read_text())["traceEvents"]
             if e["ph"] == "X" and e["args"].get("node") == "generate"]
    assert sorted({span["args"]["step"] for span in spans}) == [0, 1, 2]
    assert len(spans) == 3 * 4  # a call per prompt, 4 prompts a step
    stale = 0
    for span in spans:
        step, items = span["args"]["step"], span["args"]["items"]
        assert sorted(sample for _, sample, *_ in items) == [0, 1, 2, 3]  # n = 4, each once
        for prompt_id, _, first, last, length in items:
            assert prompt_id == items[0][0] and 1 <= length <= 6
            assert first in (-1, *range(step + 1)) and first <= last <= max(step, -1)
            assert max(first, 0) >= step - bound and (step > 0 or last == -1)
            stale += max(first, 0) < step
    assert (stale > 0) == (bound > 0)  # running ahead, some samples come from older weights


def test_a_negative_bound_is_refused():
    output = _refused(GRPO, "--executors", "sim", "--async", "--max-staleness", "-1")
    assert "--max-staleness" in output and "-1" in output


def test_async_on_a_flow_without_a_weights_feedback_is_refused_before_anything_starts():
    output = _refused(PRETRAIN, "--executors", "sim", "--async")
    assert "feedback edge that syncs weights" in output
    assert "executors:" not in output


def test_sync_with_a_bound_is_refused():
    assert "drop --sync" in _refused(GRPO, "--executors", "sim", "--sync",
                                     "--max-staleness", "1")


def test_async_with_several_updates_per_step_is_refused(tmp_path):
    flow = tmp_path / "ppo.py"
    flow.write_text("from dataflows.ppo import ppo_flow\n"
                    "flow = ppo_flow(prompts=2, n=2, ppo_epochs=2, max_new_tokens=4)\n")
    output = _refused(str(flow), "--executors", "sim", "--max-staleness", "1")
    assert "minibatch rounds" in output and "--max-staleness 0" in output


def test_a_flow_with_a_bad_bound_fails_its_check(tmp_path):
    flow = tmp_path / "flow.py"
    flow.write_text("from dataflows.grpo import grpo_flow\nflow = grpo_flow(max_staleness=-2)\n")
    result = CliRunner().invoke(main, ["check", str(flow)])
    assert result.exit_code != 0 and "max_staleness=-2" in result.output


# -- partial rollouts [Note: partial rollouts in flowkit/runner/partial.py] -----------------
def _oversampled(tmp_path: Path, oversample: float, stale: str = "recompute") -> str:
    flow = tmp_path / "partial.py"
    flow.write_text(Path(GRPO).read_text().replace(
        "source_config={\"digits\": 3})",
        f"source_config={{\"digits\": 3}}, oversample={oversample}, stale_segments={stale!r})"))
    return str(flow)


def _conserved(lines: list[dict], n: int = 4) -> None:
    """Every sample started is trained once, dropped, or still carried after the last step;
    a step trains the groups it took."""
    assert all(line["rollout/samples"] == line["generate/taken_groups"] * n for line in lines)
    conserved(lines)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sim", "torch"])
def test_partial_rollouts_train_every_sample_once_within_the_bound(tmp_path, kind):
    metrics = tmp_path / "m.jsonl"
    _run(_oversampled(tmp_path, 2.0), "--executors", kind, "--steps", "5",
         "--max-staleness", "1", "--metrics", str(metrics), "--sim-cost", "token=0.002")
    lines = _lines(metrics)
    _conserved(lines)
    assert lines[0]["rollout/carried_over"] == 16  # 8 prompts generate, 4 groups train
    assert all(line["generate/taken_groups"] == 4 for line in lines)
    assert all(line["staleness/max"] <= 1 for line in lines)
    assert lines[-1]["rollout/prompts_unused"] == 4  # the carried groups took their places


@pytest.mark.slow
def test_stale_carried_groups_can_be_dropped(tmp_path):
    metrics = tmp_path / "m.jsonl"
    _run(_oversampled(tmp_path, 2.0, "drop"), "--executors", "torch", "--steps", "4",
         "--max-staleness", "1", "--metrics", str(metrics))
    lines = _lines(metrics)
    _conserved(lines)
    assert sum(line["rollout/dropped"] for line in lines) > 0
    assert all(line["staleness/max"] <= 1 for line in lines)


def test_partial_rollouts_need_an_asynchronous_run(tmp_path):
    output = _refused(_oversampled(tmp_path, 1.5), "--executors", "sim", "--steps", "2")
    assert "partial rollouts" in output and "--max-staleness >= 1" in output
    output = _refused(_oversampled(tmp_path, 1.5), "--executors", "sim", "--max-staleness", "0")
    assert "partial rollouts" in output


def test_bad_partial_settings_fail_the_flow_check(tmp_path):
    output = CliRunner().invoke(main, ["check", _oversampled(tmp_path, 1.5, "keep")]).output
    assert "stale_segments" in output and "recompute" in output
    flow = tmp_path / "under.py"
    flow.write_text("from dataflows.grpo import grpo_flow\nflow = grpo_flow(oversample=0.5)\n")
    output = CliRunner().invoke(main, ["check", str(flow)]).output
    assert "oversample=0.5" in output
