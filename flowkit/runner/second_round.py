"""A step that samples a prompt again when its group taught nothing: `group_by(...,
second_round=k, second_round_budget=B)`.

[Note: second rounds] A group whose rewards all agree has zero advantage: it teaches nothing.
DARS (Yang et al. 2025) samples such a prompt again, to find a hard prompt's rare success (or
an easy one's rare failure), and trains the group on all of its samples. Here the group's op
runs on a prompt's group as soon as its first samples are in (the generation call that made
them ended, and each of its items reached the group); when it yields nothing
(grpo_advantages(filter_groups=True): the rewards agree), generation samples the prompt `k`
more times, numbered on from its first samples, so they draw what one request for all of them
would, while the step's `B` second-round samples last. The op then runs on all of the prompt's
samples, and what it yields is the step's. Generation (the first per-item node on the path from
the source, as sampling rounds find it; each node after it makes one item per call) stays open
while a first answer is pending: a fused, synchronous run (else refused before anything
starts). With a budget, which groups get it depends on which are judged first, as a group
quota's do. Both nodes' call policies (call_policy.py) share one `SecondRound`. In full:
docs/rl.md, "A second round for groups that agree".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from flowkit.planner.lower import Call
from flowkit.runner.call_policy import CallSite, PolicyDefaults
from flowkit.runner.sampling_rounds import path_to_generation
from flowkit.runner.stepstate import FlowRunError

__all__ = ["SECOND", "GenerationCalls", "SecondRound", "SecondRoundGroups",
           "checked_second_rounds", "second_round_nodes"]

SECOND = "second"  # a second-round call's lineage is its prompt's first call's + (SECOND,)


@attrs.define
class _Group:
    """One key's group: its items so far and where its calls stand."""

    members: list = attrs.field(factory=list)  # item lineages, in arrival order
    calls: set = attrs.field(factory=set)  # the generation calls its first samples came from
    phase: str = "first"  # first -> judged -> (second -> final) -> done
    second: tuple | None = None  # its second-round call


@attrs.define
class SecondRound:
    """One step's second rounds, shared by generation's and the group node's policies."""

    generation: str
    group: str
    more: int  # samples a second round draws
    budget: int | None  # second-round samples a step may draw (None: no bound)
    counts: dict = attrs.field(factory=dict)  # generation call -> its items, once it ended
    arrived: Counter = attrs.field(factory=Counter)  # generation call -> its items grouped
    call_key: dict = attrs.field(factory=dict)  # generation call -> its items' key
    groups: dict = attrs.field(factory=dict)  # key -> _Group
    dirty: dict = attrs.field(factory=dict)  # keys whose group may be ready, in turn
    prompts: dict | None = None  # generation's prompt refs by lineage (read again for a new one)
    site: Any = None  # generation's
    spent: int = 0  # second-round samples drawn
    again: int = 0  # groups sampled again
    kept: int = 0  # of them, those the op then yielded items for
    denied: int = 0  # groups that agreed when the budget was spent

    # -- what generation tells ------------------------------------------------------------------
    def call_ended(self, lineage: tuple, count: int) -> None:
        self.counts[lineage] = count
        if lineage in self.call_key:
            self.dirty[self.call_key[lineage]] = None

    def undecided(self) -> bool:
        """Whether a group may still ask generation for a second round."""
        if any(self.arrived[call] < count for call, count in self.counts.items()
               if call[-1:] != (SECOND,)):
            return True  # a first sample is on its way to its group
        return any(g.phase in ("first", "judged") for g in self.groups.values())

    # -- the group node's side ------------------------------------------------------------------
    def take(self, arrivals: list[tuple[tuple, Any]]) -> None:
        for lineage, key in arrivals:
            call = lineage[:-1]
            group = self.groups.setdefault(key, _Group())
            if call != group.second and call not in group.calls:
                if group.calls:
                    raise FlowRunError(
                        f"{self.group}: group_by(..., second_round={self.more}) groups one "
                        f"prompt's samples, and the samples of two generation calls ({call} "
                        f"and {sorted(group.calls)[0]}) share the key {key!r}: give each "
                        "prompt of a step its own key (prompt_id)")
                group.calls.add(call)
            group.members.append(lineage)
            self.arrived[call] += 1
            self.call_key[call] = key
            self.dirty[key] = None

    def ready(self, closed: bool) -> list[tuple[Any, list]]:
        """The groups to call now: each whose first samples (or second round) are all in; once
        the group's input has closed, every group not yet called for its samples."""
        keys = list(self.groups) if closed else list(self.dirty)
        self.dirty = {}
        out = []
        for key in keys:
            group = self.groups[key]
            if group.phase == "first" and (closed or self._in(group.calls)):
                group.phase = "final" if closed else "judged"
                out.append((key, list(group.members)))
            elif group.phase == "second" and (closed or self._in({group.second})):
                group.phase = "final"
                out.append((key, list(group.members)))
        return out

    def _in(self, calls: set) -> bool:
        return all(call in self.counts and self.arrived[call] == self.counts[call]
                   for call in calls)

    def answered(self, key: Any, count: int, site: CallSite) -> None:
        """The op ran on group `key` and yielded `count` items."""
        group = self.groups[key]
        if group.phase == "judged" and not count:
            granted = self.more if self.budget is None else min(self.more,
                                                                self.budget - self.spent)
            if granted > 0:
                self._sample_again(key, group, granted)
                return
            self.denied += 1
        elif group.phase == "final" and group.second is not None and count:
            self.kept += 1
        group.phase = "done"
        site.touch(self.generation)  # it may close now

    def _sample_again(self, key: Any, group: _Group, granted: int) -> None:
        (first,) = group.calls
        if self.prompts is None or first not in self.prompts:  # the source may still stream
            self.prompts = dict(self.site.lead_items())
        group.second, group.phase = first + (SECOND,), "second"
        self.call_key[group.second] = key
        self.spent += granted
        self.again += 1
        self.site.submit(group.second, self.prompts[first], like=first,
                         extra={"n": granted, "first_sample": self.counts[first]})


@attrs.define
class GenerationCalls(PolicyDefaults):
    """Generation's call policy: its own calls as without a second round, and the second
    rounds its groups ask for."""

    shared: SecondRound
    streams_parts = True  # a sample goes downstream as it is made

    @property
    def name(self) -> str:
        return self.shared.generation

    def submit(self, site: CallSite, prompts_closed: bool) -> bool:
        self.shared.site = site
        return True

    def done(self, lineage: tuple, future: Any, site: CallSite) -> bool:
        count = getattr(future, "count", None)
        self.shared.call_ended(lineage, count if isinstance(count, int) else 0)
        site.touch(self.shared.group)
        return True

    def may_close(self) -> bool:
        return not self.shared.undecided()

    def metrics(self, timeout: float) -> dict[str, float]:
        shared = self.shared
        return {f"{shared.generation}/second_rounds": shared.again,
                f"{shared.generation}/second_round_samples": shared.spent}


@attrs.define
class SecondRoundGroups(PolicyDefaults):
    """The group node's call policy: it forms the groups (`ready`) and hears each answer."""

    shared: SecondRound
    streams_parts = False  # a group's call answers whole

    @property
    def name(self) -> str:
        return self.shared.group

    def ready(self, arrivals: list[tuple[tuple, Any]], closed: bool) -> list[tuple[Any, list]]:
        """The groups to call now, given the items that arrived since: (key, members)."""
        self.shared.take(arrivals)
        return self.shared.ready(closed)

    def done(self, lineage: tuple, future: Any, site: CallSite) -> bool:
        count = getattr(future, "count", None)
        self.shared.answered(lineage[0], count if isinstance(count, int) else 0, site)
        return True

    def metrics(self, timeout: float) -> dict[str, float]:
        shared = self.shared
        return {f"{shared.group}/second_round_kept": shared.kept,
                f"{shared.group}/second_round_denied": shared.denied}


def second_round_nodes(plan: Sequence[Any]) -> dict[str, tuple[str, int, int | None]]:
    """The generation node of each group node with a second round: {generation: (group node,
    samples a second round draws, a step's budget of them)}. Generation is the first per-item
    node on the path from the step's source to the group's input, following each node's first
    streamed input; each node after it must make one item per call, so that a group knows when
    a call's samples are all in."""
    by_name = {node.name: node for node in plan}
    found: dict[str, tuple[str, int, int | None]] = {}
    for node in plan:
        for rule in node.inputs:
            if not getattr(rule, "group_second_round", None):
                continue
            path = path_to_generation(by_name, rule.src)  # as sampling rounds find it
            generation, between = path[-1], path[:-1]
            if by_name[generation].call is not Call.PER_ITEM:
                raise ValueError(f"{node.name}: group_by(..., second_round=) samples a group's "
                                 "prompt again with the per-item op that generated it, and no "
                                 f"per-item op feeds it (its input comes from {rule.src!r})")
            _check_generation(node.name, by_name[generation])
            many = [name for name in between if any(by_name[name].many)]
            if many:
                raise ValueError(f"{node.name}: group_by(..., second_round=) needs one item per "
                                 f"call from each op between {generation!r} and the group, and "
                                 f"{many[0]!r} yields a Stream: make it return one item")
            if generation in found:
                raise ValueError(f"{generation}: two group_by(..., second_round=) downstream "
                                 "sample it again; give one of them a second round")
            found[generation] = (node.name, int(rule.group_second_round),
                                 rule.group_second_budget)
    return found


def _check_generation(group: str, generation: Any) -> None:
    """Generation makes a Stream of a prompt's samples, and is told a later round's n and
    first_sample (a model's generate is; a function op must take them)."""
    if generation.many != (True,):
        raise ValueError(f"{group}: group_by(..., second_round=) samples a group's prompt again "
                         f"with {generation.name!r}, which makes one item a call, not a Stream "
                         "of the prompt's samples")
    config = generation.config
    if int(config.get("branches") or 1) >= 2 and (config.get("branch_at") or
                                                  config.get("branch_entropy") is not None):
        raise ValueError(f"{group}: group_by(..., second_round=) numbers a later round's samples "
                         f"on from the first round's, and {generation.name!r} grows trees, "
                         "whose leaves are not its roots: drop the branching or the second "
                         "round")
    keywords = generation.keywords
    if generation.op == "python" and keywords is not None and \
            not {"n", "first_sample"} <= keywords:
        raise ValueError(f"{group}: group_by(..., second_round=) tells {generation.name!r} a "
                         "later round's n and first_sample (the index of its first sample), "
                         "and the function takes no such keywords: give it n and first_sample "
                         "parameters")


def checked_second_rounds(plan: Sequence[Any], partial: dict, rounds: dict, *, fuse: bool
                          ) -> dict[str, tuple[str, int, int | None]]:
    """`second_round_nodes(plan)`, checked before anything starts: a fused run (stage by stage
    a group runs once generation has closed), not a node with partial rollouts or sampling
    rounds; the asynchronous case is refused by flowrun.check_async."""
    try:
        found = second_round_nodes(plan)
    except ValueError as exc:
        raise FlowRunError(str(exc)) from None
    if found and not fuse:
        raise FlowRunError(f"{', '.join(group for group, _, _ in found.values())}: "
                           "group_by(..., second_round=) samples a group again while its step "
                           "generates, and stage by stage (--no-fuse) a group runs once "
                           "generation has ended: run fused, or drop the second round")
    for name, (group, _, _) in found.items():
        for other, what in ((partial, "partial rollouts (oversample)"),
                            (rounds, "sampling rounds (group_by(..., rounds=))")):
            if name in other:
                raise FlowRunError(f"{name}: {what} and a second round (group_by(..., "
                                   f"second_round=) at {group}) both decide which of its "
                                   "calls run; use one")
    return found
