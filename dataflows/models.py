"""How the ready-made flows get their models: the user's own `Model`, or the built-in GPT.

Every ready-made flow takes `model=`, any `Model` whose build follows the model contract of the
README ("Your own model"); without one it builds the built-in GPT from `gpt` (a model config).
The roles a flow derives from it (a frozen reference, a critic) are copies of it under other
names, so they load the same weights (its config's `checkpoint`) and run its code.
"""

from __future__ import annotations

from typing import Any

import attrs

from flowkit.dsl import Model

__all__ = ["GPT_BUILD", "critic_of", "flow_model", "reference_of"]

GPT_BUILD = "executors.torch.models.gpt:GPT"


def flow_model(model: Model | None, *, gpt: dict[str, Any] | None, default_gpt: dict[str, Any],
               name: str, stages: int | None, default_stages: int, tags: tuple[str, ...]
               ) -> Model:
    """`model` (cut into `stages` when given), or the built-in GPT named `name` built from
    `gpt` (else `default_gpt`) in `stages` (else `default_stages`) with `tags`."""
    if model is None:
        return Model(name=name, build=GPT_BUILD, config=dict(default_gpt if gpt is None else gpt),
                     stages=default_stages if stages is None else stages, tags=tags)
    if not isinstance(model, Model):
        raise TypeError(f"model must be a flowkit.dsl.Model, got {type(model).__name__}: "
                        "Model(name='actor', build='mymodule:MyModel', config={...})")
    if gpt is not None:
        raise ValueError("give the flow a model or a gpt config, not both: gpt configures the "
                         "built-in GPT that is used when no model is given")
    return model if stages is None else attrs.evolve(model, stages=stages)


def reference_of(actor: Model) -> Model:
    """A frozen copy of the actor (same build, config and starting weights), held whole. A
    LoRA actor's reference is its base model: the adapters start as zero updates."""
    name = "reference" if actor.name != "reference" else "frozen_reference"
    return attrs.evolve(actor, name=name, stages=1, replicas=1, lora=None)


def critic_of(actor: Model, critic: Model | None) -> Model:
    """`critic`, or the actor's build with a value head (`value_head=True` in its config, which
    the built-in GPT takes) starting from fresh weights, in as many stages as the actor. It
    trains every weight, also for a LoRA actor: its fresh value head must learn."""
    if critic is not None:
        return critic
    config = {k: v for k, v in actor.config.items() if k != "checkpoint"}
    return attrs.evolve(actor, name="critic", config={**config, "value_head": True}, lora=None)
