"""Adaptive samples per prompt [Note: adaptive sampling in dataflows/rl/adaptive.py], without
executors: how a budget is spread by pass rate, the pass-rate history, the advantages of groups
of varying size against a hand computation, the metrics, and bad settings refused when the flow
is built, in one line each."""

from __future__ import annotations

import statistics

import pytest
from click.testing import CliRunner

from dataflows.grpo import grpo_flow
from dataflows.recipes import dr_grpo_flow, gspo_flow
from dataflows.rl.adaptive import (
    AdaptiveSampling,
    Difficulty,
    allocate_samples,
    sample_counts,
    update_difficulty,
    within_tokens,
)
from dataflows.rl.advantages import rloo_advantages
from dataflows.rl.ops import group_metrics, grpo_advantages, rollout_metrics
from dataflows.rloo import rloo_flow
from flowkit.cli import main
from flowkit.ops.records import Prompt, Scored

SETTINGS = dict(prompts=4, n=4, max_new_tokens=6)


def _scored(prompt_id: int, sample: int, reward: float, length: int = 3) -> Scored:
    return Scored(prompt_id=prompt_id, sample=sample, prompt_tokens=[1], response_tokens=[7] *
                  length, logprobs=[-0.5] * length, reward=reward)


# -- the allocation ------------------------------------------------------------------------------
@pytest.mark.parametrize("allocation", ["xrpo", "dars"])
def test_equal_pass_rates_and_the_fixed_budget_give_every_prompt_n(allocation):
    assert sample_counts([0.3] * 5, budget=40, n_min=2, n_max=16, allocation=allocation) == [8] * 5


def test_uncertain_prompts_get_the_samples_and_settled_ones_n_min():
    # XRPO's uncertainty p(1-p): 0 and 1 are settled; 0.5 weighs 0.25, 0.2 weighs 0.16
    counts = sample_counts([0.0, 1.0, 0.5, 0.2], budget=24, n_min=2, n_max=16)
    assert counts[:2] == [2, 2] and sum(counts) == 24
    assert counts[2:] == [2 + 10, 2 + 6]  # the 16 left, 0.25 : 0.16 -> 9.76, 6.24: 9 + 1, 6


def test_dars_gives_the_hard_prompts_more_and_the_solved_ones_n_min():
    counts = sample_counts([0.0, 1.0, 0.5], budget=12, n_min=2, n_max=16, allocation="dars")
    assert counts == [2 + 4, 2, 2 + 2]  # the 6 left by 1 - p: 1 : 0.5


def test_a_capped_prompt_leaves_its_share_to_the_others():
    counts = sample_counts([0.5, 0.5, 0.1], budget=30, n_min=2, n_max=8)
    assert counts == [8, 8, 8]  # BroRL's breadth capped; the rest of the budget is not spent
    counts = sample_counts([0.5, 0.1, 0.1], budget=20, n_min=2, n_max=8)
    assert counts[0] == 8 and sum(counts) == 20


def test_a_token_budget_cuts_the_largest_groups_first_never_below_n_min():
    assert within_tokens([8, 4, 2], [5.0, 5.0, 5.0], [0.25, 0.1, 0.0], token_budget=60,
                         n_min=2) == [6, 4, 2]
    assert within_tokens([8, 4], [10.0, 10.0], [0.25, 0.1], token_budget=1, n_min=2) == [2, 2]


def test_allocate_samples_reads_the_history_and_an_unseen_prompt_gets_the_prior():
    prompts = [Prompt(prompt_id=p, tokens=[1, 2]) for p in (3, 9, 4)]
    known = Difficulty(prompt_ids=[3, 9], pass_rates=[1.0, 0.0], lengths=[2.0, 2.0],
                       samples=[8, 8])
    made = list(allocate_samples.fn(prompts, known, budget=12, n_min=2, n_max=16))
    assert [(p.prompt_id, p.n) for p in made] == [(3, 2), (9, 2), (4, 8)]
    first = list(allocate_samples.fn(prompts, None, budget=12, n_min=2, n_max=16))
    assert [p.n for p in first] == [4, 4, 4]


def test_the_history_is_an_ema_of_each_prompts_pass_rate_and_length():
    step0 = update_difficulty.fn([_scored(1, 0, 1.0, 2), _scored(1, 1, 0.0, 4),
                                  _scored(2, 0, 1.0, 3)], None, ema=0.25)
    assert step0 == Difficulty(prompt_ids=[1, 2], pass_rates=[0.5, 1.0], lengths=[3.0, 3.0],
                               samples=[2, 1])
    step1 = update_difficulty.fn([_scored(1, 0, 1.0, 7)], step0, ema=0.25)
    assert step1.pass_rates == [0.75 * 0.5 + 0.25 * 1.0, 1.0]
    assert step1.lengths == [0.75 * 3.0 + 0.25 * 7.0, 3.0] and step1.samples == [3, 1]


def test_a_sample_passes_on_its_task_reward_at_the_threshold():
    shaped = Scored(prompt_id=0, sample=0, prompt_tokens=[1], response_tokens=[2],
                    logprobs=[0.0], reward=0.4, task_reward=1.0)  # an overlong penalty took 0.6
    assert update_difficulty.fn([shaped], None).pass_rates == [1.0]
    assert update_difficulty.fn([_scored(0, 0, 0.9)], None, pass_reward=1.0).pass_rates == [0.0]


# -- groups of varying size ----------------------------------------------------------------------
GROUPS = {0: [1.0, 0.0, 0.0], 1: [1.0, 1.0, 0.0, 1.0, 0.0], 2: [0.0, 1.0]}


def _group(prompt_id: int) -> list[Scored]:
    return [_scored(prompt_id, k, r) for k, r in enumerate(GROUPS[prompt_id])]


@pytest.mark.parametrize("scale", [True, False])  # GRPO (and GSPO's), Dr. GRPO's
def test_grpo_advantages_of_groups_of_varying_size_are_each_groups_own(scale):
    for prompt_id, rewards in GROUPS.items():
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        want = [(r - mean) / (std + 1e-6) if scale else r - mean for r in rewards]
        got = [e.advantages[0] for e in grpo_advantages.fn(_group(prompt_id),
                                                          scale_rewards=scale)]
        assert got == pytest.approx(want, abs=1e-12)


def test_rloo_advantages_of_groups_of_varying_size_leave_one_out_of_their_own_group():
    for prompt_id, rewards in GROUPS.items():
        n = len(rewards)
        want = [r - (sum(rewards) - r) / (n - 1) for r in rewards]
        got = [e.advantages[0] for e in rloo_advantages.fn(_group(prompt_id))]
        assert got == pytest.approx(want, abs=1e-12)


def test_metrics_count_zero_advantage_groups_and_generated_tokens():
    samples = _group(0) + [_scored(5, k, 1.0, 2) for k in range(4)] + [_scored(6, 0, 0.0)]
    # prompt 5's group is all 1.0: zero advantage, 8 of the 20 tokens
    want = {"groups/zero_advantage_fraction": 0.5,
            "groups/zero_advantage_tokens_fraction": 8 / 20, "groups/samples_mean": 8 / 3,
            "groups/samples_max": 4.0, "groups/reward_mean": (1 / 3 + 1.0 + 0.0) / 3}
    assert group_metrics(samples) == pytest.approx(want)
    metrics = rollout_metrics.fn(samples).values
    assert metrics["rollout/tokens"] == 3 * 3 + 4 * 2 + 3
    assert group_metrics([_scored(0, 0, 1.0)]) == {}  # one sample a prompt: no groups


# -- the flows -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flow", [grpo_flow, dr_grpo_flow, gspo_flow, rloo_flow])
def test_each_group_flow_takes_adaptive_sampling_and_groups_by_prompt_of_any_size(flow):
    built = flow(adaptive=AdaptiveSampling(), **SETTINGS)
    assert {"allocate_samples", "update_difficulty"} <= set(built.nodes)
    (grouped,) = [w for w in built.wires if w.dst_port == "group"]
    assert grouped.adapter.key == "prompt_id" and grouped.adapter.size is None
    assert "difficulty" in built.feedbacks


@pytest.mark.parametrize("flow, settings, message", [
    (grpo_flow, dict(adaptive=AdaptiveSampling(budget=7)),
     "adaptive budget=7 samples is smaller than 2 sample(s) (n_min) for each of the step's 4"),
    (grpo_flow, dict(adaptive=AdaptiveSampling(budget=3, n_min=1)),
     "adaptive budget=3 samples is smaller than 1 sample(s)"),
    (rloo_flow, dict(adaptive=AdaptiveSampling(n_min=1)),
     "adaptive n_min=1 makes groups of one sample, and rloo_flow's leave-one-out baseline needs"),
    (grpo_flow, dict(adaptive=AdaptiveSampling(token_budget=40)),
     "adaptive token_budget=40 cannot pay for n_min=2 sample(s) of max_new_tokens=6"),
    (grpo_flow, dict(adaptive=AdaptiveSampling(allocation="uniform")),
     "adaptive allocation='uniform': choose one of xrpo, dars"),
    (grpo_flow, dict(adaptive=AdaptiveSampling(), filter_groups=True),
     "adaptive sampling allocates a step's samples before they are drawn, and filter_groups "
     "draws rounds"),
])
def test_bad_settings_are_refused_when_the_flow_is_built(flow, settings, message):
    with pytest.raises(ValueError, match="^" + _literal(message)):
        flow(**{**SETTINGS, **settings})


@pytest.mark.parametrize("flow", [grpo_flow, rloo_flow])
def test_partial_rollouts_with_adaptive_n_build(flow):
    """Each call counts its own samples in the partial-rollout books (flowkit/runner/
    partial.py): oversample is no longer refused with adaptive sampling."""
    built = flow(**{**SETTINGS, "adaptive": AdaptiveSampling(), "oversample": 1.5,
                    "max_staleness": 1})
    assert "difficulty" in built.feedbacks


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_flowkit_run_refuses_a_bad_budget_in_one_line_before_the_run(tmp_path):
    """The flow file raises when it builds the flow: the CLI's error names the file, and the
    reason is its last line (the file's traceback above it, as for any flow file that raises)."""
    flow = tmp_path / "flow.py"
    flow.write_text("from dataflows.grpo import grpo_flow\n"
                    "from dataflows.rl.adaptive import AdaptiveSampling\n"
                    "flow = grpo_flow(prompts=4, n=4, adaptive=AdaptiveSampling(budget=3))\n")
    result = CliRunner().invoke(main, ["run", str(flow), "--no-dashboard", "--executors", "sim"])
    assert result.exit_code == 1 and "executors:" not in result.output  # nothing started
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("ValueError: adaptive budget=3 samples is smaller than 2 sample(s)")
    assert last.endswith("give budget >= 8, or fewer prompts")


def test_the_simulator_makes_each_prompts_own_n_and_groups_them(pool):
    """On simulator executors: every step stays within the budget, the groups' sizes follow
    the pass rates (they vary once the prompts come back), and each prompt's n is one group."""
    from dataflows.rl.tasks import sort_prompts
    from flowkit import RunConfig
    from tests.harness import pooled_run
    from tests.torch.rl_ops import even_token_reward

    flow = grpo_flow(prompts=4, n=4, microbatches=2, max_new_tokens=6, prompt_source=sort_prompts,
                     source_config={"digits": 3, "pool": 4}, reward=even_token_reward,
                     adaptive=AdaptiveSampling(n_min=2, n_max=10, pass_reward=0.5))
    result = pooled_run(pool, flow, RunConfig(steps=3, executors="sim", dashboard=False))
    lines = result.records
    assert [line["rollout/samples"] for line in lines][0] == 16  # no history: 4 each
    assert all(line["rollout/samples"] <= 16 for line in lines)
    assert "groups/zero_advantage_fraction" in lines[-1]
    assert max(line["groups/samples_max"] for line in lines[1:]) > 4
