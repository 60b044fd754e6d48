"""The controller's part of a run checkpoint (`RunState`): what it holds, as the bytes of its file
and read back with every field checked against its schema [Note: run state on disk in
flowkit/runner/checkpoints/state_codec.py].
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from flowkit.planner.ir import Action, Costs, Placement, Schedule
from flowkit.runner.checkpoints.open_steps import CarriedCall, OpenCall, OpenWork
from flowkit.runner.checkpoints.state_codec import (
    CheckpointError,
    decode_state,
    encode_state,
    read_private,
    reason,
    short,
)

__all__ = ["MAX_RUN_STATE", "RunState", "read_state", "state_bytes"]

_MAX_DEPTH = 32  # nesting of a plain metrics value
_MAX_STEP = 1 << 40
# bytes of a run state: what one read allocates, checked before it; an asynchronous run's open
# steps' rollouts are the largest part (tokens of thousands of samples: tens of MiB)
MAX_RUN_STATE = 2 << 30


# -- the state and its schema ------------------------------------------------------------------
@attrs.define(kw_only=True)
class RunState:
    """The controller's part of a checkpoint."""

    step: int
    records: list[dict]  # the metrics lines so far, as written
    feedback: dict[tuple, Any]  # (node, port) -> the last value the step before produced
    # model -> what its ModelTraining carries across steps (model_training.carried_state)
    training: dict[str, dict]
    profiles: dict  # (model, stages) -> profiled stage costs
    # an asynchronous run's open steps [Note: checkpoints of asynchronous runs]; None: sync
    open_work: OpenWork | None = None


def state_bytes(state: RunState) -> bytes:
    """`state` as the bytes of its file."""
    work = state.open_work
    return encode_state({
        "step": state.step, "records": list(state.records),
        "feedback": [[node, port, value] for (node, port), value in state.feedback.items()],
        "training": {model: {"item_counts": dict(carried["item_counts"]),
                             "token_counts": dict(carried.get("token_counts", {})),
                             "predicted_bubble": dict(carried["predicted_bubble"]),
                             "last_schedule": _schedule_plain(carried["last_schedule"])}
                     for model, carried in state.training.items()},
        "profiles": [[model, stages, {"F": list(costs.F), "B": list(costs.B),
                                      "W": list(costs.W), "comm": costs.comm,
                                      "per_op": costs.per_op}]
                     for (model, stages), costs in state.profiles.items()],
        "open_work": None if work is None else {
            "calls": [[step, node, [[c.lineage, list(c.items)] for c in calls]]
                      for step, by_node in work.calls.items() for node, calls in by_node.items()],
            "partial": [[step, node, metrics] for step, by_node in work.partial.items()
                        for node, metrics in by_node.items()],
            "carried": [[c.step, c.node, c.origin, c.lineage, list(c.items)]
                        for c in work.carried]},
    })


def read_state(path: Path, records: Mapping[str, type], sha256: str | None = None
               ) -> RunState:
    """The run state in file `path` (of that SHA-256, when given), every field checked; a
    CheckpointError of one line naming `path` and the field otherwise."""
    plain = decode_state(read_private(path, "--resume", MAX_RUN_STATE, sha256), path, records)
    check = _Check(path)
    fields = check.keys(plain, "the state", {"format", "step", "records", "feedback", "training",
                                             "profiles", "open_work"})
    step = check.count(fields["step"], "step", _MAX_STEP)
    records_ = [check.metrics(line, f"records[{i}]")
                for i, line in enumerate(check.list(fields["records"], "records"))]
    feedback = {}
    for i, entry in enumerate(check.list(fields["feedback"], "feedback")):
        node, port, value = check.row(entry, f"feedback[{i}]", 3)
        feedback[(check.name(node, f"feedback[{i}] node"),
                  check.name(port, f"feedback[{i}] port"))] = value
    training = {check.name(model, "training"): check.training(carried, f"training[{model!r}]")
                for model, carried in check.map(fields["training"], "training").items()}
    profiles = {}
    for i, entry in enumerate(check.list(fields["profiles"], "profiles")):
        model, stages, costs = check.row(entry, f"profiles[{i}]", 3)
        key = (check.name(model, f"profiles[{i}] model"),
               check.count(stages, f"profiles[{i}] stages", 1 << 16))
        profiles[key] = check.costs(costs, f"profiles[{i}] costs")
    work = None if fields["open_work"] is None else check.open_work(fields["open_work"])
    return RunState(step=step, records=records_, feedback=feedback, training=training,
                    profiles=profiles, open_work=work)


def _schedule_plain(schedule: Schedule | None) -> dict | None:
    if schedule is None:
        return None
    return {"kind": schedule.kind, "stage_to_device": list(schedule.placement.stage_to_device),
            "microbatches": schedule.microbatches,
            "device_ops": [[str(action) for action in ops] for ops in schedule.device_ops]}


class _Check:
    """Type and bound checks of a decoded state, each failure one line naming the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> CheckpointError:
        return CheckpointError(f"--resume: {self.path}: {where}: {problem}; the file is damaged "
                               "or was not written by flowkit")

    def list(self, value: Any, where: str) -> list:
        if not isinstance(value, list):
            raise self.fail(where, f"a {type(value).__name__}, not a list")
        return value

    def map(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"a {type(value).__name__}, not a map")
        return value

    def keys(self, value: Any, where: str, expected: set[str]) -> dict:
        found = self.map(value, where)
        if set(found) != expected:
            missing, extra = sorted(expected - set(found)), sorted(map(str, set(found) - expected))
            raise self.fail(where, f"missing {missing or '-'}, unknown {extra[:5] or '-'}")
        return found

    def row(self, value: Any, where: str, size: int) -> list:
        found = self.list(value, where)
        if len(found) != size:
            raise self.fail(where, f"{len(found)} entries, not {size}")
        return found

    def name(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not 0 < len(value) <= 256:
            raise self.fail(where, f"{short(value)} is not a name")
        return value

    def count(self, value: Any, where: str, limit: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise self.fail(where, f"{short(value)} is not a whole number in 0..{limit}")
        return value

    def number(self, value: Any, where: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(where, f"{short(value)} is not a number")
        return float(value)

    def metrics(self, value: Any, where: str, depth: int = 0) -> Any:
        """A metrics line or value: what JSON holds."""
        if depth > _MAX_DEPTH:
            raise self.fail(where, "nested too deep")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [self.metrics(v, where, depth + 1) for v in value]
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: self.metrics(v, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}
        raise self.fail(where, f"a {type(value).__name__} where a metrics value goes")

    def lineage(self, value: Any, where: str) -> tuple:
        if not (isinstance(value, tuple) and len(value) <= 64 and all(
                isinstance(p, (int, str)) and not isinstance(p, bool) for p in value)):
            raise self.fail(where, f"{short(value)} is not a lineage (a tuple of ints and "
                                   "strings)")
        return value

    def training(self, value: Any, where: str) -> dict:
        expected = {"item_counts", "predicted_bubble", "last_schedule"}
        if isinstance(value, dict) and "token_counts" in value:  # not in files before it
            expected.add("token_counts")
        fields = self.keys(value, where, expected)
        counts, tokens = ({self.name(k, f"{where} {key}"): self.count(v, f"{where} {key}",
                                                                      _MAX_STEP)
                           for k, v in self.map(fields.get(key, {}), f"{where} {key}").items()}
                          for key in ("item_counts", "token_counts"))
        bubbles = {self.name(k, f"{where} predicted_bubble"):
                   self.number(v, f"{where} predicted_bubble")
                   for k, v in self.map(fields["predicted_bubble"],
                                        f"{where} predicted_bubble").items()}
        schedule = fields["last_schedule"]
        return {"item_counts": counts, "token_counts": tokens, "predicted_bubble": bubbles,
                "last_schedule": None if schedule is None
                else self.schedule(schedule, f"{where} last_schedule")}

    def schedule(self, value: Any, where: str) -> Schedule:
        fields = self.keys(value, where, {"kind", "stage_to_device", "microbatches",
                                          "device_ops"})
        try:
            device_ops = [[Action.parse(self.name(a, where)) for a in self.list(ops, where)]
                          for ops in self.list(fields["device_ops"], where)]
            return Schedule(kind=self.name(fields["kind"], f"{where} kind"),
                            placement=Placement([self.count(d, where, 1 << 16) for d in
                                                 self.list(fields["stage_to_device"], where)]),
                            microbatches=self.count(fields["microbatches"], where, 1 << 20),
                            device_ops=device_ops)
        except (TypeError, ValueError) as exc:
            raise self.fail(where, reason(exc)) from None

    def costs(self, value: Any, where: str) -> Costs:
        fields = self.keys(value, where, {"F", "B", "W", "comm", "per_op"})
        try:
            return Costs(**{k: [self.number(x, f"{where} {k}") for x in self.list(v, where)]
                            if k in "FBW" else self.number(v, f"{where} {k}")
                            for k, v in fields.items()})
        except (TypeError, ValueError) as exc:
            raise self.fail(where, reason(exc)) from None

    def open_work(self, value: Any) -> OpenWork:
        fields = self.keys(value, "open_work", {"calls", "partial", "carried"})
        work = OpenWork()
        for i, entry in enumerate(self.list(fields["calls"], "open_work calls")):
            where = f"open_work calls[{i}]"
            step, node, calls = self.row(entry, where, 3)
            work.calls.setdefault(self.count(step, where, _MAX_STEP), {})[
                self.name(node, where)] = [
                OpenCall(self.lineage(lin, where), self.list(items, where))
                for lin, items in (self.row(c, where, 2) for c in self.list(calls, where))]
        for i, entry in enumerate(self.list(fields["partial"], "open_work partial")):
            where = f"open_work partial[{i}]"
            step, node, metrics = self.row(entry, where, 3)
            work.partial.setdefault(self.count(step, where, _MAX_STEP), {})[
                self.name(node, where)] = self.map(self.metrics(metrics, where), where)
        for i, entry in enumerate(self.list(fields["carried"], "open_work carried")):
            where = f"open_work carried[{i}]"
            step, node, origin, lineage, items = self.row(entry, where, 5)
            work.carried.append(CarriedCall(
                self.count(step, where, _MAX_STEP), self.name(node, where),
                self.count(origin, where, _MAX_STEP), self.lineage(lineage, where),
                self.list(items, where)))
        return work

