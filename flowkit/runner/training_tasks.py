"""Training a model's pipeline stages through the runtime: what each F/B/W task is told, the
profiling warm-up that gives the planner real costs, and the optimizer step across stages.

The ops themselves live with the executors (executors/torch/train/pipeline_ops.py,
executors/sim/ops.py); this module only decides what to submit where. It never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flowkit.dsl import LossSpec, Model
from flowkit.planner import Action, Costs, Kind, Placement, Schedule
from flowkit.runner.pipeline import Lane, device_lane
from flowkit.runner.replicas import finish_order
from flowkit.runtime.controller import Controller
from flowkit.runtime.dispatch import NoExecutor
from flowkit.runtime.futures import ExecutorLost, Future, wait
from flowkit.runtime.registry import ExecutorInfo

__all__ = ["model_spec", "pipeline_config", "profile_stages", "submit_exports",
           "submit_optimizer_step"]


def model_spec(model: Model, num_stages: int) -> dict:
    """The task config that names a model to its holders: every op of one model carries the
    same, so each executor builds the same weights (executors/torch/models/built.py)."""
    config = dict(model.config)
    spec = {"model": model.name, "build": model.build, "stages": num_stages,
            "seed": int(config.pop("seed", 0)), "dtype": str(config.pop("dtype", "float32")),
            "precision": model.precision}
    if model.packing:  # [Note: packed rows in executors/torch/models/packing.py]
        spec["packing"] = True
    spec["model_config"] = config
    if model.lora is not None:  # [Note: LoRA in flowkit/dsl/lora.py]
        spec["lora"] = dict(model.lora)
    return spec


def pipeline_config(base: Callable[[Action], dict], spec: dict, sizes: Sequence[int],
                    extra: dict, loss_spec: LossSpec | None, *, total: int | None = None,
                    reference: Model | None = None) -> Callable[[Action], dict]:
    """Each action's config: the simulator's cost keys, the model, stage and microbatch, the
    loss `extra` names and its knobs (as the backprop's `loss_spec` says: none without one),
    and on the last stage's F the scale of its loss: for a loss that is a mean per token the
    microbatch's share of the batch, so that the microbatches' gradients add up to the whole
    batch's (gradient accumulation); 1 for a loss in sum form, which the optimizer step
    normalizes instead. `total`: the items of the whole batch when `sizes` are one replica's
    share of it [Note: replicas in flowkit/runner/replicas.py]. `reference`: a frozen model
    whose log-probs that F takes for the KL term [Note: reference in the F in
    executors/torch/train/rows.py]."""
    total = max(1, sum(sizes) if total is None else total)
    ref_spec = None if reference is None else model_spec(reference, 1)
    last = spec["stages"] - 1
    keep = loss_spec.settings(extra) if loss_spec is not None else {}
    summed = loss_spec is not None and loss_spec.summed(extra)

    def config_for(action: Action) -> dict:
        config = {**base(action), **spec, **keep, "stage": action.stage,
                  "microbatch": action.microbatch}
        if action.kind is Kind.F and action.stage == last:
            config["loss_scale"] = 1.0 if summed else sizes[action.microbatch] / total
            if ref_spec is not None:
                config["reference"] = ref_spec
        return config

    return config_for


def profile_stages(ctl: Controller, executors: Sequence[ExecutorInfo], placement: Placement,
                   spec: dict, sample: Any, *, lane: Lane, timeout: float = 600.0,
                   reference: Model | None = None) -> Costs:
    """Per-stage F, B, W seconds measured on the executors that will run each stage, on a
    microbatch like `sample` (the executors' `profile_stage` op), as the planner's costs; the
    last stage's F with `reference`'s forward in it [Note: reference in the F in
    executors/torch/train/rows.py]."""
    futures, last = [], placement.num_stages - 1
    for stage in range(placement.num_stages):
        device = placement.device_of(stage)
        config = {**spec, "stage": stage}
        if reference is not None and stage == last:
            config["reference"] = model_spec(reference, 1)
        futures.append(ctl.submit("profile_stage", sample, config=config,
                                  executor=executors[device].id, lane=device_lane(lane, device),
                                  meta={"node": "profile", "stage": stage}))
    wait(futures, timeout=timeout)
    try:
        measured = [f.result(timeout=0) for f in futures]
    except NoExecutor as exc:  # its executor was lost before: a step failure, as its tasks'
        raise ExecutorLost(str(exc)) from None
    return Costs(F=[m["F"] for m in measured], B=[m["B"] for m in measured],
                 W=[m["W"] for m in measured])


def device_shares(stage_costs: Costs, placement: Placement) -> Costs:
    """Per-stage costs summed over each device's stages: the per-device-share costs the
    schedule builders take (they cut a share into its chunks again)."""
    shares: dict[str, list[float]] = {"F": [0.0] * placement.num_devices,
                                      "B": [0.0] * placement.num_devices,
                                      "W": [0.0] * placement.num_devices}
    for stage in range(placement.num_stages):
        device = placement.device_of(stage)
        for kind in shares:
            shares[kind][device] += getattr(stage_costs, kind)[stage]
    return Costs(comm=stage_costs.comm, **shares)


def submit_optimizer_step(ctl: Controller, schedule: Schedule, executors: Sequence[ExecutorInfo],
                          spec: dict, stats: list, config: dict, *, lane: Lane, meta: dict,
                          outputs: int, reports: bool = True,
                          reduce: Callable[[int], tuple[list, dict]] | None = None,
                          step_config: Callable[[int], dict] | None = None
                          ) -> tuple[list[Future], Any]:
    """The step across stages ([Note: the optimizer step across stages] in
    executors/torch/train/pipeline_ops.py): grad stats per stage (the last stage's adds in the first
    stage's tied gradients), then one optimizer step per stage that reads them all, and the
    microbatches' `stats` (a loss summed over tokens leaves there the normalizer every stage
    divides its gradients by). Each op runs in its device's lane, so after that device's W
    ops. Returns the futures that report nothing and stage 0's report (its `outputs`
    futures; None when not `reports`: a replica other than the first). With replicas,
    `reduce(stage)` gives the inputs and config of the stage's `reduce_grads`, which sums its
    gradients over the replicas before its grad stats [Note: replicas in
    flowkit/runner/replicas.py]; `step_config(stage)`, what its optimizer step adds (a sharded
    optimizer's group)."""
    placement, last = schedule.placement, schedule.num_stages - 1

    def submit(op: str, stage: int, *inputs: Any, n: int = 1, **more: Any) -> Any:
        device = placement.device_of(stage)
        return ctl.submit(op, *inputs, config={**config, **spec, "stage": stage, **more},
                          executor=executors[device].id, lane=device_lane(lane, device),
                          outputs=n, meta={**meta, "stage": stage, "device": device})

    # with replicas, each stage's gradients are summed first, in its device's lane right after
    # the device's last action: a device that ends early reduces while the others compute. A
    # device's stages in the order their last W started their buckets on every replica
    # (agreed_devices in flowkit/runner/replicas.py), so a replica with no microbatch starts
    # the same collectives in the same order.
    reduced = [submit("reduce_grads", stage, *after, **more) for stage in _finish_order(schedule)
               for after, more in [reduce(stage)]] if reduce is not None else []
    first_stats, tied = submit("grad_stats", 0, n=2)
    stage_stats, summed = [first_stats], None
    for stage in range(1, last + 1):
        partner = (tied,) if stage == last else ()
        stats_of, summed = submit("grad_stats", stage, *partner, n=2)
        stage_stats.append(stats_of)
    quiet = [*reduced, tied, *stage_stats[1:]] + ([summed] if last else [])

    def step(stage: int, *inputs: Any, **more: Any) -> Any:
        extra = step_config(stage) if step_config is not None else {}
        return submit("optimizer_step", stage, *stats, *stage_stats, *inputs, **extra, **more)

    for stage in range(last, 0, -1):
        quiet.append(step(stage))
    back = (summed,) if last else ()
    if not reports:
        quiet += [stage_stats[0], step(0, *back)]
        return quiet, None
    return quiet, step(0, *back, n=outputs, report=True)


def submit_exports(ctl: Controller, schedule: Schedule, executors: Sequence[ExecutorInfo],
                   spec: dict, *, lane: Lane, meta: dict, extra: Sequence[dict] = (),
                   after: Sequence[tuple] = ()) -> list[Future]:
    """Each stage's weights by the unsplit model's names (the executors' `export_weights`), in
    its device's lane: after that stage's optimizer step; `extra`, each stage's config besides
    (how the weights travel: flowkit/runner/weight_sync.py), `after`, futures each stage's
    export waits for."""
    placement = schedule.placement
    futures = []
    for stage in range(schedule.num_stages):
        device = placement.device_of(stage)
        more = extra[stage] if extra else {}
        inputs = after[stage] if after else ()
        futures.append(ctl.submit("export_weights", *inputs,
                                  config={**spec, **more, "stage": stage},
                                  executor=executors[device].id, lane=device_lane(lane, device),
                                  meta={**meta, "stage": stage, "device": device}))
    return futures


def _finish_order(schedule: Schedule) -> list[int]:
    """Every stage, each device's in the order of their last actions (finish_order), then
    those the schedule has none of (no microbatch), in stage order."""
    done = [stage for device in range(schedule.num_devices)
            for stage in finish_order(schedule, device)]
    return done + [stage for stage in range(schedule.num_stages) if stage not in done]
