"""A step that samples in rounds until its group quota fills: `group_by(..., take=T, rounds=R)`.

[Note: sampling rounds] DAPO's dynamic sampling (Yu et al. 2025) generates another batch when
too few groups of a batch have rewards that differ, up to a cap (verl's max_num_gen_batches).
Here the step's source makes R rounds of prompts at once, and the round node (the first
per-item node after the source: generation) calls them a round at a time: the next only when
the groups not yet decided can no longer make up the quota, taken + undecided < T, a group being
decided once the quota's node has run on it (quota.py). The round node, and every node after it
in turn, ends once T groups are taken or the R rounds are spent; prompts never run are counted
unused. Each prompt makes one group, so calls and groups count alike. The round node stays open
while its decision is pending, which needs a fused run (stage by stage, a step runs its first
round only); synchronous runs only, without partial rollouts (each calls generation through a
policy of its own; refused before anything starts). It is the round node's call policy
(call_policy.py), holding the quota's policy of the same step. In full: docs/rl.md, "Recipes:
DAPO, Dr. GRPO, GSPO, and the loss settings".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from flowkit.dsl import Granularity
from flowkit.planner.lower import Call
from flowkit.runner.call_policy import CallSite
from flowkit.runner.quota import GroupQuota
from flowkit.runner.stepstate import FlowRunError

__all__ = ["SamplingRounds", "checked_round_nodes", "path_to_generation", "round_nodes"]


@attrs.define
class SamplingRounds:
    """One round node's calls in one step."""

    name: str
    rounds: int
    quota: GroupQuota
    fused: bool
    streams_parts = True  # a sample goes downstream as it is made, as without rounds
    site: Any = None  # the round node's, to call a later round on
    round_size: int = 0
    sent: int = 0  # rounds called
    called: int = 0  # prompts called, over the rounds
    total: int = 0  # prompts the source made

    def __attrs_post_init__(self) -> None:
        self.quota.listener = self._decided

    def submit(self, site: CallSite, prompts_closed: bool) -> bool:
        """The first round, once the source's prompts are all in (a round is a share of
        them)."""
        self.site = site
        if not prompts_closed:
            return False
        if not self.sent:
            self.total = len(site.lead_items())
            self.round_size = max(1, -(-self.total // self.rounds))
            self.sent = 1
        return True

    def admit(self, prompts: int, lineage: tuple) -> bool:
        """The first round's prompts; the others wait for `_next_round`, or never run."""
        if self.called >= self.round_size:
            return False
        self.called += 1
        return True

    def config(self, lineage: tuple) -> dict:
        return {}

    def done(self, lineage: tuple, future: Any, site: CallSite) -> bool:
        return True

    def _undecided(self) -> int:
        quota = self.quota
        return self.called - (quota.taken + quota.empty + quota.surplus)

    def _short(self) -> bool:
        """Whether the groups to come cannot fill the quota, and a round is left."""
        quota = self.quota
        return (self.fused and self.sent and self.sent < self.rounds
                and quota.taken + self._undecided() < quota.take)

    def _decided(self) -> None:
        """The quota's node decided a group: call the next round if it is needed now."""
        if self._short():
            self._next_round()
        if self.site is not None:
            self.site.touch()  # the round node may end now

    def _next_round(self) -> None:
        begin = self.sent * self.round_size
        prompts: Sequence = self.site.lead_items()[begin:begin + self.round_size]
        self.sent += 1
        for lineage, ref in prompts:
            self.called += 1
            self.site.submit(lineage, ref)

    def may_close(self) -> bool:
        """Once the quota is met or the rounds are spent (or unfused: one round)."""
        if not self.fused or self.quota.taken >= self.quota.take or self.sent >= self.rounds:
            return True
        if self._short():
            self._next_round()
        return False

    def closed(self) -> None:
        pass

    def receive(self, calls: list, *, closed: bool) -> None:
        raise RuntimeError(f"{self.name}: a step sampled in rounds carries no calls over")

    def metrics(self, timeout: float) -> dict[str, float]:
        return {f"{self.name}/sampling_rounds": self.sent,
                f"{self.name}/prompts_unused": self.total - self.called}


def path_to_generation(by_name: dict[str, Any], src: str) -> list[str]:
    """The nodes from `src` back to the first per-item node on the path from the step's source
    (generation, last), following each node's first streamed input: where sampling rounds and
    second rounds (second_round.py) call prompts again."""
    path = [src]
    while True:
        lead = next((r for r in by_name[path[-1]].inputs if not r.feedback
                     and r.granularity is Granularity.STREAM), None)
        if lead is None or by_name[lead.src].call is not Call.PER_ITEM:
            return path
        path.append(lead.src)


def round_nodes(plan: Sequence[Any]) -> dict[str, tuple[str, int]]:
    """The round node of each group node sampled in rounds: {round node: (quota node,
    rounds)}. The round node is the first per-item node on the path from the step's source to
    the quota's grouped input, following each node's first streamed input."""
    by_name = {node.name: node for node in plan}
    found: dict[str, tuple[str, int]] = {}
    for node in plan:
        for rule in node.inputs:
            if not getattr(rule, "group_rounds", None):
                continue
            at = path_to_generation(by_name, rule.src)[-1]
            if by_name[at].call is not Call.PER_ITEM:
                raise ValueError(f"{node.name}: group_by(..., rounds={rule.group_rounds}) calls "
                                 "the prompts of a per-item op in rounds, and no per-item op "
                                 f"feeds it (its input comes from {rule.src!r})")
            if at in found:
                raise ValueError(f"{at}: two group_by(..., rounds=) downstream call it in "
                                 "rounds; give one of them rounds")
            found[at] = (node.name, int(rule.group_rounds))
    return found


def checked_round_nodes(plan: Sequence[Any], partial: dict) -> dict[str, tuple[str, int]]:
    """`round_nodes(plan)`, checked before anything starts: not a node with partial rollouts
    (`partial`); the asynchronous case is refused by flowrun.check_async."""
    try:
        found = round_nodes(plan)
    except ValueError as exc:
        raise FlowRunError(str(exc)) from None
    for name, (quota, rounds) in found.items():
        if name in partial:
            raise FlowRunError(f"{name}: partial rollouts (oversample) and sampling rounds "
                               f"(group_by(..., rounds={rounds}) at {quota}) both decide which "
                               "of its calls run; use one")
    return found
