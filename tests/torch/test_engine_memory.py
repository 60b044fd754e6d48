"""The rollout engine's memory [Note: engine cache size in executors/torch/rollout/engine.py]: its
cache holds what the admitted requests need, not the model's whole context; it grows when a longer
request comes, keeping what it holds; an idle engine hands its memory back; a prefill reads the
logits of its last position only."""

from __future__ import annotations

import pytest
import torch

from executors.torch.models.gpt import KVCache
from executors.torch.rollout import engine as engine_module
from executors.torch.rollout import lm
from executors.torch.rollout.engine import Engine, Sampling
from flowkit.ops.records import Prompt
from tests.harness import seeded_gpt, tiny_gpt
from tests.torch.helpers import with_cache_lacking

LONG = tiny_gpt(vocab_size=32, block_size=4096, n_embd=16)  # a long context, short requests
PROMPTS = [Prompt(prompt_id=i, tokens=[(5 * i + j) % 32 for j in range(length)])
           for i, length in enumerate([1, 9, 3, 14, 2, 6, 4, 7])]
GREEDY = Sampling(max_new_tokens=12, temperature=0.0)
SAMPLED = Sampling(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7, step=2)


@pytest.fixture
def model():
    return seeded_gpt(LONG, seed=1, dtype=torch.float64).eval()


def cache_bytes(cache) -> int:
    """What a cache holds on its device: the GPT's KVCache or an HF model's RowCache."""
    if cache is None:
        return 0
    cache = getattr(cache, "inner", cache)  # a test's wrapper
    tensors = [*cache.k, *cache.v] if isinstance(cache, KVCache) else \
        [t for pair in cache.layers.values() for t in pair]
    return sum(t.numel() * t.element_size() for t in tensors)


def cache_shape(cache) -> tuple[int, int]:
    """(rows, positions) of a cache."""
    first = cache.k[0] if isinstance(cache, KVCache) else next(iter(cache.layers.values()))[0]
    return first.size(0), first.size(2)


def run(engine: Engine, deferreds: list | None = None) -> tuple[list, int]:
    """Step `engine` until it is idle: (its rollouts, the most bytes its cache held)."""
    boxes = [{} for _ in deferreds or []]
    for deferred, box in zip(deferreds or [], boxes):
        deferred.bind(_Sink(box))
    most = 0
    for _ in range(10_000):
        if not engine.busy():
            break
        engine.step()
        most = max(most, cache_bytes(engine.cache))
    return [r for box in boxes for r in box["done"]], most


class _Sink:
    def __init__(self, box: dict) -> None:
        self.box = box

    def emit(self, item) -> None:
        pass

    def done(self, result) -> None:
        self.box["done"] = result

    def fail(self, error) -> None:
        raise error


def _keyed(rollouts) -> dict:
    return {(r.prompt_id, r.sample): (r.response_tokens, r.logprobs) for r in rollouts}


# -- the cache's size ---------------------------------------------------------------------------
def test_the_cache_holds_the_admitted_requests_not_the_whole_context(model):
    engine = Engine(model, version=lambda: None, max_batch=64)
    rollouts, most = run(engine, [engine.submit(PROMPTS, GREEDY, 1)])
    assert len(rollouts) == 8
    longest = max(len(p.tokens) for p in PROMPTS) + GREEDY.max_new_tokens
    per_position = cache_bytes(model.new_cache(1, 1))
    assert most <= 8 * longest * per_position  # 8 rows of the longest need
    assert most * 100 < cache_bytes(model.new_cache(64, LONG["block_size"]))


def test_a_longer_request_grows_the_cache_and_keeps_what_it_holds(model):
    """A request that needs more rows and positions than the cache has arrives mid-flight: the
    cache grows (its rows and positions kept), and every sample is what an engine sized for
    both from the start gives."""
    engine = Engine(model, version=lambda: None, max_batch=16, token_budget=8)
    first = engine.submit(PROMPTS[:2], SAMPLED, 2)
    boxes = [{}, {}]
    first.bind(_Sink(boxes[0]))
    for _ in range(4):
        engine.step()
    small = cache_shape(engine.cache)
    long_prompt = Prompt(prompt_id=99, tokens=[(3 * j) % 32 for j in range(40)])
    later = engine.submit([long_prompt, *PROMPTS[2:4]], Sampling(max_new_tokens=30, seed=3), 3)
    rest, _ = run(engine, [later])
    grown = engine.stats["cache_grown"]
    assert grown >= 1 and small[1] < 40 + 30
    got = _keyed(boxes[0]["done"] + rest)
    fresh = Engine(model, version=lambda: None, max_batch=16, token_budget=8)
    want, _ = run(fresh, [fresh.submit(PROMPTS[:2], SAMPLED, 2),
                          fresh.submit([long_prompt, *PROMPTS[2:4]],
                                       Sampling(max_new_tokens=30, seed=3), 3)])
    want = _keyed(want)
    assert got.keys() == want.keys() and len(got) == 13
    for key, (tokens, logprobs) in want.items():
        assert got[key][0] == tokens
        assert got[key][1] == pytest.approx(logprobs, abs=1e-9)


def test_a_cache_that_cannot_grow_in_place_is_made_anew_and_its_rows_refilled(model):
    """The cache protocol's `grown` is optional: without it, a larger cache is made and every
    sequence refills its prefix (as after new weights), drawing what it would have drawn."""
    results = []
    for m in (with_cache_lacking(model, "grown"), model):
        engine = Engine(m, version=lambda: None, max_batch=8, token_budget=6)
        first = {}
        engine.submit(PROMPTS[:2], SAMPLED, 1).bind(_Sink(first))
        for _ in range(3):
            engine.step()
        rest, _ = run(engine, [engine.submit(PROMPTS[2:6], SAMPLED, 2)])
        assert engine.stats["cache_grown"] >= 1
        results.append(_keyed(first["done"] + rest))
    assert results[0].keys() == results[1].keys() and len(results[0]) == 10
    for key, (tokens, logprobs) in results[1].items():
        assert results[0][key][0] == tokens
        assert results[0][key][1] == pytest.approx(logprobs, abs=1e-9)


def test_a_request_past_the_context_is_refused_by_name():
    model = seeded_gpt(tiny_gpt(vocab_size=32, block_size=24, n_embd=16), seed=1)
    engine = Engine(model, version=lambda: None)
    with pytest.raises(ValueError, match="prompt 5 .30 tokens. leaves no room"):
        engine.submit([Prompt(prompt_id=5, tokens=[1] * 30)], GREEDY, 1)
    assert not engine.busy()


# -- an idle engine's memory ------------------------------------------------------------------
def test_an_idle_engine_drops_its_cache_and_makes_one_on_next_use(model, monkeypatch):
    freed = []
    monkeypatch.setattr(engine_module, "free_device_memory", freed.append)
    engine = Engine(model, version=lambda: None, max_batch=8)
    run(engine, [engine.submit(PROMPTS[:3], GREEDY, 1)])
    assert engine.cache is None and freed == [torch.device("cpu")]
    engine.submit(PROMPTS[3:5], GREEDY, 1).bind(_Sink({}))
    engine.step()
    assert engine.cache is not None and cache_shape(engine.cache)[0] == 2  # made again
    run(engine)
    assert engine.cache is None and len(freed) == 2 and engine.stats["cache_releases"] == 2


def test_freeing_device_memory_empties_cudas_cache_and_is_nothing_on_a_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("emptied"))
    engine_module.free_device_memory(torch.device("cpu"))
    assert calls == []
    engine_module.free_device_memory(torch.device("cuda", 0))
    assert calls == ["emptied"]


# -- HF models: a 32k context --------------------------------------------------------------------
QWEN2_32K = {"architecture": "qwen2", "hf_config": dict(
    hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=32, vocab_size=256, max_position_embeddings=32768)}


def test_a_32k_context_hf_model_holds_short_prompts_in_a_small_cache_and_decodes_as_hf():
    pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
    from executors.torch.models.hf import HFCausalLM

    torch.manual_seed(3)
    model = HFCausalLM(**QWEN2_32K).to(torch.float64).eval()
    prompts = [Prompt(prompt_id=i, tokens=[(7 * i + j) % 256 for j in range(n)])
               for i, n in enumerate([1, 5, 3, 8, 2, 11, 4, 6])]
    engine = Engine(model, version=lambda: None, max_batch=64)
    rollouts, most = run(engine, [engine.submit(prompts, Sampling(max_new_tokens=10,
                                                                  temperature=0.0), 1)])
    longest = 11 + 10
    per_position = cache_bytes(model.new_cache(1, 1))
    assert 0 < most <= 8 * longest * per_position
    whole = 64 * 32768 * per_position  # what a cache of max_batch x the context would hold
    assert most * 1000 < whole
    lm = model._lm[0]
    for r in rollouts:  # and it decodes what HF's own generate decodes
        tokens = torch.tensor([r.prompt_tokens])
        want = lm.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=10,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        assert r.response_tokens == want[0, len(r.prompt_tokens):].tolist()


# -- a prefill's logits ---------------------------------------------------------------------------
def _hf_model():
    pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
    from executors.torch.models.hf import HFCausalLM

    torch.manual_seed(3)
    return HFCausalLM(**QWEN2_32K).to(torch.float64).eval()


@pytest.mark.parametrize("which", ["gpt", "hf"])
def test_a_forward_asked_for_one_position_a_row_gives_its_logits_alone(model, which):
    model = model if which == "gpt" else _hf_model()
    vocab = 32 if which == "gpt" else 256
    idx = torch.randint(0, vocab, (3, 9), generator=torch.Generator().manual_seed(0))
    start, last = torch.tensor([0, 4, 2]), torch.tensor([8, 3, 5])
    some = model.forward_cached(idx, model.new_cache(3, 20), start, last=last)
    every = model.forward_cached(idx, model.new_cache(3, 20), start)
    assert some.shape == (3, 1, vocab) and lm.reads_last(model)
    torch.testing.assert_close(some[:, 0], every[torch.arange(3), last], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="position 20 is past the cache's 20"):
        model.forward_cached(idx, model.new_cache(3, 20), torch.tensor([0, 12, 0]), last=last)


def test_a_cached_forward_reads_its_live_positions_and_its_first_rows_as_a_view(model):
    """[Note: live cache window] in executors/torch/models/gpt.py: a forward into a cache of
    4,096 positions holding 6 reads 6 (+ its own tokens), its rows 0 .. B-1 without a copy; the
    logits are those of the whole sequence run afresh."""
    from executors.torch.models.gpt import CacheWindow

    cache = model.new_cache(3, 4096)
    seqs = torch.tensor([[(7 * b + j) % 32 for j in range(7)] for b in range(3)])
    model.forward_cached(seqs[:, :6], cache, torch.zeros(3, dtype=torch.long))
    window = CacheWindow.of(None, 3, torch.full((3,), 6), 1, 4096, torch.device("cpu"))
    assert window.live == 7 and window.read(cache.k[0]).shape[2] == 7
    assert window.read(cache.k[0])._base is cache.k[0]  # a view: nothing gathered
    picked = CacheWindow.of(torch.tensor([2, 0]), 2, torch.full((2,), 6), 1, 4096,
                            torch.device("cpu"))
    assert picked.read(cache.k[0]).shape[:3] == (2, cache.k[0].shape[1], 7)
    last = model.forward_cached(seqs[:, 6:], cache, torch.full((3,), 6))[:, -1]
    assert torch.allclose(last, model(seqs)[:, -1], rtol=0, atol=1e-12)
