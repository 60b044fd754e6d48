"""A flow runner as its checkpoints see it: the one object through which writing, restoring and
replaying a checkpoint reach the runner (format.Checkpointed), so that FlowRunner holds no
checkpoint code [Note: run checkpoints in flowkit/runner/checkpoints/format.py].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from flowkit.planner.lower import NodePlan
from flowkit.runner.checkpoints.open_steps import Replay
from flowkit.runner.partial import Carried, CarryOver
from flowkit.runner.stepstate import RunnerState, Streams

__all__ = ["RunnerCheckpoints"]


class _Runner(Protocol):
    """What of a runner (flowrun.FlowRunner) its checkpoints read and resume."""

    ctl: Any
    plan: list[NodePlan]
    feedback: Any  # its Feedback (feedback.py): the nodes admission control holds back
    staleness: int | None
    step: int
    step_timeout: float
    events: Any  # its reactions' queue
    open: dict  # step -> its open StepRun
    carry_over: CarryOver
    placement: dict
    profiles: dict
    training: dict  # model -> its ModelTraining
    watchers: list[Callable[[], None]]
    previous: Streams

    def run_reactions(self, timeout: float) -> None: ...

    def resume_feedback(self, step: int, streams: Streams) -> None: ...


class RunnerCheckpoints:
    """`runner`'s side of its checkpoints: what a checkpoint copies at a step boundary, what
    the open steps add once their generation has ended, and what a resumed run takes back
    (its feedback, trainings, and the open steps' calls it replays)."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner
        # those whose calls a checkpoint drains and replays: the nodes admission control holds
        # back (the feedback's gated ones) that can be aborted and continued
        # [Note: asynchronous steps in flowkit/runner/flowrun.py]
        resumable = {node.name for node in runner.plan if node.resumable is not None}
        self.generating = [name for name in runner.feedback.gated if name in resumable]
        # a resumed asynchronous run's open steps: step -> node -> lineage -> the saved
        # rollouts of that call, and the partial-rollout metrics they report
        # [Note: checkpoints of asynchronous runs in flowkit/runner/checkpoints/open_steps.py]
        self._replay: dict[int, dict[str, dict[tuple, Any]]] = {}
        self._replay_metrics: dict[int, dict[str, dict]] = {}

    # -- the runner, as format.Checkpointed names it ------------------------------------------
    @property
    def ctl(self) -> Any:
        return self.runner.ctl

    @property
    def staleness(self) -> int | None:
        return self.runner.staleness

    @property
    def events(self) -> Any:
        return self.runner.events

    @property
    def open(self) -> dict:
        return self.runner.open

    @property
    def training(self) -> dict:
        return self.runner.training

    @property
    def watchers(self) -> list[Callable[[], None]]:
        return self.runner.watchers

    @property
    def carried(self) -> dict[int, dict[str, list[Carried]]]:
        """Calls carried past the open steps, by the step that takes them and node."""
        return self.runner.carry_over.waiting

    def run_reactions(self, timeout: float) -> None:
        self.runner.run_reactions(timeout)

    # -- writing ------------------------------------------------------------------------------
    def open_resumable(self) -> dict[int, dict[str, bool]]:
        """Each open step's generating nodes: whether each has ended."""
        return {step: {name: run.node_closed(name) for name in self.generating}
                for step, run in self.runner.open.items()}

    def boundary(self) -> RunnerState:
        """What a checkpoint holds at a step boundary of all but the open steps' generation,
        copied (it is read once that generation has ended, [Note: checkpoints that do not
        drain] in flowkit/runner/checkpoints/writer.py)."""
        runner = self.runner
        return RunnerState(
            staleness=runner.staleness,
            placement={model: [e.name for e in chosen]
                       for model, chosen in sorted(runner.placement.items())},
            feedback=self._feedback_refs_next(), profiles=dict(runner.profiles),
            training={name: t.carried_state() for name, t in runner.training.items()})

    def open_state(self, runs: Mapping[int, Any],
                   carried: Mapping[int, dict[str, list[Carried]]]) -> dict[str, Any]:
        """The part of a checkpoint that the open steps `runs` make once their generating
        nodes have ended: each one's outputs and call metrics, and the calls carried past the
        last (`carried`: those the ledger held at the boundary for steps not open then)."""
        last = max(runs, default=None)
        # the last open step's carried calls are its policy's (in the ledger or not, yet)
        past = {step: dict(by_node) for step, by_node in carried.items()
                if last is None or step != last + 1}
        if last is not None:
            for name in self.generating:
                policy = runs[last].policies.get(name)
                outgoing = list(getattr(policy, "outgoing", ()))
                if outgoing:
                    past.setdefault(last + 1, {})[name] = outgoing
        timeout = self.runner.step_timeout
        return {"open_calls": {step: {name: run.outputs(name) for name in self.generating}
                               for step, run in sorted(runs.items())},
                "open_metrics": {step: metrics for step, run in sorted(runs.items())
                                 if (metrics := {name: policy.metrics(timeout)
                                                 for name, policy in run.policies.items()})},
                "carried": dict(sorted(past.items()))}

    def _feedback_refs_next(self) -> dict[tuple[str, str], Any]:
        """The ref of the value each feedback input will read in the next step."""
        refs = {}
        previous = self.runner.previous
        for node in self.runner.plan:
            for rule in node.inputs:
                key = (rule.src, rule.src_port)
                stream = previous.get(key) if rule.feedback else None
                if stream is not None and stream.items:
                    refs[key] = stream.ordered()[-1]
        return refs

    # -- resuming -----------------------------------------------------------------------------
    def resume(self, step: int, feedback: Streams, profiles: dict,
               training: Mapping[str, dict]) -> None:
        """A resumed run goes on at `step` (restore.py): its feedback, profiled costs and
        what its trainings carry across steps."""
        runner = self.runner
        runner.resume_feedback(step, feedback)
        runner.profiles.update(profiles)
        for name, carried in training.items():
            runner.training[name].restore_carried(carried)

    def resume_open_steps(self, calls: Mapping[int, dict[str, dict[tuple, Any]]],
                          metrics: Mapping[int, dict[str, dict]],
                          carried: Mapping[int, dict[str, list[Carried]]]) -> None:
        """A resumed asynchronous run's open steps replay `calls` and report `metrics`;
        `carried` wait for their steps [Note: checkpoints of asynchronous runs]."""
        self._replay.update(calls)
        self._replay_metrics.update(metrics)
        waiting = self.runner.carry_over.waiting
        for step, by_node in carried.items():
            for name, calls_of_node in by_node.items():
                waiting.setdefault(step, {}).setdefault(name, []).extend(calls_of_node)

    def replays(self, step: int) -> dict[str, Replay]:
        """Step `step`'s generating nodes whose calls are replayed from the checkpoint it
        resumed from: each one's call policy (taken once)."""
        metrics = self._replay_metrics.pop(step, {})
        carry_over = self.runner.carry_over
        return {name: Replay(name, step, calls, metrics.get(name, {}), carry_over,
                             outgoing=carry_over.take(name, step))
                for name, calls in self._replay.pop(step, {}).items()}

