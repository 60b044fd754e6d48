"""Tree rollouts end to end on torch executors [Note: tree rollouts in
executors/torch/rollout/branching.py], float64 and seeded: a depth with one branch gives the
plain run's samples and parameters; branched leaves train, grouped by prompt, their shared
prefixes counted once in the step's generated tokens; branching by entropy at 0 nats is the
fixed-depth run [Note: entropy branching]; asynchronous trees keep the staleness bound and
resume their open step's saved leaves; partial rollouts carry trees over and grow them on;
adaptive sampling spreads a step's roots by pass rate, at the flow's n is the fixed run, and
with partial rollouts keeps its books."""

from __future__ import annotations

import pytest

from flowkit.runner.checkpoints.format import complete_checkpoints
from tests.cli.runs import GRPO, conserved, metrics_lines
from tests.cli.test_adaptive_runs import (
    _assert_same_curve,
    _assert_same_weights,
    _difficulty,
    _run,
)

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes


def test_a_depth_with_one_branch_gives_the_plain_runs_samples_and_update(tmp_path):
    plain = _run(tmp_path, GRPO, "plain", "--steps", "2")
    unbranched = _run(tmp_path, f"{GRPO}:tree_unbranched", "unbranched", "--steps", "2")
    _assert_same_curve(plain, unbranched)
    _assert_same_weights(tmp_path / "plain", tmp_path / "unbranched")


@pytest.fixture(scope="module")
def tree_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tree")
    return folder, _run(folder, f"{GRPO}:tree", "tree", "--steps", "2")


def test_branched_leaves_train_as_groups_and_count_their_shared_prefix_once(tree_run):
    lines = metrics_lines(tree_run[1])
    assert len(lines) == 2
    for line in lines:
        # 4 roots and their branches: up to 3 a root, fewer where a root ends before a depth
        assert line["rollout/samples"] == 4 + line["rollout/branches"]
        assert 1 <= line["rollout/branches"] <= 12
        generated = line["response_length_mean"] * line["rollout/samples"]
        assert line["rollout/tokens"] + line["rollout/branch_saved_tokens"] == generated
        assert line["rollout/branch_saved_tokens"] > 0


def test_branching_by_entropy_at_zero_nats_is_the_fixed_depth_run(tmp_path, tree_run):
    folder, fixed = tree_run
    uncertain = _run(tmp_path, f"{GRPO}:tree_entropy", "entropy", "--steps", "2")
    _assert_same_curve(fixed, uncertain)
    _assert_same_weights(folder / "tree", tmp_path / "entropy")


def test_adaptive_trees_at_the_flows_n_are_its_fixed_trees(tmp_path, tree_run):
    folder, fixed = tree_run
    at_n = _run(tmp_path, f"{GRPO}:tree_adaptive_at_n", "at_n", "--steps", "2")
    _assert_same_curve(fixed, at_n)
    _assert_same_weights(folder / "tree", tmp_path / "at_n")


def test_adaptive_trees_spread_the_roots_and_resume_with_their_history_exactly(tmp_path):
    """8 roots a step over 4 prompts by pass rate, each growing up to 4 leaves; the pass rates
    count leaves. Stopped after step 2 and resumed: the straight run's curve, parameters and
    history."""
    every = ("--checkpoint-every", "1")
    straight = _run(tmp_path, f"{GRPO}:tree_adaptive", "straight", "--steps", "3",
                    "--checkpoint-dir", str(tmp_path / "ck1"), *every)
    resumed = _run(tmp_path, f"{GRPO}:tree_adaptive", "resumed", "--steps", "2",
                   "--checkpoint-dir", str(tmp_path / "ck2"), *every)
    _run(tmp_path, f"{GRPO}:tree_adaptive", "resumed", "--steps", "3", "--resume",
         str(tmp_path / "ck2"), "--checkpoint-dir", str(tmp_path / "ck2"), *every)
    _assert_same_curve(straight, resumed)
    _assert_same_weights(tmp_path / "straight", tmp_path / "resumed")
    lines = metrics_lines(straight)
    assert all(line["rollout/samples"] <= 8 * 4 for line in lines)
    assert max(line["groups/samples_max"] for line in lines) > 4  # a prompt drew 2+ roots
    last = [complete_checkpoints(tmp_path / ck)[-1] for ck in ("ck1", "ck2")]
    history = _difficulty(last[0])
    assert history == _difficulty(last[1])
    assert sum(history.samples) == sum(line["rollout/samples"] for line in lines)


def test_asynchronous_trees_keep_the_bound_and_resume_the_open_steps_leaves(tmp_path):
    """--max-staleness 1: every step trains its roots and each branch they grew, no token more
    than a version behind; resumed from the checkpoint after step 2 (step 2 open there), the
    open step trains the leaves it saved, as the writer did."""
    ck, run_async = tmp_path / "ck", ("--async", "--max-staleness", "1")
    writer = metrics_lines(_run(tmp_path, f"{GRPO}:tree", "writer", "--steps", "4", *run_async,
                                "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
                                "--keep-checkpoints", "10"))
    resumed = metrics_lines(_run(tmp_path, f"{GRPO}:tree", "resumed", "--steps", "4",
                                 *run_async, "--resume", str(ck / "step-00000002")))
    assert [line["step"] for line in writer] == [0, 1, 2, 3] == [line["step"] for line in resumed]
    for line in writer + resumed:
        assert line["rollout/samples"] == 4 + line["rollout/branches"]
        assert line["staleness/max"] <= 1
    curve = ("loss", "reward_mean", "rollout/samples", "rollout/branches", "staleness/versions")
    assert [[line[key] for key in curve] for line in resumed[:3]] == [
        [line[key] for key in curve] for line in writer[:3]]


def test_partial_rollouts_carry_trees_over_and_grow_them_on(tmp_path):
    """oversample 1.5 with --async: the trees a step does not take are carried over (cut, if
    unfinished) and go on in the next step, or drop whole when stale; every sample started or
    grown trains once, is dropped or is carried. A cut tree growing on into the uninterrupted
    one: tests/torch/test_tree_rollouts.py."""
    lines = metrics_lines(_run(tmp_path, f"{GRPO}:tree_partial", "partial", "--steps", "6",
                               "--async", "--max-staleness", "1"))
    assert len(lines) == 6
    assert all(line["generate/taken_groups"] == 4 for line in lines)
    assert sum(line["rollout/resumed"] for line in lines) > 0
    conserved(lines)
    for line in lines:
        # 4 whole trees a step: 4 roots and the branches they grew
        assert line["rollout/samples"] == 4 + line["rollout/branches"]
        assert line["staleness/max"] <= 1


def test_adaptive_trees_with_partial_rollouts_keep_their_books_across_a_resume(tmp_path):
    """Roots spread by pass rate (1 to 4 a prompt) and trees carried over (oversample 1.5,
    --async): every root started and branch grown trains once, is dropped whole when stale,
    or is still carried, through a checkpoint and a resume that puts the carried trees back;
    the difficulty holds every trained leaf once."""
    ck, run_async = tmp_path / "ck", ("--async", "--max-staleness", "1")
    flow = f"{GRPO}:tree_adaptive_partial"
    _run(tmp_path, flow, "run", "--steps", "3", *run_async, "--checkpoint-dir", str(ck),
         "--checkpoint-every", "1")
    _run(tmp_path, flow, "run", "--steps", "6", *run_async, "--resume", str(ck),
         "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    lines = metrics_lines(tmp_path / "run.jsonl")
    assert [line["step"] for line in lines] == list(range(6))
    assert all(line["generate/taken_groups"] == 4 for line in lines)
    assert sum(line["rollout/resumed"] for line in lines) > 0  # trees were carried
    assert max(line["groups/samples_max"] for line in lines) > 4  # a prompt drew 2+ roots
    conserved(lines)
    history = _difficulty(complete_checkpoints(ck)[-1])
    assert sum(history.samples) == sum(line["rollout/samples"] for line in lines)
