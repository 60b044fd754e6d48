"""The seam between a step and the ways a per-item node's calls may differ from "one call per item,
its items downstream when they exist": partial rollouts (partial.py) over-provision a step, take the
calls that end first and carry the rest into the next step; a resumed asynchronous run replays a
step's checkpointed calls (checkpoints/open_steps.py). A step (steprun.py) asks the node's
`CallPolicy` at each turn instead of knowing either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from flowkit.planner.lower import InputRule
from flowkit.runner.stepstate import NodeState

__all__ = ["CallPolicy", "CallSite", "PolicyDefaults", "StepSite"]


class CallSite(Protocol):
    """What a policy may do to its node in its step (the step implements it)."""

    def submit(self, lineage: tuple, lead: Any, *, extra: dict | None = None,
               meta: dict | None = None, like: tuple | None = None) -> None:
        """Call the node on `lead` as its item-leading input, as call `lineage` (balanced as
        call `like` of the same item would be: a later round of a prompt)."""

    def abort(self, requests: Sequence[str]) -> list[Any]:
        """Cut the named calls short; the futures of the aborts, which the node waits for."""

    def lead_items(self) -> list[tuple[tuple, Any]]:
        """The items of the node's item-leading input so far, (lineage, ref) in arrival
        order."""

    def touch(self, node: str | None = None) -> None:
        """Have the step look at the node (or `node`) again (its policy's answers may have
        changed)."""


class CallPolicy(Protocol):
    """How one per-item node's calls are made and ended in one step."""

    streams_parts: bool  # a call's items may go downstream one by one as they are yielded

    def submit(self, site: CallSite, prompts_closed: bool) -> bool:
        """Make the policy's own calls (carried, replayed); whether the step's own items may
        be called now (`prompts_closed`: all of them are in)."""

    def admit(self, prompts: int, lineage: tuple) -> bool:
        """Whether the step's own item `lineage`, one of its `prompts`, is called now (else
        the policy skips it, or calls it later through the site)."""

    def config(self, lineage: tuple) -> dict:
        """What call `lineage` is told besides the node's config."""

    def done(self, lineage: tuple, future: Any, site: CallSite) -> bool:
        """Call `lineage` ended with `future`: whether its items go downstream in this step."""

    def may_close(self) -> bool:
        """Whether the node may end once its calls have."""

    def closed(self) -> None:
        """The node ended."""

    def receive(self, calls: list, *, closed: bool) -> None:
        """Calls the step before carried over (the node `closed` already, or not)."""

    def metrics(self, timeout: float) -> dict[str, float]:
        """What the step reports of the node's calls."""


class PolicyDefaults:
    """What a call policy that leaves a part of its node as it is answers there: every item
    called at once, no config of its own, the node may close once its calls have, nothing
    carried over (a subclass names itself `name`)."""

    name: str

    def submit(self, site: CallSite, prompts_closed: bool) -> bool:
        return True

    def admit(self, prompts: int, lineage: tuple) -> bool:
        return True

    def config(self, lineage: tuple) -> dict:
        return {}

    def may_close(self) -> bool:
        return True

    def closed(self) -> None:
        pass

    def receive(self, calls: list, *, closed: bool) -> None:
        raise RuntimeError(f"{self.name}: its step carries no calls over")


class StepSite:
    """A node of a step (steprun.StepRun) as its call policy acts on it: the CallSite a step
    gives its policies."""

    def __init__(self, run: Any, state: NodeState, lead: InputRule | None = None) -> None:
        self.run, self.state, self.lead = run, state, lead

    def submit(self, lineage: tuple, lead: Any, *, extra: dict | None = None,
               meta: dict | None = None, like: tuple | None = None) -> None:
        """The call goes where the node's balancer says, as the step's own calls do."""
        run, state = self.run, self.state
        state.submitted.add(lineage)
        name, executor = state.plan.name, None
        balancer = run.balancers.get(name)
        if balancer is not None:
            workload = run.submission.workloads[name]
            keys = run.streams.of(workload.lead).keys if workload.keyed else {}
            executor = balancer.assign(lineage, keys.get(like or lineage))
        run.submit(state, lineage, {self.lead.port: lead}, executor=executor, extra=extra,
                   meta=meta)

    def abort(self, requests: Sequence[str]) -> list[Any]:
        run, state = self.run, self.state
        aborts = run.submission.abort_calls(state.plan, requests, run.step)
        for abort in aborts:
            run.watch(state, (), (abort,), register=False)
        return aborts

    def lead_items(self) -> list[tuple[tuple, Any]]:
        stream = self.run.streams.of(self.lead)
        return [(lineage, stream.items[lineage]) for lineage in stream.arrivals]

    def touch(self, node: str | None = None) -> None:
        self.run.touch(node or self.state.plan.name)
