"""`flowkit export CHECKPOINT --model NAME OUT`: one model of a run checkpoint written for tools
that know nothing of flowkit, without starting executors: a Hugging Face model as the folder
`from_pretrained` loads (config, model.safetensors, its tokenizer's files), the built-in GPT as
its state dict in OUT/model.safetensors beside OUT/config.json, a LoRA model's adapters as its
`lora` save setting says. The weights are the union of the executors' layout-free states [Note:
layout-free checkpoints in layout_free.py], whatever layout wrote them.

A checkpoint is a file a user did not write: every file the manifest lists must be there with
its SHA-256 before one is parsed, states are read as safetensors (no pickle), and only the two
builds flowkit ships are built: a build path in a checkpoint is never imported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import safetensors.torch
import torch

from executors.torch import weights
from executors.torch.errors import StageError
from executors.torch.layout_free import train_prefix
from executors.torch.models.built import built_whole, save_weights
from executors.torch.state_file import read_state_file
from flowkit.wire.files import FileRefused, is_plain_name, open_regular, read_regular, sha256_of

__all__ = ["export", "export_model"]

# what flowkit/runner/checkpoints/format.py writes (executors do not import the runner)
_RUN_FORMAT = "flowkit.run_checkpoint/2"
_MANIFEST = "manifest.json"
_MAX_MANIFEST = 1 << 24
_MAX_FILE = 1 << 40
_GPT, _HF = "executors.torch.models.gpt:GPT", "executors.torch.models.hf:HFCausalLM"


class ExportError(ValueError):
    """A checkpoint or a model that cannot be exported; the message says why and what to do."""


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.argument("out", metavar="OUT", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", "model", required=True, metavar="NAME",
              help="The model of the flow to export (a name of its Model, e.g. actor).")
def export(checkpoint: Path, out: Path, model: str) -> None:
    """Write a model of a run checkpoint as a Hugging Face folder or a safetensors state dict."""
    try:
        written = export_model(checkpoint, model, out)
    except (ValueError, StageError, OSError) as exc:  # ExportError, HFModelError too
        raise click.ClickException(str(exc).splitlines()[0]) from None
    click.echo(f"wrote model {model!r} of {checkpoint} to {written}")


def export_model(checkpoint: Path, model: str, out: Path) -> Path:
    """Export model `model` of `checkpoint` (a step folder, or a checkpoint root: its newest)
    to folder `out`; returns what was written."""
    folder = _step_folder(Path(checkpoint))
    manifest = _manifest(folder)
    models = manifest["identity"]["models"]
    if model not in models:
        raise ExportError(f"{folder}: no model {model!r} in this checkpoint; --model takes one "
                          f"of {', '.join(sorted(models)) or '(none)'}")
    spec = models[model]
    if spec.get("build") not in (_GPT, _HF):
        raise ExportError(f"model {model!r} is built by {spec.get('build')!r}; export builds "
                          f"only flowkit's own ({_GPT}, {_HF}): save it with `flowkit run "
                          "--save-weights` instead")
    checksums = _verified(folder, manifest)
    tensors = _trained_weights(folder, manifest, model, checksums)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():  # building seeds torch's generator
        return _write(tensors, spec, out)


def _step_folder(path: Path) -> Path:
    if os.path.lexists(path / _MANIFEST):
        return path
    steps = sorted(p for p in path.glob("step-*") if os.path.lexists(p / _MANIFEST))
    if not steps:
        raise ExportError(f"{path}: not a run checkpoint (no {_MANIFEST} in it, and no "
                          "step-* checkpoint under it): give a --checkpoint-dir of a run")
    return steps[-1]


def _manifest(folder: Path) -> dict:
    """The manifest's fields export reads, checked: its format, the files' SHA-256, the
    models' specs."""
    path = folder / _MANIFEST
    try:
        fields = json.loads(read_regular(path, limit=_MAX_MANIFEST))
    except (FileRefused, ValueError) as exc:
        raise ExportError(f"{path}: unreadable ({exc})") from None
    if not isinstance(fields, dict) or fields.get("format") != _RUN_FORMAT:
        raise ExportError(f"{path}: not a run checkpoint of format {_RUN_FORMAT!r}")
    files, identity = fields.get("files"), fields.get("identity")
    if not (files is None or isinstance(files, dict) and all(
            isinstance(v, str) and _own_file(k) for k, v in files.items())):
        raise ExportError(f"{path}: files is not a map of the folder's files to their SHA-256")
    if not (isinstance(identity, dict) and isinstance(identity.get("models"), dict)
            and all(isinstance(v, dict) for v in identity["models"].values())):
        raise ExportError(f"{path}: identity.models is not a map of models to their specs")
    return fields


def _own_file(name: Any) -> bool:
    folder, _, part = str(name).partition("/")
    return name == "run.msgpack" or folder == "executors" and is_plain_name(part)


def _verified(folder: Path, manifest: dict) -> dict[str, str] | None:
    """Each file the manifest lists is there and of its SHA-256: their checksums by path; None
    for a checkpoint written before checksums."""
    files = manifest.get("files")
    if files is None:
        return None
    for name, digest in sorted(files.items()):
        path = folder / name
        if not os.path.lexists(path):
            raise ExportError(f"{folder}: {name} is missing, and {_MANIFEST} lists it: the "
                              "checkpoint is incomplete; export another one")
        try:
            fd, size = open_regular(path, limit=_MAX_FILE)
        except FileRefused as exc:
            raise ExportError(str(exc)) from None
        try:
            found = sha256_of(fd, size)
        finally:
            os.close(fd)
        if found != digest:
            raise ExportError(f"{path} does not match its SHA-256 in {_MANIFEST}: it changed "
                              "after it was written; export another checkpoint")
    return {str(folder / name): digest for name, digest in files.items()}


def _trained_weights(folder: Path, manifest: dict, model: str,
                     checksums: dict | None) -> dict[str, torch.Tensor]:
    """The model's weights by unsplit name: the union of the trained stages of every
    executor's state, else a copy one of them held."""
    names = sorted(n for n in (manifest.get("files") or {}) if n.startswith("executors/"))
    if checksums is None:
        names = sorted(f"executors/{p.name}" for p in (folder / "executors").iterdir())
    trained: dict[str, torch.Tensor] = {}
    copies: dict[str, torch.Tensor] = {}
    for name in names:
        _, tensors = read_state_file(str(folder / name), checksums)
        for key, value in tensors.items():
            if key.startswith(train_prefix(model) + "param/"):
                trained.setdefault(key.split("/param/", 1)[1], value)
            elif key.startswith(f"{model}/copy1/param/"):
                copies.setdefault(key.split("/param/", 1)[1], value)
    if not (trained or copies):
        raise ExportError(f"{folder}: model {model!r} was neither trained nor loaded by the "
                          "run that wrote it: its weights are those its build makes")
    return trained or copies


def _write(tensors: dict[str, torch.Tensor], spec: dict, out: Path) -> Path:
    if spec.get("lora"):  # the adapters, as the model's lora settings save them
        return Path(save_weights(None, tensors, path=str(out / f"{spec['model']}.pt"),
                                 spec=spec))
    config = dict(spec.get("model_config", {}))
    whole = built_whole(spec)
    weights.load([whole], weights.layout(whole), tensors, complete=True,
                 what=f"model {spec['model']!r}")
    if spec["build"] == _HF:
        return whole.save_pretrained(out)
    state = {name: value.detach().clone().contiguous()  # tied weights: one copy each
             for name, value in whole.state_dict().items()}
    safetensors.torch.save_file(state, out / "model.safetensors",
                                metadata={"build": spec["build"]})
    (out / "config.json").write_text(json.dumps(
        {"build": spec["build"], "dtype": spec.get("dtype"), "model_config": config}, indent=1))
    return out / "model.safetensors"
