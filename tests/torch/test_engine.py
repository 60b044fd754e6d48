"""The rollout engine [Note: rollout engine in executors/torch/rollout/engine.py]: what it generates
does not depend on how requests were batched, chunked, interleaved, paused or aborted."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from executors.optable import OpTable
from executors.torch.models.built import held_model
from executors.torch.rollout import generate as gen
from executors.torch.rollout.engine import NO_VERSION, Engine, Sampling, _fitting, run_until_done
from flowkit.ops.records import Prompt, Rollout
from tests.harness import gpt_spec, op_context, seeded_gpt, tiny_gpt
from tests.torch.helpers import with_cache_lacking

SMALL = tiny_gpt(vocab_size=32, block_size=40, n_embd=16)
PROMPTS = [Prompt(prompt_id=i, tokens=[(5 * i + j) % 32 for j in range(length)])
           for i, length in enumerate([1, 9, 3, 14, 2, 6])]
GREEDY = Sampling(max_new_tokens=12, temperature=0.0)
SAMPLED = Sampling(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7, step=2)


@pytest.fixture
def model():
    return seeded_gpt(SMALL, seed=1, dtype=torch.float64).eval()


def _engine(model, version=lambda: None, **kw) -> Engine:
    return Engine(model, version=version, **kw)


def _drain(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine.busy():
            return
        engine.step()


def _collect(deferred):
    box = {}
    deferred.bind(type("Sink", (), {"emit": lambda s, x: box.setdefault("items", []).append(x),
                                    "done": lambda s, r: box.__setitem__("done", r),
                                    "fail": lambda s, e: box.__setitem__("error", e)})())
    return box


def _keyed(rollouts) -> dict:
    return {(r.prompt_id, r.sample): r for r in rollouts}


@torch.no_grad()
def _alone_without_cache(model, tokens: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding of one prompt, the whole sequence run again for every token."""
    out, logprobs = list(tokens), []
    for _ in range(steps):
        logits = model(torch.tensor([out]))[0, -1].to(torch.float64)
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        out.append(token)
    return out[len(tokens):], logprobs


def _assert_alone(model, rollouts) -> None:
    for r in rollouts:
        tokens, logprobs = _alone_without_cache(model, r.prompt_tokens, len(r.response_tokens))
        assert r.response_tokens == tokens, r.prompt_id
        assert r.logprobs == pytest.approx(logprobs, abs=1e-9)


@pytest.mark.parametrize("budget", [512, 4, 1])
def test_greedy_equals_each_prompt_alone_with_chunked_prefill_and_requests_joining(model, budget):
    engine = _engine(model, max_batch=4, token_budget=budget)
    first = _collect(engine.submit(PROMPTS[:3], GREEDY, 1))
    for _ in range(5):
        engine.step()
    second = _collect(engine.submit(PROMPTS[3:], GREEDY, 1))  # joins mid-flight
    _drain(engine)
    assert len(first["done"]) == 3 and len(second["done"]) == 3
    _assert_alone(model, first["done"] + second["done"])
    assert all(len(r.response_tokens) == 12 for r in first["done"] + second["done"])


def test_the_token_budget_takes_decodes_first_then_prefill_chunks(model):
    engine = _engine(model, max_batch=4, token_budget=5)
    engine.submit([PROMPTS[0]], GREEDY, 1)
    engine.step()  # the one-token prompt decodes at once
    engine.submit([PROMPTS[3]], GREEDY, 1)  # 14 tokens to fill
    before = dict(engine.stats)
    engine.step()
    assert engine.stats["decode_tokens"] - before["decode_tokens"] == 1
    assert engine.stats["prefill_tokens"] - before["prefill_tokens"] == 4  # the rest


def test_sampled_draws_do_not_depend_on_batch_size_or_arrival_order(model):
    results = []
    for max_batch, order in ((64, PROMPTS), (2, PROMPTS[::-1]), (5, PROMPTS[2:] + PROMPTS[:2])):
        engine = _engine(model, max_batch=max_batch, token_budget=7)
        boxes = [_collect(engine.submit([p], SAMPLED, 3)) for p in order]
        _drain(engine)
        results.append({k: (r.response_tokens, r.logprobs) for box in boxes
                        for k, r in _keyed(box["done"]).items()})
    assert len(results[0]) == 18
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for key, (tokens, logprobs) in other.items():
            assert tokens == results[0][key][0]
            assert logprobs == pytest.approx(results[0][key][1], abs=1e-9)


@pytest.mark.parametrize(("max_batch", "budget"), [(8, 64), (3, 4), (8, 2)])
def test_the_samples_of_a_prompt_fill_its_prefix_once_and_draw_as_alone(model, max_batch,
                                                                         budget):
    # [Note: shared prompts]: one sample fills the prompt, the others copy its cache rows; with
    # a small budget the donor fills over several steps, with few rows siblings come later
    engine = _engine(model, max_batch=max_batch, token_budget=budget)
    shared = _collect(engine.submit([PROMPTS[3], PROMPTS[1]], SAMPLED, 4))
    while engine.busy():
        before = engine.stats["decode_tokens"] + engine.stats["prefill_tokens"]
        engine.step()
        ran = engine.stats["decode_tokens"] + engine.stats["prefill_tokens"] - before
        assert ran <= max(budget, max_batch)  # decodes first, then what the budget has left
    prompt_tokens = len(PROMPTS[3].tokens) + len(PROMPTS[1].tokens)  # 14 + 9
    if max_batch == 8:  # each prompt's prefix (but its last token) filled once, copied 3 times
        assert engine.stats["shared_prefix_tokens"] == 3 * (prompt_tokens - 2)
    assert engine.stats["shared_prefix_tokens"] > 0
    alone = _engine(model, max_batch=1, token_budget=64)  # one row: no sibling to copy from
    box = _collect(alone.submit([PROMPTS[3], PROMPTS[1]], SAMPLED, 4))
    _drain(alone)
    assert alone.stats["shared_prefix_tokens"] == 0
    assert engine.stats["prefill_tokens"] < alone.stats["prefill_tokens"] - 2 * prompt_tokens
    got, want = _keyed(shared["done"]), _keyed(box["done"])
    assert got.keys() == want.keys() and len(got) == 8
    for key, rollout in want.items():
        assert got[key].response_tokens == rollout.response_tokens
        assert got[key].logprobs == pytest.approx(rollout.logprobs, abs=1e-9)


def test_a_cache_without_copy_prefix_fills_each_sample_itself(model):
    # the cache protocol's copy_prefix is optional: without it, every sample fills its prompt
    engine = _engine(with_cache_lacking(model, "copy_prefix"), max_batch=8, token_budget=64)
    box = _collect(engine.submit([PROMPTS[3]], SAMPLED, 4))
    _drain(engine)
    assert "error" not in box, box.get("error")
    assert len(box["done"]) == 4 and engine.stats["shared_prefix_tokens"] == 0
    assert engine.stats["prefill_tokens"] >= 4 * (len(PROMPTS[3].tokens) - 1)


def test_a_pause_and_resume_under_unchanged_weights_changes_nothing(model):
    engine = _engine(model, max_batch=3, token_budget=6)
    box = _collect(engine.submit(PROMPTS, GREEDY, 1))
    for _ in range(4):
        engine.step()
    engine.pause()
    assert not engine.busy()
    engine.pause(False)
    _drain(engine)
    _assert_alone(model, box["done"])


def test_an_aborted_sample_continues_exactly_where_it_stopped(model):
    whole = _engine(model)
    uninterrupted = _collect(whole.submit(PROMPTS, SAMPLED, 2))
    _drain(whole)
    engine = _engine(model, max_batch=4)
    box = _collect(engine.submit(PROMPTS, SAMPLED, 2))
    for _ in range(6):
        engine.step()
    assert engine.abort() > 0
    partial = [r for r in box["done"] if r.interrupted]
    assert partial and all(not r.finished and len(r.versions) == len(r.response_tokens)
                           for r in partial)
    again = _engine(model, max_batch=3)
    resumed = _collect(again.submit(partial, SAMPLED, 1))  # a Rollout is one sample
    _drain(again)
    final = {**_keyed(r for r in box["done"] if not r.interrupted), **_keyed(resumed["done"])}
    for key, r in _keyed(uninterrupted["done"]).items():
        assert final[key].response_tokens == r.response_tokens
        assert final[key].logprobs == pytest.approx(r.logprobs, abs=1e-9)


def test_new_weights_mid_flight_refill_the_cache_and_each_token_records_its_version(model):
    version = {"now": None}
    engine = _engine(model, version=lambda: version["now"], max_batch=2, token_budget=4)
    box = _collect(engine.submit(PROMPTS[:2], GREEDY, 1))
    for _ in range(8):
        engine.step()
    with torch.no_grad():  # what a load_weights op does between two steps
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    version["now"] = 3
    _drain(engine)
    for r in box["done"]:
        switch = r.versions.index(3)
        assert set(r.versions[:switch]) == {NO_VERSION} and set(r.versions[switch:]) == {3}
        # the tokens after the switch are what the new weights say, from the same prefix
        tokens, logprobs = _alone_without_cache(
            model, r.prompt_tokens + r.response_tokens[:switch], 12 - switch)
        assert r.response_tokens[switch:] == tokens
        assert r.logprobs[switch:] == pytest.approx(logprobs, abs=1e-9)


def test_a_cancelled_request_leaves_and_the_others_go_on(model):
    engine = _engine(model, max_batch=2)
    cancelled = engine.submit(PROMPTS[:3], GREEDY, 2)
    _collect(cancelled)  # what it would have streamed goes nowhere
    kept = _collect(engine.submit(PROMPTS[3:4], GREEDY, 1))
    engine.step()
    cancelled.cancel()
    _drain(engine)
    assert len(kept["done"]) == 1 and not cancelled.finished


def test_a_model_without_the_cache_protocol_decodes_the_same(model):
    class Plain(torch.nn.Module):  # forward(tokens) only
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, tokens):
            return self.inner(tokens)

    engine = _engine(Plain(model), max_batch=3)
    box = _collect(engine.submit(PROMPTS, GREEDY, 1))
    _drain(engine)
    _assert_alone(model, box["done"])


# -- the op -----------------------------------------------------------------------------------
SPEC = gpt_spec("policy", SMALL, seed=1)


def test_the_op_shares_one_engine_per_model_and_tracks_the_held_weights_version():
    ctx = op_context()
    first = gen._generate(ctx, PROMPTS[:2], **SPEC, eos=None, max_new_tokens=4, n=2)
    second = gen._generate(ctx, PROMPTS[2:4], **SPEC, eos=None, max_new_tokens=4, n=2)
    assert list(ctx.background) == ["generate:policy"]
    held_model(ctx, {**SPEC, "stages": 1}).version = 5
    other = _collect(second)
    rollouts = run_until_done(ctx.background, first)
    _drain(ctx.background["generate:policy"])
    rollouts += other["done"]
    assert len(rollouts) == 8 and all(set(r.versions) == {5} for r in rollouts)


def test_the_generation_op_pauses_resumes_and_aborts_the_engine_here():
    ctx = op_context()
    box = _collect(gen._generate(ctx, PROMPTS[:2], **SPEC, eos=None, max_new_tokens=8, n=2))
    engine = ctx.background["generate:policy"]
    engine.step()
    assert gen._generation(ctx, action="pause") == 0 and not engine.busy()
    gen._generation(ctx, action="resume", model="policy")
    engine.step()
    assert gen._generation(ctx, action="abort", model="other") == 0  # not this model's
    assert gen._generation(ctx, action="abort") == 4
    assert len(box["done"]) == 4 and all(r.interrupted and len(r.response_tokens) == 2
                                         for r in box["done"])
    with pytest.raises(Exception, match="'stop' is not one of pause, resume, abort"):
        gen._generation(ctx, action="stop")


@pytest.mark.parametrize(("kw", "error"), [
    ({"n": 0}, "n must be at least 1"),
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
    ({"top_q": 5}, "generate does not take 'top_q': its settings are n, max_new_tokens"),
    ({"prompts": [Prompt(prompt_id=9, tokens=[1] * 40)]}, "prompt 9 .40 tokens. leaves no room"),
])
def test_bad_requests_fail_alone_naming_what_was_wrong(kw, error):
    ctx = op_context()
    running = gen._generate(ctx, PROMPTS[:2], **SPEC, eos=None, max_new_tokens=4)
    prompts = kw.pop("prompts", PROMPTS[:1])
    with pytest.raises(Exception, match=error):
        gen._generate(ctx, prompts, **{**SPEC, "eos": None, "max_new_tokens": 4, **kw})
    assert len(run_until_done(ctx.background, running)) == 2  # the other request goes on


def test_a_finished_rollout_passes_through_beside_continued_ones():
    """A carried group [Note: partial rollouts]: its finished samples come back as they were,
    its interrupted ones continue."""
    ctx = op_context()
    done = Rollout(prompt_id=4, sample=0, prompt_tokens=[1, 2], response_tokens=[3],
                   logprobs=[-1.0], versions=[0])
    cut = attrs.evolve(done, sample=1, finished=False, interrupted=True)
    out = run_until_done(ctx.background, gen._generate(ctx, [done, cut], **SPEC, eos=None,
                                                       max_new_tokens=4))
    by_sample = {r.sample: r for r in out}
    assert by_sample[0] == done
    assert by_sample[1].response_tokens[:1] == [3] and len(by_sample[1].response_tokens) == 4
    assert by_sample[1].versions[0] == 0 and not by_sample[1].interrupted


def test_an_abort_by_name_cuts_only_those_requests():
    ctx = op_context()
    named = gen._generate(ctx, PROMPTS[:1], **SPEC, eos=None, max_new_tokens=6, request="a")
    other = gen._generate(ctx, PROMPTS[1:2], **SPEC, eos=None, max_new_tokens=6, request="b")
    results: dict = {}
    for name, deferred in (("a", named), ("b", other)):  # bound, as an executor binds them
        deferred.bind(_Sink(results, name))
    engine = next(iter(ctx.background.values()))
    for _ in range(3):
        engine.step()
    samples, tokens = gen._generation(ctx, action="abort", requests=["a"])
    assert samples == 1 and tokens > 0
    while "b" not in results:
        engine.step()
    assert all(r.interrupted for r in results["a"])
    assert not any(r.interrupted for r in results["b"])


class _Sink:
    def __init__(self, results: dict, name: str) -> None:
        self.results, self.name = results, name

    def emit(self, item) -> None:
        pass

    def done(self, result) -> None:
        self.results[self.name] = result

    def fail(self, error) -> None:
        raise error


def test_register_adds_generate():
    table = OpTable()
    gen.register(table)
    assert "generate" in table


def test_an_abort_that_comes_before_its_request_ends_the_request_at_once():
    """The abort ran while the request still waited for its inputs, before any engine was
    made: the request comes back at once, its samples interrupted with nothing decoded."""
    ctx = op_context()
    assert gen._generation(ctx, action="abort", requests=["late"]) == [0, 0]
    out = run_until_done(ctx.background, gen._generate(ctx, PROMPTS[:1], **SPEC, eos=None,
                                                       max_new_tokens=6, n=2, request="late"))
    assert [(r.sample, r.response_tokens, r.interrupted) for r in out] == [(0, [], True),
                                                                          (1, [], True)]


@given(st.integers(8, 64).flatmap(lambda max_len: st.tuples(
    st.just(max_len),
    st.lists(st.integers(0, max_len - 1).flatmap(
        lambda start: st.tuples(st.just(start), st.integers(start + 1, max_len))),
        min_size=1, max_size=12))))
def test_prefill_chunks_go_in_forwards_whose_padding_fits_the_cache(case):
    """A forward right-pads its chunks to the widest, so each row's positions run to its
    start plus that width: every chunk goes in exactly one forward, and in each forward the
    latest start plus the widest chunk stays within the cache (a trajectory's observation,
    late in its row, beside a fresh prompt's long chunk once ran past it)."""
    max_len, spans = case
    chunks = [(object(), start, stop) for start, stop in spans]
    batches = _fitting(chunks, max_len)
    assert sorted(map(id, (c for b in batches for c in b))) == sorted(map(id, chunks))
    for batch in batches:
        assert max(c[1] for c in batch) + max(c[2] - c[1] for c in batch) <= max_len


def test_an_idle_engine_lets_its_cache_go_and_the_next_request_samples_as_on_a_fresh_one(model):
    """[Note: rollout engine]: with no sequence left the cache is released, memory a colocated
    executor's training can use; the next request makes a new one, and what it samples is what
    an engine that never released one samples."""
    engine = _engine(model, max_batch=4)
    first = _collect(engine.submit(PROMPTS[:2], SAMPLED, 2))
    _drain(engine)
    assert "done" in first and engine.cache is None and engine.stats["cache_releases"] == 1
    again = _collect(engine.submit(PROMPTS[2:4], SAMPLED, 2))
    _drain(engine)
    fresh = _engine(model, max_batch=4)
    alone = _collect(fresh.submit(PROMPTS[2:4], SAMPLED, 2))
    _drain(fresh)
    assert _keyed(again["done"]) == _keyed(alone["done"])
    assert engine.stats["cache_releases"] == 2


def test_a_paused_engine_keeps_the_cache_its_sequences_hold(model):
    engine = _engine(model, max_batch=4)
    _collect(engine.submit(PROMPTS[:2], GREEDY, 1))
    engine.step()
    engine.step()
    engine.pause()
    assert not engine.busy() and engine.cache is not None
    engine.pause(False)
    _drain(engine)
    assert engine.cache is None and engine.stats["cache_releases"] == 1


def test_an_abort_that_empties_the_engine_lets_its_cache_go(model):
    engine = _engine(model, max_batch=4)
    _collect(engine.submit(PROMPTS[:2], GREEDY, 1, key="a"))
    engine.step()
    engine.step()
    assert engine.cache is not None
    engine.abort_requests({"a"})
    assert engine.cache is None and not engine.busy()
