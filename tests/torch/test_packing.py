"""Packed rows [Note: packed rows in executors/torch/models/packing.py]: training (F, B, W on
pipeline stages, the language-model loss and the RL losses, a critic's value loss), log-prob and
value scoring give the padded path's losses, gradients and scores in float64, for the built-in
GPT and Hugging Face Llama and Qwen2 (GQA, rotary); the layout is sound for any lengths; the
varlen plumbing equals the masked path; a model without positions is refused in one line."""

from __future__ import annotations

import random

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from executors.optable import OpContext
from executors.torch.errors import StageError
from executors.torch.models.packing import BlockCausal, pack
from executors.torch.rollout import infer
from executors.torch.train import pipeline_ops
from executors.torch.train.held_stage import held_stage
from flowkit.ops.records import Experience, Rollout, TokenScores
from tests.harness import critic_of, gpt_spec, op_context, tiny_gpt
from tests.torch.helpers import run_microbatches

TIGHT = 1e-10
GPT = gpt_spec("policy", tiny_gpt(n_layer=3), seed=5)
ROPE = dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=32, vocab_size=64, max_position_embeddings=32)
LLAMA = {"model": "llama", "build": "hf", "dtype": "float64", "seed": 3,
         "model_config": {"architecture": "llama", "hf_config": ROPE}}
QWEN2 = {**LLAMA, "model": "qwen2", "model_config": {
    "architecture": "qwen2", "hf_config": {**ROPE, "tie_word_embeddings": True}}}
MODELS = {"gpt": GPT, "llama": LLAMA, "qwen2": QWEN2}


def _spec(name: str) -> dict:
    spec = MODELS[name]
    if spec["build"] == "hf":
        pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
        spec = {**spec, "build": "executors.torch.models.hf:HFCausalLM"}
    return spec


# -- data -------------------------------------------------------------------------------------
def _experiences(lengths: list[tuple[int, int]], seed: int) -> list[Experience]:
    """Samples of the given (prompt, response) lengths, with noisy log-probs, references and
    values so that some ratios clip."""
    rng = random.Random(seed)
    out = []
    for i, (p, r) in enumerate(lengths):
        noise = lambda scale, r=r: [rng.gauss(0.0, scale) for _ in range(r)]  # noqa: E731
        out.append(Experience(
            prompt_id=i, sample=0, prompt_tokens=[rng.randrange(64) for _ in range(p)],
            response_tokens=[rng.randrange(64) for _ in range(r)],
            logprobs=[v - 4.2 for v in noise(0.3)], reward=rng.random(),
            advantages=noise(1.0), returns=noise(1.0), values=noise(0.3),
            ref_logprobs=[v - 4.2 for v in noise(0.3)]))
    return out


def _lm_rows(lengths: list[int], seed: int, width: int = 20) -> torch.Tensor:
    """(B, width) TokenIds: each row `length` real tokens, then masked ones (~t), as SFT pads;
    one row's prompt masked too."""
    rng = random.Random(seed)
    rows = []
    for i, n in enumerate(lengths):
        row = [rng.randrange(64) for _ in range(width)]
        rows.append([t if j < n and not (i == 0 and j < 2) else ~t for j, t in enumerate(row)])
    return torch.tensor(rows)


LENGTHS = [(3, 9), (5, 0), (2, 4), (6, 11), (1, 2), (4, 7), (2, 13)]


# -- running the stage ops --------------------------------------------------------------------
def _train(spec: dict, microbatches: list[tuple], *, stages: int, packing: bool,
           **loss_config) -> tuple[list, dict, int]:
    """Each microbatch's F, B, W through every stage on one executor; (stats, gradients, the
    tokens stage 0 ran, padding included)."""
    ctx: OpContext = op_context()
    config = {**spec, "stages": stages, "loss_scale": 0.25, "packing": packing, **loss_config}
    stats = run_microbatches(ctx, spec, microbatches, stages=stages, loss_scale=0.25,
                             packing=packing, **loss_config)
    grads = {(s, n): p.grad.clone() for s in range(stages)
             for n, p in held_stage(ctx, {**config, "stage": s}).module.named_parameters()
             if p.grad is not None}
    return stats, grads, held_stage(ctx, {**config, "stage": 0}).tokens_run


def _assert_same_training(spec: dict, microbatches: list[tuple], *, stages: int,
                          **loss_config) -> tuple[int, int]:
    """Packed training equals padded; (tokens stage 0 ran padded, packed)."""
    padded = _train(spec, microbatches, stages=stages, packing=False, **loss_config)
    packed = _train(spec, microbatches, stages=stages, packing=True, **loss_config)
    for want, got in zip(padded[0], packed[0]):
        assert (got.tokens, got.normalizer) == (want.tokens, want.normalizer)
        assert got.loss == pytest.approx(want.loss, abs=TIGHT)
        assert got.values.keys() == want.values.keys()
        for key, value in want.values.items():
            assert got.values[key] == pytest.approx(value, abs=TIGHT), key
    assert padded[1].keys() == packed[1].keys() and padded[1]
    for key, want in padded[1].items():
        diff = (packed[1][key] - want).abs().max().item()
        assert diff < TIGHT, f"stage {key[0]} {key[1]}: gradient differs by {diff:.3g}"
    assert packed[2] <= padded[2]
    return padded[2], packed[2]


# -- training ---------------------------------------------------------------------------------
@pytest.mark.parametrize("model, stages", [("gpt", 1), ("gpt", 3), ("llama", 2), ("qwen2", 2)])
def test_packed_language_model_training_equals_the_padded(model, stages):
    data = [(_lm_rows([20, 4, 9, 13, 2, 7], seed=1),), (_lm_rows([5, 18, 3], seed=2),)]
    padded, packed = _assert_same_training(_spec(model), data, stages=stages)
    assert (padded, packed) == (9 * 19, 3 * 19 + 2 * 17)  # rows cut after their last target


RL_CASES = {
    "ppo": {"loss": "ppo"},
    "grpo-kl": {"loss": "grpo", "kl_coef": 0.1, "temperature": 0.7},
    "gspo-seq-mean": {"loss": "grpo", "policy_loss": "gspo", "clip_ratio_low": 3e-4,
                      "clip_ratio_high": 4e-4, "entropy_coeff": 0.01},
    "decoupled": {"loss": "ppo", "decoupled": True},
}


@pytest.mark.parametrize("case", list(RL_CASES))
@pytest.mark.parametrize("model, stages", [("gpt", 2), ("gpt", 3), ("llama", 2), ("qwen2", 3)])
def test_packed_rl_training_equals_the_padded(case, model, stages):
    exps = _experiences(LENGTHS, seed=4)
    data = [(exps[:4],), (exps[4:],)]
    padded, packed = _assert_same_training(_spec(model), data, stages=stages, **RL_CASES[case])
    assert packed < padded


@pytest.mark.parametrize("stages", [1, 2])
def test_packed_critic_training_equals_the_padded(stages):
    exps = _experiences(LENGTHS, seed=5)
    _assert_same_training(critic_of(GPT), [(exps[:5],), (exps[5:],)], stages=stages,
                          loss="value")


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 14)), min_size=1, max_size=7),
       st.integers(1, 3))
def test_packed_training_equals_the_padded_for_any_lengths(lengths, stages):
    exps = _experiences(lengths, seed=len(lengths))
    _assert_same_training(GPT, [(exps,)], stages=stages, loss="grpo", kl_coef=0.05)


# -- scoring ----------------------------------------------------------------------------------
def _rollouts(lengths: list[tuple[int, int]]) -> list[Rollout]:
    return [Rollout(prompt_id=e.prompt_id, sample=0, prompt_tokens=e.prompt_tokens,
                    response_tokens=e.response_tokens, logprobs=e.logprobs)
            for e in _experiences(lengths, seed=6)]


@pytest.mark.parametrize("model", ["gpt", "qwen2"])
def test_packed_log_probs_equal_the_padded(model):
    spec, rollouts = _spec(model), _rollouts(LENGTHS)
    padded = infer._logprobs(op_context(), rollouts, **spec, temperature=0.8)
    packed = infer._logprobs(op_context(), rollouts, **spec, temperature=0.8, packing=True,
                             max_tokens=40)  # two forwards of two rows
    for want, got in zip(padded, packed):
        assert isinstance(got, TokenScores) and (got.prompt_id, got.sample) == \
            (want.prompt_id, want.sample)
        assert got.values == pytest.approx(want.values, abs=TIGHT)


def test_packed_values_and_rewards_equal_the_padded():
    critic, rollouts = critic_of(GPT), _rollouts(LENGTHS)
    for op in (infer._values, infer._reward_model):
        padded = op(op_context(), rollouts, **critic)
        packed = op(op_context(), rollouts, **critic, packing=True)
        for want, got in zip(padded, packed):
            want = want if isinstance(want, float) else want.values
            got = got if isinstance(got, float) else got.values
            assert got == pytest.approx(want, abs=TIGHT)


# -- the layout and the attention -------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30))
def test_the_layout_places_every_sequence_once_within_its_row(lengths):
    layout = pack(lengths)
    used: dict[int, list[tuple[int, int]]] = {}
    for (row, offset), n in zip(layout.places, lengths):
        assert 0 <= row < layout.rows and offset + n <= layout.width
        if n:
            used.setdefault(row, []).append((offset, offset + n))
    for spans in used.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert layout.rows <= max(1, len(lengths))
    positions = layout.positions(torch.device("cpu"))
    for (row, offset), n in zip(layout.places, lengths):
        assert positions[row, offset:offset + n].tolist() == list(range(n))


def test_rows_pack_first_fit_by_decreasing_length():
    layout = pack([3, 8, 5, 2, 6])
    assert layout.width == 8 and layout.rows == 3
    assert layout.places == ((2, 5), (0, 0), (2, 0), (1, 6), (1, 0))
    alone = pack([4, 4, 4])  # nothing shares a row: the padded rows, in order
    assert not alone.packed and alone.places == ((0, 0), (1, 0), (2, 0))


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa=False):
    """What torch's varlen flash kernel computes, segment by segment on the CPU."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == max_k
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]  # (h, n, hs)
        out[a:b] = F.scaled_dot_product_attention(*seg, is_causal=True,
                                                  enable_gqa=enable_gqa).transpose(0, 1)
    return out


def _varlen_of_torch_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False):
    """A kernel with an older signature: causal by a flag, no grouped-query heads (torch 2.11's
    varlen_attn, which the GPU machine's torch has, takes no `enable_gqa`)."""
    assert is_causal and k.size(1) == q.size(1), "grouped heads reach a kernel that has none"
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0))


@pytest.mark.parametrize("kernel", [_reference_varlen, _varlen_of_torch_2_11],
                         ids=["torch 2.13", "torch 2.11"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_varlen_plumbing_equals_the_block_mask(kv_heads, kernel):
    layout = pack([5, 9, 3, 2, 7, 1])
    positions = layout.positions(torch.device("cpu"))
    B, T = positions.shape
    q = torch.randn(B, 4, T, 8, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, T, 8, dtype=torch.float64) for _ in range(2))
    packed = BlockCausal(positions)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=packed.mask(),
                                          enable_gqa=kv_heads != 4)
    got = packed.varlen(q, k, v, kernel)
    assert (got - want).abs().max().item() < 1e-12


def test_query_heads_that_key_value_heads_do_not_divide_are_refused():
    positions = pack([3, 2]).positions(torch.device("cpu"))
    q = torch.randn(1, 4, positions.shape[1], 8)
    k = v = torch.randn(1, 3, positions.shape[1], 8)
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key/value heads"):
        BlockCausal(positions).varlen(q, k, v, _varlen_of_torch_2_11)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU device check)")
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_varlen_kernel_on_cuda_equals_the_block_mask(kv_heads):
    """torch's own varlen kernel, where packing uses it (CUDA, half precision), against the
    block mask in float32 on the same inputs."""
    from executors.torch.models.packing import varlen_kernel

    layout = pack([5, 9, 3, 2, 7, 1])
    positions = layout.positions(torch.device("cuda"))
    B, T = positions.shape
    q = torch.randn(B, 4, T, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, kv_heads, T, 64, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    packed = BlockCausal(positions)
    kernel = varlen_kernel(q)
    assert kernel is not None, "this torch has no varlen kernel for CUDA"
    got = packed.varlen(q, k, v, kernel).float()
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                          attn_mask=packed.mask(), enable_gqa=kv_heads != 4)
    for (row, offset), n in zip(layout.places, [5, 9, 3, 2, 7, 1]):  # padding is not compared
        span = slice(offset, offset + n)
        assert (got[row, :, span] - want[row, :, span]).abs().max().item() < 3e-2


# -- refusals ---------------------------------------------------------------------------------
def test_packing_a_model_that_takes_no_positions_is_one_line():
    spec = {"model": "lstm", "build": "torch.nn:Linear", "dtype": "float64",
            "model_config": {"in_features": 4, "out_features": 4}}
    with pytest.raises(StageError, match=r"^model 'lstm' has packing on, but its Linear.forward "
                       r"takes no `positions`[^\n]*$"):
        pipeline_ops._forward(op_context(), torch.zeros(1, 3, dtype=torch.long), stage=0,
                              stages=1, microbatch=0, packing=True, **spec)


def test_a_model_keeps_packing_through_evolve():
    from flowkit.dsl import Model

    model = Model(name="m", build="hf", config={"architecture": "llama",
                                                "hf_config": ROPE}, packing=True)
    assert attrs.evolve(model, stages=2).packing
    with pytest.raises(TypeError):
        Model(name="m", build="x.y:Z", packing="yes")


@pytest.mark.parametrize("packing", [False, True])
def test_profiling_runs_an_experience_microbatch_as_training_will(packing):
    exps = _experiences(LENGTHS, seed=7)
    for s in range(3):
        seconds = pipeline_ops._profile(op_context(), exps, **GPT, stage=s, stages=3,
                                        repeats=1, packing=packing)
        assert set(seconds) == {"F", "B", "W", "BW"} and all(v > 0 for v in seconds.values())


def test_a_model_on_the_varlen_path_gives_the_padded_outputs(monkeypatch):
    """The GPT's attention through the varlen plumbing, as on CUDA in half precision, with
    the reference kernel standing in for torch's flash one."""
    from executors.torch.models import packing
    from executors.torch.models.built import right_padded
    from executors.torch.models.packing import packed_rows
    from tests.harness import seeded_gpt

    used = []
    monkeypatch.setattr(packing, "varlen_kernel",
                        lambda q: used.append(q.shape) or _reference_varlen)
    model = seeded_gpt(tiny_gpt(n_layer=2), seed=1, dtype=torch.float64)
    seqs = [[(7 * i + j) % 64 for j in range(n)] for i, n in enumerate([9, 3, 5, 2, 8, 4])]
    ids, positions, layout = packed_rows(seqs, torch.device("cpu"))
    assert positions is not None
    with torch.no_grad():
        packed, padded = model(ids, None, positions), model(right_padded(seqs, ids.device))
    assert len(used) == 2  # one call a layer
    for (row, offset), seq, want in zip(layout.places, seqs, padded):
        got = packed[row, offset:offset + len(seq)]
        assert (got - want[:len(seq)]).abs().max().item() < 1e-12


def test_packed_training_with_offloaded_activations_equals_the_padded():
    """A packed microbatch's stash goes to host memory and back like any other: its positions
    (an input) stay on the device [Note: offloaded stash in executors/torch/train/offload.py]."""
    exps = _experiences(LENGTHS, seed=8)
    _assert_same_training(GPT, [(exps[:4],), (exps[4:],)], stages=2, loss="ppo", offload=True)
