"""One model held in several shapes: its weights by the unsplit model's names, exported from one
split and loaded into another (a trainer's stages -> a generator's whole copy), and checkpoints.

The design: [Note: unsplit names] below.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from executors.torch.errors import StageError
from flowkit.wire.serialize import TORCH_DTYPES

__all__ = ["MAX_PACKED_BYTES", "Layout", "aliases_of", "checked_layout", "checked_places", "export",
           "exported", "host_views", "layout", "load", "load_checkpoint", "merge",
           "packed_copy", "packed_offsets", "packed_views", "save_checkpoint"]


# [Note: unsplit names] An executor may hold one model in several splits at once [Note: one model,
# many holders in models/built.py]: "actor" in two stages to train and whole to generate with.
# Each split names its parameters locally (a GPT stage's ``h.0.attn.c_attn.weight``); weights
# travel between splits, executors and files by the unsplit model's names
# (``transformer.h.3.attn.c_attn.weight``), mapped by the model's ``stage_names(stages,
# seq_len=...)`` (local -> unsplit, per stage; models/gpt.py), or else through its split sharing
# the whole model's tensors. A tied weight (``wte`` and ``lm_head``) is one weight under two
# names: a split with two copies [Note: tied embedding across stages] exports each under its own
# name, and loading either sets every copy, so one split's export fills any other split. The ops
# `export_weights`, `load_weights` and `save_weights` are in models/built.py; a config key
# ``checkpoint`` names a file `held_model` loads before splitting. In full: docs/training.md,
# "Your own model".


# -- names ------------------------------------------------------------------------------------
@attrs.frozen(eq=False)
class Layout:
    """How one split of a model names its weights [Note: unsplit names]."""

    names: tuple[dict[str, str], ...]  # per stage: every local parameter name -> unsplit name
    aliases: dict[str, tuple[str, ...]]  # unsplit name -> every unsplit name of its weight
    problem: str | None = None  # why the names are unknown; raised when they are needed

    @property
    def known(self) -> set[str]:
        """Every unsplit name of the model."""
        return set(self.aliases) | {u for names in self.names for u in names.values()}

    def check(self) -> Layout:
        if self.problem:
            raise StageError(self.problem)
        return self


def layout(whole: torch.nn.Module, parts: Sequence[torch.nn.Module] | None = None, *,
           seq_len: int | None = None) -> Layout:
    """The names of `parts`, the split of `whole` made with `seq_len` (None: `whole` itself,
    named as it names its parameters). Never raises: a model whose stages cannot be named gets
    a Layout whose `check` says why."""
    aliases = aliases_of(whole)
    if parts is None:
        return Layout(names=({name: name for name in aliases},), aliases=aliases)
    try:
        names = _stage_names(whole, parts, seq_len)
    except (StageError, ValueError) as e:
        return Layout(names=(), aliases=aliases, problem=str(e))
    return checked_layout(whole, parts, names)


def aliases_of(whole: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter name of `whole` -> all its names (a tied weight has several)."""
    groups: dict[int, list[str]] = {}
    for name, p in whole.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {name: tuple(group) for group in groups.values() for name in group}


def checked_layout(whole: torch.nn.Module, parts: Sequence[torch.nn.Module],
                   names: Sequence[dict[str, str]]) -> Layout:
    """The Layout of `names` (per stage, local -> unsplit), or one whose `check` says where
    they and the split's own parameters disagree."""
    aliases = aliases_of(whole)
    for s, (part, mapping) in enumerate(zip(parts, names)):
        local = {name for name, _ in part.named_parameters(remove_duplicate=False)}
        if local != set(mapping):
            odd = sorted(local ^ set(mapping))[:4]
            return Layout(names=(), aliases=aliases, problem=(
                f"{type(whole).__name__}.stage_names({len(parts)}) does not name stage {s}'s "
                f"parameters as its split does (e.g. {odd}): the two disagree"))
    return Layout(names=tuple(names), aliases=aliases)


def _stage_names(whole: torch.nn.Module, parts: Sequence[torch.nn.Module],
                 seq_len: int | None) -> list[dict[str, str]]:
    own = getattr(whole, "stage_names", None)
    if own is not None:
        names = [dict(m) for m in own(len(parts), seq_len=seq_len)]
        if len(names) != len(parts):
            raise StageError(f"{type(whole).__name__}.stage_names({len(parts)}) named "
                             f"{len(names)} stages")
        return names
    if len(parts) == 1 and parts[0] is whole:
        return [{name: name for name, _ in whole.named_parameters(remove_duplicate=False)}]
    by_id: dict[int, str] = {}
    for name, p in whole.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), name)
    names = []
    for s, part in enumerate(parts):
        mapping = {}
        for name, p in part.named_parameters(remove_duplicate=False):
            if id(p) not in by_id:
                raise StageError(
                    f"stage {s}'s parameter {name!r} is not one of the whole "
                    f"{type(whole).__name__}'s, so its unsplit name is unknown: give the model a "
                    "method stage_names(stages, seq_len=...) (see executors/torch/models/gpt.py)")
            mapping[name] = by_id[id(p)]
        names.append(mapping)
    return names


def _source(unsplit: str, given: Mapping[str, Any], aliases: Mapping[str, Sequence[str]]):
    """The given name that holds weight `unsplit`: itself, else one of its tied names."""
    for name in (unsplit, *aliases.get(unsplit, ())):
        if name in given:
            return name
    return None


# -- moving weights ---------------------------------------------------------------------------
def export(module: torch.nn.Module, names: Mapping[str, str], *,
           trained_only: bool = False, one_buffer: bool = False) -> dict[str, torch.Tensor]:
    """The module's parameters by unsplit name: detached CPU copies (one copy for a parameter
    under two names, as a one-stage GPT's tied wte/lm_head); with `trained_only`, only those
    that take gradients (a LoRA model's adapters). With `one_buffer`, a GPU module's copies are
    views of one pinned buffer [Note: one host buffer] (not for a file: safetensors refuses
    tensors that share memory)."""
    params, named = exported(module, names, trained_only=trained_only)
    if one_buffer and any(p.is_cuda for p in params):
        copies = host_views(params, pinned=True)
    else:
        copies = [p.to(device="cpu", copy=True) for p in params]
    return {name: copies[i] for name, i in named}


def exported(module: torch.nn.Module, names: Mapping[str, str], *, trained_only: bool = False
             ) -> tuple[list[torch.Tensor], list[tuple[str, int]]]:
    """What `export` copies: the module's distinct parameters, detached (a tied one once), and
    each unsplit name with the index of its parameter among them."""
    index: dict[int, int] = {}
    params, named = [], []
    for local, p in module.named_parameters(remove_duplicate=False):
        if trained_only and not p.requires_grad:
            continue
        if id(p) not in index:
            index[id(p)] = len(params)
            params.append(p.detach())
        named.append((names[local], index[id(p)]))
    return params, named


# [Note: one host buffer] A weight sync copies a GPU model's parameters to the host for the
# wire. One pageable `.to("cpu")` a parameter waits for each copy: an H200 moved Qwen2.5-0.5B's
# 0.99 GB at 1.5 GB/s so (0.65 s), and the same bytes into pinned memory, queued without a wait,
# at 53 GB/s (19 ms; `bash tools/gpu/device_check.sh`, weight_sync_path). So the export lays
# every parameter in one pinned buffer (each at a 64-byte boundary, so each view takes its
# dtype), queues every copy and waits once. The price: torch's pinned allocator keeps the
# buffer (the model's bytes rounded up to a power of two) in host memory for the next sync.
# `host_views(..., pinned=False)` is the same layout on the CPU, where it is tested; the
# device check times this export (export_d2h_s against export_pageable_s).
_ALIGN = 64
MAX_PACKED_BYTES = 1 << 44  # a packed buffer a peer describes may say at most this
_MAX_DIMS = 8


def host_views(tensors: Sequence[torch.Tensor], *, pinned: bool) -> list[torch.Tensor]:
    """Copies of `tensors` on the host as views of one buffer [Note: one host buffer]; pinned,
    the copies from a GPU queued without a wait and waited for once."""
    offsets, end = packed_offsets(tensors)
    flat = torch.empty(end, dtype=torch.uint8, pin_memory=pinned)
    views = packed_views(flat, [(t.dtype, t.shape, start) for t, start in zip(tensors, offsets)])
    for view, t in zip(views, tensors):
        view.copy_(t, non_blocking=pinned and t.is_cuda)
    if pinned:
        for device in {t.device for t in tensors if t.is_cuda}:
            torch.cuda.synchronize(device)
    return views


def packed_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Where each of `tensors` starts in one byte buffer that holds them all, each at a 64-byte
    boundary (so each view takes its dtype), and the buffer's length."""
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


def packed_views(flat: torch.Tensor, places: Iterable[tuple[torch.dtype, Sequence[int], int]]
                 ) -> list[torch.Tensor]:
    """Views of the uint8 buffer `flat`, one per (dtype, shape, byte offset)."""
    views = []
    for dtype, shape, start in places:
        size = math.prod(shape) * dtype.itemsize
        views.append(flat[start:start + size].view(dtype).view(tuple(shape)))
    return views


def packed_copy(params: Sequence[torch.Tensor], named: Sequence[tuple[str, int]]
                ) -> tuple[torch.Tensor, list[list]]:
    """`params` copied into one uint8 buffer on their device (`packed_offsets`' layout), and
    each unsplit name's place in it as a record lists it: [name, dtype, shape, byte offset]
    (`named`: each name and the index of its parameter, as `exported` gives them)."""
    offsets, end = packed_offsets(params)
    flat = torch.empty(end, dtype=torch.uint8, device=params[0].device)
    places = [(p.dtype, p.shape, start) for p, start in zip(params, offsets)]
    for view, p in zip(packed_views(flat, places), params):
        view.copy_(p)
    return flat, [[name, str(params[i].dtype).removeprefix("torch."), list(params[i].shape),
                   offsets[i]] for name, i in named]


def checked_places(tensors: Any, size: int, bad: Callable[[str], Exception]
                   ) -> list[tuple[str, tuple[torch.dtype, list, int]]]:
    """Each of `tensors` ([unsplit name, dtype, shape, byte offset], as a record from the wire
    lists them) as (name, (dtype, shape, offset)) in a `size`-byte packed buffer, once checked:
    distinct names, known dtypes, shapes of at most 8 sizes, each within the buffer at its
    dtype's alignment. `bad(what)` makes the error raised."""
    if type(tensors) is not list or not tensors:
        raise bad("its tensors must be a non-empty list")
    places, names = [], set()
    for entry in tensors:
        if not (type(entry) is list and len(entry) == 4):
            raise bad("a tensor must be [name, dtype, shape, byte offset]")
        name, dtype_name, shape, start = entry
        if type(name) is not str or name in names:
            raise bad(f"tensor names must be distinct strings ({str(name)[:80]!r})")
        if type(dtype_name) is not str or dtype_name not in TORCH_DTYPES:
            raise bad(f"tensor {name!r} has an unknown dtype {str(dtype_name)[:40]!r}")
        dtype = getattr(torch, dtype_name)
        if not (type(shape) is list and len(shape) <= _MAX_DIMS
                and all(type(n) is int and 0 <= n <= MAX_PACKED_BYTES for n in shape)):
            raise bad(f"tensor {name!r}'s shape must be at most {_MAX_DIMS} sizes >= 0")
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        if type(start) is not int or start < 0 or start % dtype.itemsize \
                or start + nbytes > size:
            raise bad(f"tensor {name!r} ({nbytes} bytes at {str(start)[:20]}) does not lie "
                      f"within the {size}-byte buffer at its dtype's alignment")
        names.add(name)
        places.append((name, (dtype, shape, start)))
    return places


def load(parts: Sequence[torch.nn.Module], lay: Layout, tensors: Mapping[str, Any], *,
         stages: Iterable[int] | None = None, complete: bool = False,
         what: str = "the model") -> int:
    """Copy `tensors` (by unsplit name) into the parameters of `parts` (the split `lay` names;
    only `stages` of them if given), casting to each parameter's dtype and device. Every name
    must be the model's and every shape must fit; with `complete`, every parameter must be
    given. All is checked before anything is copied. Returns how many parameters were set."""
    lay.check()
    bad = sorted(n for n, t in tensors.items() if not isinstance(t, torch.Tensor))
    if bad:
        raise StageError(f"weights for {what} must be tensors; {_few(bad)} are not")
    unknown = sorted(set(tensors) - lay.known)
    if unknown:
        raise StageError(f"{what} has no weights named {_few(unknown)} (its names are like "
                         f"{_few(sorted(lay.known))})")
    which = range(len(parts)) if stages is None else list(stages)
    plan: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    missing: dict[int, str] = {}
    mismatched = []
    for s in which:
        params = dict(parts[s].named_parameters(remove_duplicate=False))
        for local, unsplit in lay.names[s].items():
            p = params[local]
            if id(p) in plan:  # a tied parameter under its second name
                continue
            source = _source(unsplit, tensors, lay.aliases)
            if source is None:
                missing.setdefault(id(p), unsplit)
                continue
            value = tensors[source]
            if tuple(value.shape) != tuple(p.shape):
                mismatched.append(f"{source} is {tuple(value.shape)}, "
                                  f"{unsplit} is {tuple(p.shape)}")
            plan[id(p)] = (p, value)
    if mismatched:
        raise StageError(f"weights for {what} do not fit its shapes: {'; '.join(mismatched)}")
    lacking = sorted(name for key, name in missing.items() if key not in plan)
    if complete and lacking:
        raise StageError(f"weights for {what} lack {len(lacking)} of its parameters: "
                         f"{_few(lacking)}")
    with torch.no_grad():
        for p, value in plan.values():
            p.copy_(value)
    return len(plan)


def merge(dicts: Any) -> dict[str, torch.Tensor]:
    """One dict of the weights in `dicts` (a dict, or lists of them: export_weights' results).
    A name given twice must hold equal values."""
    out: dict[str, torch.Tensor] = {}
    for d in _dicts(dicts):
        for name, value in d.items():
            if not isinstance(value, torch.Tensor):
                raise StageError(f"weight {name!r} is a {type(value).__name__}, not a tensor")
            if name in out and not (out[name].shape == value.shape
                                    and torch.equal(out[name], value.to(out[name].dtype))):
                raise StageError(f"weight {name!r} is given twice with different values")
            out.setdefault(name, value)
    return out


def _dicts(value: Any) -> Iterable[Mapping]:
    if isinstance(value, Mapping):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _dicts(v)
    elif value is not None:
        raise StageError(f"expected dicts of weights by name, got a {type(value).__name__}")


# -- checkpoints ------------------------------------------------------------------------------
def save_checkpoint(path: str | os.PathLike, dicts: Any) -> Path:
    """Merge export dicts (`export_weights` results: one per stage, or a whole model's) and
    `torch.save` them to `path` as one dict by unsplit name; the file is replaced whole, never
    left half-written. A model config ``checkpoint: path`` starts a model from it."""
    weights = {name: t.detach().cpu() for name, t in merge(dicts).items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(weights, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(whole: torch.nn.Module, path: str | os.PathLike) -> None:
    """Set every parameter of the unsplit model `whole` from the checkpoint at `path` (a dict
    by unsplit name, as `save_checkpoint` or ``torch.save(model.state_dict())`` writes)."""
    if not Path(path).is_file():
        raise StageError(f"checkpoint {str(path)!r} is not a file (on executor host, cwd "
                         f"{os.getcwd()!r}); write one with `flowkit run FLOW --save-weights DIR` "
                         "(it writes DIR/MODEL.pt), or drop the model config's `checkpoint`")
    # mapped, not read: a parameter's bytes are read as they are copied to it [Note: models
    # from a checkpoint in executors/torch/models/built.py]
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, Mapping):
        raise StageError(f"checkpoint {str(path)!r} holds a {type(state).__name__}, not a dict "
                         "of weights by name")
    what = f"the model (loading checkpoint {str(path)!r})"  # the names it lacks are the file's
    buffers = dict(whole.named_buffers())  # a state_dict's buffers load too, but are optional
    given = {n: t for n, t in state.items() if n in buffers}
    for name, value in given.items():
        if not isinstance(value, torch.Tensor) or value.shape != buffers[name].shape:
            raise StageError(f"{what}: buffer {name!r} does not fit {tuple(buffers[name].shape)}")
    load([whole], layout(whole), {n: t for n, t in state.items() if n not in buffers},
         complete=True, what=what)
    with torch.no_grad():
        for name, value in given.items():
            buffers[name].copy_(value)


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")
