"""Where the torch executor builds its models, splits them into stages and holds them (the models
it has built, by name and number of stages).

[Note: one model, many holders] Every executor builds the whole model from its `build` path
(``module:factory``) and model config with the same seed, or from the config's ``checkpoint``
file, and keeps the stages it is asked for: all executors hold the same initial weights as a
plain loop that builds the model once. An executor holds a model by (name, number of stages),
so maybe in several splits (`held_model`): stages the pipeline ops (train/pipeline_ops.py) run
(`held_stage`), a whole copy that generation (rollout/generate.py) and scoring (rollout/infer.py)
run (`whole_model`). The `export_weights` and `load_weights` ops move weights between splits
[Note: unsplit names in weights.py].
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from executors.optable import OpContext
from executors.torch import cuda_share, weight_broadcast, weights
from executors.torch.device import building_on
from executors.torch.errors import StageError
from executors.torch.layout_free import RESUMED, load_trained
from executors.torch.lora import add_adapters, merge_adapters
from executors.torch.models.packing import accepts_positions
from flowkit.dsl.lora import check_lora, lora_identity
from flowkit.dsl.operators import PRECISIONS
from flowkit.ops.records import BroadcastWeights, SharedWeights, WeightsVersion

__all__ = ["HeldModel", "built_whole", "evaluating", "export_weights", "held_model",
           "load_weights", "right_padded", "save_weights", "whole_model"]

_DTYPES = {name: getattr(torch, name) for name in ("float32", "float64", "bfloat16", "float16")}
# a model's precision: the dtype its forward computes in under autocast over its own weights
# (None: in the weights' dtype) [Note: mixed precision in flowkit/dsl/operators.py]
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}
assert tuple(AUTOCAST) == PRECISIONS  # the DSL's names, each with its autocast dtype


@attrs.define(eq=False)
class HeldModel:
    """One model as this executor holds it: the split stages, and runners for those in use."""

    spec: tuple
    parts: list[torch.nn.Module]
    device: torch.device
    stages: dict[int, Any] = attrs.field(factory=dict)  # the ones it trains (train/held_stage.py)
    layout: Any = None  # its names by the unsplit model's (executors/torch/weights.py)
    version: int | None = None  # of the weights load_weights last set
    config: dict = attrs.field(factory=dict)  # what built it, to build it again (state.py)
    lora: dict | None = None  # its adapters' settings: only they train, export and save
    autocast: torch.dtype | None = None  # its forwards' compute dtype (AUTOCAST)
    # a resumed model's AdamW states by unsplit name, until its stages' optimizers take them
    # [Note: layout-free checkpoints in executors/torch/layout_free.py]
    resumed: dict | None = None


def held_model(ctx: OpContext, config: dict) -> HeldModel:
    """The model named in `config` split in `stages`, built on first use [Note: one model, many
    holders]; a model config's `checkpoint` file is loaded as executors/torch/weights.py says."""
    name, num_stages = config["model"], int(config["stages"])
    try:  # what a task says is checked here too: the message may not come from a Model
        lora_settings = check_lora(config.get("lora"), model=name)
    except ValueError as exc:
        raise StageError(str(exc)) from None
    spec = (config["build"], repr(sorted(config.get("model_config", {}).items())),
            int(config.get("seed", 0)), config.get("dtype", "float32"),
            repr(sorted((lora_identity(lora_settings) or {}).items())))
    models = ctx.state.setdefault("torch_models", {})
    for (other, stages), held in models.items():
        if other == name and held.spec != spec:
            raise StageError(f"model {name!r} is already held here as {held.spec}; a task asked "
                             f"for {spec}: one flow must not declare one model two ways")
        if (other, stages) == (name, num_stages):
            return held
    device = torch.device(ctx.device if ctx.device not in ("", "auto") else "cpu")
    precision = config.get("precision", "fp32")
    if precision not in AUTOCAST:
        raise StageError(f"model {name!r}: unknown precision {precision!r}; use one of "
                         f"{', '.join(AUTOCAST)}")
    resumed = ctx.state.get(RESUMED, {}).get(name)
    with _generators_kept(resumed is not None):
        torch.manual_seed(int(config.get("seed", 0)))  # every holder builds the same weights
        model_config = dict(config.get("model_config", {}))
        checkpoint = model_config.pop("checkpoint", None)  # a file to start from, not an argument
        whole = _built(config["build"], model_config, checkpoint, device,
                       _DTYPES[config.get("dtype", "float32")])
        parts = _split(whole, num_stages, config.get("seq_len"))
        if config.get("packing"):
            _check_packing(name, parts)
        layout = weights.layout(whole, parts, seq_len=config.get("seq_len"))
        if lora_settings:  # [Note: LoRA in flowkit/dsl/lora.py]
            torch.manual_seed(int(config.get("seed", 0)))  # adapters drawn alike in every split
            layout = add_adapters(whole, parts, layout, lora_settings)
    built_from = {key: config[key] for key in ("model", "build", "stages", "seed", "dtype",
                                               "precision", "model_config", "seq_len", "lora")
                  if key in config}
    held = models[(name, num_stages)] = HeldModel(
        spec=spec, parts=parts, device=device, config=built_from, layout=layout,
        lora=lora_settings, autocast=AUTOCAST[precision])
    for part in parts:  # generation and scoring compute as training does (`evaluating`)
        _COMPUTE_DTYPE[part] = held.autocast
    if resumed is not None:  # [Note: layout-free checkpoints in executors/torch/layout_free.py]
        load_trained(held, name, resumed)
    return held


@contextlib.contextmanager
def _generators_kept(keep: bool):
    """Building seeds torch's generators; a split built after a resume must leave them as the
    checkpoint set them, as the run that never stopped built it before they moved on."""
    if not keep:
        yield
        return
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        yield


def _check_packing(name: str, parts: list[torch.nn.Module]) -> None:
    """A packed model's stages must take the positions of packed rows [Note: packed rows in
    executors/torch/models/packing.py]."""
    lacking = [part for part in parts if not accepts_positions(part)]
    if lacking:
        raise StageError(f"model {name!r} has packing on, but its {type(lacking[0]).__name__}."
                         "forward takes no `positions` (the positions of packed rows): turn "
                         "packing off, or give its forward (x, targets=None, positions=None)")


def _build(path: str, model_config: dict) -> torch.nn.Module:
    return _factory(path)(**model_config)


# [Note: models from a checkpoint] A model that starts from a checkpoint file is built with its
# parameters on the meta device (no memory, no random init: `_parameters_on_meta`, as
# accelerate's init_empty_weights does), each then made empty once on its device in its dtype,
# and filled from the file read through mmap: host memory at build is about the model's size,
# not twice it, and a GPU model never holds an fp32 copy on the host (tests/torch/
# test_model_build.py measures it). Buffers are built as usual (a rotary table is computed, not
# saved). A model without a checkpoint is built on the CPU from the seeded CPU generator, so that
# every holder, and a plain loop, draws the same weights; one whose build loads a folder (an HF
# model's `path`) has `from_pretrained` load it in its dtype onto its device (`building_on`).
def _built(path: str, model_config: dict, checkpoint: str | None, device: torch.device,
           dtype: torch.dtype) -> torch.nn.Module:
    if not checkpoint:  # an HF folder loads onto `device` in `dtype` (`building_on`)
        with building_on(device, dtype):
            whole = _build(path, model_config)
        return whole.to(device=device, dtype=dtype)
    with _parameters_on_meta():
        whole = _build(path, model_config)
    _materialize(whole, device, dtype)
    whole.to(device=device, dtype=dtype)  # the buffers; the parameters are there already
    weights.load_checkpoint(whole, checkpoint)
    return whole


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter a module registers in the block is replaced by its meta twin [Note:
    models from a checkpoint]."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _materialize(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Each meta parameter made empty on `device` in `dtype` (floating ones), once: a parameter
    two modules share (tied weights) stays one."""
    made: dict[int, torch.nn.Parameter] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                kind = dtype if param.is_floating_point() else param.dtype
                made[id(param)] = torch.nn.Parameter(
                    torch.empty(param.shape, device=device, dtype=kind),
                    requires_grad=param.requires_grad)
            owner._parameters[name] = made[id(param)]


def _factory(path: str) -> Any:
    """What a model build `path` ("package.module:factory") names, imported."""
    return imported(path, "model build")


def imported(path: str, what: str, shape: str = "name") -> Any:
    """What `path` ("package.module:name", from the flow through its controller) names,
    imported; `what` it is and the `shape` of its name, for the errors."""
    module_name, _, name = path.partition(":")
    if not name:
        raise StageError(f"{what} {path!r} must be 'package.module:{shape}'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise StageError(f"{what} {path!r}: no module {exc.name!r} on this executor "
                         f"(searched {', '.join(sys.path[:4])}, ...): put it beside the flow "
                         "file or install it") from exc
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise StageError(f"{what} {path!r}: module {module_name!r} has no {part!r}")
    return obj


def _split(whole: torch.nn.Module, stages: int, seq_len: int | None) -> list[torch.nn.Module]:
    """A model splits itself with `split(stages, seq_len=...)` (the built-in GPT does); a model
    without one runs as a single stage."""
    split = getattr(whole, "split", None)
    if split is not None:
        return list(split(stages, seq_len=seq_len))
    if stages != 1:
        raise StageError(f"{type(whole).__name__} has no split(stages) method, so it cannot be "
                         f"cut into {stages} pipeline stages; give it one or use one stage")
    return [whole]


# -- the whole model, to generate and score with ----------------------------------------------
def whole_model(ctx: OpContext, config: dict) -> torch.nn.Module:
    """The named model as one module: its one-stage split, built as the training stages are,
    and shared with them when this executor holds the model in one stage."""
    missing = [key for key in ("model", "build") if key not in config]
    if missing:
        raise StageError(f"generation and inference need the model's {' and '.join(missing)} in "
                         "their config, e.g. model='policy', "
                         "build='executors.torch.models.gpt:GPT'")
    held = held_model(ctx, {**config, "stages": 1})  # its whole copy, beside any training split
    if len(held.parts) != 1:
        raise StageError(f"model {config['model']!r} is held here in {len(held.parts)} stages; "
                         "generation and inference need it whole (stages=1)")
    return held.parts[0]


# a held part's compute dtype under its model's precision, for forwards outside training
_COMPUTE_DTYPE: weakref.WeakKeyDictionary[torch.nn.Module, torch.dtype | None] = \
    weakref.WeakKeyDictionary()


@contextlib.contextmanager
def evaluating(module: torch.nn.Module):
    """Eval mode and no autograd for the block, each submodule's mode restored afterwards (the
    module may be a training stage too); a held model's forwards under its precision's
    autocast [Note: mixed precision in flowkit/dsl/operators.py]."""
    restore, dtype = _to_eval(module), _COMPUTE_DTYPE.get(module)
    try:
        with torch.no_grad():
            if dtype is None:
                yield module
            else:
                device = next((p.device.type for p in module.parameters()), "cpu")
                with torch.autocast(device, dtype=dtype):
                    yield module
    finally:
        restore()


def _to_eval(module: torch.nn.Module) -> Callable[[], None]:
    """Put `module` in eval mode; what puts each submodule back as it was.

    [Note: flat mode switch] eval() and train() call themselves down the tree, each setting
    `training` through Module.__setattr__: on the tiny Qwen2 (33 modules) the pair takes
    0.5 ms and one flat pass setting the flags directly 0.02 ms (a timing loop in a throwaway
    script); around the engine's steps on a training model the walks took 10 % of an
    executor's CPU in the README's GRPO step (`py-spy record --subprocesses` of `flowkit bench
    trl`). A module whose class overrides train() with more than that gets its own.
    """
    modules = list(module.modules())
    if not any(m.training for m in modules):
        return _nothing  # a whole copy only sampled or scored stays as it is
    if not all(_plain_mode(m) for m in modules):
        module.eval()
        return lambda: module.train(True)
    was = [m.training for m in modules]
    for m in modules:
        m.__dict__["training"] = False

    def restore() -> None:
        for m, mode in zip(modules, was):
            m.__dict__["training"] = mode
    return restore


def _plain_mode(module: torch.nn.Module) -> bool:
    """Whether train(mode) on `module` only sets its flag and its children's: torch's own, or
    transformers' PreTrainedModel.train, which also re-applies hub kernels when they are used."""
    train = type(module).train
    if train is torch.nn.Module.train:
        return True
    return (getattr(train, "__qualname__", "") == "PreTrainedModel.train"
            and not getattr(module, "use_kernels", False))


def _nothing() -> None:
    return None


def right_padded(seqs: list[list[int]], device: torch.device,
                 shape: tuple[int, int] | None = None) -> torch.Tensor:
    """(B, longest) token ids, each sequence followed by 0s (harmless to a causal model); with
    `shape` (rows, width), that many rows of that width, the rows past the sequences all 0s."""
    rows, width = shape or (len(seqs), max(len(s) for s in seqs))
    padded = [s + [0] * (width - len(s)) for s in seqs] + [[0] * width] * (rows - len(seqs))
    return torch.tensor(padded, device=device)


# -- weights between splits [Note: unsplit names in executors/torch/weights.py] ---------------
def export_weights(ctx: OpContext, *_: Any, stage: int, stages: int, model: str, build: str,
                   share_with: list | None = None, broadcast: str | None = None,
                   self_load: bool = False, **config: Any
                   ) -> dict[str, torch.Tensor] | SharedWeights | BroadcastWeights:
    """Stage `stage` of the model held here in `stages` stages: its parameters by unsplit name,
    detached CPU copies (of a LoRA model, its adapters only: the rest never changes); with
    `share_with` (the names of executors on this GPU) a stage on a GPU is left there for them
    [Note: weights on one GPU in executors/torch/cuda_share.py]; with `broadcast` (a group
    this executor is rank 0 of) sent to the group's members, kept for this executor's own
    load with `self_load` [Note: weights by broadcast in
    executors/torch/weight_broadcast.py]. Inputs only order it (after a step)."""
    held = held_model(ctx, {**config, "model": model, "build": build, "stages": stages})
    if not 0 <= int(stage) < len(held.parts):
        raise StageError(f"model {model!r} has stages 0..{len(held.parts) - 1}, not {stage}")
    trained = held.stages.get(int(stage))
    if trained is not None and trained.fsdp is not None and not trained.fsdp.gathered:
        raise StageError(f"model {model!r} stage {stage} is sharded over its replicas between "
                         "steps (FSDP): every replica gathers it first (fsdp_gather), as the "
                         "runner does before an export")
    part, names = held.parts[int(stage)], held.layout.check().names[int(stage)]
    trained_only = held.lora is not None
    shared = bool(share_with) and held.device.type == "cuda"
    if shared and not (type(share_with) is list and all(type(r) is str for r in share_with)):
        raise StageError(f"share_with must name executors, not {share_with!r:.80}")
    if broadcast is None and not shared:
        return weights.export(part, names, trained_only=trained_only, one_buffer=True)
    params, named = weights.exported(part, names, trained_only=trained_only)
    if broadcast is not None:
        return weight_broadcast.send(ctx, params, named, broadcast, for_self=bool(self_load))
    return cuda_share.share(params, named, share_with, ctx.name, slot=f"{model}/{stages}/{stage}")


def save_weights(ctx: OpContext, *exports: Any, path: str, spec: dict | None = None) -> str:
    """Write a checkpoint where the weights are: `exports` (each stage's `export_weights`,
    moved here over the data plane) merged and saved to `path`. A model whose build has a format
    of its own (`pretrained_format`: a Hugging Face causal LM) is built from `spec` (its
    model_spec), given the weights and saved in that format, to `path` without its suffix (a
    folder `from_pretrained` loads); a LoRA model's adapters as its settings say (`_save_lora`).
    The path written is returned."""
    if spec is not None and spec.get("lora"):
        return str(_save_lora(weights.merge(exports), Path(path), spec))
    if spec is not None and hasattr(_factory(spec["build"]), "save_pretrained"):
        config = {k: v for k, v in spec.get("model_config", {}).items() if k != "checkpoint"}
        whole = _build(spec["build"], config)
        if getattr(whole, "pretrained_format", False):
            whole = whole.to(dtype=_DTYPES[spec.get("dtype", "float32")])
            weights.load([whole], weights.layout(whole), weights.merge(exports), complete=True,
                         what=f"model {spec.get('model')!r}")
            return str(whole.save_pretrained(Path(path).with_suffix("")))
    return str(weights.save_checkpoint(path, exports))


def _save_lora(adapters: dict[str, torch.Tensor], path: Path, spec: dict) -> Path:
    """A LoRA model's `adapters` [Note: LoRA in flowkit/dsl/lora.py], as lora's `save` says:
    an adapter folder peft loads (a Hugging Face model: `path` without its suffix) or the
    adapter tensors by name (others: `path` as NAME.lora.pt); or merged into the base weights,
    saved as a model without adapters would be."""
    settings = spec["lora"]
    if settings["save"] == "adapter" and not hasattr(_factory(spec["build"]), "save_lora"):
        return weights.save_checkpoint(path.with_suffix(".lora.pt"), adapters)
    with torch.random.fork_rng():  # building seeds torch: this executor's draws stay its own
        return _save_lora_built(adapters, path, spec, settings)


def _save_lora_built(adapters: dict[str, torch.Tensor], path: Path, spec: dict,
                     settings: dict) -> Path:
    whole = built_whole(spec)
    pretrained = getattr(whole, "pretrained_format", False)
    if settings["save"] == "adapter":
        return whole.save_lora(path.with_suffix(""), settings, adapters)
    torch.manual_seed(int(spec.get("seed", 0)))
    layout = add_adapters(whole, [whole], weights.layout(whole), settings)
    weights.load([whole], layout, adapters, what=f"the adapters of model {spec.get('model')!r}")
    merge_adapters(whole)
    if pretrained:
        return whole.save_pretrained(path.with_suffix(""))
    return weights.save_checkpoint(path, weights.export(whole, weights.layout(whole).names[0]))


def built_whole(spec: dict) -> torch.nn.Module:
    """The model `spec` names, built as its holders built it, before any adapter."""
    config = dict(spec.get("model_config", {}))
    checkpoint = config.pop("checkpoint", None)
    torch.manual_seed(int(spec.get("seed", 0)))
    return _built(spec["build"], config, checkpoint, torch.device("cpu"),
                  _DTYPES[spec.get("dtype", "float32")])


def load_weights(ctx: OpContext, *dicts: Any, model: str, build: str, stages: int,
                 version: int | None = None, complete: bool = False, stage: int | None = None,
                 **config: Any) -> Any:
    """Copy the weights in `dicts` (export_weights' results, by unsplit name) into the model
    held here in `stages` stages (only its stage `stage` if given), then record `version`.
    Unknown names and wrong shapes are errors; missing ones only with `complete`. Inputs that
    are WeightsVersions only order it; the newest gives the version when `version` is None.
    SharedWeights are opened and BroadcastWeights received here first (`_opened`). Returns
    the WeightsVersion loaded (for generate to wait on), or None with no version. Optimizer
    state, where this split trains, is kept."""
    versions = [int(value.version) for value in dicts if isinstance(value, WeightsVersion)]
    held = held_model(ctx, {**config, "model": model, "build": build, "stages": stages})
    tensors = [_opened(ctx, value, held) for value in dicts
               if not isinstance(value, WeightsVersion)]
    which = None if stage is None else [int(stage)]
    if which and not 0 <= which[0] < len(held.parts):
        raise StageError(f"model {model!r} has stages 0..{len(held.parts) - 1}, not {stage}")
    weights.load(held.parts, held.layout, weights.merge(tensors), stages=which,
                 complete=bool(complete), what=f"model {model!r} in {stages} stage(s)")
    version = max(versions) if version is None and versions else version
    held.version = None if version is None else int(version)
    return None if version is None else WeightsVersion(model=model, version=int(version))


def _opened(ctx: OpContext, value: Any, held: HeldModel) -> Any:
    """Weights another executor left on this GPU [Note: weights on one GPU in
    executors/torch/cuda_share.py] or broadcast [Note: weights by broadcast in
    executors/torch/weight_broadcast.py], by unsplit name; anything else as it is."""
    if isinstance(value, SharedWeights):
        return cuda_share.opened(value, ctx.name, held.device)
    if isinstance(value, BroadcastWeights):
        # at most this model's weights at 8 bytes each, each at a 64-byte boundary
        limit = sum(8 * p.numel() + 64 for part in held.parts for p in part.parameters())
        return weight_broadcast.received(ctx, value, held.device, limit)
    return value
