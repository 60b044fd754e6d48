"""The torch executor's ops: pipeline stages of a model, held on this executor, run F, B, W and
BW for microbatches, then a stage-wise optimizer step that equals the unsplit model's. Task
configs say which model and stage [Note: one model, many holders in
executors/torch/models/built.py]; the ops are otherwise the StageRunner's
(executors/torch/train/stage.py).

The design: [Note: the optimizer step across stages] below.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from executors.optable import OpContext, OpTable
from executors.torch.device import device_clock, make_room
from executors.torch.errors import StageError
from executors.torch.layout_free import fill_optimizer
from executors.torch.models.built import (
    export_weights,
    held_model,
    load_weights,
    save_weights,
    whole_model,
)
from executors.torch.train import fsdp, fsdp_ops, replicas
from executors.torch.train.flops import model_flops
from executors.torch.train.fsdp_state import load_named_states, states_by_name
from executors.torch.train.held_stage import HeldStage, held_stage
from executors.torch.train.memory import keep_freed_memory
from executors.torch.train.replicas import all_reduce_grads, broadcast_shards, owned
from executors.torch.train.rl_loss import RL_LOSSES, RLLoss, RLSettings, records
from executors.torch.train.rows import (
    activation,
    experience_rows,
    lm_rows,
    reference_forward,
    sent,
)
from executors.torch.train.rows import tokens_of as _tokens
from executors.torch.train.stage import StageRunner
from flowkit.ops.records import MicrobatchStats, microbatch_stats, step_report

__all__ = ["LOSSES", "register"]


# [Note: the optimizer step across stages] Gradient clipping needs the global norm of the
# unsplit model's gradient, and the embedding tied to the LM head is one weight there but two
# copies here (stage 0's `wte`, the last stage's `lm_head`), each with a share of the gradient.
# Three ops per step, all in the stages' lanes, so they run after each stage's last W:
#   grad_stats(stage 0)           -> its squared norm (tied copies left out), its tied grads
#   grad_stats(last, tied grads)  -> adds stage 0's share to its copies, so they hold the full
#                                    gradient; its squared norm counts that full gradient once
#   optimizer_step(s, the microbatches' stats, every stage's grad stats[, the summed tied
#                  grads on stage 0]) -> divide by the stats' normalizer (a loss summed over tokens,
#                                    executors/torch/train/rl_loss.py), the global norm, clip,
#                                    AdamW, zero the gradients
# Both copies then take the same AdamW step from the same state, and stay equal.

# -- pipeline ops -----------------------------------------------------------------------------
# next-token cross-entropy; PPO/GRPO's clipped policy loss and the critic's value loss
LOSSES = ("lm", *RL_LOSSES)


def _forward(ctx: OpContext, *inputs: Any, stage: int, stages: int, microbatch: int,
             loss_scale: float = 1.0, loss: str = "lm", fused_backward: bool = False,
             offload: bool = False, copy_seconds: float = 0.0, prefetch: Any = (),
             track_memory: bool = False, **config: Any) -> Any:
    """Stage 0 reads the microbatch's data, a later stage the activation before it; the last
    stage also reads the data for its loss and returns the microbatch's stats. The loss it
    backpropagates is scaled by `loss_scale`: for "lm" the microbatch's share of the batch
    (its loss is a mean); the RL losses are sums the optimizer step divides by the step's
    token count, so the runtime gives them 1 [Note: RL losses in sum form in rl_loss.py].
    `fused_backward`: the microbatch's backward on this stage is BW [Note: a fused backward
    in executors/torch/train/stage.py]. `offload`: what it stashes goes to host memory as it ends;
    `prefetch`: copies to start first [Note: offload in the runtime in flowkit/ops]."""
    if loss not in LOSSES:
        raise StageError(f"unknown loss {loss!r}: the torch executor trains with "
                         f"{', '.join(LOSSES)}")

    # an idle vLLM engine here hands its GPU memory back first [Note: vLLM sleeps beside a
    # trainer in executors/torch/rollout/vllm_engine.py]
    make_room(ctx)
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    if held.fsdp is not None:  # the step's first F makes the stage whole again
        fsdp.gather(held.fsdp)
    _prefetch(ctx, config, stages, prefetch, track_memory, skip=(stage, microbatch))
    reference = whole_model(ctx, config["reference"]) if config.get("reference") else None
    out = _forward_on(held, inputs, stage=stage, stages=stages, microbatch=microbatch,
                      loss_scale=loss_scale, loss=loss, split=not fused_backward,
                      offload=bool(offload), config=config, reference=reference)
    # the copy's time is the simulator's; a prefetch listed after its own forward: as it ends
    del copy_seconds
    if [stage, microbatch] in [[int(p[0]), int(p[1])] for p in prefetch or ()]:
        held.runner.prefetch(microbatch)
    return out


def _forward_on(held: HeldStage, inputs: tuple, *, stage: int, stages: int, microbatch: int,
                loss_scale: float, loss: str, split: bool, offload: bool, config: dict,
                reference: torch.nn.Module | None = None) -> Any:
    first, last = stage == 0, stage == stages - 1
    packing = bool(config.get("packing"))
    if loss in RL_LOSSES:
        return _rl_forward(held, inputs, first=first, last=last, microbatch=microbatch,
                           loss_scale=float(loss_scale),
                           settings=RLSettings.from_config(loss, config), split=split,
                           offload=offload, packing=packing, reference=reference)
    if reference is not None:
        raise StageError(f"loss {loss!r} reads no reference: only an RL loss with a KL term "
                         "takes the reference's log-probs in its forward")
    x, positions = (None, None) if first else activation(inputs[0])
    if first or last:
        read, targets, positions = lm_rows(_tokens(inputs[0] if first else inputs[-1]), packing)
    if first:
        x = read
        _count_rows(held, read)
    args = [x, targets] if last else [x]
    if positions is not None:  # the stage's forward(x, targets=None, positions=None)
        args = [x, targets if last else None, positions]
    if last:
        args.append(float(loss_scale))
    out = held.runner.forward(microbatch, *args, split=split, offload=offload)
    if not last:
        return sent(out, positions)
    n_tokens = int(targets.ge(0).sum())
    return MicrobatchStats(loss=float(out) / float(loss_scale), tokens=n_tokens)


def _count_rows(held: HeldStage, ids: torch.Tensor) -> None:
    """Stage 0's (B, T) rows, for MFU [Note: model FLOPs in executors/torch/train/flops.py]."""
    held.tokens_run += ids.numel()
    held.attended += ids.numel() * ids.size(-1)


def _rl_forward(held: HeldStage, inputs: tuple, *, first: bool, last: bool, microbatch: int,
                loss_scale: float, settings: RLSettings, split: bool = True,
                offload: bool = False, packing: bool = False,
                reference: torch.nn.Module | None = None) -> Any:
    """F under an RL loss. Inputs: (experiences[, reference scores]) on stage 0, the
    activation on a middle stage, (activation, experiences[, reference scores]) on the last;
    the last stage returns the microbatch's mean loss per response token, and its token count
    as the normalizer of the summed loss it backpropagates (responses with tokens for the
    seq-mean aggregation modes). `reference`: the last stage runs this whole model on the
    microbatch's rows for the KL term's log-probs [Note: reference in the F]."""
    data = inputs if first else inputs[1:]
    experiences = records(data[0]) if data else []
    x, positions = (None, None) if first else activation(inputs[0])
    layout = None
    if first or last:
        ids, positions, layout = experience_rows(experiences, held.runner.device, packing)
    if first:
        x = ids
        _count_rows(held, x)
    args = [x] if positions is None else [x, None, positions]
    if not last:
        return sent(held.runner.forward(microbatch, *args, split=split, offload=offload),
                    positions)
    refs = records(data[1]) if len(data) > 1 else []
    if reference is not None and refs:
        raise StageError("the reference's log-probs come both from the ref_logprobs input and "
                         "from the forward's own reference: wire one of them")
    reference_logits = None if reference is None else \
        lambda: reference_forward(reference, ids, positions)
    rl_loss = RLLoss(experiences, refs, settings, held.runner.device, layout=layout,
                     reference=reference_logits)
    out = held.runner.forward(microbatch, *args, rl_loss, loss_scale, split=split,
                              offload=offload)
    summed = rl_loss.settle(out) / loss_scale  # one transfer of its statistics a microbatch
    normalizer = rl_loss.normalizer
    return MicrobatchStats(loss=summed / normalizer if normalizer else 0.0,
                           tokens=rl_loss.tokens, normalizer=normalizer, values=rl_loss.values)


def _prefetch(ctx: OpContext, config: dict, stages: int, prefetch: Any, track_memory: bool,
              skip: tuple[int, int] | None = None) -> None:
    """Start bringing back the offloaded microbatches [stage, microbatch, seconds] that this op
    carries (`skip`: one that its own forward makes, brought back as it ends), and note the
    activation memory from now on with `track_memory` [Note: activation memory reports]."""
    for entry in prefetch or ():
        s, mb = int(entry[0]), int(entry[1])
        if (s, mb) != skip:
            held_stage(ctx, {**config, "stage": s, "stages": stages}).runner.prefetch(mb)
    if track_memory:
        for held in held_model(ctx, {**config, "stages": stages}).stages.values():
            held.runner.track_memory = True


def _backward_input(ctx: OpContext, upstream: Any, *_: Any, stage: int, stages: int,
                    microbatch: int, prefetch: Any = (), track_memory: bool = False,
                    **config: Any) -> Any:
    """B: the gradient of the stage's input activation (None on stage 0, whose inputs are
    token ids). The last stage's B reads its own F's stats only to be ordered after it."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    _prefetch(ctx, config, stages, prefetch, track_memory)
    grad_outputs = () if stage == stages - 1 else (upstream,)  # the last stage starts from its loss
    return held.runner.backward_input(microbatch, *grad_outputs)[0]


def _backward_weight(ctx: OpContext, *_: Any, stage: int, stages: int, microbatch: int,
                     prefetch: Any = (), track_memory: bool = False,
                     reduce_group: str | None = None, reduce_order: str = "forward",
                     shard: str | None = None, **config: Any) -> None:
    """W. `reduce_group`: the stage's last W of the step starts its all-reduce over that
    replica group bucket by bucket, in `reduce_order` [Note: all-reduce in the last W in
    executors/torch/train/replicas.py] (`shard` "fsdp": its reduce-scatter, once the stage is
    cut)."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    _prefetch(ctx, config, stages, prefetch, track_memory)
    buckets = _start_reducing(ctx, held, reduce_group, reduce_order, shard)
    held.runner.backward_weight(microbatch, buckets)
    if buckets is not None:
        buckets.finish()


def _backward(ctx: OpContext, upstream: Any, *_: Any, stage: int, stages: int, microbatch: int,
              prefetch: Any = (), track_memory: bool = False,
              reduce_group: str | None = None, reduce_order: str = "forward",
              shard: str | None = None, **config: Any) -> Any:
    """BW; `reduce_group`, `reduce_order` and `shard` as for W."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    _prefetch(ctx, config, stages, prefetch, track_memory)
    grad_outputs = () if stage == stages - 1 else (upstream,)  # the last stage starts from its loss
    buckets = _start_reducing(ctx, held, reduce_group, reduce_order, shard)
    out = held.runner.backward(microbatch, *grad_outputs, grads_final=buckets)[0]
    if buckets is not None:
        buckets.finish()
    return out


def _start_reducing(ctx: OpContext, held: HeldStage, group: str | None, order: str,
                    shard: str | None) -> Any:
    """The buckets the stage's last W of the step starts, kept for its reduce_grads (an FSDP
    stage's reduce-scatter too, once its first reduce_grads cut it); None when it is not that
    W. A W after buckets started (a later backprop of the model in the step) makes them
    stale."""
    if held.reducing is not None:
        held.reducing[1].discard()
        held.reducing = None
    if group is None or (shard == "fsdp" and held.fsdp is None):
        return None  # an FSDP stage's first reduce_grads cuts it, then reduce-scatters
    if held.fsdp is not None:
        buckets = fsdp.ShardsInFlight(held.fsdp, reverse=_reversed(order))
    else:
        buckets = replicas.BucketsInFlight(replicas.replica_group(ctx, group),
                                           trainable(held.module), reverse=_reversed(order))
    held.reducing = (group, buckets)
    return buckets


# -- the optimizer step [Note: the optimizer step across stages] ------------------------------
def _grad_stats(ctx: OpContext, *partner: Any, stage: int, stages: int, **config: Any) -> tuple:
    """(this stage's squared gradient norm, its tied copies' gradients). Given the first
    stage's tied gradients (on the last stage), first add them to this stage's copies."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    params = dict(held.module.named_parameters())
    # Copies, never the .grad tensors themselves: on one executor (the V shape puts the first
    # and last stage together) outputs are passed by reference, and the optimizer step scales
    # and drops .grad while the other stage may still read what was sent.
    out: dict[str, torch.Tensor] = {}
    if stage == 0 and stages > 1:  # send the tied shares; the last stage counts them
        out = {n: params[n].grad.clone() for n in held.tied if params[n].grad is not None}
    for name, grad in (partner[0] if partner and partner[0] else {}).items():
        mine = params[_partner_name(held, name)]
        _accumulate(mine, grad)
        out[name] = mine.grad.clone()  # the full gradient, back to stage 0 by its own name
    counted = [p for n, p in params.items() if not (stage == 0 and n in held.tied)]
    sqnorm = squared_norm([p.grad for p in counted])
    if held.fsdp is not None:  # the sharded rows' share, summed over the replicas
        sqnorm = fsdp.sharded_squared_norm(held.fsdp, sqnorm)
    return {"stage": stage, "sqnorm": sqnorm}, out


def squared_norm(grads: list[torch.Tensor | None]) -> float:
    """The summed squares of `grads` in float64, with one transfer from the device: each
    tensor's sum stays there, and the host adds them up in order (the sum a loop of
    `float(...)` makes, bit for bit)."""
    sums = [g.detach().double().pow(2).sum() for g in grads if g is not None]
    return sum(torch.stack(sums).tolist()) if sums else 0


def _reversed(order: str) -> bool:
    """Whether the stage's gradient buckets start last first [Note: all-reduce in the last W
    in executors/torch/train/replicas.py]."""
    if order not in ("forward", "reverse"):
        raise StageError(f"reduce_order {order!r}: 'forward' or 'reverse', the order the "
                         "stage's gradient buckets start in")
    return order == "reverse"


def _reduce_grads(ctx: OpContext, *_: Any, stage: int, stages: int, replica_group: str,
                  shard: str | None = None, reduce_order: str = "forward",
                  **config: Any) -> None:
    """Sum the stage's gradients over its replica group [Note: replica groups in
    executors/torch/train/replicas.py]. Its inputs (every replica's last action of the stage) only
    order it: no member waits in the collective while another replica still computes. With
    `shard` "fsdp" the first one cuts the stage over the group, and each keeps this replica's
    rows [Note: FSDP within a stage in executors/torch/train/fsdp.py]."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    group = replicas.replica_group(ctx, replica_group)
    started, held.reducing = held.reducing, None
    if started is not None and started[0] != replica_group:
        raise StageError(f"stage {stage}'s last W reduced over {started[0]!r}, not "
                         f"{replica_group!r}")
    if shard != "fsdp":
        if started is None:
            all_reduce_grads(group, trainable(held.module), reverse=_reversed(reduce_order))
        else:
            started[1].wait()  # [Note: all-reduce in the last W]
        return
    if started is not None:  # the cut stage's reduce-scatter, started in its last W
        started[1].wait_and_release()
        return
    if held.fsdp is None:
        where = f"model {config.get('model', '')!r} stage {stage}"
        held.fsdp = fsdp.shard_stage(group, held.module, held.tied, where)
        if held.optimizer is not None:  # a whole stage's states, loaded: cut at the step
            held.saved_states = states_by_name(held.optimizer, held.module)
            held.optimizer = None
    fsdp.reduce_and_release(held.fsdp)


def _partner_name(held: HeldStage, name: str) -> str:
    """The last stage's copy of the first stage's tied parameter `name`."""
    pairs = dict(getattr(held.module, "tied_pairs", lambda: {})())
    if name not in pairs:
        raise StageError(f"stage 0 sent a gradient for tied parameter {name!r}, but this stage "
                         f"holds no copy of it (it has {sorted(pairs)})")
    return pairs[name]


def _optimizer_step(ctx: OpContext, *inputs: Any, stage: int, stages: int, step: int = 0,
                    lr: float = 3e-4, weight_decay: float = 0.1, betas: Any = (0.9, 0.95),
                    eps: float = 1e-8, clip_grad_norm: float | None = 1.0, report: bool = False,
                    model: str = "", replica_group: str | None = None,
                    shard_optimizer: bool = False, **config: Any) -> Any:
    """Clip by the global norm over every stage, take one AdamW step, zero the gradients.
    Inputs: the microbatches' stats, each stage's grad stats, and on stage 0 also the summed
    tied gradients. Losses summed over tokens leave a normalizer in their stats: the gradients
    are divided by the step's total first [Note: RL losses in sum form in rl_loss.py]. The
    stage that `report`s returns the step's metrics. With `shard_optimizer` over the stage's
    `replica_group`, this replica steps only the parameters it owns and the replicas exchange
    them [Note: sharded optimizer states in executors/torch/train/replicas.py]."""
    held = held_stage(ctx, {**config, "model": model, "stage": stage, "stages": stages})
    # what the model's generation here samples with from now on is this step's weights (a
    # fused actor in one stage generates on the model it trains, which no weights load labels)
    held_model(ctx, {**config, "model": model, "stage": stage, "stages": stages}).version = (
        int(step) + 1)
    stats = [v for v in inputs if isinstance(v, dict) and "sqnorm" in v]
    if len(stats) != stages:
        raise StageError(f"optimizer_step of stage {stage} needs the grad stats of all "
                         f"{stages} stages, got {len(stats)}")
    params = dict(held.module.named_parameters())
    summed = [v for v in inputs if isinstance(v, dict) and "sqnorm" not in v and v]
    for tied in summed:  # stage 0: the last stage sent back the full tied gradients
        for name, grad in tied.items():
            params[name].grad = grad.to(params[name].device, params[name].dtype).clone()
    grads = [p.grad for p in params.values() if p.grad is not None]
    if held.fsdp is not None:  # the module's sharded parameters hold no gradient: the rows do
        grads += [s.rows.grad for s in held.fsdp.sharded if s.rows.grad is not None]
    trained = microbatch_stats(inputs)
    if trained and not any(s.tokens for s in trained):
        # nothing was trained on (every group filtered out, every response masked): AdamW's
        # momentum and weight decay would still move the weights. The runtime gives every
        # stage the stats, so every stage decides alike
        held.module.zero_grad(set_to_none=True)
        if held.fsdp is not None:
            held.fsdp.zero_grad()
        return step_report(inputs, model=model, step=step, grad_norm=0.0) if report else None
    normalizer = sum(s.normalizer for s in microbatch_stats(inputs))
    if normalizer > 0:
        for grad in grads:
            grad.div_(normalizer)
    # the stages' squared norms are of the summed gradients: the norm scales like them
    norm = math.sqrt(sum(s["sqnorm"] for s in stats)) / (normalizer if normalizer > 0 else 1.0)
    if clip_grad_norm:
        coef = min(1.0, float(clip_grad_norm) / (norm + 1e-6))  # torch's clip_grad_norm_
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
    if trainable(held.module):  # a LoRA stage may hold no adapter: nothing to step there
        _adamw_step(ctx, held, replica_group if shard_optimizer else None, lr=lr,
                    weight_decay=weight_decay, betas=betas, eps=eps)
    held.module.zero_grad(set_to_none=True)
    if not report:
        return None
    return step_report(inputs, model=model, step=step, grad_norm=norm)


def _adamw_step(ctx: OpContext, held: HeldStage, replica_group: str | None,
                **hparams: Any) -> None:
    """One AdamW step of the stage, made on first use; over a replica group's shards, this
    replica's share, then the replicas exchange theirs. An FSDP stage steps its rows and its
    whole parameters, and exchanges nothing: the next F gathers [Note: FSDP within a stage in
    executors/torch/train/fsdp.py]."""
    if held.fsdp is not None:
        if held.optimizer is None:
            held.optimizer = _adamw(held.fsdp.optimized(), **{**_ADAMW_DEFAULTS, **hparams})
            _load_saved_states(held)
        held.optimizer.step()
        held.fsdp.zero_grad()
        return
    group = None if replica_group is None else replicas.replica_group(ctx, replica_group)
    if held.optimizer is None:
        held.shard = None if group is None else (group.rank(), group.size())
        held.optimizer = new_optimizer(held.module, shard=held.shard, **hparams)
        if held.resumed is not None:  # [Note: layout-free checkpoints in layout_free.py]
            fill_optimizer(held.optimizer, held.module, held.resumed)
            held.resumed = None
    held.optimizer.step()
    held.module.zero_grad(set_to_none=True)
    if group is not None:
        broadcast_shards(group, trainable(held.module))


def _load_saved_states(held: HeldStage) -> None:
    """Into an FSDP stage's optimizer just made, cut to this rank's rows: the whole stage's
    states its optimizer held before FSDP cut it, or a resumed checkpoint's by name [Note:
    FSDP checkpoints in executors/torch/fsdp_rows.py]."""
    saved = held.saved_states if held.saved_states is not None else \
        (held.resumed or {}).get("states")
    if saved:
        load_named_states(held.optimizer, dict(held.module.named_parameters()), saved,
                          held.fsdp)
    held.saved_states = held.resumed = None


def trainable(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


# [Note: AdamW without dynamo] torch's optimizers wrap __init__'s add_param_group, state_dict,
# load_state_dict (torch._disable_dynamo) and step (_use_grad_for_differentiable) in wrappers
# whose first call imports torch._dynamo, for torch.compile's sake: seconds of one CPU core in
# every executor that steps an optimizer (sympy, inductor, ...; measure with `python -c "import
# time, torch; t = time.perf_counter(); import torch._dynamo; print(time.perf_counter() - t)"`),
# for nothing here, where no optimizer runs under torch.compile. `_EagerAdamW`
# calls the undecorated functions that the wrappers call (functools.wraps keeps them as
# __wrapped__), with grad mode set as step's wrapper sets it: the same arithmetic, state and
# state dicts as torch.optim.AdamW (tests/torch/test_optimizer.py compares them). Where a
# torch release keeps no __wrapped__, the wrapper itself is called: slower, the same result.
def _undecorated(fn: Any) -> Any:
    return getattr(fn, "__wrapped__", fn)


_ADD_PARAM_GROUP = _undecorated(torch.optim.Optimizer.add_param_group)
_STATE_DICT = _undecorated(torch.optim.Optimizer.state_dict)
_LOAD_STATE_DICT = _undecorated(torch.optim.Optimizer.load_state_dict)
_ADAMW_STEP = _undecorated(torch.optim.AdamW.step)


class _EagerAdamW(torch.optim.AdamW):
    """torch.optim.AdamW, never importing torch._dynamo [Note: AdamW without dynamo]."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _LOAD_STATE_DICT(self, _with_own_kernels(self.param_groups, state_dict))

    def step(self, closure: Any = None) -> Any:
        enabled = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return _ADAMW_STEP(self, closure)
        finally:
            torch.set_grad_enabled(enabled)


# [Note: AdamW kernels] On CUDA the step is torch's fused kernel (one launch for every
# parameter instead of a dozen per parameter); elsewhere the single-tensor loop, whose numbers
# the tests compare with a plain loop's bit for bit. The kernel follows where the parameters
# are, not a loaded state: a state saved on a GPU loads on a CPU and back.
_KERNEL_KEYS = ("fused", "foreach")


def adamw_kernel(device_types: set[str]) -> dict[str, bool]:
    """AdamW's kernel settings for parameters on devices of `device_types` [Note: AdamW
    kernels]."""
    return {"fused": True} if device_types == {"cuda"} else {"foreach": False}


def _with_own_kernels(groups: list[dict], state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with the kernel settings of this optimizer's `groups` [Note: AdamW
    kernels]; one of another shape as it is (loading refuses it)."""
    saved = state_dict.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(groups):
        return state_dict
    own = [{**g, **{k: mine.get(k) for k in _KERNEL_KEYS}} for g, mine in zip(saved, groups)]
    return {**state_dict, "param_groups": own}


def _adamw(params: list[torch.Tensor], **hparams: Any) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (not biases, norms), as nanoGPT configures it."""
    decay = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": hparams.pop("weight_decay")},
              {"params": plain, "weight_decay": 0.0}]
    hparams["betas"] = tuple(hparams["betas"])
    kernel = adamw_kernel({p.device.type for p in params})
    return _EagerAdamW([g for g in groups if g["params"]], **kernel, **hparams)


_ADAMW_DEFAULTS = {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}


def new_optimizer(module: torch.nn.Module, *, shard: tuple[int, int] | None = None,
                  **hparams: Any) -> torch.optim.AdamW:
    """An AdamW for `module` grouped as the optimizer step makes it (for a saved state to be
    loaded into, the defaults: its hyperparameters come with the state); with `shard`
    (rank, size), for the parameters that replica owns [Note: sharded optimizer states in
    executors/torch/train/replicas.py]."""
    params = trainable(module)
    if shard is not None:
        params = owned(params, *shard)
        if not params:
            raise StageError(f"replica {shard[0]} of {shard[1]} owns none of the stage's "
                             f"{len(trainable(module))} parameters: shard the optimizer over "
                             "fewer replicas")
    return _adamw(params, **{**_ADAMW_DEFAULTS, **hparams})


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.device, param.dtype)
    param.grad = grad.clone() if param.grad is None else param.grad.add_(grad)


def _stage_parameters(ctx: OpContext, *_: Any, stage: int, stages: int,
                      **config: Any) -> dict[str, Any]:
    """A copy of the stage's parameters by name, on the CPU (checks, checkpoints, syncing)."""
    held = held_stage(ctx, {**config, "stage": stage, "stages": stages})
    if held.fsdp is not None and not held.fsdp.gathered:
        raise StageError(f"stage {stage} is sharded over its replicas between steps (FSDP): "
                         "read every replica's fsdp_shards and join them (full_stage_state)")
    return {name: p.detach().cpu().clone() for name, p in held.module.named_parameters()}


def _activation_memory(ctx: OpContext, *_: Any, model: str, reset: bool = True) -> dict:
    """The activation bytes the model's stages here held at most since the last reset (the
    StageRunners' accounting, noted by ops given track_memory; several stages here: the sum
    of their peaks, at most that) and hold now [Note: activation memory reports]."""
    runners = [held.runner for (name, _), kept in ctx.state.get("torch_models", {}).items()
               if name == model for held in kept.stages.values()]
    now = sum(r.device_bytes for r in runners)
    peak = max(now, sum(r.peak_device_bytes for r in runners))
    if reset:
        for runner in runners:
            runner.peak_device_bytes = runner.device_bytes
    return {"peak": peak, "now": now, "unit": "bytes"}


def _zero_grad(ctx: OpContext, *_: Any, stage: int, stages: int, **config: Any) -> None:
    held_stage(ctx, {**config, "stage": stage, "stages": stages}).module.zero_grad(set_to_none=True)


# -- profiling --------------------------------------------------------------------------------
def _profile(ctx: OpContext, sample: Any, *, stage: int, stages: int, repeats: int = 3,
             **config: Any) -> dict:
    """Median seconds of F, B, W and BW of this stage on a microbatch like `sample`, for the
    planner's cost model. Earlier stages run locally to make a real input activation; the
    stage's gradients are cleared afterwards, so run it before a step's first op. Torch's
    generators are left as they were (it draws output gradients, and a dropout's masks): a
    run may profile mid-run (resumed on a stage count it had not profiled), and must draw on
    as the run that profiled at its start."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        return _measured(ctx, sample, stage=stage, stages=stages, repeats=repeats, **config)


def _measured(ctx: OpContext, sample: Any, *, stage: int, stages: int, repeats: int,
              **config: Any) -> dict:
    model = held_model(ctx, {**config, "stages": stages})
    # A microbatch of experiences (an RL loss) is timed on its sequences under the LM loss: the
    # same stages on the same tokens, and at the head a log-softmax over the vocabulary too.
    x, targets, positions = lm_rows(_tokens(sample).to(model.device),
                                    bool(config.get("packing")))
    ids = x
    packed = () if positions is None else (None, positions)  # as its microbatches run
    with torch.no_grad():
        for s in range(stage):
            x = model.parts[s](x, *packed)
    last = stage == stages - 1
    args = [x, targets, positions] if positions is not None else [x, targets]
    args = (args if last else [x, *packed]) + ([1.0] if last else [])
    runner = held_stage(ctx, {**config, "stage": stage, "stages": stages}).runner
    times: dict[str, list[float]] = {"F": [], "B": [], "W": [], "BW": []}
    for rep in range(repeats + 1):  # round 0 warms up
        for fused in (False, True):
            for kind, seconds in _profile_once(runner, ("profile", rep, fused), args,
                                               fused=fused, last=last).items():
                if rep:
                    times[kind].append(seconds)
    held_stage(ctx, {**config, "stage": stage, "stages": stages}).module.zero_grad(set_to_none=True)
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    if last and config.get("reference"):  # [Note: reference in the F]: its forward is F's
        medians["F"] += _reference_seconds(whole_model(ctx, config["reference"]), ids,
                                           positions, runner.device, repeats)
    return medians


def _reference_seconds(model: torch.nn.Module, ids: torch.Tensor,
                       positions: torch.Tensor | None, device: torch.device,
                       repeats: int) -> float:
    """Median seconds of the reference's forward on a microbatch's rows (the first warms up)."""
    clock, spent = device_clock(device), []
    for _ in range(repeats + 1):
        start = clock()
        reference_forward(model, ids, positions)
        spent.append(clock() - start)
    return statistics.median(spent[1:])


def _profile_once(runner: StageRunner, key: Any, args: list, *, fused: bool,
                  last: bool) -> dict[str, float]:
    """One microbatch through the stage: F then BW, or F, B and W; seconds of each, from and
    to the stage's device synchronized [Note: device time in executors/torch/device.py]."""
    clock = device_clock(runner.device)
    start = clock()
    out = runner.forward(key, *args)
    spent = {"F": clock() - start}
    grads = () if last else (torch.randn_like(out),)
    start = clock()
    if fused:
        runner.backward(key, *grads)
        spent["BW"] = clock() - start
        return spent
    runner.backward_input(key, *grads)
    spent["B"] = clock() - start
    start = clock()
    runner.backward_weight(key)
    spent["W"] = clock() - start
    return spent


def register(table: OpTable) -> None:
    keep_freed_memory()  # executors/torch/train/memory.py: B after W must not page-fault
    table.register("F", _forward)
    table.register("B", _backward_input)
    table.register("W", _backward_weight)
    table.register("BW", _backward)
    table.register("grad_stats", _grad_stats)
    table.register("reduce_grads", _reduce_grads)
    table.register("optimizer_step", _optimizer_step)
    table.register("zero_grad", _zero_grad)
    table.register("activation_memory", _activation_memory)
    table.register("stage_parameters", _stage_parameters)
    table.register("profile_stage", _profile)
    table.register("model_flops", model_flops)
    table.register("export_weights", export_weights)
    table.register("load_weights", load_weights)
    table.register("save_weights", save_weights)
    replicas.register(table)
    fsdp_ops.register(table)
