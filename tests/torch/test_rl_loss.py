"""RL losses on the torch pipeline stages: F/B/W of microbatches of Experiences through the
stage ops give the unsplit GPT's gradient of verl's token-mean losses (tests/rl/reference_algos.py)
once divided by the step's normalizer, whatever the microbatches, padding or stage split.

The op functions run here in one process on one OpContext, as one executor holding every stage
would run them; the last test runs them on torch executor processes through the runtime's
pipeline_config and submit_optimizer_step (tests/runner/test_training_config.py has the
configs alone).
"""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from dataflows.rl.trees import shared_prefix_weights
from executors.optable import OpContext
from executors.torch.errors import StageError
from executors.torch.models.built import held_model
from executors.torch.models.gpt import GPT
from executors.torch.train import pipeline_ops
from executors.torch.train.held_stage import held_stage
from flowkit.ops.records import Experience, TokenScores, mean_values
from tests.harness import (
    critic_of,
    gpt_spec,
    op_context,
    seeded_gpt,
    tiny_gpt,
)
from tests.rl.reference_algos import kl_penalty, ppo_policy_loss, value_loss
from tests.torch.helpers import padded_batch, response_logprobs, run_microbatches

POLICY = gpt_spec("policy", tiny_gpt(), seed=5)
CRITIC = critic_of(POLICY)
TIGHT = 1e-10
# A clip bound the gradients exceed, and an AdamW eps so large that its step is about lr times
# the gradient: a wrongly scaled gradient moves the parameters visibly (Adam's own step is
# nearly blind to the gradient's scale).
STEP = {"lr": 1e-2, "clip_grad_norm": 0.05, "eps": 1.0}
NO_CLIP = {**STEP, "clip_grad_norm": 100.0}  # clipping undoes a wrong scale: test without it


def _whole(spec: dict) -> GPT:
    """The unsplit model with the weights every holder builds (same seed, then the dtype)."""
    return seeded_gpt(spec["model_config"], seed=spec["seed"], dtype=torch.float64)


# -- experiences ------------------------------------------------------------------------------
def _experiences(count: int, seed: int, *, max_response: int = 8) -> list[Experience]:
    """Random samples of different prompt and response lengths (one with an empty response).
    Their logprobs are filled in by `_near_current` so that some ratios clip and some do not."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 6))]
        length = 0 if i == 1 else rng.randint(1, max_response)
        response = [rng.randrange(64) for _ in range(length)]
        out.append(Experience(
            prompt_id=seed * 100 + i, sample=i % 3, prompt_tokens=prompt,
            response_tokens=response, logprobs=[0.0] * length, reward=rng.random(),
            advantages=[rng.gauss(0.0, 1.0) for _ in range(length)],
            returns=[rng.gauss(0.0, 1.0) for _ in range(length)],
            values=[rng.gauss(0.0, 0.3) for _ in range(length)]))
    return out


def _current_logprobs(model: GPT, exp: Experience, temperature: float = 1.0) -> list[float]:
    """The model's log-probability of each response token, alone in its batch."""
    seq = torch.tensor([exp.prompt_tokens + exp.response_tokens])
    with torch.no_grad():
        logits = model(seq[:, :-1])[0]
    p = len(exp.prompt_tokens)
    logp = torch.log_softmax(logits[p - 1:] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(exp.response_tokens)[:, None]).squeeze(-1).tolist()


def _near_current(exps: list[Experience], model: GPT, *, noise: float, seed: int,
                  field: str = "logprobs") -> list[Experience]:
    """Experiences whose `field` is the model's current log-probs plus Gaussian noise."""
    rng = random.Random(seed)
    out = []
    for e in exps:
        values = [v + rng.gauss(0.0, noise) for v in _current_logprobs(model, e)]
        out.append(attrs.evolve(e, **{field: values}))
    return out


def _ref_scores(exps: list[Experience], model: GPT, *, seed: int) -> list[TokenScores]:
    noisy = _near_current(exps, model, noise=0.3, seed=seed, field="ref_logprobs")
    return [TokenScores(prompt_id=e.prompt_id, sample=e.sample, values=e.ref_logprobs)
            for e in noisy]


# -- running the stage ops --------------------------------------------------------------------
def _stage_grads(ctx: OpContext, spec: dict, stages: int) -> dict[tuple[int, str], torch.Tensor]:
    """Each stage's parameter gradients, the tied copies' shares summed into both."""
    modules = [held_stage(ctx, {**spec, "stage": s, "stages": stages}).module
               for s in range(stages)]
    grads = {(s, n): p.grad.clone() for s, module in enumerate(modules)
             for n, p in module.named_parameters() if p.grad is not None}
    if stages > 1 and not spec["model_config"].get("value_head"):
        total = grads[(0, "wte.weight")] + grads[(stages - 1, "lm_head.weight")]
        grads[(0, "wte.weight")] = grads[(stages - 1, "lm_head.weight")] = total
    return grads


def _reference_grads(model: GPT, stages: int) -> dict[tuple[int, str], torch.Tensor]:
    """The unsplit model's gradients under the stages' parameter names."""
    out = {}
    for s, module in enumerate(model.split(stages)):
        for name, p in module.named_parameters():
            tied = name == "lm_head.weight" and stages > 1 and not model.config.value_head
            grad = model.lm_head.weight.grad if tied else p.grad
            out[(s, name)] = grad
    return out


def _assert_grads_equal(got: dict, want: dict, *, scale: float = 1.0) -> None:
    assert set(got) == set(want)
    for key, g in got.items():
        diff = (g / scale - want[key]).abs().max().item()
        assert diff < TIGHT, f"stage {key[0]} {key[1]}: gradient differs by {diff:.3g}"


# -- the plain reference: verl's losses on the unsplit model over the whole padded batch ------
def _plain_policy_loss(model: GPT, exps: list[Experience], *, kl_coef: float = 0.0,
                       kl_kind: str = "k3", temperature: float = 1.0) -> torch.Tensor:
    fields = ["logprobs", "advantages"] + (["ref_logprobs"] if kl_coef else [])
    ids, positions, tokens, mask, f = padded_batch(exps, fields)
    logp = response_logprobs(model, ids, positions, tokens, temperature)
    loss = ppo_policy_loss(f["logprobs"], logp, f["advantages"], mask, clip_ratio=0.2,
                           clip_ratio_c=3.0, agg="token-mean")
    if kl_coef:
        kl = kl_penalty(logp, f["ref_logprobs"], kl_kind)
        loss = loss + kl_coef * (kl * mask).sum() / mask.sum()
    return loss


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss, kl_coef, use_ref_input, temperature", [
    ("ppo", 0.0, False, 1.0),
    ("grpo", 0.1, True, 1.0),  # reference log-probs from the ref_logprobs input
    ("grpo", 0.1, False, 0.7),  # ... from Experience.ref_logprobs, at a sampling temperature
])
def test_pipeline_gradients_equal_the_unsplit_models_token_mean_loss(loss, kl_coef,
                                                                     use_ref_input, temperature):
    model = _whole(POLICY)
    exps = _near_current(_experiences(7, seed=1), model, noise=0.15, seed=2)
    refs = _ref_scores(exps, model, seed=3)
    with_refs = [attrs.evolve(e, ref_logprobs=r.values) for e, r in zip(exps, refs)]
    if not use_ref_input:
        exps = with_refs
    cuts = [exps[:2], exps[2:3], exps[3:]]
    data = [(cut, refs[i: i + len(cut)]) if use_ref_input else (cut,)
            for cut, i in zip(cuts, (0, 2, 3))]
    ctx = op_context()
    stats = run_microbatches(ctx, POLICY, data, stages=2, loss=loss, kl_coef=kl_coef,
                              temperature=temperature)
    normalizer = sum(s.normalizer for s in stats)
    tokens = sum(len(e.response_tokens) for e in exps)
    assert normalizer == tokens == sum(s.tokens for s in stats)

    plain = _plain_policy_loss(model, with_refs, kl_coef=kl_coef, temperature=temperature)
    plain.backward()
    _assert_grads_equal(_stage_grads(ctx, POLICY, 2), _reference_grads(model, 2),
                        scale=normalizer)
    reported = sum(s.loss * s.tokens for s in stats) / tokens
    assert reported == pytest.approx(plain.item(), abs=TIGHT)


def test_at_ratio_one_without_kl_the_loss_is_minus_the_mean_advantage():
    model = _whole(POLICY)
    exps = _near_current(_experiences(4, seed=7), model, noise=0.0, seed=0)
    stats = run_microbatches(op_context(), POLICY, [(exps,)], stages=2, loss="grpo", kl_coef=0.0)
    advantages = [a for e in exps for a in e.advantages]
    assert stats[0].loss == pytest.approx(-sum(advantages) / len(advantages), abs=1e-12)


def test_a_trees_shared_prefix_trains_once_on_the_mean_advantage_of_its_leaves():
    """[Note: tree rollouts' shared prefix in dataflows/rl/trees.py]: two leaves that share 3
    response tokens, each weighing them 1/2, train on policy (loss, normalizer, gradients) as
    the prefix once on their mean advantage and each leaf's own tokens on its own."""
    model = _whole(POLICY)
    prefix = [5, 9, 2]
    first = Experience(prompt_id=1, sample=0, prompt_tokens=[3, 4], reward=1.0,
                       response_tokens=prefix + [7, 1, 8], logprobs=[0.0] * 6,
                       advantages=[0.8] * 6)
    second = Experience(prompt_id=1, sample=1, prompt_tokens=[3, 4], reward=0.0,
                        response_tokens=prefix + [6, 6], logprobs=[0.0] * 5,
                        advantages=[-0.4] * 5, branch_of=0, shared_tokens=3)
    weights = shared_prefix_weights([first, second], "once")
    weighted = [attrs.evolve(e, token_weights=weights[(1, e.sample)]) for e in (first, second)]
    once = [attrs.evolve(first, advantages=[0.2] * 3 + [0.8] * 3),
            attrs.evolve(second, response_mask=[0] * 3 + [1] * 2)]  # its prefix: context only
    results = []
    for exps in (weighted, once):
        ctx = op_context()
        (stats,) = run_microbatches(ctx, POLICY, [(_near_current(exps, model, noise=0.0,
                                                                  seed=0),)],
                                    stages=2, loss="grpo", kl_coef=0.0)
        results.append((stats, _stage_grads(ctx, POLICY, 2)))
    (got, got_grads), (want, want_grads) = results
    assert got.normalizer == want.normalizer == 3 + 3 + 2  # the tokens generated
    assert got.loss == pytest.approx(want.loss, abs=TIGHT)
    _assert_grads_equal(got_grads, want_grads)


@pytest.mark.parametrize("weights, agg, error", [
    ([0.5, 1.0], None, "token_weights of 2 entries for 3 response tokens"),
    ([0.5, 0.0, 1.0], None, "one float in (0, 1] each"),
    ([0.5, 1.0, 1.0], "seq-mean-token-mean", "which seq-mean-token-mean's mean"),
])
def test_bad_token_weights_are_refused_naming_the_sample(weights, agg, error):
    exp = Experience(prompt_id=7, sample=2, prompt_tokens=[1], response_tokens=[2, 3, 4],
                     logprobs=[0.0] * 3, reward=0.0, advantages=[1.0] * 3,
                     token_weights=weights)
    config = {"loss_agg_mode": agg} if agg else {}
    with pytest.raises(ValueError, match="prompt_id=7 sample=2") as raised:
        run_microbatches(op_context(), POLICY, [([exp],)], stages=1, loss="grpo",
                         kl_coef=0.0, **config)
    assert error in str(raised.value)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_longer_sample_in_the_microbatch_leaves_a_samples_contribution_unchanged(stages):
    model = _whole(POLICY)
    short, longer = _near_current(_experiences(2, seed=11, max_response=3), model, noise=0.2,
                                  seed=1)
    longer = attrs.evolve(longer, prompt_tokens=longer.prompt_tokens + [1] * 9,
                          response_tokens=[5] * 12, logprobs=[-4.0] * 12,
                          advantages=[0.5] * 12)
    sums, grads = [], []
    for mb in ([short], [longer], [short, longer]):
        ctx = op_context()
        (s,) = run_microbatches(ctx, POLICY, [(mb,)], stages=stages, loss="ppo")
        sums.append(s.loss * s.normalizer)
        grads.append(_stage_grads(ctx, POLICY, stages))
    assert sums[2] == pytest.approx(sums[0] + sums[1], abs=TIGHT)
    _assert_grads_equal(grads[2], {k: grads[0][k] + grads[1][k] for k in grads[2]})


def _one_step(spec: dict, data: list[tuple], *, stages: int, hparams: dict = STEP,
              **loss_config) -> tuple:
    """F/B/W of the microbatches, then grad_stats and optimizer_step as the runtime submits
    them (every stage reads the microbatches' stats); the parameters and the step's report."""
    ctx = op_context()
    stats = run_microbatches(ctx, spec, data, stages=stages, **loss_config)
    step = {**spec, "stages": stages, **hparams}
    first, tied = pipeline_ops._grad_stats(ctx, stage=0, **step)
    grad_stats, summed = [first], None
    for s in range(1, stages):
        partner = (tied,) if s == stages - 1 else ()
        stage_stats, summed = pipeline_ops._grad_stats(ctx, *partner, stage=s, **step)
        grad_stats.append(stage_stats)
    for s in range(stages - 1, 0, -1):
        pipeline_ops._optimizer_step(ctx, stats, *grad_stats, stage=s, **step)
    back = (summed,) if stages > 1 else ()
    metrics, _ = pipeline_ops._optimizer_step(ctx, stats, *grad_stats, *back, stage=0,
                                              report=True, **step)
    params = {(s, n): p for s in range(stages)
              for n, p in pipeline_ops._stage_parameters(ctx, stage=s, **step).items()}
    return params, metrics


def test_a_step_labels_the_model_it_trains_with_the_version_it_makes():
    """A fused actor in one stage generates on the model it trains, which no weights load
    labels: the optimizer step does, so the tokens sampled after it record its version (an
    async run's staleness read -1, "the weights the run started from", for them)."""
    ctx = op_context()
    exps = _near_current(_experiences(2, seed=3), _whole(POLICY), noise=0.0, seed=0)
    stats = run_microbatches(ctx, POLICY, [(exps,)], stages=1, loss="grpo", kl_coef=0.0)
    step = {**POLICY, "stages": 1, **STEP}
    grad_stats, _ = pipeline_ops._grad_stats(ctx, stage=0, **step)
    _, version = pipeline_ops._optimizer_step(ctx, stats, grad_stats, stage=0, step=4,
                                              report=True, **step)
    assert held_model(ctx, {**POLICY, "stages": 1}).version == version.version == 5


@pytest.mark.parametrize("spec, loss", [(POLICY, "grpo"), (CRITIC, "value")])
@pytest.mark.parametrize("stages", [1, 2])
def test_one_or_three_microbatches_train_the_same_parameters(spec, loss, stages):
    model = _whole(POLICY)
    exps = _near_current(_experiences(6, seed=21), model, noise=0.1, seed=4)
    refs = _ref_scores(exps, model, seed=5)
    config = {"loss": loss, "kl_coef": 0.05}
    whole, whole_metrics = _one_step(spec, [(exps, refs)], stages=stages, **config)
    cut, cut_metrics = _one_step(spec, [(exps[:1], refs[:1]), (exps[1:4], refs[1:4]),
                                        (exps[4:], refs[4:])], stages=stages, **config)
    for key, p in whole.items():
        diff = (p - cut[key]).abs().max().item()
        assert diff < TIGHT, f"stage {key[0]} {key[1]} differs by {diff:.3g}"
    assert cut_metrics.grad_norm == pytest.approx(whole_metrics.grad_norm, abs=TIGHT)
    assert cut_metrics.grad_norm > 0.05  # the clip bound: clipping ran on the normalized norm
    assert cut_metrics.loss == pytest.approx(whole_metrics.loss, abs=TIGHT)
    assert cut_metrics.tokens == whole_metrics.tokens == sum(len(e.response_tokens)
                                                            for e in exps)


def test_the_value_loss_gradients_equal_verls_clipped_value_loss_on_the_unsplit_critic():
    critic = _whole(CRITIC)
    exps = _experiences(5, seed=31)
    ctx = op_context()
    stats = run_microbatches(ctx, CRITIC, [(exps[:3],), (exps[3:],)], stages=2, loss="value",
                              cliprange_value=0.1)
    ids, positions, _, mask, f = padded_batch(exps, ["values", "returns"])
    predicted = critic(ids).gather(1, positions)  # (B, R)
    plain = value_loss(predicted, f["returns"], f["values"], mask, clip_range=0.1)
    plain.backward()
    normalizer = sum(s.normalizer for s in stats)
    _assert_grads_equal(_stage_grads(ctx, CRITIC, 2), _reference_grads(critic, 2),
                        scale=normalizer)
    reported = sum(s.loss * s.tokens for s in stats) / sum(s.tokens for s in stats)
    assert reported == pytest.approx(plain.item(), abs=TIGHT)


def test_an_empty_microbatch_contributes_nothing():
    ctx = op_context()
    (stats,) = run_microbatches(ctx, POLICY, [([],)], stages=2, loss="grpo")
    assert (stats.loss, stats.tokens, stats.normalizer) == (0.0, 0, 0.0)
    assert all(float(g.abs().max()) == 0.0 for g in _stage_grads(ctx, POLICY, 2).values())


def test_profiling_accepts_an_experience_microbatch_and_leaves_the_generators_as_they_were():
    """A run resumed on a stage count it had not profiled profiles mid-run: its draws (stage
    0's output gradients) must not move what the run draws next."""
    exps = _experiences(3, seed=41)
    for s in range(2):
        before = torch.get_rng_state()
        seconds = pipeline_ops._profile(op_context(), exps, **POLICY, stage=s, stages=2, repeats=1)
        assert set(seconds) == {"F", "B", "W", "BW"} and all(v > 0 for v in seconds.values())
        assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU device check)")
def test_profiling_on_cuda_leaves_its_generator_as_it_was():
    """As on the CPU: the profile's draws on a CUDA stage are forked off (fork_rng with the
    initialized devices), so the run's CUDA generator goes on as if no profile had run."""
    torch.cuda.init()
    ctx = OpContext(name="exec0", device="cuda", tags=())
    before = torch.cuda.get_rng_state()
    pipeline_ops._profile(ctx, _experiences(3, seed=41), **POLICY, stage=0, stages=2, repeats=1)
    assert torch.equal(torch.cuda.get_rng_state(), before)


# -- clear errors ---------------------------------------------------------------------------
def _last_forward(spec: dict, *data, **config):
    """The last stage's F of a two-stage split on the given data inputs."""
    ctx = op_context()
    act = pipeline_ops._forward(ctx, *data, stage=0, stages=2, microbatch=0, **spec, **config)
    return pipeline_ops._forward(ctx, act, *data, stage=1, stages=2, microbatch=0, **spec,
                                 **config)


def test_an_unknown_loss_names_the_known_ones():
    with pytest.raises(StageError, match="'ppo-policy'.*lm, grpo, ppo, value"):
        _last_forward(POLICY, _experiences(2, seed=1), loss="ppo-policy")


def test_the_value_loss_needs_a_value_head():
    with pytest.raises(ValueError, match="value_head"):
        _last_forward(POLICY, _experiences(2, seed=1), loss="value")


def test_a_policy_loss_on_a_value_head_says_so():
    with pytest.raises(ValueError, match="logits"):
        _last_forward(CRITIC, _experiences(2, seed=1), loss="ppo")


def test_grpo_with_a_kl_term_needs_reference_logprobs():
    with pytest.raises(ValueError, match="reference log-prob"):
        _last_forward(POLICY, _experiences(2, seed=1), loss="grpo", kl_coef=0.1)
    # without the KL term none are needed
    stats = _last_forward(POLICY, _experiences(2, seed=1), loss="grpo", kl_coef=0.0)
    assert stats.normalizer > 0


def test_mismatched_lengths_name_the_field_and_the_sample():
    exps = _experiences(3, seed=1)
    short = [exps[0], attrs.evolve(exps[2], advantages=exps[2].advantages[:-1])]
    with pytest.raises(ValueError, match=r"prompt_id=102.*advantages"):
        _last_forward(POLICY, short, loss="ppo")
    refs = [TokenScores(prompt_id=e.prompt_id, sample=e.sample, values=[0.0]) for e in exps]
    with pytest.raises(ValueError, match="ref_logprobs"):
        _last_forward(POLICY, exps, refs, loss="grpo", kl_coef=0.1)
    with pytest.raises(ValueError, match="no reference log-probs for .*prompt_id=100"):
        _last_forward(POLICY, exps, refs[1:], loss="grpo", kl_coef=0.1)


# -- through the runtime: real torch executors, the runtime's configs and optimizer step -----
GRPO_K2 = {"loss": "grpo", "kl_coef": 0.05, "kl_kind": "k2", "clip_ratio": 0.1,
           "temperature": 1.0}


def _executor_step(ctl, infos, name: str, schedule_kind: str, data: list[tuple],
                   loss: dict) -> tuple:
    """One optimizer step of a fresh copy of POLICY (named `name`, so each call starts from
    the built weights) whose microbatches run under `schedule_kind` on the executors: the
    parameters and the step's metrics."""
    from flowkit.ops import LOSS_SPEC
    from flowkit.planner import Costs
    from flowkit.planner.schedules import build_schedule
    from flowkit.runner.pipeline import submit_schedule
    from flowkit.runner.training_tasks import pipeline_config, submit_optimizer_step
    from flowkit.runtime import Gather

    spec = {**POLICY, "model": name, "stages": 2}
    schedule = build_schedule(schedule_kind, devices=2, microbatches=len(data),
                              costs=Costs.uniform(2))
    config_for = pipeline_config(lambda action: {}, spec, [len(d[0]) for d in data],
                                 {**loss, "schedule": schedule_kind}, LOSS_SPEC)
    run = submit_schedule(ctl, schedule, infos, config_for=config_for, lane=name,
                          microbatch_inputs=data)
    quiet, (metrics, _) = submit_optimizer_step(
        ctl, schedule, infos, spec, [Gather(run.losses)], {**NO_CLIP, "step": 0}, lane=name,
        meta={}, outputs=2)
    got_metrics = metrics.result(timeout=60)
    for future in quiet:
        future.result(timeout=60)
    got = {}
    for stage in range(2):
        device = schedule.placement.device_of(stage)
        params = ctl.submit("stage_parameters", config={**spec, "stage": stage},
                            executor=infos[device].id, lane=f"{name}/{device}")
        got.update({(stage, n): p for n, p in params.result(timeout=60).items()})
    return got, got_metrics


def _assert_same_step(got: tuple, want: tuple, what: str) -> None:
    (params, metrics), (want_params, want_metrics) = got, want
    for key, p in want_params.items():
        diff = (p - params[key]).abs().max().item()
        assert diff < TIGHT, f"{what}: stage {key[0]} {key[1]} differs by {diff:.3g}"
    assert metrics.grad_norm == pytest.approx(want_metrics.grad_norm, abs=TIGHT), what
    assert metrics.grad_norm < NO_CLIP["clip_grad_norm"]
    assert metrics.loss == pytest.approx(want_metrics.loss, abs=TIGHT), what


def test_pipelines_on_torch_executors_train_like_one_microbatch_in_one_process(pool):
    """pipeline_config gives the RL loss its knobs and scale 1, submit_optimizer_step gives
    every stage the microbatches' stats (their normalizer): three microbatches on two executor
    processes, under 1F1B and ZB-H1, take the step one microbatch takes here, with GRPO's loss
    and with each recipe's knobs."""
    model = _whole(POLICY)
    exps = _near_current(_experiences(6, seed=51), model, noise=0.1, seed=6)
    exps = [attrs.evolve(e, finished=i % 3 != 0) for i, e in enumerate(exps)]
    refs = _ref_scores(exps, model, seed=7)
    cuts = [(0, 1), (1, 4), (4, 6)]
    data = [(exps[a:b], refs[a:b]) for a, b in cuts]
    losses = {"grpo": GRPO_K2, **{name: {**GRPO_K2, **knobs} if knobs["loss"] == "grpo"
                                  else knobs for name, knobs in RECIPES.items()}}
    with pool.shared(2, kind="torch", tags=("train",)) as (ctl, infos):
        for name, loss in losses.items():
            want = _one_step(POLICY, [(exps, refs)], stages=2, hparams=NO_CLIP, **loss)
            for schedule_kind in ("1f1b", "zb-h1"):
                got = _executor_step(ctl, infos, f"policy-{name}-{schedule_kind}",
                                     schedule_kind, data, loss)
                _assert_same_step(got, want, f"{name} under {schedule_kind}")


# -- the recipes' knobs: each through the stage ops equals verl's loss on the whole batch -----
RECIPES = {
    "dapo": {"loss": "grpo", "kl_coef": 0.05, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
             "entropy_coeff": 0.01, "loss_agg_mode": "token-mean"},
    "seq-mean-token-mean": {"loss": "ppo", "loss_agg_mode": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"loss": "grpo", "kl_coef": 0.05, "mask_truncated": True,
                           "loss_agg_mode": "seq-mean-token-sum"},
    "dr-grpo": {"loss": "ppo", "loss_agg_mode": "seq-mean-token-sum-norm",
                "loss_scale_factor": 10},
    "gspo": {"loss": "ppo", "policy_loss": "gspo", "clip_ratio_low": 3e-4,
             "clip_ratio_high": 4e-4},
    "tis-token": {"loss": "ppo", "rollout_is": "token", "rollout_is_threshold": 1.1},
    "mis-sequence": {"loss": "grpo", "kl_coef": 0.05, "rollout_is": "sequence",
                     "rollout_is_mode": "mask", "rollout_is_threshold": 1.5},
    "tis-geometric": {"loss": "ppo", "rollout_is": "geometric", "rollout_is_threshold": 1.05,
                      "loss_agg_mode": "seq-mean-token-mean"},
}


def _plain_recipe_loss(model: GPT, exps: list[Experience], knobs: dict) -> torch.Tensor:
    """verl's actor loss on the unsplit model over the whole padded batch, from the
    transcriptions of tests/rl/test_recipe_losses.py: pg_loss - entropy_coeff x entropy +
    kl_coef x KL, each aggregated by the mode (Dr. GRPO's as the paper averages it)."""
    from tests.rl.test_algos import _as_ours, _verl_agg_loss, _verl_policy_loss
    from tests.rl.test_recipe_losses import (
        _verl_entropy_from_logits,
        _verl_gspo,
        _verl_rollout_is,
    )

    kl_coef = knobs.get("kl_coef", 0.0)
    fields = ["logprobs", "advantages"] + (["ref_logprobs"] if kl_coef else [])
    ids, positions, tokens, mask, f = padded_batch(exps, fields)
    if knobs.get("mask_truncated"):
        mask = mask * torch.tensor([[float(e.finished)] for e in exps], dtype=mask.dtype)
    logits = model(ids)
    picked = logits.gather(1, positions[..., None].expand(-1, -1, logits.size(-1)))
    logp = torch.log_softmax(picked, dim=-1).gather(-1, tokens[..., None])[..., 0]
    gspo = knobs.get("policy_loss") == "gspo"
    agg = knobs.get("loss_agg_mode") or ("seq-mean-token-mean" if gspo else "token-mean")
    scale = knobs.get("loss_scale_factor")
    old, weights = f["logprobs"], None
    if knobs.get("rollout_is"):  # verl recomputes the old log-probs: these very weights'
        old = logp.detach()
        weights, _ = _verl_rollout_is(old, f["logprobs"], mask, knobs["rollout_is"],
                                      knobs.get("rollout_is_mode", "truncate"),
                                      knobs["rollout_is_threshold"], None, 1e-4)
        # verl's geometric mean is 0 / 0 on an empty response (verl samples none); flowkit's
        # weighs its no tokens 0
        weights = torch.nan_to_num(weights)
    if gspo:
        pg = _verl_gspo(old, logp, f["advantages"], mask, knobs["clip_ratio_low"],
                        knobs["clip_ratio_high"])
    elif scale is None:
        pg = _verl_policy_loss(old, logp, f["advantages"], mask, 0.2, 3.0, agg,
                               knobs.get("clip_ratio_low"), knobs.get("clip_ratio_high"),
                               weights)[0]
    else:  # Dr. GRPO's as the paper averages it: each response's sum over the constant
        pg = _verl_policy_loss(old, logp, f["advantages"], mask, 0.2, 3.0,
                               "seq-mean-token-sum", rollout_is_weights=weights)[0] / scale
    loss = pg
    entropy = _verl_entropy_from_logits(picked)
    if knobs.get("entropy_coeff"):
        loss = loss - knobs["entropy_coeff"] * _as_ours(_verl_agg_loss(entropy, mask, agg),
                                                        mask, agg)
    if kl_coef:
        kl = kl_penalty(logp, f["ref_logprobs"], "k3")
        loss = loss + kl_coef * _as_ours(_verl_agg_loss(kl, mask, agg), mask, agg)
    return loss, float((entropy.detach() * mask).sum() / mask.sum())


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipes_pipeline_gradients_equal_verls_loss_on_the_unsplit_model(recipe):
    knobs = RECIPES[recipe]
    model = _whole(POLICY)
    exps = _near_current(_experiences(7, seed=61), model, noise=0.15, seed=8)
    exps = [attrs.evolve(e, finished=i % 3 != 0) for i, e in enumerate(exps)]
    refs = _ref_scores(exps, model, seed=9)
    exps = [attrs.evolve(e, ref_logprobs=r.values) for e, r in zip(exps, refs)]
    ctx = op_context()
    stats = run_microbatches(ctx, POLICY, [(exps[:2],), (exps[2:3],), (exps[3:],)],
                              stages=2, **knobs)
    normalizer = sum(s.normalizer for s in stats)
    plain, entropy = _plain_recipe_loss(model, exps, knobs)
    plain.backward()
    _assert_grads_equal(_stage_grads(ctx, POLICY, 2), _reference_grads(model, 2),
                        scale=normalizer)
    reported = sum(s.loss * s.normalizer for s in stats) / normalizer
    assert reported == pytest.approx(plain.item(), abs=TIGHT)
    assert mean_values(stats)["entropy"] == pytest.approx(entropy, abs=TIGHT)


def test_a_step_with_nothing_to_train_on_leaves_the_weights_as_they_were():
    """Every group filtered out: one empty microbatch, and no AdamW step (its weight decay
    and momentum would move the weights all the same)."""
    params, metrics = _one_step(POLICY, [([],)], stages=2, loss="grpo")
    model = _whole(POLICY)
    for (stage, name), p in params.items():
        want = dict(model.split(2)[stage].named_parameters())[name]
        assert torch.equal(p, want.detach()), f"stage {stage} {name} moved"
    assert (metrics.tokens, metrics.grad_norm) == (0, 0.0)
