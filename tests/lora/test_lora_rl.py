"""LoRA in an RL run [Note: LoRA in flowkit/dsl/lora.py]: GRPO trains a built-in GPT actor's
adapters on torch executor processes; each step's weight sync carries the adapters only (its
bytes reported as `actor/sync_bytes`), the generator's copy holds the trained adapters, the
reference is the base model, and the saved adapters (NAME.lora.pt) and a merged save (a
checkpoint any GPT starts from) give the trained model's function."""

from __future__ import annotations

import pytest
import torch

from dataflows.grpo import grpo_flow
from executors.torch.models.built import export_weights, held_model, save_weights
from executors.torch.models.gpt import GPT
from executors.torch.weights import load_checkpoint
from flowkit.dsl import Model
from flowkit.planner.lower import lower_flow
from flowkit.runner.flowrun import FlowRunner
from flowkit.runner.training_tasks import model_spec
from tests.harness import op_context, tiny_gpt

GPT_CONFIG = tiny_gpt()
LORA = {"r": 2, "alpha": 4, "target_modules": ["c_attn", "c_proj"]}
ACTOR = Model(name="actor", build="executors.torch.models.gpt:GPT",
              config={**GPT_CONFIG, "dtype": "float64", "seed": 3}, stages=2, tags=("train",),
              lora=LORA)
STEPS = 2


@pytest.fixture(scope="module")
def run(pool, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-grpo")
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, infos):
        flow = grpo_flow(model=ACTOR, prompts=4, n=3, microbatches=2, max_new_tokens=5,
                         lr=1e-2, kl_coef=0.01, schedule="zb-h1")
        flow.nodes["update_actor"].config["clip_ratio"] = 10.0  # every token's gradient kept
        runner = FlowRunner(ctl, lower_flow(flow))
        reports = [runner.run_step(step) for step in range(STEPS)]
        (path,) = runner.save_weights(tmp)
        rollout = next(e for e in infos if "rollout" in e.tags)
        generator = ctl.submit("export_weights", config={**model_spec(ACTOR, 1), "stage": 0},
                               executor=rollout.id).result(timeout=60)
        reference = flow.models["reference"]
    return {"saved": path, "adapters": torch.load(path, weights_only=True),
            "generator": generator, "reports": reports, "reference": reference}


def test_only_the_adapters_train_sync_and_save(run):
    adapters = run["adapters"]
    assert run["saved"].name == "actor.lora.pt"
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert any(".lora_B." in n and t.abs().max() > 0 for n, t in adapters.items()), \
        "no adapter moved from its zero start"
    assert run["generator"].keys() == adapters.keys()  # the sync carried the adapters only
    for name, tensor in adapters.items():
        assert torch.equal(run["generator"][name], tensor), name
    assert run["reference"].lora is None  # the reference is the base model


def test_each_steps_sync_reports_the_adapters_bytes(run):
    adapter_bytes = sum(t.numel() * t.element_size() for t in run["adapters"].values())
    whole = sum(p.numel() * 8 for p in GPT(**GPT_CONFIG).parameters())
    for report in run["reports"]:  # the serialized exports: the tensors and their names
        assert adapter_bytes <= report.metrics["actor/sync_bytes"] < 1.2 * adapter_bytes
    assert adapter_bytes < whole / 10


def test_a_merged_save_is_a_checkpoint_with_the_trained_function(tmp_path):
    ctx = op_context()
    spec = {**model_spec(ACTOR, 1), "lora": {**ACTOR.lora, "save": "merged"}}
    held = held_model(ctx, spec)
    with torch.no_grad():  # adapters as training might leave them
        for p in held.parts[0].parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.1)
    exported = export_weights(ctx, stage=0, **spec)
    path = save_weights(ctx, exported, path=str(tmp_path / "actor.pt"), spec=spec)
    assert path == str(tmp_path / "actor.pt")
    plain = GPT(**GPT_CONFIG).to(torch.float64)
    load_checkpoint(plain, path)  # every weight of the plain GPT, by its own names
    idx = torch.randint(0, GPT_CONFIG["vocab_size"], (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(plain(idx), held.parts[0](idx), rtol=0, atol=1e-12)
