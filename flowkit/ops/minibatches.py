"""Several optimizer steps per flow step (PPO epochs): how a Backprop's batch is shuffled and cut
into minibatches, and each minibatch into microbatches. Pure Python, so the runtime and a plain
training loop (a test, a user checking a run) cut a batch the same way by calling these.

The design: [Note: minibatch rounds] below.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["ROUND_KNOBS", "cut", "epoch_order", "minibatch_rounds", "rounds_of"]


# [Note: minibatch rounds] A Backprop with `epochs` E and `minibatches` M trains the step's batch E
# times over; each epoch orders it by a seeded permutation (`epoch_order`) and cuts that order into
# M contiguous minibatches (`cut`), so the step takes E x M optimizer steps, one per minibatch (a
# "round"), each normalized by its own minibatch's total. verl's names: `ppo_epochs` is E;
# `ppo_mini_batch_size` is the batch size / M (a count, not a size, so a batch whose size changes
# from step to step still makes M steps). With E = M = 1 nothing is shuffled: the one round is the
# batch in its lineages' order, as before rounds existed.
#
# The runtime (flowkit/runner/model_training.py) makes rounds a barrier: they start once every item
# is in. Each round runs the schedule over its minibatch's microbatches and then an optimizer step
# that reads only that round's microbatch stats, so a sum-form loss (SUM_FORM_LOSSES) is divided by
# its own minibatch's total and "lm" weighs a microbatch by its share of the minibatch: the plain
# loop that steps once per minibatch. The steps of all rounds but the last are the backprop's; the
# last is the OptimizerStep node's, whose report sums up the rounds
# (flowkit.ops.records.StepMetrics) and whose weights alone go to the executors that generate.

T = TypeVar("T")

ROUND_KNOBS = {"epochs": 1, "minibatches": 1, "shuffle_seed": 0}
"""A Backprop's config keys for rounds, with their defaults: one optimizer step a flow step."""


def rounds_of(config: dict[str, Any]) -> int:
    """Optimizer steps a Backprop with this config takes per flow step: epochs x minibatches."""
    return int(config.get("epochs") or 1) * int(config.get("minibatches") or 1)


def epoch_order(count: int, *, seed: int, step: int, epoch: int) -> list[int]:
    """A permutation of range(count), the same in every process for the same arguments (a
    string seed is hashed by SHA-512, not by Python's per-process salted hash)."""
    order = list(range(count))
    random.Random(f"flowkit-minibatches/{seed}/{step}/{epoch}").shuffle(order)
    return order


def cut(items: Sequence[T], parts: int) -> list[list[T]]:
    """`items` in `parts` contiguous slices whose sizes differ by at most one, larger first."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        out.append(list(items[start:start + size]))
        start += size
    return out


def minibatch_rounds(count: int, *, epochs: int, minibatches: int, seed: int,
                     step: int) -> list[list[int]]:
    """The indices (into the batch in its lineages' order) of each round's minibatch, in the
    order the rounds train: epoch after epoch, each epoch's minibatches in turn."""
    if minibatches > count:
        raise ValueError(f"minibatches={minibatches} needs at least {minibatches} items in the "
                         f"batch, got {count}")
    if epochs * minibatches == 1:
        return [list(range(count))]
    return [part for epoch in range(epochs)
            for part in cut(epoch_order(count, seed=seed, step=step, epoch=epoch), minibatches)]
