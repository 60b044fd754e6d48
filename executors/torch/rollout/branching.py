"""Tree rollouts: samples that fork at fixed response depths, or where the model is unsure,
and share their prefix's cache.

The design: [Note: tree rollouts] and [Note: entropy branching] below.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["branch_samples", "leaves_per_root", "level_branches", "levels_passed", "root_sample"]


# [Note: tree rollouts] Branching at fixed depths, as LATR and BranchGRPO do: a sample that has
# drawn `d` response tokens, d in the sampling's `branch_at`, and goes on forks into `branches`
# samples: itself and branches - 1 new ones holding its d tokens and their log-probs, each new
# one copying its prefix's cache positions from it (the cache's `copy_prefix`, as [Note: shared
# prompts] in engine.py does) and drawing token d on with its own seed. Sample indices are
# fixed by the tree, not by finishing order: root r of n is r * k^D (k branches, D depths) and
# branch b at the i-th depth adds b * k^(D-1-i), so a prompt has at most n * k^D leaves, fewer
# when a sample ends before a depth. Every sample's seed is `sequence_seed` of its own index, a
# pure function of (seed, prompt, parent sample, branch) [Note: counter-based sampling in
# sampling.py]: runs and batch compositions draw the same trees. With no depth or k = 1 the
# indices are 0..n-1 and the samples are plain ones, bit for bit. A leaf records the sample it
# forked from (`branch_of`) and the response tokens it shares (`shared_tokens`).

# [Note: entropy branching] With `branch_entropy` H, the i-th depth of `branch_at` is where
# level i may begin: a sample on level i forks at its first response token t >= that depth
# (and past the token it was itself forked at) whose sampling distribution, at the sampling's
# temperature over the whole vocabulary, has entropy >= H (nats), as ETTRL and TreeRL fork at
# uncertain tokens. The branches hold the t tokens before it and draw token t themselves, as
# a fixed-depth fork at t does, so the tree's indices and seeds are the same; the parent forks
# after drawing token t, even when that token ends it. At H = 0 every token qualifies and the
# trees are the fixed-depth ones (tests/torch/test_tree_rollouts.py). A token whose entropy is
# within rounding of H (1e-12) may fork in one batch and not in another.


def leaves_per_root(branch_at: Sequence[int], branches: int) -> int:
    """The most leaves one sample grows into: k^D."""
    return branches ** len(branch_at) if branches > 1 else 1


def root_sample(root: int, branch_at: Sequence[int], branches: int) -> int:
    """The index of a prompt's root sample `root` (0 .. n-1) [Note: tree rollouts]."""
    return root * leaves_per_root(branch_at, branches)


def branch_samples(sample: int, depth: int, branch_at: Sequence[int], branches: int) -> list[int]:
    """The indices of the new samples that `sample` forks into at response depth `depth` (one
    of `branch_at`): branches 1 .. k-1 of that level; the sample itself goes on as branch 0."""
    return level_branches(sample, sorted(branch_at).index(depth), len(branch_at), branches)


def levels_passed(tokens: int, branch_at: Sequence[int]) -> int:
    """The levels a fixed-depth tree's sample holding `tokens` response tokens has forked at
    (its own level included, if a branch): a sample forks on drawing token d, d in `branch_at`,
    so one carried over and continued goes on from the next depth."""
    return bisect.bisect_right(sorted(branch_at), tokens)


def level_branches(sample: int, level: int, levels: int, branches: int) -> list[int]:
    """The indices of the new samples that `sample` forks into on level `level` of `levels`."""
    stride = branches ** (levels - 1 - level)
    return [sample + b * stride for b in range(1, branches)]
