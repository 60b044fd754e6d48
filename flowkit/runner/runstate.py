"""The controller's part of a run checkpoint on disk: plain values in msgpack, checked against a
schema when read, never pickle [Note: run state on disk].

[Note: run state on disk] `--resume` reads a file that anyone who could write the checkpoint
folder may have crafted, so reading it must run no code: the file is msgpack of None, bool, int,
float, str, bytes, lists and maps, plus four extension types this module builds itself: a tuple,
a tensor and a numpy array (dtype from a fixed list, shape, raw bytes), and a record (an attrs
class named by path). A record's class is looked up in the records this run allows (those of the
declared op contract, flowkit/ops/records.py, and those the flow's ports carry, with their
subclasses already loaded), never imported; an unknown name is an error. Every field of the state
is checked for its type and bounds before anything is built from it, and any problem is one
CheckpointError naming the file and the field. A model's build and config are not part of it:
a resumed training rebuilds them from the flow (flowtrain.ModelTraining.restore_carried).
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import msgpack

from flowkit.ops import records as contract_records
from flowkit.planner.ir import Action, Costs, Placement, Schedule
from flowkit.runner.asyncstate import CarriedCall, OpenCall, OpenWork

__all__ = ["CheckpointError", "RunState", "STATE_FORMAT", "allowed_records", "read_private",
           "read_state", "state_bytes", "write_private"]

STATE_FORMAT = "flowkit.run_state/1"

_TUPLE, _RECORD, _TENSOR, _NDARRAY = 1, 2, 3, 4
_MAX_FILE = 1 << 36  # 64 GiB: far past any real state, and a bound on what a read allocates
_MAX_DEPTH = 32  # nesting of a plain metrics value
_MAX_STEP = 1 << 40
_TORCH_DTYPES = frozenset("bool uint8 int8 int16 int32 int64 float16 bfloat16 float32 float64 "
                          "complex64 complex128".split())
_NUMPY_KINDS = frozenset("biufc")  # no object arrays: their items would be unpickled


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read or resumed from; the message names why."""


# -- private files -----------------------------------------------------------------------------
def write_private(path: Path, data: bytes) -> None:
    """Write `path` as a new file only its owner can read (0600 whatever the umask), synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb", closefd=False) as file:
            file.write(data)
            file.flush()
            os.fsync(fd)
    finally:
        os.close(fd)


def read_private(path: Path, what: str, limit: int = _MAX_FILE) -> bytes:
    """The bytes of regular file `path`; a CheckpointError naming it when it is a symlink, not
    a regular file, over `limit` bytes or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if os.path.islink(path):
            raise CheckpointError(f"{what}: {path} is a symbolic link; a checkpoint's files "
                                  "must be its own") from None
        raise CheckpointError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{what}: {path} is not a regular file")
        if info.st_size > limit:
            raise CheckpointError(f"{what}: {path} has {info.st_size} bytes, more than the "
                                  f"{limit} a checkpoint's file may have")
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(info.st_size)
    finally:
        os.close(fd)


# -- the records a run allows ------------------------------------------------------------------
def allowed_records(flow: Any = None) -> dict[str, type]:
    """Record classes by path: the declared op contract's, and those `flow`'s ports carry,
    each with its subclasses loaded in this process (a Scored where a Rollout is declared)."""
    roots = [getattr(contract_records, name) for name in contract_records.__all__]
    if flow is not None:
        roots += list(_port_items(flow))
    found: dict[str, type] = {}
    todo = [cls for cls in roots if isinstance(cls, type) and attrs.has(cls)]
    while todo:
        cls = todo.pop()
        path = _path_of(cls)
        if path not in found:
            found[path] = cls
            todo += [sub for sub in cls.__subclasses__() if attrs.has(sub)]
    return found


def _port_items(flow: Any) -> Iterable[Any]:
    for node in flow.nodes.values():
        operator = node.operator
        yield from (ptype.item for ptype in operator.outputs.values())
        yield from (port.type.item for port in operator.inputs.values())
    yield from (fb.type.item for fb in flow.feedbacks.values())


def _path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# -- encoding ----------------------------------------------------------------------------------
def encode_state(state: Mapping[str, Any]) -> bytes:
    """msgpack of `state` (plain values, tuples, attrs records, tensors, numpy arrays)."""
    return msgpack.packb({"format": STATE_FORMAT, **state}, default=_default,
                         use_bin_type=True, strict_types=True)


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if attrs.has(type(obj)):
        fields = {f.name: getattr(obj, f.name) for f in attrs.fields(type(obj)) if f.init}
        return msgpack.ExtType(_RECORD, _pack([_path_of(type(obj)), fields]))
    module = type(obj).__module__
    if module.startswith("torch") and type(obj).__name__ in ("Tensor", "Parameter"):
        tensor = obj.detach().cpu().contiguous()
        data = tensor.view(-1).view(_torch().uint8).numpy().tobytes() if tensor.numel() else b""
        meta = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data]
        return msgpack.ExtType(_TENSOR, _pack(meta))
    if module == "numpy" and hasattr(obj, "__array_interface__"):
        import numpy

        array = numpy.ascontiguousarray(obj)
        return msgpack.ExtType(_NDARRAY, _pack([array.dtype.str, list(array.shape),
                                                array.tobytes()]))
    for base in (bool, int, float, str, bytes):  # a subclass (an IntEnum, a str enum): its value
        if isinstance(obj, base):
            return base(obj)
    raise CheckpointError(f"a checkpoint holds plain values, records, tensors and arrays, "
                          f"not a {type(obj).__qualname__}")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)


def _torch() -> Any:
    import torch

    return torch


# -- decoding ----------------------------------------------------------------------------------
def decode_state(data: bytes, path: Path, records: Mapping[str, type]) -> dict:
    """The state in `data` (the bytes of `path`), its values rebuilt; a CheckpointError of one
    line naming `path` when it is not one this flowkit wrote."""
    hook = _Decoder(records).ext_hook
    try:
        state = msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False,
                                use_list=True)
    except CheckpointError as exc:
        raise CheckpointError(f"--resume: {path}: {exc}") from None
    except Exception as exc:  # truncated, not msgpack, too deep: never a traceback
        raise CheckpointError(f"--resume: {path}: not a run state ({_reason(exc)})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"--resume: {path}: not a run state of this flowkit "
                              f"({STATE_FORMAT!r}, found {_short(found)})")
    return state


def _reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


class _Decoder:
    __slots__ = ("records",)

    def __init__(self, records: Mapping[str, type]) -> None:
        self.records = records

    def ext_hook(self, code: int, data: bytes) -> Any:
        payload = msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False)
        if code == _TUPLE:
            return tuple(_list(payload, "a tuple"))
        if code == _RECORD:
            return self._record(payload)
        if code == _TENSOR:
            return _tensor(payload)
        if code == _NDARRAY:
            return _ndarray(payload)
        raise CheckpointError(f"unknown extension type {code}")

    def _record(self, payload: Any) -> Any:
        if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[0], str)
                and isinstance(payload[1], dict)):
            raise CheckpointError("a record that is not [class, fields]")
        path, fields = payload
        cls = self.records.get(path)
        if cls is None:
            raise CheckpointError(f"record class {path[:200]!r} is not one this flow uses; "
                                  "nothing is imported from a checkpoint")
        names = {f.name for f in attrs.fields(cls) if f.init}
        unknown = sorted(set(map(str, fields)) - names)
        if unknown:
            raise CheckpointError(f"record {path} has no field(s) {unknown[:5]}")
        try:
            return cls(**fields)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"record {path}: {_reason(exc)}") from None


def _shape(value: Any, what: str) -> list[int]:
    dims = _list(value, f"{what} shape")
    if len(dims) > 16 or not all(isinstance(d, int) and not isinstance(d, bool) and
                                 0 <= d < _MAX_FILE for d in dims):
        raise CheckpointError(f"{what} of shape {dims[:17]!r}: not a shape")
    return dims


def _tensor(payload: Any) -> Any:
    dtype_name, shape, data = _triple(payload, "a tensor")
    if dtype_name not in _TORCH_DTYPES:
        raise CheckpointError(f"a tensor of dtype {str(dtype_name)[:40]!r}")
    torch = _torch()
    dtype, dims = getattr(torch, dtype_name), _shape(shape, "a tensor")
    if len(data) != math.prod(dims) * dtype.itemsize:
        raise CheckpointError(f"a tensor of shape {dims} and dtype {dtype_name} with "
                              f"{len(data)} bytes")
    if not data:
        return torch.empty(dims, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(dims)


def _ndarray(payload: Any) -> Any:
    import numpy

    dtype_name, shape, data = _triple(payload, "an array")
    try:
        dtype = numpy.dtype(str(dtype_name))
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
        raise CheckpointError(f"an array of dtype {str(dtype_name)[:40]!r}")
    dims = _shape(shape, "an array")
    if len(data) != math.prod(dims) * dtype.itemsize:
        raise CheckpointError(f"an array of shape {dims} with {len(data)} bytes")
    return numpy.frombuffer(bytearray(data), dtype=dtype).reshape(dims)


def _triple(payload: Any, what: str) -> tuple[Any, Any, bytes]:
    if not (isinstance(payload, list) and len(payload) == 3 and isinstance(payload[2], bytes)):
        raise CheckpointError(f"{what} that is not [dtype, shape, bytes]")
    return payload[0], payload[1], payload[2]


def _list(value: Any, what: str) -> list:
    if not isinstance(value, list):
        raise CheckpointError(f"{what} that is a {type(value).__name__}, not a list")
    return value


# -- the state and its schema ------------------------------------------------------------------
@attrs.define(kw_only=True)
class RunState:
    """The controller's part of a checkpoint."""

    step: int
    records: list[dict]  # the metrics lines so far, as written
    feedback: dict[tuple, Any]  # (node, port) -> the last value the step before produced
    # model -> what its ModelTraining carries across steps (flowtrain.carried_state)
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


def read_state(path: Path, records: Mapping[str, type]) -> RunState:
    """The run state in file `path`, every field checked; a CheckpointError of one line naming
    `path` and the field otherwise."""
    plain = decode_state(read_private(path, "--resume"), path, records)
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
            raise self.fail(where, f"{_short(value)} is not a name")
        return value

    def count(self, value: Any, where: str, limit: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise self.fail(where, f"{_short(value)} is not a whole number in 0..{limit}")
        return value

    def number(self, value: Any, where: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(where, f"{_short(value)} is not a number")
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
            raise self.fail(where, f"{_short(value)} is not a lineage (a tuple of ints and "
                                   "strings)")
        return value

    def training(self, value: Any, where: str) -> dict:
        fields = self.keys(value, where, {"item_counts", "predicted_bubble", "last_schedule"})
        counts = {self.name(k, f"{where} item_counts"): self.count(v, f"{where} item_counts",
                                                                   _MAX_STEP)
                  for k, v in self.map(fields["item_counts"], f"{where} item_counts").items()}
        bubbles = {self.name(k, f"{where} predicted_bubble"):
                   self.number(v, f"{where} predicted_bubble")
                   for k, v in self.map(fields["predicted_bubble"],
                                        f"{where} predicted_bubble").items()}
        schedule = fields["last_schedule"]
        return {"item_counts": counts, "predicted_bubble": bubbles,
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
            raise self.fail(where, _reason(exc)) from None

    def costs(self, value: Any, where: str) -> Costs:
        fields = self.keys(value, where, {"F", "B", "W", "comm", "per_op"})
        try:
            return Costs(**{k: [self.number(x, f"{where} {k}") for x in self.list(v, where)]
                            if k in "FBW" else self.number(v, f"{where} {k}")
                            for k, v in fields.items()})
        except (TypeError, ValueError) as exc:
            raise self.fail(where, _reason(exc)) from None

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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
