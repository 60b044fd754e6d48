"""Token-budget microbatches: a backprop with `microbatch_tokens` forms its microbatches by the
tokens of its items, not their count, and gives each to the replica with the fewest tokens so far.

[Note: token-budget microbatches] Each item of a backprop with `microbatch_tokens=N` reports its
tokens (the field its op declares, ModelOp.item_tokens; a report key, nothing fetched). A
barrier (the first step) plans as many microbatches as first-fit by decreasing tokens fills
with N, a streamed step as many as the last step's tokens fill, either rounded up to as many
for each replica. A streamed step forms one each time the items in fill a budget (largest first
that fit), each to the replica with the fewest tokens among those with a slot beside their
last (replica r runs global microbatches r, r + D, ...). At the close (a barrier's: at once),
what is left fills every replica's slots left, each item largest first to the replica with the
fewest tokens so far, so the replicas reach their all-reduce together. Losses in
sum form make any cut the whole batch's (tests/runner/test_token_microbatches.py,
tests/torch/test_token_microbatch_runs.py; `flowkit bench train --microbatch-tokens` times it).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import attrs

__all__ = ["TokenSlots", "fill_one", "first_fit_decreasing", "planned_count"]


def first_fit_decreasing(items: Sequence[Hashable], tokens: dict, budget: int) -> list[list]:
    """`items` in bins of at most `budget` tokens (one longer alone), first fit by decreasing
    tokens, ties in the given order."""
    bins: list[list] = []
    loads: list[int] = []
    for item in sorted(items, key=lambda i: -tokens[i]):  # sorted() is stable: ties keep order
        n = tokens[item]
        slot = next((b for b, load in enumerate(loads) if load + n <= budget), None)
        if slot is None:
            bins.append([item])
            loads.append(n)
        else:
            bins[slot].append(item)
            loads[slot] += n
    return bins


def fill_one(items: Sequence[Hashable], tokens: dict, budget: int) -> list:
    """One microbatch from `items`: the largest that fit in `budget` together, at least one."""
    chosen, load = [], 0
    for item in sorted(items, key=lambda i: -tokens[i]):
        if not chosen or load + tokens[item] <= budget:
            chosen.append(item)
            load += tokens[item]
    return chosen


def planned_count(total_tokens: int, budget: int, replicas: int) -> int:
    """Microbatches a step whose items hold `total_tokens` fills, as many for each replica."""
    return replicas * max(1, math.ceil(math.ceil(total_tokens / budget) / replicas))


@attrs.define
class TokenSlots:
    """A step's global microbatch numbers still free, by replica (replica r runs r, r + D,
    ...), and the tokens each replica was given [Note: token-budget microbatches]."""

    free: list[list[int]]
    tokens: list[int]

    @classmethod
    def of(cls, microbatches: int, replicas: int) -> TokenSlots:
        return cls(free=[list(range(r, microbatches, replicas)) for r in range(replicas)],
                   tokens=[0] * replicas)

    @property
    def left(self) -> int:
        return sum(len(slots) for slots in self.free)

    @property
    def spare(self) -> bool:
        """Whether some replica has a slot beside the last one it keeps for the close."""
        return any(len(slots) > 1 for slots in self.free)

    def take(self, tokens: int, *, keep_last: bool = False) -> int:
        """The global number of a microbatch of `tokens`: the next slot of the replica with
        the fewest tokens among those with one left (`keep_last`: with one beside their last,
        which the close fills)."""
        least = 2 if keep_last else 1
        replica = min((r for r, slots in enumerate(self.free) if len(slots) >= least),
                      key=lambda r: (self.tokens[r], r))
        self.tokens[replica] += tokens
        return self.free[replica].pop(0)

    def place(self, items: Sequence[Hashable], tokens: dict) -> list[tuple[int, list]]:
        """Every slot left and its items: each item, largest first, to the replica with the
        fewest tokens so far among those with a slot left, into its lightest slot (some may
        stay empty), so the replicas' totals, not the microbatches', come out even."""
        bins: dict[int, list] = {g: [] for slots in self.free for g in slots}
        loads = dict.fromkeys(bins, 0)
        open_replicas = [r for r, slots in enumerate(self.free) if slots]
        for item in sorted(items, key=lambda i: -tokens[i]):  # stable: ties keep their order
            replica = min(open_replicas, key=lambda r: (self.tokens[r], r))
            slot = min(self.free[replica], key=lambda g: (loads[g], g))
            bins[slot].append(item)
            loads[slot] += tokens[item]
            self.tokens[replica] += tokens[item]
        self.free = [[] for _ in self.free]
        return sorted(bins.items(), key=lambda placed: -loads[placed[0]])
