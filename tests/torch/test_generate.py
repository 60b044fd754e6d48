"""Generation with the KV cache: equal to recomputing the whole sequence each step, continuous
batching that emits every sample whatever the slot count, top-p and EOS."""

from __future__ import annotations

import attrs
import pytest
import torch

from executors.optable import Deferred, OpTable
from executors.torch.errors import StageError
from executors.torch.models.gpt import GPT, KVCache
from executors.torch.rollout import generate as gen
from executors.torch.rollout.engine import run_until_done
from flowkit.ops.records import Prompt
from tests.harness import gpt_spec, op_context, seeded_gpt, tiny_gpt

SMALL = tiny_gpt(vocab_size=32, block_size=24, n_embd=16)
MODEL = gpt_spec("policy", SMALL, seed=3)
PROMPTS = [Prompt(prompt_id=i, tokens=[(7 * i + j) % 32 for j in range(length)])
           for i, length in enumerate([1, 5, 3, 8, 2])]


def _generate(ctx=None, prompts=PROMPTS, on_item=None, **kw):
    """The op's rollouts: a request to the engine, run here until it is done."""
    ctx = ctx or op_context()
    result = gen._generate(ctx, prompts, **{**MODEL, "eos": None, **kw})
    return run_until_done(ctx.background, result, on_item) if isinstance(result, Deferred) \
        else result  # (generate_now, with what it streams)


def _by_key(rollouts):
    return {(r.prompt_id, r.sample): r for r in rollouts}


def _greedy_without_cache(model: GPT, tokens: list[int], steps: int) -> list[int]:
    idx = torch.tensor([tokens])
    for _ in range(steps):
        logits = model(idx)[0, -1]  # the whole sequence again, no cache
        idx = torch.cat([idx, logits.argmax().view(1, 1)], dim=1)
    return idx[0, len(tokens):].tolist()


def test_cached_forward_equals_full_forward_in_pieces_with_right_padding():
    model = seeded_gpt(SMALL, dtype=torch.float64)
    idx = torch.randint(0, 32, (3, 12))
    full = model(idx)
    cache = KVCache.empty(model.config, 3, 12, dtype=torch.float64)
    lengths = torch.tensor([4, 7, 2])  # rows prefilled to different lengths, right-padded
    pre = model.forward_cached(idx[:, :7], cache, torch.zeros(3, dtype=torch.long))
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(pre[b, :n], full[b, :n], rtol=0, atol=1e-12)
    for _ in range(3):  # then one token per row per step, each at its own position
        out = model.forward_cached(idx[torch.arange(3), lengths][:, None], cache, lengths)
        torch.testing.assert_close(out[:, 0], full[torch.arange(3), lengths], rtol=0, atol=1e-12)
        lengths = lengths + 1


def test_greedy_with_cache_equals_recompute_token_for_token():
    ctx = op_context()
    rollouts = _by_key(_generate(ctx, temperature=0.0, max_new_tokens=10, max_batch=3))
    model = gen.whole_model(ctx, MODEL)
    for p in PROMPTS:
        r = rollouts[(p.prompt_id, 0)]
        assert r.response_tokens == _greedy_without_cache(model, p.tokens, 10)
        assert r.finished is False and r.prompt_tokens == p.tokens


def test_continuous_batching_gives_every_sample_whatever_the_slots():
    few = _generate(n=3, max_new_tokens=6, max_batch=4, seed=3, eos=5)
    many = _generate(n=3, max_new_tokens=6, max_batch=64, seed=3, eos=5)
    assert sorted(_by_key(few)) == [(p.prompt_id, k) for p in PROMPTS for k in range(3)]
    assert len(few) == 15
    # one generator per sample: slot assignment does not change what a sample draws
    assert {k: r.response_tokens for k, r in _by_key(few).items()} == \
        {k: r.response_tokens for k, r in _by_key(many).items()}
    samples = [r.response_tokens for r in few if r.prompt_id == 3]
    assert len({tuple(s) for s in samples}) > 1  # n samples of a prompt differ


def test_a_later_round_draws_what_one_request_for_all_the_samples_would():
    """first_sample [Note: second rounds in flowkit/runner/second_round.py]: n=2 numbered from
    3 are samples 3 and 4 of a request for 5, token for token and log-prob for log-prob; a
    prompt's own n (adaptive sampling) is the first round's, not a later one's."""
    whole = _by_key(_generate(n=5, max_new_tokens=6, seed=3))
    later = _by_key(_generate(n=2, first_sample=3, max_new_tokens=6, seed=3,
                              prompts=[attrs.evolve(p, n=3) for p in PROMPTS]))
    assert sorted(later) == [(p.prompt_id, k) for p in PROMPTS for k in (3, 4)]
    for key, rollout in later.items():
        assert rollout.response_tokens == whole[key].response_tokens
        assert rollout.logprobs == pytest.approx(whole[key].logprobs, abs=1e-6)
    with pytest.raises(StageError, match="first_sample must be a whole number >= 0"):
        _generate(n=2, first_sample=-1)


def test_tiny_top_p_is_greedy():
    greedy = _by_key(_generate(temperature=0.0, max_new_tokens=8))
    narrow = _by_key(_generate(temperature=1.0, top_p=1e-9, max_new_tokens=8))
    for key, r in greedy.items():
        assert narrow[key].response_tokens == r.response_tokens
        assert narrow[key].logprobs == pytest.approx(r.logprobs, abs=1e-12)


def test_eos_stops_a_sample_and_it_is_emitted():
    ctx = op_context()
    greedy = _by_key(_generate(ctx, temperature=0.0, max_new_tokens=10))
    eos = greedy[(1, 0)].response_tokens[2]
    stopped = _by_key(_generate(ctx, temperature=0.0, max_new_tokens=10, eos=eos))
    r = stopped[(1, 0)]
    cut = greedy[(1, 0)].response_tokens.index(eos) + 1
    assert r.response_tokens == greedy[(1, 0)].response_tokens[:cut] and r.finished
    assert len(r.logprobs) == len(r.response_tokens)
    assert len(stopped) == len(PROMPTS)


def test_the_context_bounds_a_sample_which_says_it_was_clipped():
    long = [Prompt(prompt_id=9, tokens=list(range(20)))]
    (r,) = _generate(prompts=long, temperature=0.0, max_new_tokens=50)
    assert len(r.prompt_tokens) + len(r.response_tokens) == SMALL["block_size"]
    assert r.clipped and not r.finished
    (r,) = _generate(prompts=long, temperature=0.0, max_new_tokens=4)  # fits: not clipped
    assert len(r.response_tokens) == 4 and not r.clipped and not r.finished


def test_a_prompt_without_room_and_a_missing_build_are_clear_errors():
    prompts = [Prompt(prompt_id=1, tokens=[1]), Prompt(prompt_id=7, tokens=list(range(24)))]
    with pytest.raises(ValueError, match=r"prompt 7 \(24 tokens\) leaves no room to generate "
                       r"within the model's context_length 24: use prompts shorter than 24 "
                       r"tokens, or a model with a longer context"):
        _generate(prompts=prompts)
    with pytest.raises(ValueError, match=r"prompts \[3\] are empty"):
        _generate(prompts=[Prompt(prompt_id=3, tokens=[])])
    with pytest.raises(Exception, match="build"):
        gen._generate(op_context(), PROMPTS, model="policy")


class _Plain(torch.nn.Module):
    """A model with forward(tokens) -> logits and a context, but no cache protocol."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.context_length = model, model.context_length

    def forward(self, tokens):
        return self.model(tokens)


def test_decoding_without_the_cache_protocol_gives_the_same_rollouts():
    model = seeded_gpt(SMALL, dtype=torch.float64)
    s = gen._Sampling(n=3, max_new_tokens=30, temperature=1.0, top_p=0.9, eos=5, seed=4,
                      max_batch=4)
    with torch.no_grad():
        cached = _by_key(gen.decode(model, PROMPTS, s, torch.device("cpu")))
        plain = _by_key(gen.decode(_Plain(model), PROMPTS, s, torch.device("cpu")))
    assert not gen.lm.has_cache(_Plain(model)) and sorted(plain) == sorted(cached)
    assert any(r.clipped for r in cached.values()) and any(r.finished for r in cached.values())
    for key, r in cached.items():
        assert plain[key].response_tokens == r.response_tokens
        assert plain[key].logprobs == pytest.approx(r.logprobs, rel=0, abs=1e-9)
        assert (plain[key].finished, plain[key].clipped) == (r.finished, r.clipped)


def test_register_adds_generate():
    table = OpTable()
    gen.register(table)
    assert "generate" in table


def test_each_sample_is_emitted_the_moment_it_finishes():
    emitted = []
    greedy = _by_key(_generate(op_context(), temperature=0.0, max_new_tokens=10))
    eos = greedy[(1, 0)].response_tokens[2]  # prompt 1 stops early, the others run on
    returned = _generate(temperature=0.0, max_new_tokens=10, eos=eos, on_item=emitted.append)
    assert emitted == returned  # every one, in finishing order
    assert emitted[0].prompt_id == 1 and emitted[0].finished


def test_a_streaming_generate_task_hands_over_each_sample_before_it_ends(pool):
    parts = []
    with pool.shared(1, kind="torch") as (ctl, (executor,)):
        whole = ctl.submit("generate", PROMPTS[:2], executor=executor.id, on_part=parts.append,
                           config={**MODEL, "eos": None, "n": 3, "max_new_tokens": 12,
                                   "max_batch": 1})  # one sample at a time: finishing apart
        rollouts = whole.result(timeout=60)
        assert [p.result(timeout=5) for p in parts] == rollouts and len(rollouts) == 6
        assert parts[0].timing[1] < parts[-1].timing[1] == pytest.approx(whole.timing[1],
                                                                          abs=0.5)
