"""bf16 mixed precision [Note: mixed precision in flowkit/dsl/operators.py]: fp32 weights,
gradients and optimizer states, forwards under bf16 autocast; the split B/W equals the fused
backward under autocast [Note: deferred calls under autocast], a plain autocast loop too, and an
update at an RL learning rate is kept where a bf16 cast of the weights loses it. Autocast runs
on the CPU, so all of it is tested here."""

from __future__ import annotations

import copy

import pytest
import torch

from executors.optable import OpContext
from executors.torch import StageRunner
from executors.torch.models.built import evaluating, held_model
from executors.torch.models.gpt import GPT
from executors.torch.train import pipeline_ops as po
from flowkit.dsl import Model
from flowkit.runner.config import RunConfig
from tests.torch.helpers import KINDS, make_data, make_stages, run_order, schedule_order

BF16 = torch.bfloat16
CFG = {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}


def _fp32(kind: str, stages: int) -> tuple[list, list]:
    modules = [m.float() for m in make_stages(kind, stages)]
    data = [tuple(t.float() if t.is_floating_point() else t for t in mb)
            for mb in make_data(kind, 4)]
    return modules, data


def _grads(modules) -> list[torch.Tensor]:
    return [p.grad for m in modules for p in m.parameters()]


def _autocast_reference(modules, data) -> list[torch.Tensor]:
    """Plain autograd of the summed losses, each forward under bf16 autocast."""
    ref = copy.deepcopy(modules)
    for x, y in data:
        with torch.autocast("cpu", dtype=BF16):
            for s, stage in enumerate(ref):
                x = stage(x, y) if s == len(ref) - 1 else stage(x)
        x.backward()
    return _grads(ref)


def _close(got: list[torch.Tensor], want: list[torch.Tensor], rel: float) -> None:
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        scale = w.abs().max().clamp_min(1e-6)
        assert float((g - w).abs().max() / scale) <= rel


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_split_backward_under_bf16_equals_the_fused_one(kind, schedule):
    """Every toy model (linear, layer norm, embedding, convolution, a shared parameter): B then
    W and the fused BW under autocast give the same fp32 gradients to bf16's rounding, and both
    those of a plain autocast loop."""
    order = schedule_order(schedule, 2, 4)
    got = {}
    for split in (True, False):
        modules, data = _fp32(kind, 2)
        runners = [StageRunner(m, autocast=BF16) for m in modules]
        run_order(runners, data, order, split=split)
        assert all(p.dtype == torch.float32 for m in modules for p in m.parameters())
        got[split] = _grads(modules)
    _close(got[True], got[False], rel=1e-2)
    _close(got[True], _autocast_reference(*_fp32(kind, 2)), rel=1e-2)


def test_without_autocast_the_runner_is_unchanged():
    modules, data = _fp32("mlp_ln", 2)
    run_order([StageRunner(m) for m in modules], data, schedule_order("zb-h1", 2, 4))
    exact = _grads(modules)
    modules, data = _fp32("mlp_ln", 2)
    run_order([StageRunner(m, autocast=BF16) for m in modules], data,
              schedule_order("zb-h1", 2, 4))
    assert any(not torch.equal(a, b) for a, b in zip(exact, _grads(modules)))  # it did cast


def _spec(name: str, **extra) -> dict:
    return {"model": name, "build": "executors.torch.models.gpt:GPT", "model_config": CFG,
            "seed": 0, **extra}


def _one_step(ctx: OpContext, spec: dict, lr: float) -> tuple[dict, dict]:
    """Weights before and after one pipeline step (2 stages, split B/W, AdamW at `lr`)."""
    tokens = torch.randint(0, CFG["vocab_size"], (4, 17), generator=torch.Generator()
                           .manual_seed(1))
    held = held_model(ctx, {**spec, "stages": 2})
    before = {f"{s}.{n}": p.detach().clone() for s, part in enumerate(held.parts)
              for n, p in part.named_parameters()}
    a0 = po._forward(ctx, tokens, stage=0, stages=2, microbatch=0, **spec)
    stats = po._forward(ctx, a0, tokens, stage=1, stages=2, microbatch=0, **spec)
    g1 = po._backward_input(ctx, stats, stage=1, stages=2, microbatch=0, **spec)
    po._backward_input(ctx, g1, stage=0, stages=2, microbatch=0, **spec)
    for s in (1, 0):
        po._backward_weight(ctx, stage=s, stages=2, microbatch=0, **spec)
    s0, tied0 = po._grad_stats(ctx, stage=0, stages=2, **spec)
    s1, tied1 = po._grad_stats(ctx, tied0, stage=1, stages=2, **spec)
    rest = {k: v for k, v in spec.items() if k != "model"}
    po._optimizer_step(ctx, [stats], s0, s1, tied1, stage=0, stages=2, model=spec["model"],
                       lr=lr, **rest)
    po._optimizer_step(ctx, [stats], s0, s1, stage=1, stages=2, model=spec["model"], lr=lr,
                       **rest)
    after = {f"{s}.{n}": p.detach().clone() for s, part in enumerate(held.parts)
             for n, p in part.named_parameters()}
    return before, after


def _changed(before: dict, after: dict) -> float:
    moved = sum(int((after[k] != before[k]).sum()) for k in before)
    return moved / sum(t.numel() for t in before.values())


def test_bf16_mixed_precision_keeps_an_rl_sized_update_a_bf16_cast_loses():
    """One AdamW step at lr 1e-6: fp32 master weights move (almost) all of them; weights cast
    to bf16 keep most unchanged, the loss the issue measured."""
    ctx = OpContext(name="precision", device="cpu", tags=())
    mixed = _changed(*_one_step(ctx, _spec("mixed", precision="bf16"), lr=1e-6))
    cast = _changed(*_one_step(ctx, _spec("cast", dtype="bfloat16"), lr=1e-6))
    held = held_model(ctx, {**_spec("mixed", precision="bf16"), "stages": 2})
    assert all(p.dtype == torch.float32 for part in held.parts for p in part.parameters())
    assert mixed > 0.9 and cast < 0.5, (mixed, cast)


def test_a_bf16_models_scoring_runs_under_autocast_too():
    """Generation and scoring (`evaluating`) compute as the trainer does."""
    ctx = OpContext(name="precision", device="cpu", tags=())
    whole = held_model(ctx, {**_spec("scored", precision="bf16"), "stages": 1}).parts[0]
    plain = held_model(ctx, {**_spec("plain"), "stages": 1}).parts[0]
    ids = torch.randint(0, CFG["vocab_size"], (2, 8))
    with evaluating(whole):
        mixed = whole(ids)
    with evaluating(plain):
        exact = plain(ids)
    assert mixed.dtype == BF16 and exact.dtype == torch.float32
    assert float((mixed.float() - exact).abs().max()) < 0.1 * float(exact.abs().max())
    assert isinstance(GPT(**CFG), torch.nn.Module)


def test_precision_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, not 'fp16'"):
        Model(name="m", build="executors.torch.models.gpt:GPT", precision="fp16")
    with pytest.raises(ValueError, match="keeps fp32 weights.*dtype='bfloat16'.*leave dtype"):
        Model(name="m", build="executors.torch.models.gpt:GPT", precision="bf16",
              config={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="'precision' must be in"):
        RunConfig(precision="half")


def test_a_bf16_models_engine_keeps_its_cache_in_bf16():
    """Half the cache memory of the fp32 weights', and generation runs under autocast."""
    from executors.torch.rollout.engine import Engine, Sampling
    from flowkit.ops.records import Prompt
    from tests.torch.test_engine_memory import run

    ctx = OpContext(name="precision", device="cpu", tags=())
    whole = held_model(ctx, {**_spec("generating", precision="bf16"), "stages": 1}).parts[0]
    engine = Engine(whole, version=lambda: None, max_batch=4)
    prompts = [Prompt(prompt_id=i, tokens=[1 + i, 2, 3]) for i in range(3)]
    rollouts, _ = run(engine, [engine.submit(prompts, Sampling(max_new_tokens=4,
                                                               temperature=0.0), 1)])
    assert [len(r.response_tokens) for r in rollouts] == [4, 4, 4]
    engine.submit(prompts[:1], Sampling(max_new_tokens=4, temperature=0.0), 1)
    engine.step()
    assert engine.cache.k[0].dtype == BF16


def test_a_microbatch_under_bf16_holds_no_copy_of_the_weights():
    """B's dX casts W when it runs: the forward saves the fp32 parameter itself, which is not
    activation memory, so a microbatch in flight holds its activations only."""
    module = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    held = {}
    for autocast in (None, BF16):
        runner = StageRunner(module, autocast=autocast)
        runner.forward(0, torch.randn(2, 4, 256))
        held[autocast] = runner.device_bytes
        runner.reset()
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    assert held[BF16] <= held[None] < weights / 16, held


def test_the_runs_precision_leaves_a_model_cast_to_bf16_as_it_is():
    """--precision bf16 on a flow with a frozen bf16 copy (tis_bf16's actor): that model keeps
    its cast, the others compute in bf16."""
    from examples.grpo_sort import tis_bf16
    from flowkit.runner.setup import with_training_options

    flow = with_training_options(tis_bf16, stages=None, microbatches=None, schedule=None,
                                 precision="bf16")
    assert {m.config.get("dtype", "float32"): m.precision for m in flow.models.values()} == {
        "bfloat16": "fp32"}


def test_evaluating_restores_a_training_module_and_leaves_an_eval_one_as_it_was():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    with evaluating(model) as inside:
        assert not any(m.training for m in inside.modules())
        assert not torch.is_grad_enabled()
    assert all(m.training for m in model.modules())
    model.eval()
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert not any(m.training for m in model.modules())


def test_evaluating_puts_back_each_submodules_own_mode():
    """A submodule kept in eval mode on a training model (a frozen norm) stays so afterwards;
    one whose class overrides train() is switched through it."""
    calls = []

    class Frozen(torch.nn.Module):
        def train(self, mode: bool = True):
            calls.append(mode)
            return super().train(mode)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model[1].eval()
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, True, False]
    wrapped = torch.nn.Sequential(Frozen(), torch.nn.Dropout(0.5))
    with evaluating(wrapped):
        assert not any(m.training for m in wrapped.modules())
    assert all(m.training for m in wrapped.modules()) and calls == [False, True]


def test_evaluating_switches_a_hugging_face_model_in_one_flat_pass():
    """transformers' PreTrainedModel.train (hub kernels aside) only sets flags: the flat pass
    takes it, and puts the model back in training mode."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    model = transformers.Qwen2ForCausalLM(config).train()
    switched = []
    model.train = lambda mode=True: switched.append(mode)  # not called by the flat pass
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert all(m.training for m in model.modules()) and switched == []
