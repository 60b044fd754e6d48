"""The executor ops that model ops lower to: each op's name, what it reads and which config keys
the runtime may give it. The runtime submits them (flowkit/runner/model_training.py,
training_tasks.py, flowrun.py), the simulator (executors/sim/ops.py) and the torch executor
(executors/torch/) implement them, and tests/executors/test_op_contract.py holds both
implementations to this.

An executor op is called as ``op(ctx, *inputs, **config)``: the inputs are what the task reads
(other ops' outputs, moved to it by the runtime), the config what the task was told.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import attrs

from flowkit.ops.configs import AGENT_KEYS, SAMPLING_KEYS
from flowkit.ops.losses import LOSS_KNOBS

__all__ = ["EXECUTOR_OPS", "LOWERED_OPS", "OFFLOAD_KEYS", "PIPELINE_OPS", "SIMULATED", "STATE_OPS",
           "OpSpec", "missing_executor_ops"]


@attrs.frozen
class OpSpec:
    name: str
    inputs: str  # what the positional inputs are
    keywords: frozenset[str] = attrs.field(converter=frozenset)  # what the config may hold
    doc: str = ""


MODEL_KEYS = ("model", "build", "stages", "seed", "dtype", "precision", "model_config",
              "lora", "packing")  # model_spec's
_STAGE = (*MODEL_KEYS, "stage")
# every pipeline op: the copies it issues as it starts [Note: offload in the runtime] and its
# activation memory's change in microbatch stashes (the simulator's accounting; `track_memory`:
# the executor notes its peak, which `activation_memory` reads)
_PIPELINE = (*_STAGE, "microbatch", "loss", *LOSS_KNOBS, "seconds", "seconds_per_token",
             "prefetch", "memory", "track_memory")
# the simulator's rollout engine and sampled lengths (flowkit/planner/simcosts.py)
_SIM_ENGINE = ("seconds_per_seq", "seconds_per_prefill_token", "token_budget", "max_batch",
               "prompt_sigma")
_OPTIMIZER = (*_STAGE, "step", "seconds", "lr", "weight_decay", "betas", "eps", "clip_grad_norm",
              "replica_group", "shard_optimizer")
_SCORING = (*MODEL_KEYS, "step", "max_batch", "max_tokens", "seconds_per_token")
# Generate's settings but `take`, which the runner keeps (flowkit/runner/flowrun.py)
_SAMPLING = tuple(key for key in SAMPLING_KEYS if key != "take")

PIPELINE_OPS = ("F", "B", "W", "BW")

EXECUTOR_OPS = {spec.name: spec for spec in (
    OpSpec("F", "stage 0: the microbatch's data; a later stage: the activation before it, and "
           "on the last stage the data again, for the loss",
           (*_PIPELINE, "loss_scale", "out_bytes", "last", "tokens", "fused_backward", "offload",
            "copy_seconds", "reference"),
           "forward; the last stage returns the microbatch's MicrobatchStats (fused_backward: "
           "its backward will be one BW, so it need not prepare a split one; offload: what it "
           "stashes goes to host memory once it ends, a copy of copy_seconds on the simulator; "
           "reference: the model spec of a frozen reference whose log-probs the last stage "
           "takes for the KL term itself)"),
    OpSpec("B", "the gradient of the stage's output (the last stage: its own F's stats)",
           (*_PIPELINE, "out_bytes", "first"), "input gradients; stashes what W needs"),
    OpSpec("W", "the stage's B output, only to be ordered after it",
           (*_PIPELINE, "reduce_group", "reduce_order", "shard"),
           "weight gradients from what B stashed (reduce_group: the stage's last W of the step "
           "starts its gradient all-reduce over that replica group, bucket by bucket, in "
           "reduce_order: forward, or reverse, the last bucket first; shard 'fsdp': its "
           "reduce-scatter, once the stage is cut)"),
    OpSpec("BW", "as B", (*_PIPELINE, "out_bytes", "first", "reduce_group", "reduce_order",
                          "shard"),
           "B and W in one op (reduce_group, reduce_order, shard: as W's)"),
    OpSpec("activation_memory", "anything, only to be ordered after it", ("model", "reset"),
           "{peak, now, unit}: the activation memory the model's stages on this executor held at "
           "most since the last reset (reset: start again from now) and hold now, as the "
           "executor accounts it (torch: bytes, for pipeline ops given track_memory; the "
           "simulator: microbatch stashes, from each op's `memory`)"),
    OpSpec("model_flops", "anything, only to be ordered after it", ("model", "reset"),
           "{flops, tokens, peak_flops}: the model's training FLOPs of the rows its stage 0 "
           "ran here since the last reset, their tokens, this device's peak FLOP/s (None where "
           "unknown) [Note: model FLOPs in executors/torch/train/flops.py]"),
    OpSpec("grad_stats", "on the last stage, the first stage's tied gradients", _OPTIMIZER,
           "a stage's squared gradient norm and its tied gradients"),
    OpSpec("reduce_grads", "every replica's last action of the stage, only to be ordered after "
           "them", (*_STAGE, "replica_group", "reduce_order", "allreduce_seconds", "shard"),
           "sum the stage's gradients over its replicas [Note: replicas]: through "
           "torch.distributed (replica_group), or its modelled seconds on the simulator"),
    OpSpec("replica_store", "nothing", ("group", "size", "host", "timeout_s"),
           "on a replica group's rank 0: open its rendezvous store; returns {host, port}"),
    OpSpec("replica_group", "replica_store's address",
           ("group", "rank", "size", "timeout_s", "weights"),
           "join the replica group (gloo, NCCL on CUDA) [Note: replica groups]"),
    OpSpec("leave_replica_groups", "anything, only to be ordered after it", ("groups",),
           "drop the named replica groups"),
    OpSpec("optimizer_step", "the microbatches' stats, every stage's grad stats; after "
           "earlier rounds of the flow step, their StepMetrics [Note: minibatch rounds]",
           (*_OPTIMIZER, "report"),
           "clip by the global norm, one step; the reporting stage returns "
           "(StepMetrics, WeightsVersion)"),
    OpSpec("generate", "a prompt (or a list of them; an interrupted Rollout is continued, a "
           "finished one passes through), then weights versions to wait for",
           (*_SCORING, *_SAMPLING, *AGENT_KEYS, "token_budget", "min_new_tokens",
            "length_sigma", *_SIM_ENGINE, "request", "min_version", "first_sample"),
           "n Rollouts per prompt (numbered from `first_sample`, a later round's "
           "[Note: second rounds]), each streamed as it finishes; `request` names it for an "
           "abort, "
           "carried Rollouts older than `min_version` are recomputed or dropped as "
           "`stale_segments` says [Note: partial rollouts]; with an `environment`, each a "
           "multi-turn trajectory [Note: multi-turn rollouts]"),
    OpSpec("logprobs", "a rollout (or a list of them)", (*_SCORING, "temperature"),
           "TokenScores: per-token log-probabilities"),
    OpSpec("values", "a rollout (or a list), then weights versions to wait for", _SCORING,
           "TokenScores: per-token values of a critic"),
    OpSpec("reward_model", "a rollout (or a list of them)", _SCORING,
           "a float score per rollout"),
    OpSpec("generation", "anything, only to be ordered after it", ("action", "model", "requests"),
           "pause, resume or abort the rollout engine(s) here; abort returns the requests' "
           "unfinished samples as interrupted Rollouts: the count, or with `requests` (the "
           "generate requests to abort, by name) [samples, tokens] cut"),
    OpSpec("profile_stage", "a microbatch like the ones to come",
           (*_STAGE, "repeats", "reference"),
           "median seconds of F, B, W, BW: the planner's costs (reference: the last stage's F "
           "runs that model's forward too, as F does)"),
    OpSpec("export_weights", "anything, only to be ordered after it",
           (*_STAGE, "share_with", "broadcast", "self_load"),
           "a stage's weights by the unsplit model's names (left on its GPU for the executors "
           "share_with names, or broadcast to a group's)"),
    OpSpec("load_weights", "export_weights dicts and weights versions",
           (*_STAGE, "version", "complete"), "load them into the model held here"),
    OpSpec("save_weights", "export_weights dicts of every stage", ("path", "spec"),
           "merge and write them as one checkpoint file, or, for a model with a format of its "
           "own (a Hugging Face causal LM, built from spec), as its folder; returns the path"),
    OpSpec("save_state", "anything, only to be ordered after it", ("path",),
           "write what this executor holds for a run checkpoint (weights, optimizer states, "
           "versions, random generators) to path; returns {bytes, sha256} of the file"),
    OpSpec("load_state", "anything, only to be ordered after it",
           ("path", "files", "models", "trains", "checksums"),
           "build the models (models: the flow's spec of each, by name) and load what "
           "save_state wrote to path, and the models it trains (trains) in this run's split "
           "from every executor state in files; each file read first checked against its "
           "SHA-256 in checksums (by path); a saved build or config that differs is refused"),
)}

LOWERED_OPS = {"pipeline": (*PIPELINE_OPS, "profile_stage"),
               "step": ("grad_stats", "optimizer_step")}
"""The executor ops a model op runs as, by its `ModelOp.lowering` (without one: its own)."""

SIMULATED = frozenset(PIPELINE_OPS) | {"activation_memory", "grad_stats", "reduce_grads",
                                       "optimizer_step",
                                       "generate", "generation",
                                       "logprobs", "values", "reward_model", "save_state",
                                       "load_state"}
"""The ops the timed simulator implements: every op a flow's model ops lower to, the rollout
engine's control, and the run checkpoint's state ops. Not the replica groups: it models the
all-reduce's time in reduce_grads instead of running one."""

# [Note: offload in the runtime] A schedule's O and P actions (flowkit/planner/offload.py) are
# no tasks of their own: they run on the device's copy engines beside its compute, issued with
# the compute op listed before them, and the runtime (flowkit/runner/pipeline.py) hands them
# to that op. An F whose O follows it gets `offload` (and the copy's `copy_seconds`): what it
# stashes goes to host memory as soon as it ends. The compute op listed before a P gets
# `prefetch`, a list of [stage, microbatch, copy seconds]: as it starts, the executor starts
# copying those microbatches' activations back, beside the op; their B or BW waits for the
# copy. Every executor that runs pipeline ops must read these keys (an executor that ignored
# them would train right and keep every activation: the contract test holds both to it).
OFFLOAD_KEYS = {"F": ("offload", "copy_seconds", "prefetch"), "B": ("prefetch",),
                "W": ("prefetch",), "BW": ("prefetch",)}
"""The config keys that carry offload, by pipeline op: each executor's op must name them."""

STATE_OPS = ("save_state", "load_state")
"""The ops an executor takes part in a run checkpoint with [Note: run checkpoints in
flowkit/runner/checkpoints/format.py]."""


def missing_executor_ops(nodes: Iterable[Any], implemented: Collection[str]) -> list[str]:
    """What executors implementing the ops `implemented` lack to run a lowered flow's `nodes`
    (flowkit/planner/lower.py's NodePlans): the executor ops its model ops run as (by their
    lowering: a backprop runs as F, B, W), then each loss its nodes name that the executors
    implement no such loss of (by the node's declared `loss_spec`), as "the 'x' loss"."""
    nodes = list(nodes)
    wanted = {need for node in nodes if node.model is not None
              for need in LOWERED_OPS.get(node.call.value, (node.op,))}
    missing = sorted(wanted - set(implemented))
    unknown = {node.loss_spec.unknown(node.config) for node in nodes
               if node.loss_spec is not None}
    return missing + sorted(f"the {name!r} loss" for name in unknown if name is not None)
