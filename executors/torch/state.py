"""An executor's part of a run checkpoint
[Note: run checkpoints in flowkit/runner/checkpoints/format.py]:
`save_state` writes every model this executor holds that training or a weight sync changed
(its trained stages' parameters and AdamW states, a loaded copy's weights, the weights version)
and its random number generators, as one safetensors file in layout-free form [Note: layout-free
checkpoints in layout_free.py]; `load_state` builds the models again in this run's split, from
the flow's build and config the controller sends (never from the file's: it names them only to
refuse a state of another model), and puts it all back.

A model no op changed since it was built (a frozen reference) is written by name only: it is
built again from its build path and seed, which gives the same weights [Note: one model, many
holders in models/built.py]. Building seeds torch's generator, so `load_state` builds every model
first and restores the generators last: the next op draws what the uninterrupted run's would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from executors.optable import Deferred, OpContext
from executors.torch import weights
from executors.torch.errors import StageError
from executors.torch.layout_free import RESUMED, saved_model, train_prefix, trained_union
from executors.torch.models.built import held_model
from executors.torch.state_file import encode, read_state_file
from flowkit.dsl.lora import lora_identity

__all__ = ["StateWriter", "checked_cuda_rng", "checked_rng", "cuda_rng_states", "load_state",
           "restore_cuda_rng", "save_state", "state_of", "usable_cuda_rng"]

log = logging.getLogger("flowkit.executor")


def state_of(ctx: OpContext) -> tuple[dict, dict[str, torch.Tensor]]:
    """What this executor holds that a run must get back: (plain values, tensors by
    layout-free name) [Note: layout-free checkpoints in executors/torch/layout_free.py],
    the tensors host copies the models' next steps do not change."""
    entries, tensors = [], {}
    for (name, stages), held in sorted(ctx.state.get("torch_models", {}).items()):
        entry, own = saved_model(name, stages, held)
        entries.append(entry)
        tensors.update(own)
    tensors[_TORCH_RNG] = torch.get_rng_state()
    for index, value in cuda_rng_states().items():
        tensors[f"{_CUDA_RNG}{index}"] = value.detach().to("cpu", copy=True)
    version, internal, gauss = random.getstate()
    return {"models": entries, "python_rng": [version, list(internal), gauss]}, tensors


_TORCH_RNG = "rng.torch"
_CUDA_RNG = "rng.cuda."


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


def save_state(ctx: OpContext, *_: Any, path: str) -> Deferred:
    """Write this executor's state to `path` (inside the checkpoint's unfinished folder, which
    the controller renames when every part is in), a new file only its owner reads; the task
    ends with the bytes written. [Note: a state written in the background]: the state is copied
    to host memory here, so the tasks after this one may change the models at once, and a
    thread writes the copy while the executor goes on."""
    writer = ctx.background.setdefault(_WRITER, StateWriter())
    writer.wait_written()  # one copy on the way at most, however fast checkpoints come
    snapshot = state_of(ctx)  # host copies (layout_free.py)
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


def _write(fd: int, path: Path, snapshot: tuple[dict, dict], outcome: list) -> None:
    try:
        data = encode(*snapshot)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())  # on disk before the controller renames the checkpoint in
        # hashed as written [Note: checkpoint checksums in flowkit/runner/checkpoints/writer.py]
        outcome.append({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    except BaseException as exc:  # the task fails with it, naming it
        outcome.append(exc)


def load_state(ctx: OpContext, *_: Any, path: str | None = None, files: list | None = None,
               models: dict | None = None, trains: list | None = None,
               checksums: dict | None = None) -> int:
    """Put a checkpoint back on this executor: the models its own state `path` holds (None:
    it had none) built from `models` (the flow's spec of each, by name: what the controller
    sends, never what the file says), and what every executor state in `files` holds of the
    models it `trains` in this run, for the splits it builds of them [Note: layout-free
    checkpoints in layout_free.py]; then its random generators. A file whose saved build or
    config differs from the flow's is refused, naming both. Every file is read and checked
    before anything held here is dropped. Returns how many models it holds or will build."""
    specs = models or {}
    meta, tensors = read_state_file(path, checksums) if path else ({"models": []}, {})
    where = path or "(no state of its own)"
    entries = [_checked(entry, i, where, specs)
               for i, entry in enumerate(_field(meta, "models", list, where))]
    trained = {name: _trained_files(name, path, (meta, tensors), files or [], specs, checksums)
               for name in trains or ()}
    rng = _generators(meta, tensors, path) if path else None
    _forget_models(ctx)
    for entry, spec in entries:
        if not entry["trains"] and not _trained_here(entry, trains or (), specs):
            _restore_copy(ctx, entry, spec, tensors, where)
    for name, found in trained.items():
        if found:  # else no executor had trained it yet (a step-0 checkpoint): as built
            ctx.state.setdefault(RESUMED, {})[name] = trained_union(name, found)
    if rng is not None:
        _set_generators(*rng, where)
    return len({name for name, _ in ctx.state.get("torch_models", {})}
               | set(ctx.state.get(RESUMED, {})))


def _trained_here(entry: dict, trains: Sequence[str], specs: dict) -> bool:
    """Whether a saved copy is, in this run, a split this executor trains: a copy and a trained
    split in as many stages are one held model [Note: one model, many holders], as in a run on
    this layout that never stopped, where generation here reads the trained split. It is set
    from the checkpoint's trained union then, its AdamW states kept for its optimizer; the
    copy, built first, would take that split's place without them (the run on another layout
    that resumed from it went on with fresh moments)."""
    return entry["name"] in trains and entry["stages"] == int(specs[entry["name"]]["stages"])


def _trained_files(name: str, path: str | None, own: tuple[dict, dict], files: list,
                   specs: dict, checksums: dict | None) -> list[tuple[str, dict, dict]]:
    """(path, entry, tensors) of each executor state that holds trained model `name`, this
    executor's own first; none before any executor trained it."""
    if name not in specs:
        raise StageError(f"this executor is to train model {name!r}, which the flow does not "
                         f"declare (it has {sorted(specs) or 'none'})")
    found = []
    for other in sorted(set(files[:65536]) - {path}, key=str):
        found.extend(_trained_in(name, str(other), read_state_file(str(other), checksums),
                                 specs))
    mine = _trained_in(name, path, own, specs) if path else []
    return mine + found


def _trained_in(name: str, path: str, state: tuple[dict, dict], specs: dict) -> list:
    meta, tensors = state
    prefix = train_prefix(name)
    for i, entry in enumerate(_field(meta, "models", list, path)):
        if isinstance(entry, dict) and entry.get("name") == name and entry.get("trains"):
            checked, _ = _checked(entry, i, path, specs)
            return [(path, checked, {k: v for k, v in tensors.items() if k.startswith(prefix)})]
    return []


def _generators(meta: dict, tensors: dict, path: str) -> tuple:
    """The file's random generators, checked before anything held changes."""
    torch_rng = checked_rng(tensors.get(_TORCH_RNG), "torch_rng", path)
    cuda = {key[len(_CUDA_RNG):]: value for key, value in tensors.items()
            if key.startswith(_CUDA_RNG)}
    if not all(index.isdigit() and len(index) < 5 for index in cuda):
        raise StageError(f"{path}: cuda_rng is not a map of device indices to generator "
                         "states: the file is damaged")
    cuda_rng = usable_cuda_rng({int(i): checked_rng(v, f"cuda_rng[{i}]", path, _CUDA_RNG_BYTES)
                                for i, v in sorted(cuda.items())}, path)
    python_rng = _field(meta, "python_rng", list, path)
    return torch_rng, cuda_rng, python_rng


def _set_generators(torch_rng: torch.Tensor, cuda_rng: dict, python_rng: list,
                    path: str) -> None:
    try:
        version, internal, gauss = python_rng
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(torch_rng)
        restore_cuda_rng(cuda_rng)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise StageError(f"{path}: its random generators' state is damaged ({exc})") from None


def _field(mapping: Any, key: str, kind: type, path: str, where: str = "") -> Any:
    value = mapping.get(key) if isinstance(mapping, dict) else None
    if not isinstance(value, kind):
        raise StageError(f"{path}: {where}{key} is a {type(value).__name__}, not a "
                         f"{kind.__name__}: the file is damaged or not flowkit's")
    return value


_SPEC_KEYS = ("build", "seed", "dtype", "model_config", "lora")


def _checked(entry: Any, index: int, path: str, models: dict) -> tuple[dict, dict]:
    """Saved model `index` of `path` checked against the flow's spec of it, with that spec
    (in the saved split: a copy goes back as it was held)."""
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
    trains = _field(entry, "trains", bool, path, where)
    if not trains and stages not in (1, int(spec["stages"])):
        raise StageError(f"{path}: model {name!r} saved in {stages} stages; this flow splits it "
                         f"in {spec['stages']}")
    for key in ("shards", "hyper"):
        _field(entry, key, dict, path, where)
    if not all(kind in ("decay", "plain") and isinstance(group, dict)
               and all(key in _HYPER and _hyper_value(v) for key, v in group.items())
               for kind, group in entry["hyper"].items()):
        raise StageError(f"{path}: model {name!r} has optimizer hyperparameters that are not "
                         f"AdamW's ({_short(entry['hyper'])})")
    version = entry.get("version")
    if version is not None and not isinstance(version, int):
        raise StageError(f"{path}: model {name!r} has a weights version that is not a number")
    return entry, {**spec, "stages": stages}


# what an AdamW param group holds besides its parameters (torch 2.x), each a number, a flag,
# None, or the two betas
_HYPER = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
          "differentiable", "fused", "decoupled_weight_decay", "initial_lr"}


def _hyper_value(value: Any) -> bool:
    if isinstance(value, list):
        return len(value) == 2 and all(_hyper_value(v) and v is not None for v in value)
    return value is None or isinstance(value, (bool, int, float))


def _identity(key: str, value: Any) -> Any:
    """What of a spec's value makes the model: a LoRA's settings but where it is saved; as
    JSON has it (a saved tuple is a list)."""
    value = lora_identity(value) if key == "lora" and isinstance(value, dict) else value
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


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
    ctx.state.pop(RESUMED, None)
    for name in [n for n in ctx.background if n.startswith("generate:")]:
        del ctx.background[name]


def _restore_copy(ctx: OpContext, entry: dict, spec: dict, tensors: dict, path: str) -> None:
    """A model this executor held but did not train: built again, and a copy that weights
    were loaded into given them back."""
    held = held_model(ctx, spec)
    prefix = f"{entry['name']}/copy{entry['stages']}/param/"
    found = {key[len(prefix):]: value for key, value in tensors.items()
             if key.startswith(prefix)}
    if found:
        weights.load(held.parts, held.layout, found, complete=held.lora is None,
                     what=f"model {entry['name']!r} in {entry['stages']} stage(s) (from {path})")
    held.version = entry["version"]
