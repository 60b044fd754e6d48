"""Hugging Face causal LMs as flowkit models [Note: Hugging Face stages in
executors/torch/models/hf.py]: pipeline training on real executor processes equals a plain
single-process HF training loop, the engine's cached decoding equals `model.generate`, and a saved
model loads with `from_pretrained`. Every model is a tiny random config built offline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.harness import requires

requires("transformers", "hf")

from dataflows.pretrain import pretrain_flow  # noqa: E402
from executors.torch.models.hf import HFCausalLM  # noqa: E402
from executors.torch.rollout import generate as gen  # noqa: E402
from executors.torch.rollout.engine import run_until_done  # noqa: E402
from flowkit.dsl import Model  # noqa: E402
from flowkit.ops.records import Prompt  # noqa: E402
from flowkit.planner.lower import lower_flow  # noqa: E402
from flowkit.runner.flowrun import FlowRunner  # noqa: E402
from tests.harness import (  # noqa: E402
    op_context,
    per_stage,
    plain_training,
    trained_on_executors,
)

CORPUS = str(Path(__file__).parents[2] / "examples" / "data" / "corpus.txt")
DEVICES, MICROBATCHES, SEQUENCES, SEQ_LEN, STEPS = 2, 4, 8, 8, 2
HPARAMS = {"lr": 1e-2, "clip_grad_norm": 0.5}
ROPE = dict(hidden_size=16, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, vocab_size=256, max_position_embeddings=32)
LLAMA = {"architecture": "llama", "hf_config": ROPE}
QWEN2_TIED = {"architecture": "qwen2", "hf_config": {**ROPE, "tie_word_embeddings": True}}
GPT2 = {"architecture": "gpt2", "hf_config": dict(
    n_embd=16, n_layer=4, n_head=2, vocab_size=256, n_positions=32, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)}


def _plain_model(config: dict, dtype: torch.dtype, seed: int = 3) -> HFCausalLM:
    """The model as every holder of `config` and `seed` builds it
    (executors/torch/models/built.py)."""
    torch.manual_seed(seed)
    return HFCausalLM(**config).to(dtype)


@pytest.fixture(scope="module")
def torch_cluster(pool):
    with pool.shared(DEVICES, kind="torch", tags=("train",)) as (ctl, _):
        yield ctl


def _train_on_executors(ctl, config: dict, schedule: str, dtype: str, name: str,
                        saved: Path | None = None):
    model = Model(name=name, build="hf", config={**config, "dtype": dtype, "seed": 3},
                  stages=DEVICES, tags=("train",))
    flow = pretrain_flow(model=model, corpus=CORPUS, microbatches=MICROBATCHES,
                         schedule=schedule, batch_size=SEQUENCES, seq_len=SEQ_LEN, **HPARAMS)
    losses, runner = trained_on_executors(ctl, flow, name, STEPS)
    params = {}
    for stage_params in per_stage(ctl, runner, name, "stage_parameters").values():
        params.update(stage_params)
    if saved is not None:
        assert runner.save_weights(saved) == [saved / name]
    return losses, params


def _train_plain(config: dict, dtype: torch.dtype):
    """The reference: the HF model itself in one process, its logits and cross-entropy, the
    same batches, gradient accumulation, clipping and AdamW."""
    lm = _plain_model(config, dtype)._lm[0]

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        logits = lm(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    losses = plain_training(lm.parameters(), loss_of, corpus=CORPUS, steps=STEPS,
                            sequences=SEQUENCES, seq_len=SEQ_LEN, microbatches=MICROBATCHES,
                            **HPARAMS)
    return lm, losses


def _assert_match(lm, params: dict, close) -> None:
    """Every parameter of the stages (by HF name) equals the plain model's; a tied head's
    copy equals the embedding it is tied to."""
    want = dict(lm.named_parameters(remove_duplicate=False))
    assert set(params) <= set(want)
    assert {name for name, _ in lm.named_parameters()} <= set(params)
    for name, got in params.items():
        close(got, want[name].detach(), name)


@pytest.mark.parametrize("config", [LLAMA, QWEN2_TIED], ids=["llama", "qwen2-tied"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v", "auto"])
def test_hf_pipeline_training_equals_the_plain_hf_loop_in_float64(torch_cluster, config,
                                                                  schedule):
    name = f"{config['architecture']}-{schedule}"
    losses, params = _train_on_executors(torch_cluster, config, schedule, "float64", name)
    lm, plain_losses = _train_plain(config, torch.float64)

    def close(got, want, where):
        diff = (got - want).abs().max().item()
        assert diff < 1e-10, f"{name}: {where} differs by {diff:.3g}"

    _assert_match(lm, params, close)
    assert losses == pytest.approx(plain_losses, abs=1e-10)


def test_hf_gpt2_training_matches_the_plain_loop_in_float32(torch_cluster):
    _, params = _train_on_executors(torch_cluster, GPT2, "zb-h1", "float32", "gpt2-32")
    lm, _ = _train_plain(GPT2, torch.float32)

    def close(got, want, where):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=where)

    _assert_match(lm, params, close)


# -- generation ------------------------------------------------------------------------------
PROMPTS = [Prompt(prompt_id=i, tokens=[(7 * i + j) % 256 for j in range(length)])
           for i, length in enumerate([1, 5, 3, 8, 2])]


def _spec(config: dict) -> dict:
    return {"model": "policy", "build": "executors.torch.models.hf:HFCausalLM",
            "model_config": config, "dtype": "float64", "seed": 3}


@pytest.mark.parametrize("config", [LLAMA, QWEN2_TIED, GPT2], ids=["llama", "qwen2", "gpt2"])
def test_engine_greedy_decoding_equals_hf_generate_token_for_token(config):
    ctx = op_context()
    result = gen._generate(ctx, PROMPTS, **_spec(config), eos=None, temperature=0.0,
                           max_new_tokens=10, max_batch=3)
    rollouts = {r.prompt_id: r for r in run_until_done(ctx.background, result, None)}
    lm = _plain_model(config, torch.float64)._lm[0].eval()
    for p in PROMPTS:
        tokens = torch.tensor([p.tokens])  # the mask given: token 0 is no pad here
        want = lm.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=10,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        assert rollouts[p.prompt_id].response_tokens == want[0, len(p.tokens):].tolist()


def test_sampled_log_probs_equal_the_recomputed_ones():
    ctx = op_context()
    result = gen._generate(ctx, PROMPTS, **_spec(QWEN2_TIED), eos=None, temperature=1.0,
                           max_new_tokens=8, max_batch=2, step=2)
    lm = _plain_model(QWEN2_TIED, torch.float64)._lm[0].eval()
    for r in run_until_done(ctx.background, result, None):
        tokens = torch.tensor([r.prompt_tokens + r.response_tokens])
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=tokens).logits[0].double(), -1)
        n = len(r.prompt_tokens)
        want = [float(logp[n - 1 + i, t]) for i, t in enumerate(r.response_tokens)]
        assert r.logprobs == pytest.approx(want, abs=1e-9)


# -- round trips and bad input -----------------------------------------------------------------
def test_a_saved_model_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _plain_model(QWEN2_TIED, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # "trained": not the weights a fresh build would give
    folder = model.save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    idx = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=idx).logits, model(idx), rtol=0, atol=0)
    again = HFCausalLM(path=str(folder))
    with torch.no_grad():
        torch.testing.assert_close(again(idx), model(idx), rtol=0, atol=0)


def test_save_weights_writes_an_hf_folder_with_the_trained_weights(torch_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    _, params = _train_on_executors(torch_cluster, QWEN2_TIED, "zb-h1", "float64", "saved",
                                    saved=tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "saved", local_files_only=True, dtype=torch.float64)
    assert (tmp_path / "saved" / "config.json").is_file()
    for name, value in loaded.named_parameters(remove_duplicate=False):
        assert torch.equal(value.detach(), params[name]), name
    lm, _ = _train_plain(QWEN2_TIED, torch.float64)  # the trained model, by the plain loop
    idx = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        diff = (loaded(input_ids=idx).logits - lm(input_ids=idx).logits).abs().max().item()
    assert diff < 1e-9


def test_a_model_directory_without_config_json_is_refused_when_declared(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="has no config.json"):
        Model(name="policy", build="hf", config={"path": str(tmp_path)})
    with pytest.raises(ValueError, match="no such directory"):
        Model(name="policy", build="hf", config={"path": str(tmp_path / "nope")})


def test_an_architecture_that_cannot_be_split_is_refused_when_declared(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="'t5', which flowkit cannot split.*llama"):
        Model(name="policy", build="hf", config={"path": str(tmp_path)})
    with pytest.raises(ValueError, match="'bert', which flowkit cannot split"):
        Model(name="policy", build="hf", config={"architecture": "bert"})
    with pytest.raises(ValueError, match="exactly one"):
        Model(name="policy", build="hf", config={})


def test_more_stages_than_decoder_layers_is_a_clear_error():
    model = _plain_model(LLAMA, torch.float32)
    with pytest.raises(ValueError, match="4 decoder layers splits into 1 to 4 pipeline stages"):
        model.split(5)


# -- RL with HF models ---------------------------------------------------------------------------
SMALL_VOCAB = {"architecture": "qwen2", "hf_config": {**ROPE, "vocab_size": 64,
                                                      "tie_word_embeddings": True}}


def test_a_value_head_gives_one_value_per_position_and_ties_nothing():
    critic = HFCausalLM(**SMALL_VOCAB, value_head=True)
    assert critic(torch.randint(0, 64, (2, 7))).shape == (2, 7)
    first, last = critic.split(2)
    assert first.tied_copies() == last.tied_copies() == ()
    assert "score.weight" in dict(last.named_parameters()) and not critic.pretrained_format


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_rl_steps_train_an_hf_actor_and_sync_it_to_the_generator_by_hf_names(pool, tmp_path,
                                                                            algorithm):
    from transformers import AutoModelForCausalLM

    from dataflows.grpo import grpo_flow
    from dataflows.ppo import ppo_flow
    from flowkit.runner.training_tasks import model_spec

    actor = Model(name="actor", build="hf", config={**SMALL_VOCAB, "dtype": "float64",
                                                    "seed": 3}, stages=2, tags=("train",))
    make = grpo_flow if algorithm == "grpo" else ppo_flow
    flow = make(prompts=4, n=2, microbatches=2, max_new_tokens=4, schedule="1f1b", lr=1e-2,
                model=actor)
    tags = [("train",), ("train",), ("rollout",)]
    with pool.shared(3, kind="torch", tags=tags) as (ctl, infos):
        runner = FlowRunner(ctl, lower_flow(flow))
        reports = [runner.run_step(step) for step in range(2)]
        saved = dict(zip(runner.training, runner.save_weights(tmp_path)))
        rollout = next(e for e in infos if "rollout" in e.tags)
        synced = ctl.submit("export_weights", config={**model_spec(actor, 1), "stage": 0},
                            executor=rollout.id).result(timeout=60)
    assert all(math.isfinite(r.metrics["update_actor/loss"]) for r in reports)
    trained = AutoModelForCausalLM.from_pretrained(
        saved["actor"], local_files_only=True, dtype=torch.float64)
    for name, value in trained.named_parameters():
        assert torch.equal(synced[name], value.detach()), name
    start = _plain_model(SMALL_VOCAB, torch.float64)
    moved = [n for n, p in start.named_parameters() if not torch.equal(p, synced[n])]
    assert moved, "the actor did not train"


@pytest.mark.parametrize("config", [LLAMA, QWEN2_TIED, GPT2], ids=["llama", "qwen2", "gpt2"])
def test_the_training_forward_lets_sdpa_be_causal_itself(config, monkeypatch):
    """Without a mask SDPA runs its flash or memory-efficient kernel (is_causal); the logits and
    the loss equal those under the explicit causal mask, which eager attention still gets."""
    import executors.torch.models.hf as hf

    model = _plain_model(config, torch.float64)
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    seen: list = []
    original = hf._mask
    monkeypatch.setattr(hf, "_mask", lambda *a: seen.append(a) or original(*a))
    fast = model(ids)
    assert model.whole()._causal_kernel and not seen  # no mask was made
    monkeypatch.setattr(type(model.whole()), "_causal_kernel", property(lambda self: False))
    masked = model(ids)
    assert seen and torch.allclose(fast, masked, atol=1e-10)
