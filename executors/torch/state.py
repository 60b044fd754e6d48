"""An executor's part of a run checkpoint
[Note: run checkpoints in flowkit/runner/checkpoints/format.py]:
`save_state` writes every model this executor holds that training or a weight sync changed
(per split and stage: the parameters and buffers, the optimizer state, the weights version)
and its random number generators; `load_state` builds the same models again, from the flow's
build and config the controller sends (never from the file's: it names them only to refuse a
state of another model), and puts it all back. The file holds tensors and plain values only and
is read with torch's weights-only loader.

A model no op changed since it was built (a frozen reference) is written by name only: it is
built again from its build path and seed, which gives the same weights [Note: one model, many
holders in models/built.py]. Building seeds torch's generator, so `load_state` builds every model
first and restores the generators last: the next op draws what the uninterrupted run's would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
from pathlib import Path
from typing import Any

import torch

from executors.optable import Deferred, OpContext
from executors.torch.errors import StageError
from executors.torch.models.built import held_model
from executors.torch.train.fsdp_state import fsdp_shares, join_saved_shares, restore_whole
from executors.torch.train.held_stage import held_stage
from executors.torch.train.reshard import recut
from flowkit.dsl.lora import lora_identity
from flowkit.wire.files import FileRefused, open_regular, sha256_of

__all__ = ["StateWriter", "checked_cuda_rng", "checked_rng", "cuda_rng_states", "load_state",
           "restore_cuda_rng", "save_state", "state_of", "usable_cuda_rng"]

_FORMAT = "flowkit.executor_state/1"
_MAX_STATE = 1 << 40  # bytes: past any model this runs, a bound on what a load may read

log = logging.getLogger("flowkit.executor")


def state_of(ctx: OpContext) -> dict[str, Any]:
    """What this executor holds that a run must get back, as one picklable dict of tensors."""
    models = []
    for (name, stages), held in sorted(ctx.state.get("torch_models", {}).items()):
        changed = held.version is not None or any(
            s.optimizer is not None for s in held.stages.values())
        parts = {}
        # [Note: FSDP checkpoints in executors/torch/train/fsdp_state.py]
        fsdp = fsdp_shares(held.stages)
        if changed:  # every stage of a loaded copy; only the trained ones of a training split
            indices = range(len(held.parts)) if held.version is not None else sorted(held.stages)
            parts = {i: _saved(held.parts[i], held.lora is not None) for i in indices
                     if i not in fsdp}
        optimizers = {i: s.optimizer.state_dict() for i, s in held.stages.items()
                      if s.optimizer is not None and i not in fsdp}
        shards = {i: list(s.shard) for i, s in held.stages.items()
                  if s.optimizer is not None and s.shard is not None}
        models.append({"name": name, "stages": stages, "config": held.config, "parts": parts,
                       "optimizers": optimizers, "shards": shards, "fsdp": fsdp,
                       "version": held.version,
                       "held_stages": sorted(held.stages)})
    state = {"format": _FORMAT, "models": models, "torch_rng": torch.get_rng_state(),
             "python_rng": random.getstate()}
    cuda_rng = cuda_rng_states()
    if cuda_rng:
        state["cuda_rng"] = cuda_rng
    return state


# [Note: CUDA random state] Dropout on a GPU draws from the CUDA generators, not the CPU's: a
# state saves each visible device's ({index: uint8 tensor}, as torch.cuda.get_rng_state gives
# it) when this process has used CUDA (asking sooner would make a context on every device), and
# load_state sets them back. A state without them (written on a CPU, or by an older flowkit)
# loads as before, and one written with them loads on a CPU with a warning: there is nothing
# there to draw from them.
# the sizes torch's generators take, checked before anything held is dropped: the CPU's Mersenne
# Twister state (5,056 bytes in torch 2.x) and CUDA's Philox seed and offset (16)
_CPU_RNG_BYTES = torch.get_rng_state().numel()
_CUDA_RNG_BYTES = 16


def cuda_rng_states() -> dict[int, torch.Tensor]:
    """Each visible CUDA device's generator state, when this process has used CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {i: torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())}


def checked_rng(value: Any, what: str, path: str, size: int = _CPU_RNG_BYTES) -> torch.Tensor:
    """A saved generator state: a 1-D uint8 tensor of the `size` its generator takes, else a
    StageError (before anything held changes: torch would refuse it only once set)."""
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
            and value.numel() == size):
        shown = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                 if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
        raise StageError(f"{path}: {what} is {shown}, not a generator state (a 1-D uint8 "
                         f"tensor of {size} bytes): the file is damaged")
    return value


def checked_cuda_rng(state: dict, path: str) -> dict[int, torch.Tensor]:
    """The file's CUDA generator states by device [Note: CUDA random state], checked; {} in a
    file without them."""
    saved = state.get("cuda_rng", {})
    if not isinstance(saved, dict) or len(saved) > 1024 or not all(
            type(i) is int and i >= 0 for i in saved):
        raise StageError(f"{path}: cuda_rng is not a map of device indices to generator "
                         "states: the file is damaged")
    return {i: checked_rng(v, f"cuda_rng[{i}]", path, _CUDA_RNG_BYTES)
            for i, v in sorted(saved.items())}


def usable_cuda_rng(states: dict[int, torch.Tensor], path: str) -> dict[int, torch.Tensor]:
    """The saved CUDA generator states this executor can set [Note: CUDA random state]: none
    without CUDA (with a warning); a device it does not see is an error."""
    if states and not torch.cuda.is_available():
        log.warning("%s holds the CUDA generators' state, and this executor has no CUDA: "
                    "a resumed run's GPU draws cannot be restored here", path)
        return {}
    count = torch.cuda.device_count() if states else 0
    missing = [i for i in states if i >= count]
    if missing:
        raise StageError(f"{path} holds the random state of CUDA device(s) {missing}, and this "
                         f"executor sees {count}: resume on the devices it was saved on")
    return states


def restore_cuda_rng(states: dict[int, torch.Tensor]) -> None:
    for index, value in states.items():
        torch.cuda.set_rng_state(value, index)


def _saved(part: torch.nn.Module, adapters_only: bool) -> dict[str, torch.Tensor]:
    """A stage's state dict; of a LoRA model, without the frozen base weights, which building
    it again restores [Note: LoRA in flowkit/dsl/lora.py]."""
    state = part.state_dict()
    if adapters_only:
        frozen = _frozen(part)
        state = {name: value for name, value in state.items() if name not in frozen}
    return state


def _frozen(part: torch.nn.Module) -> set[str]:
    return {name for name, p in part.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


def _load_part(part: torch.nn.Module, tensors: dict, adapters_only: bool) -> None:
    """What `_saved` wrote back into `part`; of a LoRA model, its adapters and buffers (the
    base weights were built again)."""
    if not adapters_only:
        part.load_state_dict(tensors)
        return
    missing, unexpected = part.load_state_dict(tensors, strict=False)
    lacking = sorted(set(missing) - _frozen(part))
    if lacking or unexpected:
        raise RuntimeError(f"the saved adapters lack {lacking[:3]} and have unknown "
                           f"{list(unexpected)[:3]}")


def save_state(ctx: OpContext, *_: Any, path: str) -> Deferred:
    """Write this executor's state to `path` (inside the checkpoint's unfinished folder, which
    the controller renames when every part is in), a new file only its owner reads; the task
    ends with the bytes written. [Note: a state written in the background]: the state is copied
    to host memory here, so the tasks after this one may change the models at once, and a
    thread writes the copy while the executor goes on."""
    writer = ctx.background.setdefault(_WRITER, StateWriter())
    writer.wait_written()  # one copy on the way at most, however fast checkpoints come
    snapshot = _on_host(state_of(ctx))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        return writer.write(fd, Path(path), snapshot)
    except BaseException:
        os.close(fd)
        raise


# [Note: a state written in the background] After DataStates-LLM and ByteCheckpoint: a checkpoint
# copies what it saves out of the live tensors first (on a GPU, to host memory: the slow part of
# writing is the disk, not the copy), then writes the copy from a thread. The executor's loop steps
# the writer as a Background between its tasks: each step waits a millisecond at most for a
# thread to end, then ends the save_state task it belongs to. So the next step's training runs
# while the file is written, and the controller renames the checkpoint in only once every task
# ended, that is, every file is on disk (fsync). A save waits for the write before it, so host
# memory holds one copy at most when checkpoints come faster than the disk takes them.
_WRITER = "state_writer"
_WAIT_S = 0.001  # a step's wait for a writing thread: the loop neither spins nor stalls


class StateWriter:
    """A Background [Note: deferred ops in executors/optable.py] that ends each save_state
    task once its thread has written the file."""

    def __init__(self) -> None:
        self.writing: list[tuple[Deferred, threading.Thread, list]] = []

    def write(self, fd: int, path: Path, snapshot: dict) -> Deferred:
        deferred, outcome = Deferred(), []
        thread = threading.Thread(target=_write, args=(fd, path, snapshot, outcome),
                                  name=f"save {path.name}", daemon=True)
        thread.start()
        self.writing.append((deferred, thread, outcome))
        return deferred

    def wait_written(self) -> None:
        """Until every write begun has reached its file (its task ends at the next step)."""
        for _, thread, _ in self.writing:
            thread.join()

    def busy(self) -> bool:
        return bool(self.writing)

    def step(self) -> None:
        self.writing[0][1].join(_WAIT_S)
        for entry in list(self.writing):
            deferred, thread, outcome = entry
            if thread.is_alive():
                continue
            self.writing.remove(entry)
            if deferred.finished or deferred.cancelled:  # ended already (the executor failed it)
                continue
            if outcome and isinstance(outcome[0], BaseException):
                deferred.fail(outcome[0])
            else:
                deferred.done(outcome[0])


def _write(fd: int, path: Path, snapshot: dict, outcome: list) -> None:
    try:
        with os.fdopen(fd, "wb") as file:
            # hashed as written [Note: checkpoint checksums in flowkit/runner/checkpoints/writer.py]
            hashing = _Hashing(file)
            torch.save(snapshot, hashing)
            file.flush()
            os.fsync(file.fileno())  # on disk before the controller renames the checkpoint in
        outcome.append({"bytes": hashing.bytes, "sha256": hashing.digest.hexdigest()})
    except BaseException as exc:  # the task fails with it, naming it
        outcome.append(exc)


class _Hashing:
    """A file that hashes what is written to it (torch.save only writes and flushes)."""

    def __init__(self, file: Any) -> None:
        self.file, self.digest, self.bytes = file, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.digest.update(data)
        self.bytes += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _on_host(value: Any) -> Any:
    """`value` with every tensor copied to host memory, apart from the live ones."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        copied = [_on_host(item) for item in value]
        return copied if isinstance(value, list) else tuple(copied)
    return value


def load_state(ctx: OpContext, *_: Any, path: str, models: dict | None = None,
               optimizer_shards: dict | None = None, checksums: dict | None = None) -> int:
    """Build the models `path` holds from `models` (the flow's spec of each, by name: what the
    controller sends, never what the file says) and load their weights, optimizer states and
    versions, then this executor's random generators; returns how many models it holds. A
    file whose saved build or config differs from the flow's is refused, naming both. Where
    `optimizer_shards` (by model: the shard of its optimizer states this executor owns now,
    and the files of every saved replica of its device) differs from how the file cut them,
    the states are merged from those files and cut again [Note: resuming at another replica
    count in flowkit/runner/replicas.py]."""
    state = _read(path, checksums)
    entries = [_checked(entry, i, path, models or {}) for i, entry in
               enumerate(_field(state, "models", list, path))]
    plans = optimizer_shards or {}
    # every file read and checked before anything held here is dropped
    peers = {entry["name"]: _peers(entry, plans.get(entry["name"]), path, models or {},
                                   checksums) for entry, _ in entries}
    fsdp = {entry["name"]: join_saved_shares(entry, _device_entries(
        entry, plans.get(entry["name"]), models or {}, checksums), path)
        for entry, _ in entries if entry.get("fsdp")}
    torch_rng = checked_rng(state.get("torch_rng"), "torch_rng", path)
    cuda_rng = usable_cuda_rng(checked_cuda_rng(state, path), path)
    python_rng = _field(state, "python_rng", tuple, path)
    _forget_models(ctx)
    for entry, spec in entries:
        _restore(ctx, entry, spec, path, peers[entry["name"]], fsdp.get(entry["name"], {}))
    try:
        torch.set_rng_state(torch_rng)
        restore_cuda_rng(cuda_rng)
        random.setstate(python_rng)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise StageError(f"{path}: its random generators' state is damaged ({exc})") from None
    return len(entries)


def _peers(entry: dict, plan: dict | None, path: str, models: dict,
           checksums: dict | None) -> tuple:
    """(target shard, the saved states to cut it from: (shard, state dict) by stage) when the
    file's optimizer states are cut otherwise than this executor needs them, else None."""
    target = None if not plan or plan.get("target") is None else tuple(plan["target"])
    if all(_shard(entry, index) == target for index in entry["optimizers"]):
        return None
    if not any(_shard(entry, index) for index in entry["optimizers"]):
        return target, {i: [(None, o)] for i, o in entry["optimizers"].items()}
    files = [] if not plan else plan.get("peers", [])
    cuts: dict[int, list] = {index: [] for index in entry["optimizers"]}
    for peer in files[:1024]:
        state = _read(str(peer), checksums)
        for i, other in enumerate(_field(state, "models", list, str(peer))):
            if other.get("name") == entry["name"] and other.get("stages") == entry["stages"]:
                checked, _ = _checked(other, i, str(peer), models)
                for index, saved in checked["optimizers"].items():
                    if index in cuts:
                        cuts[index].append((_shard(checked, index), saved))
    for index, found in cuts.items():
        size = _shard(entry, index)[1]
        if sorted(shard[0] for shard, _ in found if shard) != list(range(size)):
            raise StageError(f"{path}: model {entry['name']!r} stage {index} has its optimizer "
                             f"states in {size} shards, and the checkpoint's files of this "
                             f"device hold {len(found)} of them: they cannot be cut again")
    return target, cuts


def _device_entries(entry: dict, plan: dict | None, models: dict,
                    checksums: dict | None) -> list[dict]:
    """The model's entries in the checkpoint's files of every saved replica of this device
    (the plan's peers; without them, this file's alone) [Note: FSDP checkpoints in
    executors/torch/train/fsdp_state.py]."""
    found = []
    for peer in ([] if not plan else plan.get("peers", []))[:1024]:
        state = _read(str(peer), checksums)
        for i, other in enumerate(_field(state, "models", list, str(peer))):
            if other.get("name") == entry["name"] and other.get("stages") == entry["stages"]:
                found.append(_checked(other, i, str(peer), models)[0])
    return found or [entry]


def _shard(entry: dict, index: int) -> tuple[int, int] | None:
    shard = entry["shards"].get(index)
    return None if shard is None else (int(shard[0]), int(shard[1]))


def _read(path: str, checksums: dict | None = None) -> dict:
    """The state in `path`: tensors and plain values only (torch's weights-only loader: no
    object of the file's choosing is built, no code runs), a regular file checked against its
    SHA-256 in `checksums` (by path; None: a checkpoint written before them) before torch
    parses a byte of it [Note: contained files in flowkit/wire/files.py]; a link, another
    kind of file or a damaged one is one line."""
    try:
        fd, size = open_regular(path, limit=_MAX_STATE)
    except FileRefused as exc:
        raise StageError(f"cannot read executor state: {exc}") from None
    with os.fdopen(fd, "rb") as file:
        if checksums is not None and checksums.get(path) != sha256_of(fd, size):
            raise StageError(f"{path} does not match its SHA-256 in manifest.json: it changed "
                             "after it was written")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a damaged or crafted file: whatever torch raises
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise StageError(f"cannot read executor state {path}: {first}") from None
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise StageError(f"{path} is not an executor state of this flowkit ({_FORMAT})")
    return state


def _field(mapping: Any, key: str, kind: type, path: str, where: str = "") -> Any:
    value = mapping.get(key) if isinstance(mapping, dict) else None
    if not isinstance(value, kind):
        raise StageError(f"{path}: {where}{key} is a {type(value).__name__}, not a "
                         f"{kind.__name__}: the file is damaged or not flowkit's")
    return value


_SPEC_KEYS = ("build", "seed", "dtype", "model_config", "lora")


def _checked(entry: Any, index: int, path: str, models: dict) -> tuple[dict, dict]:
    """Saved model `index` of `path` checked against the flow's spec of it, with that spec."""
    where = f"models[{index}] "
    name = _field(entry, "name", str, path, where)
    stages = _field(entry, "stages", int, path, where)
    spec = models.get(name)
    if spec is None:
        raise StageError(f"{path} holds model {name!r}, which this flow does not declare "
                         f"(it has {sorted(models) or 'none'})")
    saved = _field(entry, "config", dict, path, where)
    for key in _SPEC_KEYS:
        if _identity(key, saved.get(key)) != _identity(key, spec.get(key)):
            raise StageError(f"{path}: model {name!r} was saved with {key}="
                             f"{_short(saved.get(key))}, this flow has {_short(spec.get(key))}: "
                             "resume with the flow that wrote it")
    if stages not in (1, int(spec["stages"])):
        raise StageError(f"{path}: model {name!r} saved in {stages} stages; this flow splits it "
                         f"in {spec['stages']}")
    parts, optimizers = (_field(entry, key, dict, path, where) for key in ("parts", "optimizers"))
    held_stages = _field(entry, "held_stages", list, path, where)
    # [Note: sharded optimizer states in executors/torch/train/replicas.py]; older files have none
    shards = entry.setdefault("shards", {})
    if not (isinstance(shards, dict) and all(
            isinstance(i, int) and i in optimizers and isinstance(v, list) and len(v) == 2
            and all(isinstance(n, int) for n in v) and 0 <= v[0] < v[1] <= 1024
            for i, v in shards.items())):
        raise StageError(f"{path}: model {name!r} has optimizer shards that are not "
                         "{stage: [rank, size]} of its saved optimizers")
    version = entry.get("version")
    indices = [*parts, *optimizers, *held_stages]
    if not all(isinstance(i, int) and 0 <= i < stages for i in indices):
        raise StageError(f"{path}: model {name!r} names stages outside 0..{stages - 1}")
    if version is not None and not isinstance(version, int):
        raise StageError(f"{path}: model {name!r} has a weights version that is not a number")
    return entry, {**spec, "stages": stages}


def _identity(key: str, value: Any) -> Any:
    """What of a spec's value makes the model: a LoRA's settings but where it is saved."""
    return lora_identity(value) if key == "lora" and isinstance(value, dict) else value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _forget_models(ctx: OpContext) -> None:
    """Drop every model this executor holds, and the rollout engines that decode with them,
    before a load: a step that failed part-way ([Note: executor restarts] in
    flowkit/runner/checkpoints/restarts.py) may have changed any of them, also one the
    checkpoint holds by name only, so each is built again from its seed. The engines have
    nothing in flight (the controller waits for that), and the next generate request makes a
    new one."""
    for held in ctx.state.pop("torch_models", {}).values():
        for stage in held.stages.values():
            stage.runner.reset()
    for name in [n for n in ctx.background if n.startswith("generate:")]:
        del ctx.background[name]


def _restore(ctx: OpContext, entry: dict, spec: dict, path: str, peers: tuple | None,
             fsdp: dict[int, tuple]) -> None:
    held = held_model(ctx, spec)
    what = f"model {entry['name']!r} in {entry['stages']} stage(s) (from {path})"
    for index, (params, _) in fsdp.items():  # whole again, from every replica's share
        restore_whole(held.parts[index], params, f"{what}, stage {index}")
    for index, tensors in entry["parts"].items():
        try:
            _load_part(held.parts[index], tensors, held.lora is not None)
        except (RuntimeError, TypeError, AttributeError) as exc:  # shapes or names: one line
            first = str(exc).strip().splitlines()
            raise StageError(f"{what}, stage {index}: {first[1 if len(first) > 1 else 0]}"
                             .strip()) from None
    for index in entry["held_stages"]:
        held_stage(ctx, {**spec, "stage": index})
    for index, (_, states) in fsdp.items():  # for the optimizer the next step makes
        held_stage(ctx, {**spec, "stage": index}).saved_states = states
    for index, saved in entry["optimizers"].items():
        from executors.torch.train.pipeline_ops import new_optimizer, trainable

        stage = held.stages[index]
        stage.shard = _shard(entry, index) if peers is None else peers[0]
        stage.optimizer = new_optimizer(stage.module, shard=stage.shard)
        if peers is not None:  # [Note: resuming at another replica count]
            saved = recut(trainable(stage.module), peers[1][index], stage.shard,
                          stage.optimizer.state_dict())
        try:
            stage.optimizer.load_state_dict(saved)  # its hyperparameters too: the saved ones win
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise StageError(f"{what}, stage {index}: its optimizer state does not fit "
                             f"({str(exc).splitlines()[0][:200] if str(exc) else exc!r})"
                             ) from None
    held.version = entry["version"]
