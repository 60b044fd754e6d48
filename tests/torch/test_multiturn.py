"""Multi-turn rollouts [Note: multi-turn rollouts in flowkit/ops/environments.py]: the engine
keeps the exact tokens it sampled, appends each environment turn as the model's format renders
it, marks which tokens the model sampled, records their log-probabilities as a fresh forward
over the whole trajectory computes them, and a failing or hanging environment ends its own
trajectory only."""

from __future__ import annotations

import json
import threading
import time

import attrs
import pytest
import torch

from executors.optable import Deferred
from executors.torch.models.built import whole_model
from executors.torch.rollout import generate as gen
from executors.torch.rollout.engine import run_until_done
from flowkit.ops import Environment, EnvStep
from flowkit.ops.records import Prompt
from tests.harness import generating, gpt_spec, op_context, tiny_gpt

GPT = tiny_gpt(vocab_size=256, block_size=96, n_layer=2, n_embd=16)
MODEL = gpt_spec("actor", GPT, seed=5)
PROMPTS = [Prompt(prompt_id=i, tokens=list(f"guess {i}:".encode())) for i in range(3)]
HERE = __name__


class Countdown(Environment):
    """Answers each turn with the length of what it saw, done after `steps` steps; rewards
    each step 0.25."""

    def __init__(self, steps: int = 3) -> None:
        self.steps, self.actions = steps, []

    def reset(self, prompt: str, answer: str | None = None) -> None:
        assert prompt.startswith("guess ") and answer is None

    def step(self, action: str) -> EnvStep:
        self.actions.append(action)
        left = self.steps - len(self.actions)
        return EnvStep(observation=f"[{len(action)} bytes, {left} left]", reward=0.25,
                       done=left == 0, info={"left": left, "note": "not a number"})


class Counted(Countdown):
    """Countdown that counts its episodes open and closed."""

    opened, closed = [], []

    def reset(self, prompt: str, answer: str | None = None) -> None:
        Counted.opened.append(prompt)

    def close(self) -> None:
        Counted.closed.append(self)


class Raises(Environment):
    def step(self, action: str) -> EnvStep:
        raise RuntimeError("the tool broke")


class Hangs(Environment):
    release = threading.Event()

    def step(self, action: str) -> EnvStep:
        Hangs.release.wait(30)
        return EnvStep(observation="late")


def _trajectories(ctx=None, prompts=PROMPTS, **kw):
    ctx = ctx or op_context()
    settings = {**MODEL, "max_new_tokens": 6, "temperature": 1.0, "sample_seed": 3, "n": 2,
                "environment": f"{HERE}:Countdown", "max_turns": 5, **kw}
    result = gen._generate(ctx, prompts, **settings)
    assert isinstance(result, Deferred)
    return ctx, run_until_done(ctx.background, result)


def _segments(rollout) -> list[tuple[int, list[int]]]:
    """The response as runs of (mask bit, tokens)."""
    runs: list[tuple[int, list[int]]] = []
    for token, bit in zip(rollout.response_tokens, rollout.response_mask):
        if runs and runs[-1][0] == bit:
            runs[-1][1].append(token)
        else:
            runs.append((bit, [token]))
    return runs


def test_each_turn_keeps_the_sampled_tokens_and_appends_the_environments_bytes():
    _, rollouts = _trajectories()
    assert len(rollouts) == 6
    for r in rollouts:
        assert r.finished and r.turns == 3 and r.env_reward == pytest.approx(0.75)
        # the numbers of the last step's info, and the time spent in the environment's calls
        assert r.env_info["left"] == 0 and "note" not in r.env_info
        assert r.env_info["env_seconds"] >= 0
        assert len(r.response_mask) == len(r.response_tokens) == len(r.logprobs)
        runs = _segments(r)
        if runs[-1][0] == 0:  # the last turn, cut by its budget, closed as its stop token would
            assert runs.pop() == (0, [10]) and len(runs[-1][1]) == 6 and runs[-1][1][-1] != 10
        assert [bit for bit, _ in runs] == [1, 0, 1, 0, 1], runs
        for k, (_, model_tokens) in enumerate(runs[::2]):
            ended = model_tokens[-1] == 10
            assert ended or len(model_tokens) == 6  # its stop token, or its turn budget
            if k < 2:  # the environment's turn: a newline if the budget cut the model's turn
                left = 3 - (k + 1)
                said = bytes(model_tokens[:len(model_tokens) - int(ended)])
                expected = ([] if ended else [10]) + list(
                    f"[{len(said.decode(errors='replace'))} bytes, {left} left]\n".encode())
                assert runs[2 * k + 1][1] == expected
        assert all(lp == 0.0 for lp, bit in zip(r.logprobs, r.response_mask) if not bit)


def test_the_model_tokens_log_probs_are_a_fresh_forward_over_the_whole_trajectory():
    ctx, rollouts = _trajectories()
    model = whole_model(ctx, {**MODEL, "stages": 1})
    for r in rollouts:
        ids = torch.tensor([r.prompt_tokens + r.response_tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0].to(torch.float64), -1)
        start = len(r.prompt_tokens)
        for k, (token, bit) in enumerate(zip(r.response_tokens, r.response_mask)):
            if bit:
                assert r.logprobs[k] == pytest.approx(float(logp[start + k - 1, token]),
                                                      abs=1e-9)


def test_releasing_the_cache_row_while_the_environment_steps_samples_the_same():
    _, kept = _trajectories()
    _, released = _trajectories(keep_cache=False)
    key = lambda r: (r.prompt_id, r.sample)  # noqa: E731
    assert [(r.response_tokens, r.response_mask) for r in sorted(kept, key=key)] == \
        [(r.response_tokens, r.response_mask) for r in sorted(released, key=key)]
    for a, b in zip(sorted(kept, key=key), sorted(released, key=key)):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)


def test_turn_and_token_budgets_cut_a_trajectory_unfinished():
    _, by_turns = _trajectories(max_turns=2)
    assert all(r.turns == 2 and not r.finished and r.env_reward == pytest.approx(0.5)
               for r in by_turns)
    # no observation after the last turn (only its closing newline, when its budget cut it)
    assert all(_segments(r)[-1] in ((0, [10]),) or _segments(r)[-1][0] == 1 for r in by_turns)
    _, by_tokens = _trajectories(max_total_tokens=20)
    assert all(len(r.response_tokens) <= 20 and not r.finished for r in by_tokens)
    one = _trajectories(env_config={"steps": 1})[1]
    assert all(r.finished and r.turns == 1 and _segments(r)[1:] in ([], [(0, [10])])
               for r in one)


def test_an_environment_that_raises_ends_its_trajectory_with_the_reason():
    _, rollouts = _trajectories(environment=f"{HERE}:Raises")
    assert all(not r.finished and r.turns == 1 for r in rollouts)
    assert all("RuntimeError: the tool broke" in r.env_error for r in rollouts)


def test_a_hanging_environment_ends_at_its_timeout_while_the_others_go_on():
    ctx = op_context()
    Hangs.release.clear()
    hanging = gen._generate(ctx, PROMPTS[:1], **{**MODEL, "max_new_tokens": 4, "n": 1,
                                                "environment": f"{HERE}:Hangs",
                                                "env_timeout_s": 0.5})
    others = gen._generate(ctx, PROMPTS[1:], **{**MODEL, "max_new_tokens": 4, "n": 2,
                                               "environment": f"{HERE}:Countdown",
                                               "max_turns": 5})
    started = time.monotonic()
    done = run_until_done(ctx.background, others)
    assert len(done) == 4 and all(r.finished for r in done)
    [cut] = run_until_done(ctx.background, hanging)
    Hangs.release.set()
    assert time.monotonic() - started < 10
    assert not cut.finished and "env_timeout_s" in cut.env_error
    assert cut.env_info["env_seconds"] >= 0.5


@pytest.mark.parametrize(("settings", "words"), [
    ({"environment": "nowhere.at.all:Env"}, "no module 'nowhere'"),
    ({"environment": f"{HERE}"}, "must be 'package.module:Class'"),
    ({"environment": f"{HERE}:PROMPTS"}, "not a class with step"),
])
def test_a_bad_environment_says_what_to_fix(settings, words):
    with pytest.raises(Exception, match=words):
        _trajectories(**settings)


# -- training on trajectories -----------------------------------------------------------------
def _trajectory_experience(mask: list[int], advantages: list[float]):
    from flowkit.ops.records import Experience

    length = len(mask)
    return Experience(prompt_id=0, sample=0, prompt_tokens=[1, 2, 3],
                      response_tokens=[(7 * k) % 50 for k in range(length)],
                      logprobs=[-1.0 - 0.1 * k for k in range(length)], reward=1.0,
                      response_mask=mask, advantages=advantages)


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_environments_tokens_train_nothing_and_count_in_no_mean(policy_loss, agg):
    """The loss and its gradient ignore what stands at the environment's positions (their
    advantages, the logits there), and its token count is the model's tokens."""
    from executors.torch.train.rl_loss import RLLoss, RLSettings

    mask = [1, 1, 0, 0, 0, 1, 1, 1, 0, 1]
    settings = RLSettings.from_config("grpo", {"kl_coef": 0.0, "policy_loss": policy_loss,
                                               "loss_agg_mode": agg})
    gen_ = torch.Generator().manual_seed(0)
    advantages = torch.randn(len(mask), generator=gen_, dtype=torch.float64).tolist()
    other = [a if bit else a + 5.0 for a, bit in zip(advantages, mask)]
    logits = torch.randn(1, 3 + len(mask) - 1, 50, generator=gen_, dtype=torch.float64)

    def run(advs: list[float], logits: torch.Tensor) -> tuple[float, torch.Tensor, RLLoss]:
        logits = logits.clone().requires_grad_(True)
        loss = RLLoss([_trajectory_experience(mask, advs)], [], settings, torch.device("cpu"))
        total = loss(logits)
        total.backward()
        return float(total.detach()), logits.grad, loss

    value, grad, loss = run(advantages, logits)
    assert loss.tokens == sum(mask)
    context = [3 - 1 + k for k, bit in enumerate(mask) if not bit]  # where each is predicted
    assert grad[0, context].abs().max() == 0
    shuffled = logits.clone()
    shuffled[0, context] = torch.randn(len(context), 50, generator=gen_, dtype=torch.float64)
    assert run(other, shuffled)[0] == pytest.approx(value, abs=1e-12)


def test_a_response_mask_of_the_wrong_length_is_refused_naming_the_sample():
    from executors.torch.train.rl_loss import RLLoss, RLSettings

    bad = attrs.evolve(_trajectory_experience([1, 0, 1], [0.1, 0.2, 0.3]), response_mask=[1, 0])
    with pytest.raises(ValueError, match="response_mask of 2 entries for 3 response tokens"):
        RLLoss([bad], [], RLSettings.from_config("grpo", {"kl_coef": 0.0}), torch.device("cpu"))


def test_every_episode_is_closed_once_its_trajectory_ends():
    Counted.opened.clear(), Counted.closed.clear()
    _, rollouts = _trajectories(environment=f"{HERE}:Counted")
    assert len(Counted.opened) == len(Counted.closed) == len(rollouts) == 6
    assert len({id(env) for env in Counted.closed}) == 6


@pytest.mark.parametrize("keep_cache", [True, False])
@pytest.mark.parametrize("steps", [2, 5, 9, 14])
def test_an_aborted_trajectory_continues_where_it_stopped(steps, keep_cache):
    """[Note: parked trajectories] An abort after `steps` engine steps (samples mid-turn,
    waiting for their environment, some done): the interrupted Rollouts given to a new request
    continue with their parked episodes and end as the uninterrupted run's, token for token;
    every episode is closed once, at its end."""
    settings = {**MODEL, "max_new_tokens": 6, "temperature": 1.0, "sample_seed": 3, "n": 2,
                "environment": f"{HERE}:Counted", "max_turns": 5, "keep_cache": keep_cache}
    _, whole = _trajectories(**settings)
    Counted.opened.clear(), Counted.closed.clear()
    ctx, engine, first = generating(PROMPTS, **settings)
    for _ in range(steps):
        engine.step()
    time.sleep(0.05)  # some environment calls answered, maybe not taken yet
    engine.abort()
    cut = [r for r in first if r.interrupted]
    assert len(first) == 6 and cut and len(engine.parked) == len(cut)
    assert len(Counted.closed) == 6 - len(cut)  # the finished ones closed, the cut parked
    rest = run_until_done(ctx.background, gen._generate(ctx, cut, **settings))
    ended = {(r.prompt_id, r.sample): r for r in first if not r.interrupted}
    ended |= {(r.prompt_id, r.sample): r for r in rest}
    for want in whole:
        got = ended[(want.prompt_id, want.sample)]
        assert (got.response_tokens, got.response_mask, got.turns, got.finished) == (
            want.response_tokens, want.response_mask, want.turns, want.finished)
        assert got.env_reward == want.env_reward and got.logprobs == pytest.approx(
            want.logprobs, abs=1e-9)
    assert not engine.parked and len(Counted.closed) == len(Counted.opened) == 6
    assert len({id(env) for env in Counted.closed}) == 6


def test_a_trajectory_whose_episode_is_elsewhere_starts_again_from_its_prompt():
    """Its sampled tokens are dropped, not continued without the environment's state; drawn
    again with the same seeds, it is the same trajectory."""
    settings = {**MODEL, "max_new_tokens": 6, "temperature": 1.0, "sample_seed": 3, "n": 1,
                "environment": f"{HERE}:Counted", "max_turns": 5}
    _, whole = _trajectories(prompts=PROMPTS[:1], **settings)
    ctx = op_context()
    interrupted = attrs.evolve(whole[0], interrupted=True, finished=False,
                               response_tokens=whole[0].response_tokens[:4],
                               response_mask=whole[0].response_mask[:4],
                               logprobs=whole[0].logprobs[:4], versions=whole[0].versions[:4])
    [again] = run_until_done(ctx.background, gen._generate(ctx, [interrupted], **settings))
    assert (again.response_tokens, again.turns) == (whole[0].response_tokens, whole[0].turns)


class Saved(Countdown):
    """Countdown that saves its state, and counts its resets and restores."""

    resets, restores = [], []

    def reset(self, prompt: str, answer: str | None = None) -> None:
        Saved.resets.append(prompt)

    def state(self):
        return {"steps": self.steps, "actions": list(self.actions)}

    def restore(self, state) -> None:
        Saved.restores.append(state)
        self.steps, self.actions = state["steps"], list(state["actions"])


class Unsaveable(Countdown):
    def state(self):
        return {"env": object()}


@pytest.mark.parametrize("steps", [3, 7, 12])
def test_an_aborted_trajectory_goes_on_elsewhere_from_its_saved_state(steps):
    """[Note: parked trajectories] An environment that saves its state: an interrupted
    trajectory cut between its environment's steps carries it (Rollout.env_state, plain data),
    and an engine that never saw it (another executor, a resumed run) restores the episode
    and goes on where it stopped, without a reset: it ends as the uninterrupted run's."""
    settings = {**MODEL, "max_new_tokens": 6, "temperature": 1.0, "sample_seed": 3, "n": 2,
                "environment": f"{HERE}:Saved", "max_turns": 5}
    _, whole = _trajectories(**settings)
    ctx, engine, first = generating(PROMPTS, **settings)
    for _ in range(steps):
        engine.step()
    engine.abort()
    cut = [r for r in first if r.interrupted]
    saved = [r for r in cut if r.env_state is not None]
    assert saved, "some trajectory was cut between its environment's steps"
    assert json.loads(json.dumps([r.env_state for r in saved])) == [r.env_state for r in saved]
    Saved.resets.clear(), Saved.restores.clear()
    elsewhere = op_context("exec1")
    rest = run_until_done(elsewhere.background, gen._generate(elsewhere, cut, **settings))
    assert len(Saved.restores) == len(saved) and len(Saved.resets) == len(cut) - len(saved)
    ended = {(r.prompt_id, r.sample): r for r in first if not r.interrupted}
    ended |= {(r.prompt_id, r.sample): r for r in rest}
    for want in whole:
        got = ended[(want.prompt_id, want.sample)]
        assert (got.response_tokens, got.response_mask, got.turns, got.finished) == (
            want.response_tokens, want.response_mask, want.turns, want.finished)
        assert got.env_reward == want.env_reward and got.env_info["left"] == \
            want.env_info["left"]
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-9)


@pytest.mark.parametrize("env_state", [
    {"env": {}, "reward": "lots", "seconds": 0, "info": {}, "turns": 1, "turn_start": 0},
    {"env": {}, "reward": 0, "seconds": 0, "info": {}, "turns": 99, "turn_start": 0},
    {"env": {}, "reward": 0, "seconds": 0, "info": {}, "turns": 1, "turn_start": 10_000},
    {"env": {"steps": "three"}, "reward": 0, "seconds": 0, "info": {}, "turns": 1,
     "turn_start": 0},
    ["not", "a", "dict"],
])
def test_a_bad_saved_state_starts_the_trajectory_again(env_state):
    """A Rollout's env_state comes from a peer or a checkpoint file: one that is not what the
    engine writes, or that restore refuses, is dropped and the trajectory drawn again."""
    settings = {**MODEL, "max_new_tokens": 6, "temperature": 1.0, "sample_seed": 3, "n": 1,
                "environment": f"{HERE}:Saved", "max_turns": 5}
    _, whole = _trajectories(prompts=PROMPTS[:1], **settings)
    interrupted = attrs.evolve(whole[0], interrupted=True, finished=False, env_state=env_state,
                               response_tokens=whole[0].response_tokens[:4],
                               response_mask=whole[0].response_mask[:4],
                               logprobs=whole[0].logprobs[:4], versions=whole[0].versions[:4])
    ctx = op_context()
    [again] = run_until_done(ctx.background, gen._generate(ctx, [interrupted], **settings))
    assert (again.response_tokens, again.turns) == (whole[0].response_tokens, whole[0].turns)


def test_a_state_that_is_not_plain_data_is_not_saved():
    settings = {**MODEL, "max_new_tokens": 6, "temperature": 1.0, "sample_seed": 3, "n": 2,
                "environment": f"{HERE}:Unsaveable", "max_turns": 5}
    ctx, engine, first = generating(PROMPTS, **settings)
    for _ in range(7):
        engine.step()
    engine.abort()
    assert [r for r in first if r.interrupted]
    assert all(r.env_state is None for r in first)


class SlowJudge(Environment):
    """Ends the episode after its first turn, once `release` is set; reward 1."""

    release = threading.Event()

    def step(self, action: str) -> EnvStep:
        SlowJudge.release.wait(30)
        return EnvStep(reward=1.0, done=True)


def test_a_trajectory_cut_at_the_context_while_its_environment_answers_still_ends():
    """A turn cut by its budget one token short of the context gets its closing token: the
    prefix fills the context while the environment answers. Cut then, the trajectory is
    carried with a full prefix; given back, it takes its environment's answer (here: done,
    reward 1) instead of failing the request for want of room."""
    prompt = PROMPTS[0]
    budget = GPT["block_size"] - len(prompt.tokens) - 1
    settings = {**MODEL, "max_new_tokens": budget, "temperature": 1.0, "sample_seed": 3,
                "n": 1, "eos": None, "environment": f"{HERE}:SlowJudge", "max_turns": 2}
    SlowJudge.release.clear()
    ctx, engine, first = generating([prompt], **settings)
    deadline = time.monotonic() + 20
    while not any(seq.episode.turns == 1 for seq, *_ in engine.env_calls.pending.values()) \
            and time.monotonic() < deadline:  # its first turn done, the judge thinking
        engine.step()
    engine.abort()
    [cut] = first
    assert cut.interrupted and len(cut.prompt_tokens) + len(cut.response_tokens) == \
        GPT["block_size"]
    SlowJudge.release.set()
    [done] = run_until_done(ctx.background, gen._generate(ctx, [cut], **settings))
    assert done.finished and done.env_reward == 1.0 and done.response_tokens == \
        cut.response_tokens
