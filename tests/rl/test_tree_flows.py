"""Tree rollouts in the group flows [Note: tree rollouts in executors/torch/rollout/branching.py],
without executors: a prompt's leaves are its group, their advantages against their siblings, the
step's generated tokens count a shared prefix once, and bad settings are refused when the flow
is built, in one line."""

from __future__ import annotations

import re
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataflows.grpo import grpo_flow
from dataflows.recipes import dr_grpo_flow, gspo_flow
from dataflows.rl.adaptive import AdaptiveSampling
from dataflows.rl.advantages import rloo_advantages
from dataflows.rl.ops import grpo_advantages, rollout_metrics
from dataflows.rl.trees import shared_prefix_weights
from dataflows.rloo import rloo_flow
from executors.torch.rollout.branching import branch_samples
from flowkit.ops.records import Scored

SETTINGS = dict(prompts=4, n=2, max_new_tokens=8, branch_at=(3,), branches=2)


def _leaf(sample: int, reward: float, *, branch_of: int | None = None, shared: int = 0,
          length: int = 6) -> Scored:
    return Scored(prompt_id=0, sample=sample, prompt_tokens=[1], response_tokens=[7] * length,
                  logprobs=[-0.5] * length, reward=reward, branch_of=branch_of,
                  shared_tokens=shared)


# two roots (0, 2), each forked once at depth 3 (1 from 0, 3 from 2)
TREE = [_leaf(0, 1.0), _leaf(1, 0.0, branch_of=0, shared=3), _leaf(2, 0.0),
        _leaf(3, 1.0, branch_of=2, shared=3, length=4)]


@pytest.mark.parametrize("flow", [grpo_flow, dr_grpo_flow, gspo_flow, rloo_flow])
def test_each_group_flow_groups_a_prompts_leaves_whatever_their_number(flow):
    built = flow(**{**SETTINGS, "n": 1} if flow is rloo_flow else SETTINGS)
    (grouped,) = [w for w in built.wires if w.dst_port == "group"]
    assert grouped.adapter.key == "prompt_id" and grouped.adapter.size is None


def test_a_leafs_advantage_is_against_all_its_prompts_leaves():
    rewards = [leaf.reward for leaf in TREE]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    got = [e.advantages[0] for e in grpo_advantages.fn(TREE)]
    assert got == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards], abs=1e-12)


def test_a_prefix_trained_once_weighs_one_over_the_leaves_that_share_it():
    """[Note: tree rollouts' shared prefix]: each leaf of TREE shares its first 3 tokens with
    one other; GRPO's and RLOO's experiences carry the weights with shared_prefix="once", a
    lone sample none, and per leaf (the default) no leaf any."""
    half = [0.5] * 3
    assert shared_prefix_weights(TREE, "once") == {
        (0, 0): half + [1.0] * 3, (0, 1): half + [1.0] * 3, (0, 2): half + [1.0] * 3,
        (0, 3): half + [1.0]}
    for estimator in (grpo_advantages, rloo_advantages):
        once = [e.token_weights for e in estimator.fn(TREE, shared_prefix="once")]
        assert once[1] == half + [1.0] * 3
        assert [e.token_weights for e in estimator.fn(
            [_leaf(0, 1.0), _leaf(1, 0.0)], shared_prefix="once")] == [[], []]
        assert all(e.token_weights == [] for e in estimator.fn(TREE))


@st.composite
def _trees(draw) -> list[Scored]:
    """A prompt's samples as the engine grows them [Note: tree rollouts]: roots at r * k^D, a
    sample that goes on past a depth of `depths` forks into k - 1 more, each of a random
    length past that depth."""
    k = draw(st.integers(1, 3))
    depths = sorted(draw(st.sets(st.integers(1, 6), max_size=3)))
    roots = draw(st.integers(1, 3))
    stride = k ** len(depths) if k > 1 else 1
    samples, todo = [], [(r * stride, None, 0, 0) for r in range(roots)]
    while todo:
        index, parent, shared, level = todo.pop()
        length = draw(st.integers(max(shared, 1), 9))
        samples.append(_leaf(index, 0.0, branch_of=parent, shared=shared, length=length))
        for i, depth in enumerate(depths[level:], start=level):
            if k > 1 and length > depth:
                todo += [(child, index, depth, i + 1)
                         for child in branch_samples(index, depth, depths, k)]
    return samples


@given(_trees())
def test_summed_over_the_leaves_each_token_generated_weighs_one(tree):
    weights = shared_prefix_weights(tree, "once")
    generated = sum(len(s.response_tokens) - s.shared_tokens for s in tree)
    summed = sum(sum(weights.get((0, s.sample), [1.0] * len(s.response_tokens))) for s in tree)
    assert summed == pytest.approx(generated, abs=1e-9)
    assert all(0.0 < w <= 1.0 for row in weights.values() for w in row)
    assert all(len(weights[(0, s.sample)]) == len(s.response_tokens)
               for s in tree if (0, s.sample) in weights)


def test_the_steps_generated_tokens_count_a_shared_prefix_once():
    metrics = rollout_metrics.fn(TREE).values
    assert metrics["rollout/tokens"] == 6 + (6 - 3) + 6 + (4 - 3)
    assert metrics["rollout/branch_saved_tokens"] == 6 and metrics["rollout/branches"] == 2
    assert "rollout/branch_saved_tokens" not in rollout_metrics.fn([TREE[0], TREE[2]]).values


@pytest.mark.parametrize("settings, message", [
    (dict(branch_at=(8,)), "1 error(s) in the sampling settings: branch_at depth 8 must lie in "
                           "1 .. max_new_tokens - 1 = 7"),
    (dict(branches=0), "1 error(s) in the sampling settings: branches must be at least 1"),
    (dict(engine="vllm", branch_entropy=0.5), "1 error(s) in the sampling settings: "
                                              "branch_entropy forks where a token's "
                                              "whole-vocabulary entropy reaches a threshold, "
                                              "and vLLM returns the sampled token's log-prob"),
    (dict(branch_at=(), branch_entropy=0.5), "1 error(s) in the sampling settings: "
                                             "branch_entropy=0.5 picks where tree rollouts "
                                             "fork, and none grow"),
    (dict(max_staleness=1, oversample=2.0), "1 error(s) in the sampling settings: partial "
                                            "rollouts (oversample) carry trees over at fixed "
                                            "depths only"),
    (dict(max_staleness=1, oversample=2.0, stale_segments="drop", branch_entropy=0.5),
     "1 error(s) in the sampling settings: partial rollouts (oversample) carry trees over"),
    (dict(adaptive=AdaptiveSampling(n_min=1, token_budget=10**6)),
     "1 error(s) in the sampling settings: adaptive token_budget costs a prompt's samples at "
     "its mean response length, and a tree's root generates its shared prefix once"),
    (dict(adaptive=AdaptiveSampling(n_min=2, second_round=2)),
     "1 error(s) in the sampling settings: a second round of a tree's prompt would number its "
     "roots on from its first leaves"),
    (dict(policy_loss="gspo", shared_prefix="once"),
     "1 error(s) in the sampling settings: tree rollouts train a shared prefix once by weighing "
     "its tokens, and GSPO's"),
    (dict(loss_agg_mode="seq-mean-token-mean", shared_prefix="once"),
     "1 error(s) in the sampling settings: tree rollouts train a shared prefix once by weighing "
     "its tokens, which loss_agg_mode='seq-mean-token-mean'"),
])
def test_bad_tree_settings_are_refused_in_one_line_when_the_flow_is_built(settings, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)) as raised:
        grpo_flow(**{**SETTINGS, **settings})
    assert "\n" not in str(raised.value)


def test_adaptive_sampling_counts_a_trees_roots_and_rloo_takes_one_root_a_prompt():
    """n_min=1 root: its leaves are the siblings a leave-one-out baseline needs."""
    for make in (grpo_flow, rloo_flow):
        flow = make(**{**SETTINGS, "adaptive": AdaptiveSampling(n_min=1, n_max=3)})
        assert "allocate_samples" in flow.nodes


def test_the_simulator_refuses_a_tree_rather_than_sample_plain_ones():
    from executors.sim.ops import _generate
    from flowkit.ops.records import Prompt
    from tests.harness import op_context

    with pytest.raises(ValueError, match="^simulator executors sample no tree rollouts"):
        _generate(op_context(), Prompt(prompt_id=0, tokens=[1, 2]), n=2, max_new_tokens=4,
                  branch_at=(2,), branches=2)


def test_per_leaf_weighs_nothing_and_an_unknown_setting_is_refused_in_one_line():
    assert shared_prefix_weights(TREE, "per_leaf") == {}
    with pytest.raises(ValueError, match=r"^1 error\(s\) in the sampling settings: "
                                         r"shared_prefix='twice': one of per_leaf, once"):
        grpo_flow(prompts=4, n=2, shared_prefix="twice")


def test_the_gspo_recipe_with_a_tree_trained_once_is_refused_in_one_line():
    with pytest.raises(ValueError, match="GSPO's sequence-level ratio") as raised:
        gspo_flow(**SETTINGS, shared_prefix="once")
    assert "\n" not in str(raised.value)
