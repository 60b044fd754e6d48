"""Tree rollouts in flowkit's own engine [Note: tree rollouts in
executors/torch/rollout/branching.py]: samples fork at fixed depths, or at uncertain tokens
[Note: entropy branching], and share their prefix."""

from __future__ import annotations

import attrs
import pytest
import torch

from executors.torch.rollout import generate as gen
from executors.torch.rollout.branching import branch_samples, leaves_per_root
from executors.torch.rollout.engine import Engine, Sampling, run_all_until_done, run_until_done
from executors.torch.rollout.sampling import sequence_seed
from flowkit.ops.records import Prompt
from tests.harness import gpt_spec, op_context, seeded_gpt, tiny_gpt

SMALL = tiny_gpt(vocab_size=32, block_size=40, n_embd=16)
PROMPTS = [Prompt(prompt_id=i, tokens=[(5 * i + j) % 32 for j in range(length)])
           for i, length in enumerate([1, 9, 3, 14])]
PLAIN = Sampling(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7, step=2)
TREE = attrs.evolve(PLAIN, branch_at=(2, 6), branches=3)


@pytest.fixture
def model():
    return seeded_gpt(SMALL, seed=1, dtype=torch.float64).eval()


def _run(model, sampling: Sampling, n: int, prompts=PROMPTS, **engine_kw):
    engine = Engine(model, version=lambda: None, **{"max_batch": 64, **engine_kw})
    deferreds = [engine.submit([p], sampling, n) for p in prompts]
    rollouts = [r for done in run_all_until_done({"engine": engine}, deferreds) for r in done]
    return {(r.prompt_id, r.sample): r for r in rollouts}, engine


@pytest.mark.parametrize("no_branching", [{"branch_at": ()}, {"branch_at": (3,), "branches": 1}])
def test_without_branching_the_rollouts_are_the_plain_ones_bit_for_bit(model, no_branching):
    plain, _ = _run(model, PLAIN, 3)
    tree, _ = _run(model, attrs.evolve(PLAIN, **no_branching), 3)
    assert plain == tree


def test_each_sample_grows_into_its_leaves_numbered_by_the_tree(model):
    tree, _ = _run(model, TREE, 2)  # eos None: no sample ends before a branch depth
    assert leaves_per_root(TREE.branch_at, TREE.branches) == 9
    for prompt in PROMPTS:
        assert sorted(s for p, s in tree if p == prompt.prompt_id) == list(range(18))
    roots = [r for r in tree.values() if r.branch_of is None]
    assert sorted({r.sample for r in roots}) == [0, 9]
    assert {r.shared_tokens for r in tree.values() if r.branch_of is not None} == {2, 6}
    assert branch_samples(9, 2, (2, 6), 3) == [12, 15]
    assert branch_samples(12, 6, (2, 6), 3) == [13, 14]


def test_a_branch_shares_its_parents_prefix_and_draws_on_with_its_own_seed(model):
    tree, _ = _run(model, TREE, 2)
    diverged = 0
    for (prompt_id, _), leaf in tree.items():
        if leaf.branch_of is None:
            continue
        parent, shared = tree[(prompt_id, leaf.branch_of)], leaf.shared_tokens
        assert leaf.response_tokens[:shared] == parent.response_tokens[:shared]
        assert leaf.logprobs[:shared] == parent.logprobs[:shared]
        diverged += leaf.response_tokens[shared:] != parent.response_tokens[shared:]
    assert diverged > 0  # its own draws, not its parent's
    # a branch's seed is a pure function of (seed, step, prompt, its index in the tree)
    assert TREE.seed_of(3, 12) == sequence_seed(7, 3, 12, step=2) != TREE.seed_of(3, 9)


@torch.no_grad()
def test_a_leafs_logprobs_equal_a_plain_forward_over_its_tokens(model):
    tree, engine = _run(model, TREE, 2, max_batch=8, token_budget=16)
    prompt_copies = sum(3 * (len(p.tokens) - 1) for p in PROMPTS if len(p.tokens) > 1)
    assert engine.stats["shared_prefix_tokens"] > prompt_copies  # branches copied their prefix
    for leaf in tree.values():
        sequence = torch.tensor([leaf.prompt_tokens + leaf.response_tokens])
        logits = model(sequence)[0].to(torch.float64)
        start = len(leaf.prompt_tokens) - 1
        logp = torch.log_softmax(logits[start:start + len(leaf.response_tokens)], dim=-1)
        want = logp.gather(1, torch.tensor(leaf.response_tokens)[:, None])[:, 0]
        assert leaf.logprobs == pytest.approx(want.tolist(), abs=1e-9)


@pytest.mark.parametrize(("max_batch", "budget", "order"), [(2, 7, -1), (5, 3, 1), (64, 512, -1)])
def test_the_trees_do_not_depend_on_batch_size_budget_or_arrival_order(model, max_batch, budget,
                                                                       order):
    want, _ = _run(model, TREE, 2)
    got, _ = _run(model, TREE, 2, prompts=PROMPTS[::order], max_batch=max_batch,
                  token_budget=budget)
    assert got.keys() == want.keys()
    for key, rollout in want.items():
        assert got[key].response_tokens == rollout.response_tokens
        assert got[key].logprobs == pytest.approx(rollout.logprobs, abs=1e-9)
        assert (got[key].branch_of, got[key].shared_tokens) == (rollout.branch_of,
                                                                rollout.shared_tokens)


def test_a_sample_that_ends_before_a_branch_depth_does_not_branch(model):
    tree, _ = _run(model, attrs.evolve(TREE, max_new_tokens=4, branch_at=(2, 3), eos=None), 1)
    short, _ = _run(model, attrs.evolve(TREE, max_new_tokens=4, branch_at=(2, 3),
                                         eos=tuple(range(32))), 1)  # every token ends it
    assert len(tree) == 9 * len(PROMPTS)
    assert len(short) == len(PROMPTS) and all(r.branch_of is None for r in short.values())


SPEC = {**gpt_spec("policy", SMALL, seed=1), "eos": None, "max_new_tokens": 4}


@pytest.mark.parametrize(("kw", "error"), [
    ({"branch_at": (4,), "branches": 2}, r"branch_at depth 4 must lie in 1 \.\. max_new_tokens"),
    ({"branch_at": (0,), "branches": 2}, r"branch_at depth 0 must lie in 1"),
    ({"branch_at": (2,), "branches": 0}, "branches must be at least 1"),
    ({"branch_at": (2, 2), "branches": 2}, "branch_at must not repeat a depth"),
    ({"branch_at": (2,), "branches": 2, "branch_entropy": 0.5, "engine": "vllm"},
     "branch_entropy forks where a token's whole-vocabulary entropy reaches a threshold, and "
     "vLLM returns the sampled token's log-prob, not that entropy"),
    ({"branch_entropy": 1.0}, "branch_entropy=1.0 picks where tree rollouts fork, and none grow"),
    ({"branch_at": (2,), "branches": 1, "branch_entropy": 1.0}, "and branches >= 2"),
])
def test_bad_branching_is_refused_in_one_line_before_any_sample(kw, error):
    ctx = op_context()
    with pytest.raises(Exception, match=error) as raised:
        gen._generate(ctx, PROMPTS[:1], **{**SPEC, **kw})
    assert "\n" not in str(raised.value)
    assert not ctx.background  # no engine was made


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_a_tree_cut_and_continued_grows_into_the_uninterrupted_tree(model, steps):
    """Partial rollouts carry a cut tree over: each continued sample goes on from its tokens,
    forking at the depths past them and at none before, so the leaves are the uninterrupted
    tree's, token for token (counter-based draws)."""
    whole, _ = _run(model, TREE, 2)
    engine = Engine(model, version=lambda: None, max_batch=8)
    box = {}
    deferred = engine.submit(PROMPTS, TREE, 2)
    deferred.bind(_Sink(box))
    for _ in range(steps):
        engine.step()
    assert engine.abort() > 0
    cut = [r for r in box["done"] if r.interrupted]
    done = {(r.prompt_id, r.sample): r for r in box["done"] if not r.interrupted}
    again = Engine(model, version=lambda: None, max_batch=64)
    resumed = run_until_done({"engine": again}, again.submit(cut, TREE, 1))
    done.update({(r.prompt_id, r.sample): r for r in resumed})
    assert sorted(done) == sorted(whole)
    for key, leaf in whole.items():
        assert done[key].response_tokens == leaf.response_tokens
        assert (done[key].branch_of, done[key].shared_tokens) == (leaf.branch_of,
                                                                  leaf.shared_tokens)
        assert done[key].logprobs == pytest.approx(leaf.logprobs, abs=1e-9)


class _Sink:
    def __init__(self, box):
        self.box = box

    def emit(self, item):
        pass

    def done(self, result):
        self.box["done"] = result

    def fail(self, error):
        raise error


def test_the_generate_op_grows_trees_through_its_settings():
    ctx = op_context()
    done = run_until_done(ctx.background, gen._generate(ctx, PROMPTS[:2], **SPEC, n=2,
                                                        branch_at=[1], branches=2))
    assert sorted((r.prompt_id, r.sample) for r in done) == [(p, s) for p in (0, 1)
                                                             for s in range(4)]


# -- entropy branching ----------------------------------------------------------------------------

@torch.no_grad()
def _entropies(model, rollout) -> list[float]:
    """The entropy (nats, temperature 1) of the distribution each response token was drawn
    from, by a plain forward over the rollout's tokens."""
    sequence = torch.tensor([rollout.prompt_tokens + rollout.response_tokens])
    start = len(rollout.prompt_tokens) - 1
    logits = model(sequence)[0].to(torch.float64)[start:start + len(rollout.response_tokens)]
    return torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1).tolist()


def test_at_entropy_zero_the_trees_are_the_fixed_depth_ones(model):
    fixed, _ = _run(model, TREE, 2)
    uncertain, _ = _run(model, attrs.evolve(TREE, branch_entropy=0.0), 2)
    assert uncertain.keys() == fixed.keys()
    for key, rollout in fixed.items():  # forks a step later: other batches, the same draws
        assert uncertain[key].response_tokens == rollout.response_tokens
        assert uncertain[key].logprobs == pytest.approx(rollout.logprobs, abs=1e-9)
        assert (uncertain[key].branch_of, uncertain[key].shared_tokens) == (
            rollout.branch_of, rollout.shared_tokens)


def test_a_threshold_no_token_reaches_grows_no_branch(model):
    tree, _ = _run(model, attrs.evolve(TREE, branch_entropy=1e9), 2)
    assert sorted(s for p, s in tree if p == 0) == [0, 9]  # the roots alone, as the tree numbers
    assert all(r.branch_of is None for r in tree.values())


def test_a_sample_forks_at_its_first_token_past_the_levels_depth_as_uncertain_as_asked(model):
    sampling = attrs.evolve(PLAIN, top_p=1.0, branch_at=(1, 3), branches=2)
    spread = [h for r in _run(model, sampling, 2)[0].values() for h in _entropies(model, r)]
    threshold = sorted(spread)[len(spread) * 3 // 4]  # a quarter of the tokens reach it
    tree, _ = _run(model, attrs.evolve(sampling, branch_entropy=threshold), 3)
    forked = [r for r in tree.values() if r.branch_of is not None]
    assert forked and len(tree) < 3 * 4 * len(PROMPTS)  # some forks, not every one
    for leaf in forked:
        parent = tree[(leaf.prompt_id, leaf.branch_of)]
        level = 0 if leaf.sample - parent.sample == 2 else 1  # root r: 4r + 2 b0 + b1
        # the parent's tokens this level could fork at: from the level's depth, past the one
        # the parent was forked at, and past its fork of level 0
        begin = [sampling.branch_at[level], parent.shared_tokens + 1]
        if level == 1 and parent.branch_of is None and (leaf.prompt_id, parent.sample + 2) in tree:
            begin.append(tree[(leaf.prompt_id, parent.sample + 2)].shared_tokens + 1)
        at, entropies, earliest = leaf.shared_tokens, _entropies(model, parent), max(begin)
        assert at >= earliest and entropies[at] >= threshold - 1e-9
        assert all(h < threshold + 1e-9 for h in entropies[earliest:at])  # the first such
        assert leaf.response_tokens[:at] == parent.response_tokens[:at]


def test_a_sample_forks_at_an_uncertain_token_that_ends_it(model):
    every_token_ends = attrs.evolve(TREE, branch_at=(1,), branches=2, branch_entropy=0.0,
                                    eos=tuple(range(32)))
    tree, _ = _run(model, every_token_ends, 1)
    # each root ends at its first token and never reaches depth 1; with max_new_tokens 2 it
    # would draw token 1 and fork there as it ends
    assert all(r.branch_of is None for r in tree.values())
    two = attrs.evolve(every_token_ends, eos=None, max_new_tokens=2)
    tree, _ = _run(model, two, 1)
    assert sorted(s for p, s in tree if p == 0) == [0, 1]
    assert {r.shared_tokens for r in tree.values() if r.branch_of is not None} == {1}


def test_the_generate_op_branches_by_entropy_through_its_settings():
    ctx = op_context()
    done = run_until_done(ctx.background, gen._generate(ctx, PROMPTS[:2], **SPEC, n=2,
                                                        branch_at=[1], branches=2,
                                                        branch_entropy=0.0))
    assert sorted((r.prompt_id, r.sample) for r in done) == [(p, s) for p in (0, 1)
                                                             for s in range(4)]
