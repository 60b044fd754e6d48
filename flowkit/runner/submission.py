"""What every step of a run sends its calls through: the flow's wiring, the controller, the queue of
reactions the run takes one at a time, the balancers' estimates, the call policies a step's nodes
get, and the lending of trainers' bubbles. The runner (flowrun.py) builds one for the run; each
`StepRun` (steprun.py) is given it.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any

import attrs

from flowkit.planner.lower import Call, NodePlan
from flowkit.runner.balance import Balancer
from flowkit.runner.bubble_fill import BubbleFill
from flowkit.runner.call_policy import CallPolicy
from flowkit.runner.checkpoints.adaptor import RunnerCheckpoints
from flowkit.runner.partial import CarryOver, PartialCalls, PartialRollouts
from flowkit.runner.quota import GroupQuota
from flowkit.runner.sampling_rounds import SamplingRounds
from flowkit.runner.second_round import GenerationCalls, SecondRound, SecondRoundGroups
from flowkit.runner.stepstate import BalancedCalls, Wiring
from flowkit.runtime.controller import Controller

__all__ = ["STREAM_WINDOW", "Submission", "function_config", "streams_parts"]

# A streaming call runs at most this many items ahead of the items whose consumers are done
# [Note: stream credits in flowkit/runtime/credits.py]: a bound on what a slow consumer lets
# queue up, far above what a generation call streams between two reactions.
STREAM_WINDOW = 1024


@attrs.define(kw_only=True, eq=False)
class Submission:
    """A run's way out for its steps' calls."""

    wiring: Wiring
    ctl: Controller
    events: queue.SimpleQueue  # every open step's reactions, run one at a time by the run
    workloads: dict[str, BalancedCalls]  # nodes whose calls are balanced by predicted work
    trainers: frozenset[int]  # the executors that train a model: lent to a balancer's count
    # the lending of training executors' bubbles to scoring, when the run fills them
    # [Note: bubble filling in flowkit/runner/bubble_fill.py]
    bubble_fill: BubbleFill | None
    # call policies [Note: partial rollouts in partial.py]: by node, what makes them
    partial: dict[str, PartialRollouts]
    quotas: dict[str, int]
    rounds: dict[str, tuple[str, int]]
    second_rounds: dict[str, tuple[str, int, int | None]]  # [Note: second rounds]
    carry_over: CarryOver
    checkpoints: RunnerCheckpoints  # a resumed run's replays
    staleness: int | None
    attempt: str  # in request names: unique to this runner
    handled_parts: list = attrs.field(factory=list)  # streamed items taken in since settling
    ahead: Any = None  # a synchronous run's next sources [Note: sources ahead in sources_ahead.py]

    def send(self, plan: NodePlan, step: int, args: Sequence, config: dict, *,
             executor: int | None = None, meta: dict | None = None,
             on_part: Any = None) -> Any:
        """One call of `plan`'s op in step `step` on `args`: its future (a tuple of them for
        several outputs); `on_part(part)`: each item as the call yields it."""
        return self.ctl.submit(plan.op, *args, config=config, executor=executor, tags=plan.tags,
                               outputs=max(1, len(plan.outputs)),
                               meta={"node": plan.name, "step": step, **(meta or {})},
                               report_key=self.wiring.report_keys.get(plan.name),
                               on_part=on_part, trace_key=plan.trace_key,
                               window=None if on_part is None else STREAM_WINDOW,
                               handled_by_caller=on_part is not None)

    def send_source(self, plan: NodePlan, step: int, on_part: Any) -> Any:
        """A source's call in step `step` [Note: sources ahead in sources_ahead.py]."""
        streams = streams_parts(self.wiring.fuse, plan, None)
        return self.send(plan, step, (), function_config(plan, step, []),
                         on_part=on_part if streams else None)

    def balancer(self, name: str, plan: NodePlan) -> Balancer | None:
        """A step's balancer of node `name`'s calls, over the estimates of every step."""
        config = self.wiring.op_configs[name]
        able = [e.id for e in self.ctl.executors() if e.runs(plan.op, frozenset(plan.tags))]
        if not able:
            return None  # the dispatcher says why when the first call is submitted
        infos = {e.id: e for e in self.ctl.executors()}
        return Balancer(self.workloads[name].estimates, able,
                        count=config.get(plan.workload.count, 1),
                        budget=config.get(plan.workload.budget, 1),
                        lent=frozenset(e for e in self.trainers if e in able),
                        outstanding=lambda executor: infos[executor].outstanding)

    # -- call policies: partial rollouts and replay ([Note: partial rollouts in partial.py],
    # [Note: checkpoints of asynchronous runs in flowkit/runner/checkpoints/open_steps.py]) ---
    def call_policies(self, step: int) -> dict[str, CallPolicy]:
        """Step `step`'s nodes whose calls are replayed from a checkpoint, or partial."""
        policies: dict[str, CallPolicy] = dict(self.checkpoints.replays(step))
        floor = step - (self.staleness or 0)  # the oldest version a carried call may keep
        for name, setting in self.partial.items():
            if name not in policies:
                policies[name] = PartialCalls(name, step, setting, self.carry_over,
                                              f"{self.attempt}:{step}", floor,
                                              incoming=self.carry_over.take(name, step))
        for name, take in self.quotas.items():  # [Note: group quota] in quota.py
            policies.setdefault(name, GroupQuota(name, take))
        for name, (quota, rounds) in self.rounds.items():  # [Note: sampling rounds]
            policies.setdefault(name, SamplingRounds(name, rounds, policies[quota],
                                                     self.wiring.fuse))
        for name, (group, more, budget) in self.second_rounds.items():  # [Note: second rounds]
            shared = SecondRound(name, group, more, budget)
            policies[name], policies[group] = GenerationCalls(shared), SecondRoundGroups(shared)
        return policies

    def abort_calls(self, plan: NodePlan, requests: Sequence[str], step: int) -> list[Any]:
        """Ask every engine that may run `plan`'s calls to abort these requests with the
        op's declared abort op; each reply is [samples, tokens] cut."""
        abort_op = plan.resumable.abort_op
        targets = [e for e in self.ctl.executors()
                   if e.runs(plan.op, frozenset(plan.tags)) and abort_op in e.ops]
        return [self.ctl.submit(abort_op, config=plan.resumable.abort_config(requests),
                                executor=e.id, meta={"node": f"{plan.name}/abort", "step": step})
                for e in targets]


def function_config(plan: NodePlan, step: int, ports: list[str],
                    extra: dict | None = None) -> dict:
    """The config of a call of function op `plan` in step `step` on inputs `ports`, with a
    call policy's `extra` keyword arguments (a second round's n and first_sample)."""
    config = {**plan.config, "step": step} if plan.takes_step else plan.config
    config = {**config, **extra} if extra else config
    return {"target": plan.target, "config": config, "ports": ports,
            "outputs": list(plan.outputs), "many": list(plan.many)}


def streams_parts(fuse: bool, plan: NodePlan, policy: CallPolicy | None) -> bool:
    """Whether a call's items go downstream each as it is yielded: one output of many items,
    in a fused run (unfused, consumers wait for the whole stream anyway), of a call that is not
    a group's. A group is complete when it is called, so its items come as fast as the op
    computes them; its calls go batched instead, and a batched task that runs long still
    answers the groups it has finished [Note: early items in executors/process.py]."""
    return fuse and plan.many == (True,) and plan.call is not Call.PER_GROUP \
        and (policy is None or policy.streams_parts)  # a partial-rollout group goes whole
