"""Partial rollouts: a step over-provisions generation and takes the groups that finish first.

[Note: partial rollouts] After APRIL (Zhou et al. 2025, "APRIL: active partial rollouts in
reinforcement learning to tame long-tail generation"). A generating node with `take=T` in its
config (Generate's; the RL flows set it from `oversample`, e.g. 1.5 x the step's prompts):
  - its calls (one per prompt: the prompt's n samples, a group) run as usual, but do not
    stream their samples: a call's samples go downstream when the whole group is done, so a
    group never reaches training half in one step and half in the next;
  - the first T calls to end are the step's; when the T-th ends, the node asks the engines to
    abort its calls still running (`generation` with `action=abort, requests=[...]`): each
    comes back with its finished samples and its unfinished ones `interrupted`, with the
    per-token versions they have;
  - every call that ends after that carries over to the next step, which submits them before
    its own prompts: interrupted samples continue from their prefix under the weights then
    current, finished ones pass through. A carried call keeps its origin step (its sampling
    seeds) and is keyed `"<origin>/<key>"` in the next step's groups, so it never merges with
    a new prompt of the same id;
  - a step runs as many calls as its source made prompts (oversample x the batch's): the
    carried ones, then its own prompts in the places left; those left over never run
    (`rollout/prompts_unused`: a step-seeded source draws fresh ones each step). So a step
    submits once the step before has closed its generation and handed over what it carries:
    the engines go on with the carried calls while the step before trains;
  - a carried sample whose oldest token is older than the staleness bound allows for the step
    that will train it (version < step - η) is, as `stale_segments` says, "recompute"d (sampled
    again from its prompt) or "drop"ped with its whole group (a group-relative advantage needs
    all of it), counted in `rollout/dropped`.
Each generated sample is thus trained once, in the step that took its group, or is still
carried at the end of the run (`rollout/carried_over` of the last step). Carried samples are
one version stale at least, so partial rollouts run with a staleness bound >= 1.
"""

from __future__ import annotations

from typing import Any

import attrs

from flowkit.ops import STALE_SEGMENTS

__all__ = ["CARRIED", "STALE_SEGMENTS", "Carried", "PartialRollouts", "PartialState",
           "carried_key"]

CARRIED = "carried"  # the first part of a carried call's lineage in the step that resumes it


@attrs.frozen
class PartialRollouts:
    """A generating node's setting: the groups a step takes, what a stale carried sample
    becomes, and the samples per call (for counting)."""

    take: int
    stale_segments: str
    n: int


@attrs.define
class Carried:
    """A call that carries over: its output future (its group's rollouts, the unfinished
    ones interrupted)."""

    origin: int  # the step whose prompt it is (its sampling seeds)
    lineage: tuple  # in the origin step
    ref: Any

    @property
    def resumed_lineage(self) -> tuple:
        return (CARRIED, self.origin, *self.lineage)


def carried_origin(lineage: tuple) -> int | None:
    return lineage[1] if lineage and lineage[0] == CARRIED else None


def carried_key(lineage: tuple, key: Any) -> Any:
    """A group key reported for an item of a carried call, made distinct from the keys of
    the step's own prompts."""
    origin = carried_origin(lineage)
    return key if origin is None or key is None else f"{origin}/{key}"


@attrs.define
class PartialState:
    """One generating node in one step."""

    setting: PartialRollouts
    taken: int = 0
    aborting: bool = False
    incoming: list[Carried] = attrs.field(factory=list)  # from the step before: first
    incoming_sent: int = 0
    outgoing: list[Carried] = attrs.field(factory=list)  # to the next step
    resumed: dict[tuple, Carried] = attrs.field(factory=dict)  # lineage here -> the call
    pending_calls: dict[tuple, str] = attrs.field(factory=dict)  # lineage -> request key
    aborts: list[Any] = attrs.field(factory=list)  # futures of [samples, tokens] cut
    dropped: int = 0
    own: int = 0  # of the step's own prompts, those it runs
    unused: int = 0  # and those it leaves: the carried calls took their places

    def room(self, prompts: int) -> bool:
        """Whether another of the step's `prompts` runs: a step runs as many calls as its
        source made prompts, the carried ones first."""
        return len(self.incoming) + self.own < prompts

    def dropped_whole(self, lineage: tuple, future: Any) -> bool:
        """Whether a resumed call came back short: its group dropped as stale (counted here,
        neither trained nor carried again)."""
        count = getattr(future, "count", None)
        if lineage not in self.resumed or count is None or count >= self.setting.n:
            return False
        self.dropped += self.setting.n - count
        return True

    def carry(self, origin: int, lineage: tuple, ref: Any) -> None:
        """A call of this step goes to the next one; a resumed call keeps its origin."""
        first = carried_origin(lineage)
        if first is not None:
            origin, lineage = first, lineage[2:]
        self.outgoing.append(Carried(origin, lineage, ref))

    def metrics(self, node: str, timeout: float) -> dict[str, float]:
        cut = [f.result(timeout=timeout) for f in self.aborts]
        return {f"{node}/taken_groups": self.taken,
                "rollout/carried_over": len(self.outgoing) * self.setting.n,
                "rollout/started": self.own * self.setting.n,
                "rollout/resumed": len(self.incoming) * self.setting.n,
                "rollout/prompts_unused": self.unused,
                "rollout/aborted_samples": sum(int(c[0]) for c in cut if c),
                "rollout/aborted_tokens": sum(int(c[1]) for c in cut if c),
                "rollout/dropped": self.dropped}
