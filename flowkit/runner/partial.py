"""Partial rollouts: a step over-provisions generation and takes the groups that finish first.

The design: [Note: partial rollouts] below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from flowkit.dsl import Resumable
from flowkit.runner.call_policy import CallSite

__all__ = ["CARRIED", "Carried", "CarryOver", "PartialCalls", "PartialRollouts", "carried_key"]


# [Note: partial rollouts] After APRIL (Zhou et al. 2025). A node whose op declares its calls
# resumable (ModelOp.resumable: Generate's), with T in its config key `take` (from `oversample`):
#   - a call (one prompt's group of n samples) goes downstream only when the whole group is done,
#     so a group never trains half in one step and half in the next;
#   - the first T calls to end are the step's; then the node aborts the rest (the op's
#     `abort_op`), which come back with finished samples and `interrupted` ones with their
#     per-token versions, and carry over: the next step submits them first, keyed
#     `"<origin>/<key>"` and keeping their origin step's seeds;
#   - a step runs P calls (its source's prompts), carried ones in the places of its own; it calls
#     T of its own as soon as the admission gate lets it [Note: asynchronous steps in
#     flowrun.py], the rest once the step before has handed over what it carries;
#   - a carried sample older than the bound (version < step - η, `version_floor`) is recomputed or
#     its group dropped, per the node's `stale_segments`. So each sample trains once, is dropped,
#     or is still carried after the last step; partial rollouts need η >= 1. In full: docs/rl.md,
#     "Asynchronous RL: bounded staleness and partial rollouts".

# [Note: own prompts first] With `stale_segments="drop"` (the node's Resumable.stale setting), a
# step calls all its own prompts as soon as its generation is admitted, and the calls carried from
# the step before run beside them as they arrive, taking no place. A step carries at most
# prompts - take calls on, and never one it was carried (those past either drop whole, counted in
# `rollout/dropped`), so it runs at most its prompts plus prompts - take. The reason is the
# staleness bound: a step's generation is admitted once the weights are at most η versions older
# than its own, so a call it carries began under weights its next step may not train on.
# Resumed, such a call is sampled again from its prompt (recompute) or dropped (drop): waiting
# for it to take a place only holds the next step's prompts back (partial / async stays about 1
# that way: `flowkit bench rl --stale-segments recompute`). Dropped, it frees its place: the
# step's own over-provisioned prompts all race from the start, and the first `take` groups to
# finish cut the long tail, as in APRIL. A carried call whose tokens are all within the bound
# (one that had not started) still runs and counts like any other group.

CARRIED = "carried"  # the first part of a carried call's lineage in the step that resumes it


@attrs.frozen
class PartialRollouts:
    """A node's setting: the calls (groups) a step takes, the items a call makes unless its
    output says how many (adaptive n, trees: each call its own count), how its calls are named,
    aborted and continued, and whether a carried call's stale groups are dropped (then carried
    calls take no places: [Note: own prompts first])."""

    take: int
    n: int
    resumable: Resumable
    drop_stale: bool = False


@attrs.define
class Carried:
    """A call that carries over: its output future (its group's rollouts, the unfinished
    ones interrupted)."""

    origin: int  # the step whose prompt it is (its sampling seeds)
    lineage: tuple  # in the origin step
    ref: Any
    count: int | None = None  # its samples, where `ref` does not say (one put back on resume)

    @property
    def resumed_lineage(self) -> tuple:
        return (CARRIED, self.origin, *self.lineage)

    def samples(self, n: int) -> int:
        """The samples it carries: every sample of its group, finished or interrupted (its
        output's count), or `n` where nothing says."""
        return self.count if self.count is not None else _count(self.ref, n)


def _count(future: Any, n: int) -> int:
    """A done call's item count (a Future's), else `n`."""
    count = getattr(future, "count", None)
    return count if isinstance(count, int) else n


def carried_origin(lineage: tuple) -> int | None:
    return lineage[1] if lineage and lineage[0] == CARRIED else None


def carried_key(lineage: tuple, key: Any) -> Any:
    """A group key reported for an item of a carried call, made distinct from the keys of
    the step's own prompts."""
    origin = carried_origin(lineage)
    return key if origin is None or key is None else f"{origin}/{key}"


class OpenStep(Protocol):
    """A step the ledger hands carried calls to (steprun.StepRun)."""

    def node_closed(self, name: str) -> bool: ...

    def receive_carried(self, name: str, calls: list[Carried]) -> None: ...


class CarryOver:
    """The carry-over ledger: calls a step's node carries to the next step, handed to it if
    it is open, else kept until it opens. `open` is the runner's open steps, by number."""

    def __init__(self, open_steps: Mapping[int, OpenStep]) -> None:
        self.open = open_steps
        self.waiting: dict[int, dict[str, list[Carried]]] = {}  # for steps not open yet

    def carry(self, node: str, step: int, calls: list[Carried]) -> None:
        """`step`'s node `node` is done: its carried calls to the step after it."""
        following = self.open.get(step + 1)
        if following is not None:
            following.receive_carried(node, calls)
        elif calls:
            self.waiting.setdefault(step + 1, {}).setdefault(node, []).extend(calls)

    def take(self, node: str, step: int) -> list[Carried]:
        return self.waiting.get(step, {}).pop(node, [])

    def settled(self, node: str, step: int) -> bool:
        """No step before `step` may still carry calls of `node` over to it."""
        before = self.open.get(step - 1)
        return before is None or before.node_closed(node)

    @property
    def pending(self) -> int:
        """Calls carried past the last step run, not yet in any open step."""
        return sum(len(calls) for by_node in self.waiting.values() for calls in by_node.values())


@attrs.define
class PartialCalls:
    """One node's partial rollouts in one step: its call policy (call_policy.py)."""

    name: str
    step: int
    setting: PartialRollouts
    ledger: CarryOver
    request_prefix: str  # unique to the runner and step: names its calls for the abort
    version_floor: int  # the oldest weights version a carried call may keep
    streams_parts = False  # a group goes downstream whole, in one step or the next
    taken: int = 0
    aborting: bool = False
    incoming: list[Carried] = attrs.field(factory=list)  # from the step before, to run
    incoming_sent: int = 0
    # from the step before, passed on unrun (this step had taken its groups)
    passed: list[Carried] = attrs.field(factory=list)
    outgoing: list[Carried] = attrs.field(factory=list)  # to the next step
    deferred: list[tuple] = attrs.field(factory=list)  # own prompts waiting for the count
    resumed: dict[tuple, Carried] = attrs.field(factory=dict)  # lineage here -> the call
    pending_calls: dict[tuple, str] = attrs.field(factory=dict)  # lineage -> request name
    aborts: list[Any] = attrs.field(factory=list)  # futures of [samples, tokens] cut
    dropped: int = 0
    started: int = 0  # samples of the step's own calls (taken or carried on)
    grown: int = 0  # samples a resumed call's trees grew past those it was carried with
    own: int = 0  # of the step's own prompts, those it runs
    unused: int = 0  # and those it leaves: the carried calls took their places
    prompts: int = 0  # the step's own prompts, as admit was told

    def submit(self, site: CallSite, prompts_closed: bool) -> bool:
        """The calls carried from the step before as they arrive; the step's own prompts once
        they are all in (how many is `admit`'s), those deferred once the step before has
        handed over all it carries."""
        floor = {self.setting.resumable.version_floor: self.version_floor}
        for carried in self.incoming[self.incoming_sent:]:
            lineage = carried.resumed_lineage
            self.resumed[lineage] = carried
            site.submit(lineage, carried.ref, extra={"step": carried.origin, **floor},
                        meta={"origin": carried.origin})
        self.incoming_sent = len(self.incoming)
        if self.deferred and self._settled():
            self._call_deferred(site)
        return prompts_closed

    def admit(self, prompts: int, lineage: tuple) -> bool:
        """Whether own prompt `lineage` of the step's `prompts` is called now: in the places
        the carried calls leave, of which there are `take` at least (the step before carries
        at most prompts - take); those past `take` are deferred until the count is known.
        Where stale groups are dropped, every own prompt at once [Note: own prompts first]."""
        if self.aborting:
            self.unused += 1
            return False
        self.prompts = prompts
        if self.setting.drop_stale:  # [Note: own prompts first]
            if self.own >= prompts:
                self.unused += 1
                return False
            self.own += 1
            return True
        if not self._settled():
            if self.own >= self.setting.take:
                self.deferred.append(lineage)
                return False
        elif self.own + len(self.incoming) >= prompts:
            self.unused += 1
            return False
        self.own += 1
        return True

    def _settled(self) -> bool:
        return self.ledger.settled(self.name, self.step)

    def _call_deferred(self, site: CallSite) -> None:
        """The deferred own prompts, in the places the carried calls left (none once the
        step has taken its groups)."""
        deferred, self.deferred = set(self.deferred), []
        prompts = site.lead_items()
        for lineage, ref in prompts:
            if lineage not in deferred:
                continue
            if self.aborting or self.own + len(self.incoming) >= len(prompts):
                self.unused += 1
                continue
            self.own += 1
            site.submit(lineage, ref)

    def config(self, lineage: tuple) -> dict:
        """Each call named, to abort it."""
        name = self.pending_calls[lineage] = f"{self.request_prefix}:{lineage}"
        return {self.setting.resumable.request: name}

    def done(self, lineage: tuple, future: Any, site: CallSite) -> bool:
        self.pending_calls.pop(lineage, None)
        if lineage not in self.resumed:
            self.started += _count(future, self.setting.n)
        dropped = self._dropped_whole(lineage, future)
        if self.aborting:  # after the step took its groups: to the next step
            if not dropped and not self._dropped_instead_of_carried(lineage, future):
                self._carry(lineage, future)
            return False
        if not dropped:  # a call dropped whole is no group: the step still wants its `take`
            self.taken += 1
            if self.taken >= self.setting.take:
                self._abort_the_rest(site)
        return True

    def _abort_the_rest(self, site: CallSite) -> None:
        self.aborting = True
        requests = list(self.pending_calls.values())
        if requests:
            self.aborts.extend(site.abort(requests))

    def _dropped_whole(self, lineage: tuple, future: Any) -> bool:
        """Whether a resumed call came back short: its group dropped as stale (counted here,
        neither trained nor carried again)."""
        count = getattr(future, "count", None)
        if lineage not in self.resumed:
            return False
        carried = self.resumed[lineage].samples(self.setting.n)
        if count is None or count >= carried:
            self.grown += 0 if count is None else count - carried  # a tree's new branches
            return False
        self.dropped += carried - count
        return True

    def _dropped_instead_of_carried(self, lineage: tuple, future: Any) -> bool:
        """[Note: own prompts first]: where stale groups drop, a call carried in is not
        carried again, and a step carries at most prompts - take calls (its own run beside
        the carried ones, so more could end after its take); the others drop whole."""
        if not self.setting.drop_stale:
            return False
        if lineage in self.resumed or len(self.outgoing) >= self.prompts - self.setting.take:
            self.dropped += _count(future, self.setting.n)
            return True
        return False

    def _carry(self, lineage: tuple, ref: Any) -> None:
        """A call of this step goes to the next one; a resumed call keeps its origin."""
        origin, first = self.step, carried_origin(lineage)
        if first is not None:
            origin, lineage = first, lineage[2:]
        self.outgoing.append(Carried(origin, lineage, ref))

    def may_close(self) -> bool:
        return self._settled() and not self.deferred

    def closed(self) -> None:
        self.ledger.carry(self.name, self.step, self.outgoing)

    def receive(self, calls: list, *, closed: bool) -> None:
        """Run them, or pass them on if the step has taken its groups already."""
        if self.aborting or closed:
            self.outgoing.extend(calls)
            self.passed.extend(calls)
        else:
            self.incoming.extend(calls)

    def metrics(self, timeout: float) -> dict[str, float]:
        cut = [f.result(timeout=timeout) for f in self.aborts]
        n, passed = self.setting.n, self.passed
        return {f"{self.name}/taken_groups": self.taken,
                "rollout/carried_over": sum(c.samples(n) for c in self.outgoing),
                "rollout/started": self.started,
                "rollout/resumed": sum(c.samples(n) for c in [*self.incoming, *passed]),
                "rollout/passed_on": sum(c.samples(n) for c in passed),
                "rollout/prompts_unused": self.unused,
                "rollout/aborted_samples": sum(int(c[0]) for c in cut if c),
                "rollout/aborted_tokens": sum(int(c[1]) for c in cut if c),
                "rollout/dropped": self.dropped,
                "rollout/grown": self.grown}
