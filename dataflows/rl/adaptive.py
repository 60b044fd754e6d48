"""Adaptive samples per prompt: a prompt's n drawn from the pass rate of its earlier samples.

[Note: adaptive sampling] A group whose samples all pass (or all fail) has zero advantage and
teaches nothing; its tokens are wasted. So each step, before generation, `allocate_samples`
gives every prompt `n_min` samples and spreads the rest of the step's budget over the prompts
by a weight of its pass-rate estimate p: "xrpo" weighs by uncertainty, p(1 - p) (XRPO, most
samples where the outcome is least known), "dars" by hardness, 1 - p (DARS's hardness-weighted
schedule, most samples where the prompt is rarely solved); a prompt always solved gets n_min
with either. `n_max` caps one prompt's samples (BroRL's breadth). After scoring,
`update_difficulty` folds each prompt's pass rate into its EMA. The estimates are a record fed
back from step to step (flow.feedback "difficulty"), so they live in the run and its
checkpoints, restored exactly on resume; a prompt is known by its `prompt_id`, which a source
that makes the same prompt again must give it again (a dataset's row, sort_prompts' pool).
The feedback is chained: in an asynchronous run a step allocates by, and folds into, the
estimates of the step just before (its generation waits for that step's scores, not its
training), so no step's samples are left out of them.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence

import attrs

from flowkit.dsl import Batch, Stream, op
from flowkit.ops.records import Prompt, Scored

__all__ = ["ALLOCATIONS", "SECOND_ROUND_WHEN", "AdaptiveSampling", "Difficulty", "allocate_samples",
           "check_adaptive", "sample_counts", "update_difficulty"]

ALLOCATIONS = ("xrpo", "dars")
SECOND_ROUND_WHEN = ("agree", "fail")  # which groups a second round samples again


@attrs.frozen(kw_only=True)
class AdaptiveSampling:
    """How a step's samples are spread over its prompts [Note: adaptive sampling]."""

    budget: int | None = None
    """Samples a step generates at most (None: prompts x n, what the fixed-n flow makes)."""
    token_budget: int | None = None
    """Generated tokens a step may spend at most, each prompt's samples costed at its mean
    response length so far (an unseen prompt's: max_new_tokens); None: no token budget."""
    n_min: int = 2
    """Samples every prompt gets (2: a group always has a sibling to compare with)."""
    n_max: int = 16
    """The most samples one prompt gets (BroRL's breadth)."""
    allocation: str = "xrpo"
    """"xrpo": the rest of the budget by uncertainty p(1-p); "dars": by hardness 1-p."""
    ema: float = 0.5
    """Weight of the newest step in a prompt's pass-rate estimate (1: only the last step)."""
    prior: float = 0.5
    """Pass rate assumed for a prompt never sampled (0.5: most uncertain)."""
    pass_reward: float = 1.0
    """A sample passes when its task reward is at least this."""
    second_round: int = 0
    """More samples for a prompt whose first samples' task rewards all agree, drawn within the
    step (DARS's second stage; 0: none); its group then trains on all of them, and a group
    that still agrees is dropped, as DAPO's filter does [Note: second rounds in
    flowkit/runner/second_round.py]. GRPO's flows, synchronous runs."""
    second_round_budget: int | None = None
    """Second-round samples a step may draw at most (None: every group that agrees gets its
    second round)."""
    second_round_when: str = "agree"
    """"agree": a second round for a prompt whose first samples' task rewards all agree;
    "fail": only for one none of whose samples passed (`pass_reward`: DARS's hard prompts),
    a prompt every sample solved training as without a second round."""

    def group_settings(self) -> dict:
        """group_by's settings of a second round: none without one."""
        if not self.second_round:
            return {}
        return {"second_round": self.second_round,
                "second_round_budget": self.second_round_budget}

    def group_filter(self) -> dict:
        """grpo_advantages' settings of a second round: which groups it drops, so that they
        are sampled again (none without a second round)."""
        if not self.second_round:
            return {}
        if self.second_round_when == "fail":
            return {"filter_below": self.pass_reward}
        return {"filter_groups": True}


@attrs.frozen(kw_only=True)
class Difficulty:
    """What the run knows of each prompt sampled so far, in prompt_id order."""

    prompt_ids: list[int] = attrs.field(factory=list)
    pass_rates: list[float] = attrs.field(factory=list)  # EMA of the share that passed
    lengths: list[float] = attrs.field(factory=list)  # EMA of the mean response length
    samples: list[int] = attrs.field(factory=list)  # samples seen, over all steps

    def of(self) -> dict[int, tuple[float, float]]:
        """{prompt_id: (pass rate, length)}."""
        return {p: (r, n) for p, r, n in zip(self.prompt_ids, self.pass_rates, self.lengths)}


def check_adaptive(adaptive: AdaptiveSampling, *, prompts: int, n: int,
                   max_new_tokens: int, needs_siblings: str | None = None) -> None:
    """Refuse settings that cannot make a step, in one line each, before the flow is built."""
    if adaptive.allocation not in ALLOCATIONS:
        raise ValueError(f"adaptive allocation={adaptive.allocation!r}: choose one of "
                         f"{', '.join(ALLOCATIONS)}")
    if not 1 <= adaptive.n_min <= adaptive.n_max:
        raise ValueError(f"adaptive n_min={adaptive.n_min}, n_max={adaptive.n_max}: give "
                         "1 <= n_min <= n_max")
    if needs_siblings and adaptive.n_min < 2:
        raise ValueError(f"adaptive n_min={adaptive.n_min} makes groups of one sample, and "
                         f"{needs_siblings} needs siblings in every group: set n_min >= 2")
    _check_second_round(adaptive)
    if not 0 < adaptive.ema <= 1 or not 0 <= adaptive.prior <= 1:
        raise ValueError(f"adaptive ema={adaptive.ema}, prior={adaptive.prior}: ema in (0, 1] "
                         "and prior in [0, 1]")
    budget = samples_budget(adaptive, prompts=prompts, n=n)
    if budget < prompts * adaptive.n_min:
        raise ValueError(f"adaptive budget={budget} samples is smaller than {adaptive.n_min} "
                         f"sample(s) (n_min) for each of the step's {prompts} prompts: give "
                         f"budget >= {prompts * adaptive.n_min}, or fewer prompts")
    floor = prompts * adaptive.n_min * max_new_tokens
    if adaptive.token_budget is not None and adaptive.token_budget < floor:
        raise ValueError(f"adaptive token_budget={adaptive.token_budget} cannot pay for n_min="
                         f"{adaptive.n_min} sample(s) of max_new_tokens={max_new_tokens} for "
                         f"each of {prompts} prompts: give token_budget >= {floor}")


def _check_second_round(adaptive: AdaptiveSampling) -> None:
    for name in ("second_round", "second_round_budget"):
        value = getattr(adaptive, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ValueError(f"adaptive {name}={value!r}: a whole number of samples >= 0")
    if adaptive.second_round_when not in SECOND_ROUND_WHEN:
        raise ValueError(f"adaptive second_round_when={adaptive.second_round_when!r}: one of "
                         f"{', '.join(SECOND_ROUND_WHEN)}")
    if adaptive.second_round_budget is not None and not adaptive.second_round:
        raise ValueError(f"adaptive second_round_budget={adaptive.second_round_budget} bounds "
                         "a second round: give second_round too")
    if adaptive.second_round and adaptive.n_min < 2:
        raise ValueError(f"adaptive second_round={adaptive.second_round} samples again a prompt "
                         f"whose first samples agree, and n_min={adaptive.n_min} gives a prompt "
                         "one sample, which agrees with nothing: set n_min >= 2")


def samples_budget(adaptive: AdaptiveSampling, *, prompts: int, n: int) -> int:
    return prompts * n if adaptive.budget is None else adaptive.budget


def _weight(rate: float, allocation: str) -> float:
    return rate * (1.0 - rate) if allocation == "xrpo" else 1.0 - rate


def sample_counts(rates: Sequence[float], *, budget: int, n_min: int, n_max: int,
                  allocation: str = "xrpo") -> list[int]:
    """Each prompt's samples: n_min, plus its share of the rest of `budget` by its weight,
    capped at n_max (water-filling: what a capped prompt cannot take goes to the others),
    whole samples by largest remainder, ties to the earlier prompt. Equal rates and a budget
    of prompts x n give every prompt n."""
    counts = [n_min] * len(rates)
    weights = [_weight(rate, allocation) for rate in rates]
    left = budget - n_min * len(rates)
    open_ = [i for i, w in enumerate(weights) if w > 0]
    while left > 0 and open_:
        total = sum(weights[i] for i in open_)
        wants = {i: left * weights[i] / total for i in open_}
        capped = [i for i in open_ if counts[i] + wants[i] >= n_max]
        if capped:  # these fill up; the rest of the budget is shared again
            for i in capped:
                left -= n_max - counts[i]
                counts[i] = n_max
            open_ = [i for i in open_ if i not in capped]
            continue
        whole = {i: math.floor(wants[i] + 1e-9) for i in open_}
        for i in open_:
            counts[i] += whole[i]
        rest = left - sum(whole.values())
        by_remainder = sorted(open_, key=lambda i: (-(wants[i] - whole[i]), i))
        for i in by_remainder[:rest]:
            counts[i] += 1
        left = 0
    return counts


def within_tokens(counts: list[int], lengths: Sequence[float], weights: Sequence[float], *,
                  token_budget: int, n_min: int) -> list[int]:
    """`counts` cut, a sample at a time from the prompt with the most samples (ties: the least
    weight, then the later prompt), until their expected tokens fit `token_budget` or every
    prompt is at n_min."""
    counts = list(counts)
    spent = sum(c * length for c, length in zip(counts, lengths))
    while spent > token_budget:
        cuttable = [i for i, c in enumerate(counts) if c > n_min]
        if not cuttable:
            break
        i = max(cuttable, key=lambda j: (counts[j], -weights[j], j))
        counts[i] -= 1
        spent -= lengths[i]
    return counts


@op
def allocate_samples(prompts: Batch[Prompt], difficulty: Difficulty | None = None, *,
                     budget: int = 16, token_budget: int | None = None, n_min: int = 2,
                     n_max: int = 16, allocation: str = "xrpo", prior: float = 0.5,
                     max_new_tokens: int = 256) -> Stream[Prompt]:
    """The step's prompts, each with its own `n` [Note: adaptive sampling]; `difficulty`: the
    estimates of the steps before (none at the first)."""
    known = (difficulty or Difficulty()).of()
    rates = [known.get(p.prompt_id, (prior, 0.0))[0] for p in prompts]
    counts = sample_counts(rates, budget=budget, n_min=n_min, n_max=n_max,
                           allocation=allocation)
    if token_budget is not None:
        lengths = [known[p.prompt_id][1] if p.prompt_id in known else float(max_new_tokens)
                   for p in prompts]
        counts = within_tokens(counts, lengths, [_weight(r, allocation) for r in rates],
                               token_budget=token_budget, n_min=n_min)
    for prompt, count in zip(prompts, counts):
        yield attrs.evolve(prompt, n=count)


@op
def update_difficulty(scored: Batch[Scored], difficulty: Difficulty | None = None, *,
                      ema: float = 0.5, pass_reward: float = 1.0) -> Difficulty:
    """`difficulty` with this step's samples folded in: each prompt's pass rate and mean
    response length, an EMA weighing this step by `ema` (a prompt's first step: as it is)."""
    passed: dict[int, list[float]] = defaultdict(list)
    lengths: dict[int, list[int]] = defaultdict(list)
    for s in scored:
        task = s.reward if s.task_reward is None else s.task_reward
        passed[s.prompt_id].append(1.0 if task >= pass_reward else 0.0)
        lengths[s.prompt_id].append(len(s.response_tokens))
    before = difficulty or Difficulty()
    table = {p: [r, n, k] for p, r, n, k in zip(before.prompt_ids, before.pass_rates,
                                                 before.lengths, before.samples)}
    for prompt_id, shares in passed.items():
        rate, length = statistics.fmean(shares), statistics.fmean(lengths[prompt_id])
        if prompt_id in table:
            old_rate, old_length, seen = table[prompt_id]
            rate = (1 - ema) * old_rate + ema * rate
            length = (1 - ema) * old_length + ema * length
            table[prompt_id] = [rate, length, seen + len(shares)]
        else:
            table[prompt_id] = [rate, length, len(shares)]
    ids = sorted(table)
    return Difficulty(prompt_ids=ids, pass_rates=[table[p][0] for p in ids],
                      lengths=[table[p][1] for p in ids], samples=[table[p][2] for p in ids])
