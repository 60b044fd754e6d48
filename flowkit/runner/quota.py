"""A step that takes a set number of groups: `group_by(..., take=T)` on a per-group op's input.

[Note: group quota] The op runs on every group as it completes; the first T calls that yield
items are the step's and their items go downstream, a call that yields nothing (a group the op
filtered out) counts for nothing, and the items of calls that end after the T-th are dropped.
The flow over-provisions the groups (more prompts than it trains on) and filters them in the
op: DAPO's dynamic sampling (Yu et al. 2025) keeps the groups whose rewards differ. Calls end in
the order their groups complete, so which groups a step takes depends on timing, as with
partial rollouts. A step whose groups run out before T reports how many it is short; it never
waits for more. It is the group node's call policy (call_policy.py): the step asks it of each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from flowkit.runner.call_policy import CallSite, PolicyDefaults

__all__ = ["GroupQuota", "group_quotas"]


@attrs.define
class GroupQuota(PolicyDefaults):
    """One group node's quota in one step."""

    name: str
    take: int
    streams_parts = False  # a group's call answers whole
    taken: int = 0
    empty: int = 0  # calls that yielded nothing: groups the op filtered out
    surplus: int = 0  # calls that yielded items after the quota was met: dropped
    # told after each group's call is decided (the step's sampling rounds: sampling_rounds.py)
    listener: Any = None

    def done(self, lineage: tuple, future: Any, site: CallSite) -> bool:
        """Whether call `lineage`'s items are the step's."""
        ours = self._decide(future)
        if self.listener is not None:
            self.listener()
        return ours

    def _decide(self, future: Any) -> bool:
        if not getattr(future, "count", None):
            self.empty += 1
            return True  # nothing to pass on, nothing to count
        if self.taken >= self.take:
            self.surplus += 1
            return False
        self.taken += 1
        return True

    def metrics(self, timeout: float) -> dict[str, float]:
        return {f"{self.name}/groups_taken": self.taken,
                f"{self.name}/groups_empty": self.empty,
                f"{self.name}/groups_surplus": self.surplus,
                f"{self.name}/groups_short": max(0, self.take - self.taken)}


def group_quotas(plan: Sequence[Any]) -> dict[str, int]:
    """The nodes whose grouped input takes a set number of groups, and that number."""
    return {node.name: rule.group_take for node in plan for rule in node.inputs
            if getattr(rule, "group_take", None)}
