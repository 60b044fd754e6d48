"""The batch sampler [Note: counter-based sampling]: draws that depend only on (seed, position),
the logprob convention and top-p set of `generate.sample_token`, the right distribution, and a
Philox that matches Random123's known answers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from executors.torch.rollout import generate as gen
from executors.torch.rollout import sampling as smp

INT64 = st.integers(-(2**63), 2**63 - 1)


# -- helpers ----------------------------------------------------------------------------------
def _rows(rng_seed: int, b: int, v: int, *, greedy: bool = True) -> dict:
    """B random rows: logits (B, V) of varied sharpness, and per-row settings."""
    g = torch.Generator().manual_seed(rng_seed)
    scale = torch.tensor([0.1, 1.0, 4.0])[torch.randint(0, 3, (b, 1), generator=g)]
    temps = torch.tensor([0.0, 0.3, 1.0, 2.5] if greedy else [0.3, 0.7, 1.0, 2.5])
    return dict(
        logits=torch.randn(b, v, generator=g, dtype=torch.float64) * scale,
        temperature=temps[torch.randint(0, 4, (b,), generator=g)],
        top_p=torch.tensor([0.05, 0.5, 0.9, 1.0])[torch.randint(0, 4, (b,), generator=g)],
        seeds=torch.randint(-(2**62), 2**62, (b,), generator=g),
        positions=torch.randint(0, 2**40, (b,), generator=g))


def _select(rows: dict, index) -> dict:
    return {k: v[index] for k, v in rows.items()}


def _cat(*parts: dict) -> dict:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _sample(rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return smp.sample_tokens(rows["logits"], temperature=rows["temperature"],
                             top_p=rows["top_p"], seeds=rows["seeds"],
                             positions=rows["positions"])


def _kept(row: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The existing per-row math of `gen.sample_token`: the tokens it may draw (bool, V), and
    any token tied with one of them (at the edge of the set, which of two tied tokens ranks
    first is the sort's choice; `sample_tokens` sorts stably, `_top_p` does not)."""
    probs = F.log_softmax(row.to(torch.float64) / temperature, dim=-1).exp()
    return probs >= probs[gen._top_p(probs, top_p) > 0].min()


# -- reproducibility --------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(rng_seed=st.integers(0, 2**32), b=st.integers(1, 8), v=st.integers(2, 40),
       extra=st.integers(0, 6), data=st.data())
def test_a_row_draws_the_same_in_any_batch_and_row(rng_seed, b, v, extra, data):
    rows = _rows(rng_seed, b, v)
    tokens, logprobs = _sample(rows)
    perm = torch.tensor(data.draw(st.permutations(range(b))), dtype=torch.long)
    others = _rows(rng_seed + 1, extra, v)
    cut = data.draw(st.integers(0, extra))
    batch = _cat(_select(others, slice(0, cut)), _select(rows, perm),
                 _select(others, slice(cut, extra)))
    t2, lp2 = _sample(batch)
    assert torch.equal(t2[cut:cut + b], tokens[perm])
    assert torch.equal(lp2[cut:cut + b], logprobs[perm])
    for i in range(b):  # and alone
        t1, lp1 = _sample(_select(rows, slice(i, i + 1)))
        assert (int(t1), float(lp1)) == (int(tokens[i]), float(logprobs[i]))


def test_a_sequence_resumed_at_p_draws_what_it_would_have_drawn():
    """Position p's logits depend on p only here, so a sequence's tokens are a function of its
    seed and positions: decoded alone, or paused at 5 and resumed in another batch and row."""
    v, seed = 50, smp.sequence_seed(11, 3, 1)
    logits_at = [torch.randn(v, generator=torch.Generator().manual_seed(p)) for p in range(12)]

    def one(p):
        return dict(logits=logits_at[p][None], temperature=torch.tensor([1.0]),
                    top_p=torch.tensor([0.95]), seeds=torch.tensor([seed]),
                    positions=torch.tensor([p]))

    alone = [int(_sample(one(p))[0]) for p in range(12)]
    resumed = []
    for p in range(12):  # other sequences around it; a pause between positions 4 and 5
        others = _rows(100 + p, 3 if p < 5 else 1, v)
        batch = _cat(others, one(p)) if p < 5 else _cat(one(p), others)
        tokens, _ = _sample(batch)
        resumed.append(int(tokens[-1] if p < 5 else tokens[0]))
    assert resumed == alone
    assert len(set(alone)) > 1  # the positions do draw differently


# -- the logprob convention and greedy --------------------------------------------------------
def test_greedy_takes_the_argmax_and_records_temperature_one():
    rows = _rows(5, 64, 30)
    rows["temperature"] = torch.zeros(64)
    tokens, logprobs = _sample(rows)
    for row, token, logp in zip(rows["logits"], tokens, logprobs):
        assert (int(token), float(logp)) == gen.sample_token(row, temperature=0.0, top_p=0.3,
                                                             generator=None)


@settings(max_examples=30, deadline=None)
@given(rng_seed=st.integers(0, 2**32), b=st.integers(1, 16), v=st.integers(2, 64),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
def test_logprobs_are_log_softmax_at_temperature_over_the_whole_vocabulary(rng_seed, b, v, dtype):
    rows = _rows(rng_seed, b, v)
    rows["logits"] = rows["logits"].to(dtype)
    tokens, logprobs = _sample(rows)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float64
    for row, t, top_p, token, logp in zip(rows["logits"], rows["temperature"], rows["top_p"],
                                          tokens, logprobs):
        t, x = float(t), row.to(torch.float64)
        if t == 0:
            assert int(token) == int(torch.argmax(x))
            assert float(logp) == float(F.log_softmax(x, dim=-1)[token])
        else:  # sample_token's math, and a token it may draw
            assert float(logp) == float(F.log_softmax(x / t, dim=-1)[token])
            assert _kept(row, t, float(top_p))[token]


def test_low_precision_logits_sample_as_their_float64_values():
    rows = _rows(9, 32, 100)
    rows["logits"] = rows["logits"].to(torch.bfloat16)
    wide = {**rows, "logits": rows["logits"].to(torch.float64)}
    for got, want in zip(_sample(rows), _sample(wide)):
        assert torch.equal(got, want)


# -- memory: chunks of rows and positions [Note: chunked log-probabilities] --------------------
@settings(max_examples=30, deadline=None)
@given(rng_seed=st.integers(0, 2**32), b=st.integers(1, 20), v=st.integers(2, 50),
       chunk_rows=st.integers(1, 20))
def test_a_batch_sampled_a_chunk_of_rows_at_a_time_draws_as_whole(rng_seed, b, v, chunk_rows):
    rows = _rows(rng_seed, b, v)
    whole = _sample(rows)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(smp, "_CHUNK_ELEMENTS", chunk_rows * v)
        chunked = _sample(rows)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])


@settings(max_examples=60, deadline=None)
@given(rng_seed=st.integers(0, 2**32), b=st.integers(1, 5), t=st.integers(1, 9),
       v=st.integers(2, 50), chunk=st.integers(1, 60), sliced=st.booleans(),
       temperature=st.sampled_from([1.0, 0.7, 2.5]),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
def test_token_logprobs_in_chunks_are_the_whole_vocabularys_log_softmax(
        rng_seed, b, t, v, chunk, sliced, temperature, dtype):
    """Any chunk of positions gives the bits of the log-softmax of all positions at once, in
    the logits' precision (at least float32), read at the tokens; float64 logits give float64's
    exact values, lower ones agree with them to float32's rounding."""
    g = torch.Generator().manual_seed(rng_seed)
    logits = (torch.randn(b + 1, t + 2, v, generator=g, dtype=torch.float64) * 4).to(dtype)
    if sliced:  # as the logprobs op reads a padded forward: its real rows and widths
        logits = logits[:b, :t]
    tokens = torch.randint(0, v, logits.shape[:2], generator=g)
    got = smp.token_logprobs(logits, tokens, temperature=temperature, chunk=chunk)
    wide = torch.promote_types(dtype, torch.float32)
    whole = F.log_softmax(logits.to(wide) / temperature, dim=-1)
    assert got.dtype == torch.float64 and got.shape == tokens.shape
    assert torch.equal(got, whole.gather(-1, tokens[..., None])[..., 0].to(torch.float64))
    exact = F.log_softmax(logits.to(torch.float64) / temperature, dim=-1)
    exact = exact.gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(got, exact, rtol=0, atol=0 if dtype == torch.float64 else 1e-4)
    flat = smp.token_logprobs(logits[0], tokens[0], temperature=temperature, chunk=chunk)
    assert torch.equal(flat, got[0])  # (T, V) as well as (B, T, V)
    in64 = smp.token_logprobs(logits, tokens, temperature=temperature, dtype=torch.float64)
    assert torch.equal(in64, exact)  # the exact path, asked for


# -- top-p ------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(logits=st.lists(st.lists(st.integers(-6, 6) | st.floats(-20, 20), min_size=12,
                                max_size=12), min_size=1, max_size=6),
       top_p=st.lists(st.floats(0.0, 1.2), min_size=6, max_size=6))
def test_top_p_keeps_the_set_generate_keeps(logits, top_p):
    """Equal sets; where probabilities tie the sorts may rank the tied tokens differently, so
    there the kept tokens' probabilities are compared as multisets. (`_top_p` gives its top
    token a tiny weight when top_p <= 0; the set is the same.)"""
    probs = F.softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)
    top_p = torch.tensor(top_p[: len(logits)], dtype=torch.float64)
    kept, order = smp._nucleus(probs, top_p)
    kept = torch.zeros_like(probs).scatter(1, order, kept)  # back in vocabulary order
    for p, q, tp in zip(probs, kept, top_p):
        want = gen._top_p(p, float(tp))
        assert torch.equal(torch.sort(p[q > 0]).values, torch.sort(p[want > 0]).values)
        if len(set(p.tolist())) == len(p):
            assert torch.equal(q > 0, want > 0)


@settings(max_examples=60, deadline=None)
@given(rng_seed=st.integers(0, 2**32), b=st.integers(1, 12), v=st.integers(2, 60),
       candidates=st.integers(1, 60), coarse=st.booleans())
def test_sorting_only_the_likeliest_candidates_draws_as_the_full_sort(
        rng_seed, b, v, candidates, coarse):
    """Rows whose top-p set lies within the candidates take the short path, the others the
    full sort; every row draws what the full sort draws. Coarse (bf16-like) logits tie often."""
    g = torch.Generator().manual_seed(rng_seed)
    logits = torch.randn(b, v, generator=g, dtype=torch.float64) * 3
    if coarse:
        logits = logits.round()
    probs = F.softmax(logits, dim=-1)
    top_p = torch.rand(b, generator=g, dtype=torch.float64)
    u = torch.rand(b, generator=g, dtype=torch.float64)
    draws = []
    for k in (v, candidates):  # v: every row sorts everything
        with pytest.MonkeyPatch.context() as m:
            m.setattr(smp, "_CANDIDATES", k)
            draws.append(smp._top_p_draw(probs, top_p, u))
    assert torch.equal(draws[1], draws[0])


@settings(max_examples=15, deadline=None)
@given(rng_seed=st.integers(0, 2**32), v=st.integers(2, 30), top_p=st.floats(0.01, 0.99),
       temperature=st.floats(0.2, 3.0))
def test_tokens_outside_the_top_p_set_are_never_drawn(rng_seed, v, top_p, temperature):
    row = torch.randn(v, generator=torch.Generator().manual_seed(rng_seed)) * 3
    n = 2000
    tokens, _ = smp.sample_tokens(row.expand(n, v), temperature=torch.full((n,), temperature),
                                  top_p=torch.full((n,), top_p), seeds=torch.arange(n),
                                  positions=torch.zeros(n, dtype=torch.long))
    assert _kept(row, temperature, top_p)[tokens].all()


# -- the distribution -------------------------------------------------------------------------
# Upper 1e-6 tail of chi-square: with these fixed seeds the tests are deterministic, and a right
# sampler lands far below it; a wrong one (off-by-one token, wrong temperature) lands far above.
CHI2_TAIL = {2: 27.63, 4: 33.38, 5: 35.89}  # by degrees of freedom


@pytest.mark.parametrize("temperature,top_p,kept", [(1.0, 1.0, 6), (0.6, 1.0, 6), (2.5, 1.0, 6),
                                                     (1.0, 0.8, 3), (2.0, 0.9, 5)])
def test_draws_follow_the_tempered_renormalized_distribution(temperature, top_p, kept):
    """20k draws (2000 seeds x 10 positions) of a 6-token vocabulary: Pearson's chi-square
    against softmax(logits / T), restricted to the top-p set and renormalized."""
    row = torch.tensor([2.0, 1.2, 0.5, 0.0, -0.7, -1.5], dtype=torch.float64)
    seeds = torch.arange(2000).repeat_interleave(10)
    positions = torch.arange(10).repeat(2000)
    n = len(seeds)
    tokens, _ = smp.sample_tokens(row.expand(n, -1), temperature=torch.full((n,), temperature),
                                  top_p=torch.full((n,), top_p), seeds=seeds, positions=positions)
    want = gen._top_p(F.softmax(row / temperature, dim=-1), top_p)
    want = want / want.sum()
    counts = torch.bincount(tokens, minlength=6).to(torch.float64)
    assert (counts[want == 0] == 0).all()
    expected = n * want[want > 0]
    assert (want > 0).sum() == kept
    chi2 = float(((counts[want > 0] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_TAIL[kept - 1], (chi2, counts.tolist(), expected.tolist())
    assert float(0.5 * (counts / n - want).abs().sum()) < 0.015  # total variation


def test_inverse_cdf_never_takes_a_token_without_weight():
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]] * 4, dtype=torch.float64)
    u = torch.tensor([0.0, 0.3 - 2**-53, 1 - 2**-53, 1.0], dtype=torch.float64)  # 1.0: rounded up
    assert smp._inverse_cdf(weights, u).tolist() == [1, 1, 3, 3]


# -- the counter-based uniforms ---------------------------------------------------------------
# Random123's kat_vectors for philox4x32 10: counter (4 words), key (2 words) -> output (4 words).
PHILOX_KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def test_philox_matches_random123_known_answers():
    counter = torch.tensor([c for c, _, _ in PHILOX_KAT]).T  # (4, 3): one column per case
    key = torch.tensor([k for _, k, _ in PHILOX_KAT]).T
    out = smp._philox4x32(counter, key)
    assert out.T.tolist() == [want for _, _, want in PHILOX_KAT]


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, 2**32 - 1), m=st.sampled_from(smp._PHILOX_M))
def test_mulhilo_is_the_64_bit_product(a, m):
    hi, lo = smp._mulhilo(torch.tensor([a]), torch.tensor([m]))
    assert (int(hi) << 32) + int(lo) == a * m


def test_uniforms_are_in_the_unit_interval_with_uniform_moments():
    seeds = torch.arange(2000).repeat_interleave(100)
    positions = torch.arange(100).repeat(2000)
    u = smp.uniforms(seeds, positions)
    n = len(u)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    counts = torch.bincount((u * 64).long(), minlength=64).to(torch.float64)
    assert float(((counts - n / 64) ** 2 / (n / 64)).sum()) < 131.0  # chi2(63): 1e-6 tail at 131.4
    grid = u.view(2000, 100) - 0.5  # neighbours along positions and along seeds: uncorrelated
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):
        corr = float((a * b).mean() / (a.std() * b.std()))
        assert abs(corr) < 5 / math.sqrt(a.numel())
    assert len(torch.unique(u)) == n  # 53-bit values: no two counters collide here


@settings(max_examples=100, deadline=None)
@given(seed=INT64, position=INT64)
def test_uniform_is_a_function_of_its_seed_and_position_alone(seed, position):
    u = float(smp.uniforms(torch.tensor([seed]), torch.tensor([position])))
    assert 0.0 <= u < 1.0
    around = smp.uniforms(torch.tensor([seed ^ 1, seed, seed, seed]),
                          torch.tensor([position, position ^ 1, position, position ^ (1 << 40)]))
    assert float(around[2]) == u
    assert len({u, float(around[0]), float(around[1]), float(around[3])}) == 4


def test_extreme_seeds_and_positions_stay_in_range():
    edges = torch.tensor([0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63)])
    seeds, positions = torch.meshgrid(edges, edges, indexing="ij")
    u = smp.uniforms(seeds.flatten(), positions.flatten())
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert len(torch.unique(u)) == len(u)


# -- sequence seeds ---------------------------------------------------------------------------
def test_sequence_seed_is_pinned_and_spreads():
    # Pinned: a change here changes every run's rollouts.
    assert smp.sequence_seed(0, 0, 0) == 1195769770526638388
    assert smp.sequence_seed(1, 2, 3, step=4) == 2440921749258156019
    grid = [smp.sequence_seed(seed, prompt, sample, step=step) for seed in (0, 1, -1)
            for step in range(4) for prompt in range(30) for sample in range(8)]
    assert len(set(grid)) == len(grid)
    assert all(0 <= s < 2**63 for s in grid)
    assert smp.sequence_seed(0, 1, 2) != smp.sequence_seed(0, 2, 1)


def test_wrong_shapes_are_reported_together():
    with pytest.raises(ValueError, match=r"2 errors: top_p must be \(3,\).*positions"):
        smp.sample_tokens(torch.zeros(3, 5), temperature=torch.ones(3), top_p=torch.ones(2),
                          seeds=torch.zeros(3, dtype=torch.long), positions=torch.zeros(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_what_the_cpu_draws():
    rows = _rows(21, 128, 500)
    on_cpu = _sample(rows)
    on_gpu = _sample({k: v.cuda() for k, v in rows.items()})
    assert torch.equal(on_gpu[0].cpu(), on_cpu[0])
    torch.testing.assert_close(on_gpu[1].cpu(), on_cpu[1])


# -- top-k ------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(rng_seed=st.integers(0, 2**32), b=st.integers(1, 8), v=st.integers(2, 40),
       data=st.data())
def test_a_top_k_row_draws_among_its_k_likeliest_and_keeps_the_whole_log_prob(rng_seed, b, v,
                                                                              data):
    rows = _rows(rng_seed, b, v, greedy=False)
    k = torch.tensor(data.draw(st.lists(st.integers(1, v + 2), min_size=b, max_size=b)))
    tokens, logprobs = smp.sample_tokens(rows["logits"], temperature=rows["temperature"],
                                         top_p=rows["top_p"], seeds=rows["seeds"],
                                         positions=rows["positions"], top_k=k)
    for i in range(b):
        logp = F.log_softmax(rows["logits"][i] / rows["temperature"][i], dim=-1)
        kth = torch.topk(logp, int(min(k[i], v))).values[-1]
        assert logp[tokens[i]] >= kth  # one of the k likeliest (ties at the k-th included)
        assert logprobs[i] == pytest.approx(float(logp[tokens[i]]))  # before truncation


def test_top_k_one_is_greedy_and_zero_is_off():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 30, generator=g, dtype=torch.float64)
    common = dict(temperature=torch.full((6,), 1.3), top_p=torch.ones(6),
                  seeds=torch.arange(6), positions=torch.zeros(6, dtype=torch.int64))
    one, _ = smp.sample_tokens(logits, top_k=torch.ones(6, dtype=torch.int64), **common)
    assert torch.equal(one, logits.argmax(dim=-1))
    off, _ = smp.sample_tokens(logits, top_k=torch.zeros(6, dtype=torch.int64), **common)
    assert torch.equal(off, smp.sample_tokens(logits, **common)[0])


def test_a_rows_top_k_draw_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 30, generator=g, dtype=torch.float64)
    settings = dict(temperature=torch.full((5,), 0.8), top_p=torch.tensor([1, .9, 1, .5, 1.]),
                    seeds=torch.arange(5) * 7, positions=torch.arange(5),
                    top_k=torch.tensor([3, 0, 5, 2, 0]))
    together, _ = smp.sample_tokens(logits, **settings)
    alone = [smp.sample_tokens(logits[i:i + 1], **{n: s[i:i + 1] for n, s in
                                                   settings.items()})[0] for i in range(5)]
    assert together.tolist() == [int(t) for t in alone]


@settings(max_examples=50, deadline=None)
@given(seeds=st.lists(INT64, min_size=1, max_size=40), position=INT64)
def test_host_uniforms_are_the_same_bits_as_the_device_rounds(seeds, position):
    """The host path (numpy) and the tensor rounds that a GPU runs give the same uniforms."""
    s = torch.tensor(seeds)
    p = torch.tensor([position] * len(seeds)) + torch.arange(len(seeds))
    key = torch.stack([s & smp._MASK32, (s >> 32) & smp._MASK32])
    counter = torch.stack([p & smp._MASK32, (p >> 32) & smp._MASK32, 0 * p, 0 * p])
    out = smp._philox4x32(counter, key)
    want = ((out[0] >> 5) * (1 << 26) + (out[1] >> 6)).to(torch.float64) * 2.0**-53
    assert torch.equal(smp.uniforms(s, p), want)


@settings(max_examples=30, deadline=None)
@given(rng_seed=st.integers(0, 2**32), b=st.integers(1, 8), v=st.integers(2, 40),
       data=st.data())
def test_the_entropy_asked_is_each_rows_at_its_temperature_and_changes_no_draw(rng_seed, b, v,
                                                                              data):
    """[Note: entropy branching in executors/torch/rollout/branching.py]: nats, over the whole
    vocabulary at the row's temperature (greedy rows at 1), whatever its top-k or top-p."""
    rows = _rows(rng_seed, b, v, greedy=data.draw(st.booleans()))
    k = torch.tensor(data.draw(st.lists(st.integers(0, v), min_size=b, max_size=b)))
    plain = smp.sample_tokens(rows["logits"], temperature=rows["temperature"],
                              top_p=rows["top_p"], seeds=rows["seeds"],
                              positions=rows["positions"], top_k=k)
    tokens, logprobs, entropy = smp.sample_tokens(
        rows["logits"], temperature=rows["temperature"], top_p=rows["top_p"],
        seeds=rows["seeds"], positions=rows["positions"], top_k=k, entropy=True)
    assert torch.equal(tokens, plain[0]) and torch.equal(logprobs, plain[1])
    t = torch.where(rows["temperature"] > 0, rows["temperature"], 1.0).to(torch.float64)
    p = torch.softmax(rows["logits"].to(torch.float64) / t[:, None], dim=-1)
    want = -(p * torch.log(p)).nan_to_num().sum(-1)
    assert entropy.dtype == torch.float64
    assert entropy.tolist() == pytest.approx(want.tolist(), abs=1e-9)
