"""Inference ops on rollouts: log-probabilities equal the sampler's, values and rewards from a
value-head GPT read at the documented positions."""

from __future__ import annotations

import pytest
import torch

from executors.optable import OpTable
from executors.torch.rollout import generate as gen
from executors.torch.rollout import infer, sampling
from flowkit.ops.records import Prompt, Rollout, TokenScores
from flowkit.runtime import RemoteError
from tests.harness import critic_of, gpt_spec, op_context, tiny_gpt

POLICY = gpt_spec("policy", tiny_gpt(vocab_size=32, block_size=24, n_embd=16), seed=1)
CRITIC = critic_of(POLICY)
PROMPTS = [Prompt(prompt_id=i, tokens=[(5 * i + j) % 32 for j in range(length)])
           for i, length in enumerate([2, 6, 1, 4])]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_generation_logprobs_equal_the_recomputed_ones(temperature, top_p):
    ctx = op_context()
    rollouts = gen.generate_now(ctx, PROMPTS, **POLICY, n=2, max_new_tokens=7, eos=3,
                             temperature=temperature, top_p=top_p, max_batch=3)
    scores = infer._logprobs(ctx, rollouts, **POLICY, temperature=temperature, max_batch=5)
    assert len(scores) == len(rollouts)
    for r, s in zip(rollouts, scores):
        assert (s.prompt_id, s.sample) == (r.prompt_id, r.sample)
        assert s.values == pytest.approx(r.logprobs, rel=0, abs=1e-9)


def test_one_rollout_in_one_score_out():
    ctx = op_context()
    r = Rollout(prompt_id=4, sample=1, prompt_tokens=[1, 2, 3], response_tokens=[4, 5],
                logprobs=[0.0, 0.0])
    out = infer._logprobs(ctx, r, **POLICY)
    assert isinstance(out, TokenScores) and len(out.values) == 2 and out.sample == 1


def test_values_and_reward_read_the_documented_positions():
    ctx = op_context()
    rs = [Rollout(prompt_id=i, sample=0, prompt_tokens=list(range(1, 2 + i)),
                  response_tokens=[7, 8, 9][: 1 + i], logprobs=[]) for i in range(3)]
    values = infer._values(ctx, rs, **CRITIC, max_batch=2)
    rewards = infer._reward_model(ctx, rs, **CRITIC)
    critic = gen.whole_model(ctx, CRITIC)
    with torch.no_grad():
        for r, v, reward in zip(rs, values, rewards):
            seq = torch.tensor([r.prompt_tokens + r.response_tokens])
            alone = critic(seq)[0]  # (T,) values, no padding
            p = len(r.prompt_tokens)
            assert v.values == pytest.approx(alone[p - 1 : -1].tolist(), abs=1e-12)
            assert reward == pytest.approx(float(alone[-1]), abs=1e-12)
    assert isinstance(infer._reward_model(ctx, rs[0], **CRITIC), float)


def test_value_ops_need_a_value_head_and_register_adds_the_ops():
    r = Rollout(prompt_id=0, sample=0, prompt_tokens=[1], response_tokens=[2], logprobs=[0.0])
    with pytest.raises(ValueError, match=r"values needs a critic whose forward\(tokens\) returns "
                       r"values \(B, T\), but this model returned shape \(\d+, \d+, 32\): logits"
                       r".*value_head=True"):
        infer._values(op_context(), r, **POLICY)
    with pytest.raises(ValueError, match=r"reward_model needs a critic"):
        infer._reward_model(op_context(), r, **POLICY)
    table = OpTable()
    infer.register(table)
    assert {"logprobs", "values", "reward_model"} <= set(table.names())


def test_a_critic_cannot_give_logprobs_nor_generate():
    r = Rollout(prompt_id=0, sample=0, prompt_tokens=[1], response_tokens=[2], logprobs=[0.0])
    with pytest.raises(ValueError, match=r"logprobs needs a language model .* returned shape "
                       r"\(\d+, \d+\): values, so a critic"):
        infer._logprobs(op_context(), r, **CRITIC)
    with pytest.raises(ValueError, match=r"generate needs a language model"):
        gen.generate_now(op_context(), PROMPTS, **CRITIC)


def test_a_rollout_past_the_context_is_named():
    rs = [Rollout(prompt_id=i, sample=1, prompt_tokens=[1] * 20, response_tokens=[2] * (4 + i),
                  logprobs=[]) for i in range(3)]  # 24, 25, 26 tokens; the context is 24
    with pytest.raises(ValueError, match=r"rollout \(prompt 1, sample 1\) runs 25 tokens, past "
                       r"the model's context_length 24 \(and 1 more\)"):
        infer._reward_model(op_context(), rs, **CRITIC)


# -- batched forms [Note: batched forms in executors/optable.py] -------------------------------
def _ragged_rollouts(count: int = 7) -> list[Rollout]:
    return [Rollout(prompt_id=i, sample=i % 2, prompt_tokens=[(3 * i + j) % 32 for j in
                                                              range(1 + i % 4)],
                    response_tokens=[(7 * i + j) % 32 for j in range(1 + (5 * i) % 6)],
                    logprobs=[]) for i in range(count)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op", ["logprobs", "values", "reward_model"])
def test_a_batched_task_of_rollouts_scores_each_exactly_as_alone(op, dtype):
    # [Note: batch-invariant forwards]: the same bits whichever rollouts share a forward
    from executors.tasks import Task, run_items
    from flowkit.wire.task import TaskSpec

    spec = {**(POLICY if op == "logprobs" else CRITIC), "dtype": dtype, "max_batch": 3}
    table = OpTable()
    infer.register(table)
    rollouts = _ragged_rollouts(9)
    ctx = op_context()
    alone = [table.get(op)(ctx, r, **spec) for r in rollouts]
    for batch in (rollouts, rollouts[::-1], rollouts[2:7]):
        task = Task(TaskSpec(op, spec, outputs=list(range(len(batch))), items=len(batch),
                             per_item=(0,)), table.get(op))
        together = run_items(task, ctx, [batch], table.batched(op))
        assert together == [alone[rollouts.index(r)] for r in batch]


def test_forwards_have_shapes_fixed_by_their_rows_own_lengths():
    rollouts = _ragged_rollouts(12) + [Rollout(prompt_id=99, sample=0, prompt_tokens=[1] * 15,
                                               response_tokens=[2] * 9, logprobs=[])]
    forwards = list(infer._forwards(rollouts, (4, 48), context=24))
    assert sorted(i for indices, _ in forwards for i in indices) == list(range(13))
    for indices, (rows, width) in forwards:
        lengths = [len(rollouts[i].prompt_tokens) + len(rollouts[i].response_tokens) - 1
                   for i in indices]
        assert len(indices) <= rows == min(4, 48 // width)
        assert all(infer._width(n) == width or width == 24 for n in lengths)
    assert forwards[0] == ([0, 1, 2], (3, 16))  # 3 rows of 16: 48 tokens
    assert [shape for indices, shape in forwards if 12 in indices] == [(2, 24)]  # the context


def test_a_forward_takes_256_tokens_on_a_cpu_unless_told():
    """[Note: batch-invariant forwards]: a CPU's forward costs in proportion to its rows, so a
    lone rollout's fixed shape is kept small there; a GPU's takes 4096 tokens."""
    model = torch.nn.Linear(2, 2)
    assert infer._limits(model, (32, None)) == (32, 256)
    assert infer._limits(model, (32, 4096)) == (32, 4096)
    shapes = {shape for _, shape in infer._forwards(_ragged_rollouts(12),
                                                    infer._limits(model, (32, None)), None)}
    assert shapes and all(rows == 256 // width for rows, width in shapes)


def test_a_rollouts_width_pads_at_most_a_third_of_its_tokens():
    # [Note: batch-invariant forwards]: powers of two and one and a half times them
    widths = {infer._width(n) for n in range(1, 4097)}
    assert sorted(widths)[:6] == [16, 24, 32, 48, 64, 96] and len(widths) == 17  # 16 .. 4096
    for n in range(16, 4097):
        width = infer._width(n)
        assert n <= width and 3 * n >= 2 * width, n


def test_logprobs_in_chunks_of_positions_are_the_same_bits_and_a_float32_models_close():
    """[Note: chunked log-probabilities in executors/torch/rollout/sampling.py]: a chunk of a
    few positions gives what one of the whole forward gives; a float32 model's log-softmax is
    float32's, within its rounding of the float64 one."""
    ctx = op_context()
    rollouts = _ragged_rollouts(6)
    whole = infer._logprobs(ctx, rollouts, **POLICY, temperature=0.7)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "_CHUNK_ELEMENTS", 3 * 32)  # three positions of 32 tokens
        chunked = infer._logprobs(ctx, rollouts, **POLICY, temperature=0.7)
    assert chunked == whole
    single = {**POLICY, "model": "policy32", "dtype": "float32"}
    low = infer._logprobs(ctx, rollouts, **single, temperature=0.7)
    model = gen.whole_model(ctx, single)
    for r, scores in zip(rollouts, low):
        seq = torch.tensor([r.prompt_tokens + r.response_tokens])
        with torch.no_grad():
            logits = model(seq)[0].to(torch.float64) / 0.7
        logp = torch.log_softmax(logits, -1)
        n = len(r.prompt_tokens)
        want = [float(logp[n - 1 + i, t]) for i, t in enumerate(r.response_tokens)]
        assert scores.values == pytest.approx(want, abs=1e-5)


def test_scoring_tasks_waiting_together_run_as_one_call_with_the_same_scores(pool):
    """[Note: merged tasks] in executors/tasks.py: batched logprobs tasks queued behind a slow
    op run as one call, each answered with what it gets alone, bit for bit."""
    ctl, (executor,) = pool.cluster(1, kind="torch")
    rollouts = [Rollout(prompt_id=i, sample=0, prompt_tokens=[(3 * i + j) % 32 for j in range(5)],
                        response_tokens=[(i + j) % 32 for j in range(1 + i % 4)],
                        logprobs=[0.0] * (1 + i % 4)) for i in range(9)]
    chunks = [rollouts[:3], rollouts[3:5], rollouts[5:]]
    slow = {"target": "tests.runtime.batch_ops:slow_on_last", "ports": ["x"]}
    with ctl.batch():  # all three wait behind the half-second op
        ctl.submit("python", 3, config=slow, executor=executor.id)
        together = [ctl.submit_items("logprobs", chunk, per_item=[0], config=POLICY,
                                     executor=executor.id) for chunk in chunks]
    alone = []
    for chunk in chunks:  # one at a time: nothing to merge with
        futures = ctl.submit_items("logprobs", chunk, per_item=[0], config=POLICY,
                                   executor=executor.id)
        alone.append([f.result(timeout=60).values for f in futures])
    assert [[f.result(timeout=60).values for f in fs] for fs in together] == alone
    assert len({fs[-1].timing for fs in together}) == 1  # one call: one start, one end


def test_a_merged_call_that_fails_fails_only_the_task_whose_item_is_bad(pool):
    ctl, (executor,) = pool.cluster(1, kind="torch")
    good = Rollout(prompt_id=0, sample=0, prompt_tokens=[1, 2], response_tokens=[3],
                   logprobs=[0.0])
    too_long = Rollout(prompt_id=1, sample=0, prompt_tokens=[1] * 30, response_tokens=[2],
                       logprobs=[0.0])  # past the model's context of 24
    slow = {"target": "tests.runtime.batch_ops:slow_on_last", "ports": ["x"]}
    with ctl.batch():
        ctl.submit("python", 3, config=slow, executor=executor.id)
        first = ctl.submit_items("logprobs", [good, good], per_item=[0], config=POLICY,
                                 executor=executor.id)
        second = ctl.submit_items("logprobs", [good, too_long], per_item=[0], config=POLICY,
                                  executor=executor.id)
    assert [len(f.result(timeout=60).values) for f in first] == [1, 1]
    with pytest.raises(RemoteError, match="past the model's context_length 24"):
        second[0].result(timeout=60)
