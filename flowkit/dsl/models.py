"""What can be known of a flow's models before any executor starts: how many layers the built-in
GPT or a Hugging Face model has, so a pipeline cut into more stages than that is refused, and
whether a checkpoint a model's config names is there. Pure Python: it reads configs and
config.json, never model code. `flowkit check` and `Run` report what these find."""

from __future__ import annotations

import json
from pathlib import Path

from flowkit.dsl.flow import Flow
from flowkit.dsl.hf import HF_BUILD
from flowkit.dsl.operators import Model

__all__ = ["GPT_BUILD", "GPT_DEFAULT_LAYERS", "checkpoint_problems", "model_layers",
           "stages_problems"]

GPT_BUILD = "executors.torch.models.gpt:GPT"
GPT_DEFAULT_LAYERS = 4
"""The built-in GPT's n_layer when its config gives none (GPTConfig's default; a test holds
them equal: the core imports no executor code)."""


def model_layers(model: Model) -> int | None:
    """The layers a model's pipeline stages split, where its build and config say (the built-in
    GPT's n_layer, a Hugging Face config's num_hidden_layers); None for a build of its own."""
    if model.build == GPT_BUILD:
        return int(model.config.get("n_layer", GPT_DEFAULT_LAYERS))
    if model.build != HF_BUILD:
        return None
    if model.config.get("path") is not None:
        config_file = Path(model.config["path"]) / "config.json"
        hf_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    else:
        hf_config = dict(model.config.get("hf_config") or {})
    layers = hf_config.get("num_hidden_layers", hf_config.get("n_layer"))  # gpt2: n_layer
    return layers if isinstance(layers, int) else None


def stages_problems(flow: Flow) -> list[str]:
    """A line for each model cut into more pipeline stages than it has layers."""
    problems = []
    for model in flow.models.values():
        layers = model_layers(model)
        if layers is not None and model.stages > layers:
            problems.append(f"model {model.name!r} has {layers} layers, so it cuts into at most "
                            f"{layers} pipeline stages, not {model.stages}: give {layers} or "
                            "fewer, or a deeper model")
    return problems


def checkpoint_problems(flow: Flow) -> list[str]:
    """A line for each checkpoint file a model's config names (`checkpoint`) that is not there,
    relative to the working directory as the executors read it."""
    named: dict[str, list[str]] = {}  # path -> the models that start from it
    for model in flow.models.values():
        checkpoint = model.config.get("checkpoint")
        if checkpoint and not Path(checkpoint).is_file():
            named.setdefault(str(checkpoint), []).append(repr(model.name))
    return [f"model{'s' * (len(models) > 1)} {', '.join(models)}: checkpoint {path!r}: no "
            f"such file (in {Path.cwd()}): write it first (`--save-weights DIR` writes "
            "DIR/MODEL.pt after a run) or correct the path in the model's config"
            for path, models in named.items()]
