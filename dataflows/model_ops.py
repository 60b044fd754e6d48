"""Model ops of the ready-made flows: what executors holding a model will run.

These are declarations (typed signatures); the torch and simulator executors implement the
executor ops they name.
"""

from __future__ import annotations

from typing import Any

from flowkit.dsl import Batch, ModelOp, Problem, Resumable, Stream, Workload
from flowkit.ops import (
    AGENT,
    AGENT_RANGES,
    KL_ALIASES,
    KL_KINDS,
    LOSS_AGG_MODES,
    LOSS_KNOBS,
    LOSS_SPEC,
    LOSSES,
    POLICY_LOSSES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    ROUND_KNOBS,
    SAMPLING,
    SAMPLING_CHOICES,
    SAMPLING_RANGES,
    rounds_of,
)
from flowkit.ops.records import (
    MicrobatchStats,
    Prompt,
    Rollout,
    StepMetrics,
    TokenScores,
    WeightsVersion,
)
from flowkit.planner.schedules import schedule_kinds

__all__ = ["Backprop", "Generate", "LogProbs", "OptimizerStep", "RewardModel", "Values"]


class Generate(ModelOp):
    """Sample n responses per prompt; each finished sample leaves as soon as it is done."""

    executor_op = "generate"
    many_per_call = True
    fan_out = ("n", "prompt_id")  # n rollouts per call, all of the prompt's prompt_id
    # spread over rollout executors by predicted tokens: n x the prompt's estimated length
    workload = Workload(key="prompt_id", count="n", budget="max_new_tokens",
                        size="response_length")
    traced = "version_span"  # the trace shows which weights versions sampled each rollout
    # its calls can be aborted and continued: partial rollouts, asynchronous checkpoints
    resumable = Resumable(take="take", version_floor="min_version", request="request",
                          abort_op="generation", stale="stale_segments")
    engine_key = "engine"  # SamplingConfig.engine: flowkit's engine or vLLM (--rollout-engine)
    inputs = {"prompts": Stream[Prompt], "weights": Stream[WeightsVersion]}
    optional = ("weights",)
    outputs = {"rollouts": Stream[Rollout]}
    # the settings, their defaults and what they allow: flowkit.ops.SamplingConfig's, and
    # flowkit.ops.AgentConfig's for multi-turn trajectories in an environment
    config = {**SAMPLING.as_config(), **AGENT.as_config()}
    choices = SAMPLING_CHOICES
    ranges = {**SAMPLING_RANGES, **AGENT_RANGES}

    def node_problems(self, flow: Any, node: Any) -> list[Problem]:
        return _eos_problems(node) + _environment_problems(node)


def _eos_problems(node: Any) -> list[Problem]:
    eos = node.config.get("eos")
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    if eos is None or eos == "model" or all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return []
    return [Problem(rule="bad-config", op=node.name, port="eos",
                    message=f"eos={eos!r} is not a token id, a list of them, None or 'model'",
                    fix="leave eos='model' (the tokenizer's EOS), or pass eos=ID")]


def _environment_problems(node: Any) -> list[Problem]:
    """The environment's name and settings, as far as the flow can tell: the rollout executor
    imports the class [Note: multi-turn rollouts in flowkit/ops/environments.py]."""
    env, settings = node.config.get("environment"), node.config.get("env_config")
    program = node.config.get("program")
    if env is not None and not _import_name(env):
        return [Problem(rule="bad-config", op=node.name, port="environment",
                        message=f"environment={env!r} is not a class's import name",
                        fix="name it 'package.module:Class' (an Environment subclass), e.g. "
                            "'dataflows.envs:GuessNumber'")]
    if program is not None and not _import_name(program):
        return [Problem(rule="bad-config", op=node.name, port="program",
                        message=f"program={program!r} is not a function's import name",
                        fix="name it 'package.module:function', a function of a Task that "
                            "talks to task.client() (an openai.OpenAI)")]
    if env is not None and program is not None:
        return [Problem(rule="bad-config", op=node.name, port="program",
                        message=f"both environment={env!r} and program={program!r} are given",
                        fix="a trajectory steps an environment or runs an agent program: "
                            "give one")]
    if not isinstance(settings, dict) or not all(isinstance(k, str) for k in settings):
        return [Problem(rule="bad-config", op=node.name, port="env_config",
                        message=f"env_config={settings!r} is not a dict of keyword arguments",
                        fix="pass the environment class's keyword arguments as a dict")]
    return []


def _import_name(path: Any) -> bool:
    """Whether `path` has the shape of "package.module:name"."""
    module, _, name = path.partition(":") if isinstance(path, str) else ("", "", "")
    return bool(module and name and all(
        part.isidentifier() for part in [*module.split("."), *name.split(".")]))


class LogProbs(ModelOp):
    """Per-token log-probabilities of each response under the model (e.g. a frozen reference)."""

    executor_op = "logprobs"
    scores = True  # [Note: bubble filling in flowkit/runner/bubble_fill.py]
    inputs = {"rollouts": Stream[Rollout]}
    outputs = {"logprobs": Stream[TokenScores]}
    config = {"temperature": SAMPLING.temperature}  # the sampler's: log_softmax(logits / T)
    ranges = {"temperature": (0, None)}


class Values(ModelOp):
    """Per-token value estimates of each response from a critic (the GPT with a value head);
    `weights` orders it after the critic's last update."""

    executor_op = "values"
    scores = True  # [Note: bubble filling in flowkit/runner/bubble_fill.py]
    inputs = {"rollouts": Stream[Rollout], "weights": Stream[WeightsVersion]}
    optional = ("weights",)
    outputs = {"values": Stream[TokenScores]}


class RewardModel(ModelOp):
    """A sequence-level score of each response from a reward model."""

    executor_op = "reward_model"
    scores = True  # [Note: bubble filling in flowkit/runner/bubble_fill.py]
    inputs = {"rollouts": Stream[Rollout]}
    outputs = {"scores": Stream[float]}


class Backprop(ModelOp):
    """F, B and W of the model's pipeline stages over microbatches formed from the items, under
    a pipeline schedule; gradients accumulate on the executors until the optimizer step.

    `epochs` and `minibatches` (verl's ppo_epochs, and the batch size / ppo_mini_batch_size):
    train the step's batch `epochs` times, each time shuffled (seeded by `shuffle_seed` and the
    step) and cut into `minibatches`, with an optimizer step after each minibatch, configured
    by the OptimizerStep its stats feed [Note: minibatch rounds in flowkit/ops/minibatches.py].
    Then `microbatches` is per minibatch, and the backprop waits for every item first.

    `fuse`: a group name that backprops of other models share (PPO's actor and critic): their
    pipelines run as one fused schedule on the same executors, one model's bubbles filled with
    the other's microbatches [Note: fused training in flowkit/runner/fusedtrain.py].

    `microbatch_tokens`: form microbatches of about that many tokens (prompt and response)
    instead of `microbatches` by count, and balance the replicas by tokens [Note: token-budget
    microbatches in flowkit/runner/token_microbatches.py].

    `reference`: the name of a frozen model of the flow (held whole) whose log-probs of each
    microbatch's responses the last stage's forward takes for GRPO's KL term, instead of a
    wired ref_logprobs input [Note: reference in the F in executors/torch/train/rows.py]."""

    executor_op = "backprop"
    lowering = "pipeline"
    many_per_call = True
    # token batches (pretraining) or experiences (RL); reference log-probs for a KL loss term
    inputs = {"batch": Stream[object], "ref_logprobs": Stream[TokenScores]}
    optional = ("ref_logprobs",)
    outputs = {"stats": Stream[MicrobatchStats]}
    # loss: one of flowkit.ops.LOSSES, with its knobs; what the runner needs to know of it
    loss_spec = LOSS_SPEC
    item_tokens = "sequence_length"  # Rollout.sequence_length: what microbatch_tokens reads
    config = {"loss": "lm", "schedule": "1f1b", "microbatches": 8, "microbatch_tokens": None,
              "memory_limit": None, "fuse": None, "reference": None, **ROUND_KNOBS,
              **LOSS_KNOBS}
    choices = {"loss": tuple(LOSSES), "kl_kind": (*KL_KINDS, *KL_ALIASES),
               "schedule": tuple(schedule_kinds()), "loss_agg_mode": (None, *LOSS_AGG_MODES),
               "policy_loss": POLICY_LOSSES, "rollout_is": (None, *ROLLOUT_IS_LEVELS),
               "rollout_is_mode": ROLLOUT_IS_MODES}
    # the counts (microbatches, epochs, minibatches) are node_problems': whole numbers >= 1
    # behav_cap >= 1: a cap below 1 would down-weight even fresh samples (weight 1), as would
    # an importance-weight threshold below 1. The flags (decoupled, mask_truncated) are no
    # numbers; node_problems checks that they are bools
    ranges = {"kl_coef": (0, None), "clip_ratio": (0, None), "clip_ratio_c": (1, None),
              "clip_ratio_low": (0, 1), "clip_ratio_high": (0, None),
              "loss_scale_factor": (1, None), "cliprange_value": (0, None),
              "temperature": (0, None), "behav_cap": (1, None),
              "rollout_is_threshold": (1, None), "rollout_is_threshold_lower": (0, 1),
              "rollout_is_veto_threshold": (0, 1)}

    def node_problems(self, flow: Any, node: Any) -> list[Problem]:
        problems = [p for key, fix in _COUNTS.items() if (p := _count_problem(node, key, fix))]
        if not problems and rounds_of(node.config) > 1:
            problems += _round_problems(self.model, flow, node)
        flags = [_flag_problem(node, key) for key in ("decoupled", "mask_truncated")]
        rounds = 1 if problems else rounds_of(node.config)  # counts checked first
        return (problems + [p for p in flags if p] + _loss_problems(node, rounds)
                + _reference_problems(self.model, flow, node)
                + _fuse_problems(self.model, flow, node, rounds)
                + _token_problems(flow, node, rounds))


class OptimizerStep(ModelOp):
    """AdamW over every stage, with gradient clipping by the global norm: needs every microbatch's
    gradient, so its input is a barrier."""

    executor_op = "optimizer_step"
    lowering = "step"
    inputs = {"stats": Batch[MicrobatchStats]}
    outputs = {"metrics": Stream[StepMetrics], "weights": Stream[WeightsVersion]}
    config = {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "clip_grad_norm": 1.0}
    ranges = {"lr": (0, None), "weight_decay": (0, None), "clip_grad_norm": (0, None)}




# -- checks of a Backprop's call: counts, and what minibatch rounds need -----------------------
def _upstream(flow: Any, name: str) -> set[str]:
    """The nodes `name` reads from, directly or not, over the wires that are no feedback."""
    feeds: dict[str, list[str]] = {}
    for wire in flow.wires:
        if not wire.feedback:
            feeds.setdefault(wire.dst, []).append(wire.src)
    seen, todo = set(), [name]
    while todo:
        for src in feeds.get(todo.pop(), ()):
            if src not in seen:
                seen.add(src)
                todo.append(src)
    return seen


def _fuse_problems(model: str, flow: Any, node: Any, rounds: int) -> list[Problem]:
    """A fuse group is a name that backprops of two or more models share, each trained in one
    round [Note: fused training in flowkit/runner/fusedtrain.py]."""
    group = node.config.get("fuse")
    if group is None:
        return []
    if not isinstance(group, str) or not group:
        return [Problem(rule="bad-config", op=node.name, port="fuse",
                        message=f"fuse={group!r} is not a group name",
                        fix="name the group its partners name too, e.g. fuse='train'")]
    partners = [n for n in flow.nodes.values() if n is not node
                and isinstance(n.operator, Backprop) and n.config.get("fuse") == group]
    problems = []
    if not any(n.operator.model != model for n in partners):
        problems.append(Problem(
            rule="fuse-alone", op=node.name, port="fuse",
            message=f"fuse={group!r}: no backprop of another model names that group",
            fix=f"pass fuse={group!r} to the other model's Backprop too, or leave fuse out"))
    if any(n.operator.model == model for n in partners):
        problems.append(Problem(
            rule="fuse-twice", op=node.name, port="fuse",
            message=f"fuse={group!r}: model {model!r} has another backprop in the group",
            fix="fuse one backprop of each model"))
    upstream = _upstream(flow, node.name)
    for partner in partners:
        if partner.name in upstream:  # it would wait for the fused plan, which waits for it
            problems.append(Problem(
                rule="fuse-dependent", op=node.name, port="fuse",
                message=f"fuse={group!r}: it reads what {partner.label!r}, in the same group, "
                        "makes; fused backprops train side by side on the same batch",
                fix=f"leave fuse out of one of them, or feed both from what comes before "
                    f"{partner.label!r}"))
    if rounds > 1:
        problems.append(Problem(
            rule="fuse-rounds", op=node.name, port="fuse",
            message=f"fuse={group!r} with epochs x minibatches = {rounds}: a fused backprop "
                    "trains the step's batch in one round",
            fix="leave epochs and minibatches at 1, or leave fuse out"))
    return problems


_COUNTS = {
    "microbatches": "pipeline microbatches per (mini)batch, e.g. microbatches=8",
    "epochs": "passes over the step's batch (verl's ppo_epochs), e.g. epochs=2",
    "minibatches": "optimizer steps per epoch: the batch is cut into that many, e.g. "
                   "minibatches=4 (verl's ppo_mini_batch_size is the batch size / minibatches)",
}


def _token_problems(flow: Any, node: Any, rounds: int) -> list[Problem]:
    """`microbatch_tokens`: a whole number, at least one sequence's worth (the longest response
    a generation in the flow may make, and a prompt token), and not with minibatch rounds,
    which cut the batch by count."""
    budget = node.config.get("microbatch_tokens")
    if budget is None:
        return []
    fix = "e.g. microbatch_tokens=4096: several sequences' tokens a microbatch"
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        return [Problem(rule="bad-count", op=node.name, port="microbatch_tokens",
                        message=f"microbatch_tokens={budget!r} is not a whole number >= 1",
                        fix=fix)]
    if rounds > 1:
        return [Problem(rule="bad-config", op=node.name, port="microbatch_tokens",
                        message="microbatch_tokens forms microbatches by tokens, and minibatch "
                                "rounds (epochs x minibatches) cut the batch by count",
                        fix="give microbatches with rounds, or no rounds")]
    longest = max([int(n.config[n.operator.workload.budget]) + 1
                   for n in flow.nodes.values()
                   if getattr(n.operator, "workload", None) is not None
                   and isinstance(n.config.get(n.operator.workload.budget), int)], default=0)
    if budget < longest:
        return [Problem(rule="bad-config", op=node.name, port="microbatch_tokens",
                        message=f"microbatch_tokens={budget} is smaller than one sequence: "
                                f"a response of up to {longest - 1} tokens and its prompt",
                        fix=f"give microbatch_tokens >= {longest}, better several sequences'")]
    return []


def _count_problem(node: Any, key: str, fix: str) -> Problem | None:
    value = node.config.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return Problem(rule="bad-count", op=node.name, port=key,
                   message=f"{key}={value!r} is not a whole number >= 1", fix=fix)


def _flag_problem(node: Any, key: str) -> Problem | None:
    """A switch must be a bool: a string such as "false" would read as on."""
    value = node.config.get(key)
    if isinstance(value, bool):
        return None
    return Problem(rule="bad-config", op=node.name, port=key,
                   message=f"{key}={value!r} is not True or False", fix=f"pass {key}=True")


def _loss_problems(node: Any, rounds: int) -> list[Problem]:
    """Loss knobs that cannot go together, before anything runs."""
    config, problems = node.config, []
    agg = config.get("loss_agg_mode")
    if config.get("policy_loss") == "gspo" and agg not in (None, "seq-mean-token-mean"):
        problems.append(Problem(
            rule="bad-config", op=node.name, port="loss_agg_mode",
            message=f"policy_loss='gspo' takes one ratio per response, averaged over its "
                    f"tokens (seq-mean-token-mean, as verl aggregates it), not {agg!r}",
            fix="leave loss_agg_mode unset (None) or 'seq-mean-token-mean'"))
    if agg == "seq-mean-token-sum-norm" and config.get("loss_scale_factor") is None:
        problems.append(Problem(
            rule="bad-config", op=node.name, port="loss_scale_factor",
            message="loss_agg_mode='seq-mean-token-sum-norm' divides each response's summed "
                    "loss by a constant, and loss_scale_factor is not set",
            fix="pass loss_scale_factor=MAX_NEW_TOKENS (the generation budget; the RL flows "
                "set it so)"))
    if config.get("rollout_is") is not None and rounds > 1:
        problems.append(Problem(
            rule="bad-config", op=node.name, port="rollout_is",
            message=f"rollout_is={config['rollout_is']!r} takes the trainer's log-probs from "
                    f"the update's own forward, so each sample gets one optimizer step, but "
                    f"epochs={config['epochs']}, minibatches={config['minibatches']} give it "
                    f"{rounds}",
            fix="leave epochs and minibatches at 1, or rollout_is=None"))
    return problems


def _reference_problems(model: str, flow: Any, node: Any) -> list[Problem]:
    """`reference`: a frozen model of the flow, held whole, whose log-probs the last stage's
    forward takes for GRPO's KL term [Note: reference in the F in executors/torch/train/rows.py],
    in place of a wired ref_logprobs input."""
    name = node.config.get("reference")
    if name is None:
        return []

    def problem(message: str, fix: str) -> list[Problem]:
        return [Problem(rule="bad-config", op=node.name, port="reference", message=message,
                        fix=fix)]

    known = flow.models.get(name) if isinstance(name, str) else None
    if known is None:
        return problem(f"reference={name!r} names no model of the flow",
                       "flow.add_model(reference) and pass its name, e.g. reference='reference'")
    if name == model:
        return problem(f"reference={name!r} is the model this backprop trains",
                       "pass a frozen copy of it (dataflows.models.reference_of)")
    if node.config.get("loss") != "grpo" or not node.config.get("kl_coef"):
        return problem(f"reference={name!r}: only loss 'grpo' with kl_coef > 0 reads the "
                       f"reference in its loss (here loss={node.config.get('loss')!r}, "
                       f"kl_coef={node.config.get('kl_coef')!r})",
                       "drop reference, or train with loss='grpo' and a kl_coef")
    if known.stages != 1:
        return problem(f"reference {name!r} is cut in {known.stages} stages; the forward runs "
                       "it whole", "give the reference stages=1")
    if any(isinstance(n.operator, Backprop) and n.operator.model == name
           for n in flow.nodes.values()):
        return problem(f"reference {name!r} is trained in this flow, and the copy the forward "
                       "holds would never see its updates", "give a frozen model")
    if any(w.dst == node.name and w.dst_port == "ref_logprobs" for w in flow.wires):
        return problem(f"reference={name!r} and a wired ref_logprobs input both give the "
                       "reference's log-probs", "wire one of them")
    return []


def _round_problems(model: str, flow: Any, node: Any) -> list[Problem]:
    """Rounds step the model after each minibatch with the config of the OptimizerStep that
    the backprop's stats feed, so there must be one; and the backprop must be the model's only
    one, since two backprops' gradients add up into one step, which rounds cannot cut."""
    rounds = f"epochs={node.config['epochs']}, minibatches={node.config['minibatches']}"
    problems = []
    steps = [w.dst for w in flow.wires if w.src == node.name and w.src_port == "stats"
             and not w.feedback and isinstance(flow.nodes[w.dst].operator, OptimizerStep)
             and flow.nodes[w.dst].operator.model == model]
    if not steps:
        problems.append(Problem(
            rule="rounds-without-step", op=node.name, port="epochs",
            message=f"{rounds} take an optimizer step after each minibatch, configured by the "
                    f"OptimizerStep that its stats feed, but they feed no OptimizerStep of "
                    f"model {model!r}",
            fix=f"OptimizerStep({model!r})(collect({node.label}.stats)), or leave epochs and "
                "minibatches at 1"))
    others = [n.label for n in flow.nodes.values() if n is not node
              and isinstance(n.operator, Backprop) and n.operator.model == model]
    if others:
        problems.append(Problem(
            rule="rounds-shared-step", op=node.name, port="epochs",
            message=f"{rounds} cut the step into one optimizer step per minibatch, but model "
                    f"{model!r} is also trained by {', '.join(map(repr, others))}, whose "
                    "gradients would add up into the same steps",
            fix="train the model in one Backprop, or leave epochs and minibatches at 1"))
    return problems
