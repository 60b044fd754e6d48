"""Adaptive samples per prompt against a fixed n [Note: adaptive sampling in
dataflows/rl/adaptive.py], at an equal budget of generated tokens.

Method: the digit-sorting warm-up (examples/sort_sft.py's flow, `warm_steps` steps, fresh
weights), then per seed, alternating in one command, GRPO from those weights (examples/
grpo_sort.py's task: `prompts` prompts a step, exact-match reward, the actor in 2 stages) with
fixed n = `n` and with adaptive sampling (`budget` samples a step, by default the fixed
side's, n_min..n_max by XRPO's uncertainty), each until it has generated `token_budget`
response tokens. The prompts come in turn from a pool of `pool` (sort_prompts' pool, by the
seed), so that a prompt comes back with its history. A side's reward at a step is
`groups/reward_mean` (each prompt's mean reward, averaged over prompts: adaptive sampling
weighs prompts unequally, so reward_mean would not compare), smoothed over the last `window`
steps; `tokens_to_target` is the tokens generated up to the first step where that reaches
`target` (None: not within the budget).
`zero_advantage_share` is the mean over steps of the share of groups whose rewards were all
equal, `zero_advantage_tokens_share` of the generated tokens those groups hold;
`tokens_per_reward_gain` the tokens a side generated over its smoothed reward's gain from its
first `window` steps to its last (None: no gain). `ratio` is
the second side's median tokens_to_target over fixed's (the seeds where both got there).
With `tree`, the second side is tree rollouts instead ([Note: tree rollouts] in
executors/torch/rollout/branching.py): n / branches ** len(branch_at) roots a prompt, each
branching at the response depths `branch_at` into `branches`, so as many leaves a prompt as the
fixed side's n where no sample ends early; its tokens count a shared prefix once. With
`branch_entropy`, a level forks at the first token from its depth whose distribution has that
entropy ([Note: entropy branching] in executors/torch/rollout/branching.py): fewer leaves where
the model is sure. With `adaptive_tree`, the tree side spreads its roots by pass rate too
(n_min..n_max roots a prompt, `budget` roots a step, by default prompts x its roots). With
`second_round`, the adaptive side samples that many more times, within the step, each prompt
whose first samples agree (DARS's second stage, [Note: second rounds] in
flowkit/runner/second_round.py), `second_round_budget` samples a step at most, only those none
of whose samples passed with `second_round_when` "fail"; its tokens count both rounds.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

__all__ = ["AdaptiveBench", "run_adaptive_bench"]


@attrs.frozen(kw_only=True)
class AdaptiveBench:
    seeds: int = 3
    warm_steps: int = 600
    token_budget: int = 40_000  # response tokens each side may generate
    prompts: int = 16
    n: int = 8
    pool: int = 64
    n_min: int = 2
    n_max: int = 8  # the fixed side's n: a settled prompt's samples are saved
    budget: int | None = None  # the adaptive side's samples a step (None: prompts x n)
    target: float = 0.8
    window: int = 3
    max_steps: int = 500  # a bound on one side's steps, whatever its tokens
    tree: bool = False  # the second side: tree rollouts, not adaptive sampling
    branch_at: tuple[int, ...] = (1, 2)  # the sorted digits' first two: where answers diverge
    branches: int = 2
    branch_entropy: float | None = None  # the tree side forks at uncertain tokens (nats)
    shared_prefix: str = "per_leaf"  # the tree side's ([Note: tree rollouts' shared prefix])
    adaptive_tree: bool = False  # the tree side's roots by pass rate (n_min..n_max roots)
    second_round: int = 0  # the adaptive side samples again the prompts that agree (DARS)
    second_round_budget: int | None = None  # its second-round samples a step (None: all)
    second_round_when: str = "agree"  # or "fail": only the prompts no sample solved

    @property
    def sides(self) -> tuple[str, str]:
        if self.tree:
            return ("fixed", "adaptive_tree" if self.adaptive_tree else "tree")
        return ("fixed", "adaptive")

    @property
    def tree_roots(self) -> int:
        """The tree side's samples a prompt before branching."""
        return max(1, self.n // self.branches ** len(self.branch_at))


def run_adaptive_bench(bench: AdaptiveBench = AdaptiveBench()) -> dict:
    """The warm-up, then both sides per seed, alternating; figures per seed and over seeds."""
    if bench.seeds < 1 or bench.warm_steps < 1 or bench.window < 1:
        raise ValueError(f"needs seeds, warm_steps and window >= 1, got {bench.seeds}, "
                         f"{bench.warm_steps} and {bench.window}")
    with tempfile.TemporaryDirectory(prefix="flowkit-adaptive-") as folder:
        warm = _warm_up(bench, Path(folder) / "warm")
        runs = []
        for seed in range(bench.seeds):
            runs.append({"seed": seed, **{side: _side(bench, warm["weights"], seed, side)
                                          for side in bench.sides}})
    warm.pop("weights")
    return {"setup": attrs.asdict(bench), "warm_up": warm, "runs": runs,
            **_over_seeds(runs), "method": __doc__.split("Method: ", 1)[1].strip()}


def _warm_up(bench: AdaptiveBench, out: Path) -> dict:
    """examples/sort_sft.py's flow for `warm_steps` steps, the actor's weights to out."""
    from benchmarks.runs import bench_run
    from dataflows.pretrain import pretrain_flow
    from dataflows.rl.tasks import SORT_GPT, sort_sequences

    flow = pretrain_flow(source=sort_sequences,
                         source_config={"digits": 3, "correct_fraction": 0.2}, batch_size=64,
                         stages=2, microbatches=4, schedule="1f1b", gpt=SORT_GPT, lr=2e-3,
                         model_name="actor", name="sort_sft")
    start = time.perf_counter()
    with bench_run(flow, steps=bench.warm_steps, executors="torch", save_weights=out) as run:
        for _ in run.steps():
            pass
    return {"steps": bench.warm_steps, "wall_s": time.perf_counter() - start,
            "weights": out / "actor.pt"}


def grpo_side(bench: AdaptiveBench, weights: Path, seed: int, side: str) -> Any:
    """examples/grpo_sort.py's GRPO from `weights`, prompts from the pool and samples drawn
    by `seed`; `side` "adaptive" spreads the same samples a step by pass rate, "tree" grows
    them as tree rollouts."""
    from dataflows.grpo import grpo_flow
    from dataflows.rl.adaptive import AdaptiveSampling
    from dataflows.rl.tasks import SORT_GPT, SORT_RESPONSE_TOKENS, sort_prompts, sort_reward

    second = {"second_round": bench.second_round,
              "second_round_budget": bench.second_round_budget,
              "second_round_when": bench.second_round_when} if side == "adaptive" else {}
    adaptive = AdaptiveSampling(n_min=bench.n_min, n_max=bench.n_max, budget=bench.budget,
                                **second) if side in ("adaptive", "adaptive_tree") else None
    tree = {"n": bench.tree_roots, "branch_at": bench.branch_at, "branches": bench.branches,
            "branch_entropy": bench.branch_entropy, "shared_prefix": bench.shared_prefix} \
        if side in ("tree", "adaptive_tree") else {"n": bench.n}
    return grpo_flow(prompts=bench.prompts, **tree, stages=2, microbatches=4,
                     schedule="1f1b", max_new_tokens=SORT_RESPONSE_TOKENS, lr=3e-4,
                     kl_coef=0.001, gpt={**SORT_GPT, "checkpoint": str(weights)},
                     prompt_source=sort_prompts, reward=sort_reward, sample_seed=seed,
                     source_config={"digits": 3, "pool": bench.pool, "seed": seed},
                     adaptive=adaptive)


def _side(bench: AdaptiveBench, weights: Path, seed: int, side: str) -> dict:
    """One side's run until its tokens are spent: its curve and figures."""
    from benchmarks.runs import bench_run

    tokens, rewards, zero, zero_tokens, spent, again = [], [], [], [], 0, 0
    with bench_run(grpo_side(bench, weights, seed, side), steps=bench.max_steps,
                   executors="torch") as run:
        for report in run.steps():
            spent += int(report.metrics["rollout/tokens"])
            tokens.append(spent)
            rewards.append(float(report.metrics["groups/reward_mean"]))
            zero.append(float(report.metrics["groups/zero_advantage_fraction"]))
            zero_tokens.append(float(report.metrics["groups/zero_advantage_tokens_fraction"]))
            again += int(report.metrics.get("generate/second_round_samples", 0))
            if spent >= bench.token_budget:
                break
    smoothed = [statistics.fmean(rewards[max(0, i + 1 - bench.window):i + 1])
                for i in range(len(rewards))]
    reached = next((tokens[i] for i, r in enumerate(smoothed)
                    if i + 1 >= bench.window and r >= bench.target), None)
    gain = smoothed[-1] - statistics.fmean(rewards[:bench.window])
    return {"steps": len(tokens), "tokens": spent, "tokens_to_target": reached,
            "zero_advantage_share": statistics.fmean(zero),
            "zero_advantage_tokens_share": statistics.fmean(zero_tokens),
            "second_round_samples": again, "reward_last": smoothed[-1],
            "tokens_per_reward_gain": spent / gain if gain > 0 else None,
            "reward_curve": rewards, "tokens_curve": tokens}


def _over_seeds(runs: list[dict]) -> dict:
    out: dict[str, Any] = {}
    fixed, other = "fixed", _other_side(runs)
    for side in (fixed, other):
        reached = [run[side]["tokens_to_target"] for run in runs]
        got = [t for t in reached if t is not None]
        out[side] = {"reached": f"{len(got)}/{len(runs)}",
                     "tokens_to_target_median": statistics.median(got) if got else None,
                     "zero_advantage_share": statistics.fmean(
                         run[side]["zero_advantage_share"] for run in runs),
                     "zero_advantage_tokens_share": statistics.fmean(
                         run[side]["zero_advantage_tokens_share"] for run in runs),
                     "reward_last": statistics.fmean(run[side]["reward_last"] for run in runs),
                     "tokens_per_reward_gain_median": _median(
                         run[side]["tokens_per_reward_gain"] for run in runs)}
    both = [(run[fixed]["tokens_to_target"], run[other]["tokens_to_target"])
            for run in runs if None not in (run[fixed]["tokens_to_target"],
                                            run[other]["tokens_to_target"])]
    out["ratio"] = (statistics.median(a for _, a in both) / statistics.median(f for f, _ in both)
                    if both else None)
    return out


def _median(values: Any) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _other_side(runs: list[dict]) -> str:
    """The side the fixed one is compared with: adaptive sampling or tree rollouts (their
    roots adaptive or not)."""
    return next(side for side in ("adaptive_tree", "tree", "adaptive") if side in runs[0])
