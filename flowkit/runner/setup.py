"""What a run decides before anything starts: the flow with the run's training settings, which
executors run it and with which tags. Each wrong setting is a RunConfigError naming it."""

from __future__ import annotations

from importlib.metadata import entry_points

import attrs

from flowkit.dsl import Flow, Model
from flowkit.dsl.errors import FlowError
from flowkit.dsl.graph import Node
from flowkit.ops import EXECUTOR_OPS, missing_executor_ops
from flowkit.planner.lower import Call, NodePlan
from flowkit.runner.config import RunConfigError

__all__ = ["backprops_of", "check_kind", "choose_executors", "executor_kinds",
           "executor_tags", "trained_as", "training_executors", "with_training_options"]


def executor_kinds() -> tuple[str, ...]:
    """The installed executor kinds: the entries of the `flowkit.executors` group, read from
    the packages' metadata so that nothing of the executors is imported."""
    return tuple(sorted({entry.name for entry in entry_points(group="flowkit.executors")}))


def check_kind(kind: str) -> None:
    """`kind`, if an installed executor kind; else a RunConfigError naming the known ones."""
    known = executor_kinds()
    if kind not in known:
        raise RunConfigError("executors", f"unknown executor kind {kind!r}: the installed ones "
                             f"are {', '.join(known) or 'none (is flowkit installed?)'}")


def executor_tags(plan: list[NodePlan], count: int,
                  tags: tuple[tuple[str, ...], ...] | None,
                  placement: str | None = None) -> list[tuple[str, ...]]:
    """One tag tuple per executor: as given, or as `placement` says (RunConfig.placement;
    None: colocated, every executor every tag the flow asks for)."""
    if tags is not None:
        if len(tags) != count:
            raise RunConfigError("tags", f"{len(tags)} tag groups for {count} executors: give "
                                 "one per executor, ';' between them")
        return [tuple(group) for group in tags]
    wanted = sorted({tag for node in plan for tag in node.tags})
    if placement in (None, "colocated"):
        return [tuple(wanted)] * count
    trainers, training = training_executors(plan)
    others = tuple(tag for tag in wanted if tag not in training)
    if not others:
        raise RunConfigError("placement", f"--placement {placement} puts training on executors "
                             "of its own and the other ops on the rest, but every op of this "
                             f"flow runs on training's tags ({', '.join(training)}): use "
                             "--placement colocated")
    if count <= trainers:
        raise RunConfigError("placement", f"--placement {placement}: training takes "
                             f"{trainers} executors (its stages x replicas) and none is left "
                             f"for {', '.join(others)}: give --num-executors {trainers + 1} "
                             "or more")
    lent = tuple(wanted) if placement == "multiplexed" else training
    return [lent] * trainers + [others] * (count - trainers)


def training_executors(plan: list[NodePlan]) -> tuple[int, tuple[str, ...]]:
    """How many executors the trained models take (the most stages x replicas: the models
    share them) and the tags those executors carry (the trained models')."""
    trained = [node.model for node in plan if node.model is not None
               and node.call in (Call.PIPELINE, Call.STEP)]
    count = max((model.stages * model.replicas for model in trained), default=0)
    return count, tuple(sorted({tag for model in trained for tag in model.tags}))


def choose_executors(plan: list[NodePlan], kind: str) -> tuple[str, str | None]:
    """The executors' kind, and a line saying why when it was chosen for the user. `auto`:
    torch executors, which must implement every model op of the flow (they implement every op
    of the contract, flowkit.ops.EXECUTOR_OPS); base for a flow without models; the timed
    simulator runs only when asked for, never as a silent stand-in."""
    if kind != "auto":
        return kind, None
    if all(node.model is None for node in plan):
        return "base", None
    missing = missing_executor_ops(plan, EXECUTOR_OPS)
    if missing:
        raise RunConfigError(
            "executors", f"the torch executors do not implement {', '.join(missing)}: give "
            "the flow ops they implement, or run it on the timed simulator with --executors sim")
    return "torch", "executors: torch (it implements every model op of this flow)"


def check_offload(value: object, where: str = "offload",
                  memory_limit: object = None) -> None:
    """RunConfigError unless `value` is None, one of OFFLOAD_CHOICES (none, half, all), or
    auto with a `memory_limit` to choose under."""
    from flowkit.planner.offload import OFFLOAD_CHOICES

    if value is not None and value not in (*OFFLOAD_CHOICES, "auto"):
        raise RunConfigError("offload", f"{where} {value!r}: expected one of "
                             f"{', '.join(OFFLOAD_CHOICES)} (the share of each stage's "
                             "activations kept in host memory between F and B) or auto")
    if value == "auto" and memory_limit is None:
        raise RunConfigError("offload", f"{where} auto chooses none, half or all under a "
                             "memory limit, and there is none: give one (--memory-limit)")


def _check_memory_limit(node: Node, model: Model) -> None:
    """A handcrafted schedule that cannot keep within its backprop's memory limit fails here,
    before anything starts (its memory does not depend on the costs, which are profiled
    later); `auto` searches with the costs, so its run says so at the first step."""
    from flowkit.planner import Costs, ScheduleError
    from flowkit.planner.schedules import build_schedule
    from flowkit.runner.trainschedule import backprop_kind

    limit, kind = node.config.get("memory_limit"), node.config.get("schedule") or "1f1b"
    if limit is None or kind == "auto" or node.config.get("offload") == "auto":
        return
    kind = backprop_kind(kind, model.stages, model.replicas)  # the schedule the run builds
    count = -(-int(node.config.get("microbatches") or 1) // model.replicas)  # per replica
    try:
        build_schedule(kind, devices=model.stages, microbatches=count,
                       costs=Costs.uniform(model.stages), memory_limit=limit)
    except ScheduleError as exc:
        raise RunConfigError("memory_limit", f"{node.name!r}: {exc.problems[0]}: raise "
                             "the memory limit, pick a schedule that needs less (auto), or "
                             "let offload make room (--offload auto)") from None
    except ValueError:
        return  # a shape the kind cannot take: the run says so as it did


_BACKPROP_OPTIONS = ("microbatches", "microbatch_tokens", "schedule", "offload", "memory_limit")


def backprops_of(flow: Flow) -> list[Node]:
    """The nodes of `flow` that train a model (lowered to a pipeline)."""
    return [node for node in flow.nodes.values()
            if getattr(node.operator, "lowering", None) == "pipeline"]


def trained_as(model: Model, *, stages: int, replicas: int, shard_optimizer: bool,
                shard: str | None) -> Model:
    """`model` with the run's layout, its sharding checked [Note: FSDP within a stage in
    executors/torch/train/fsdp.py]: FSDP needs replicas to shard over, and replaces ZeRO-1."""
    if shard == "fsdp" and shard_optimizer:
        raise RunConfigError("fsdp", f"model {model.name!r}: FSDP shards the optimizer states "
                             "already, with the parameters and gradients: leave "
                             "--shard-optimizer (ZeRO-1) out")
    if shard == "fsdp" and replicas < 2:
        raise RunConfigError("fsdp", f"model {model.name!r}: FSDP shards each stage over its "
                             f"replicas, and it trains as {replicas}: give --replicas 2 or "
                             "more, or leave --fsdp (shard='fsdp') out")
    return attrs.evolve(model, stages=stages, replicas=replicas,
                        shard_optimizer=shard_optimizer, shard=shard)


def with_training_options(flow: Flow, *, stages: int | None, microbatches: int | None,
                          schedule: str | None, replicas: int | None = None,
                          shard_optimizer: bool = False, fsdp: bool = False,
                          offload: str | None = None,
                          memory_limit: float | None = None,
                          precision: str | None = None, packing: bool = False,
                          microbatch_tokens: int | None = None) -> Flow:
    """`flow` with every trained model cut into `stages` and trained by `replicas` (their
    optimizer states sharded over them with `shard_optimizer`, their parameters, gradients and
    optimizer states with `fsdp`), and every
    backprop run with `microbatches` (or `microbatch_tokens`) under `schedule`, `offload` of
    its activations to host
    memory and within `memory_limit`, every model computing in `precision` [Note: mixed
    precision in flowkit/dsl/operators.py] and with `packing` in packed rows, where given
    (the flow is changed in place; an
    offload the flow sets is checked).
    A backprop with fewer microbatches than its model's replicas is an error here, before
    anything starts: each replica runs at least one."""
    if schedule is not None:
        from flowkit.planner.schedules.registry import get_spec

        try:  # an unknown name fails here, before any executor starts
            get_spec(schedule)
        except ValueError as exc:
            raise RunConfigError("schedule", str(exc)) from None
    if precision is not None:  # a model cast to another dtype (a frozen copy) stays as it is
        for name, model in flow.models.items():
            if model.config.get("dtype", "float32") == "float32":
                flow.models[name] = attrs.evolve(model, precision=precision)
    if packing:
        for name, model in flow.models.items():
            flow.models[name] = attrs.evolve(model, packing=True)
    backprops = backprops_of(flow)
    for name in {node.model for node in backprops}:
        model = flow.models[name]
        flow.models[name] = trained_as(model, stages=stages or model.stages,
                                        replicas=replicas or model.replicas,
                                        shard_optimizer=shard_optimizer or model.shard_optimizer,
                                        shard="fsdp" if fsdp else model.shard)
    for node in backprops:
        if microbatches is not None:
            node.config["microbatches"] = microbatches
        if microbatch_tokens is not None:
            node.config["microbatch_tokens"] = microbatch_tokens
        if schedule is not None:
            node.config["schedule"] = schedule
        if offload is not None:
            node.config["offload"] = offload
        if memory_limit is not None:
            node.config["memory_limit"] = memory_limit
        check_offload(node.config.get("offload"), f"{node.name!r}'s offload",
                      node.config.get("memory_limit"))
        _check_memory_limit(node, flow.models[node.model])
        count, model = node.config.get("microbatches") or 1, flow.models[node.model]
        if count < model.replicas and node.config.get("microbatch_tokens") is None:
            raise RunConfigError("microbatches", f"{node.name!r} runs {count} microbatch(es) a "
                                 f"step, but model {model.name!r} trains as {model.replicas} "
                                 "replicas, each of which runs at least one: give at least "
                                 f"{model.replicas} (--microbatches {model.replicas})")
    try:
        flow.validate()
    except FlowError as exc:  # a backprop setting an option gave, as that option's error
        if any(p.port not in _BACKPROP_OPTIONS for p in exc.problems):
            raise
        problem = exc.problems[0]
        fix = f" ({problem.fix})" if problem.fix else ""
        raise RunConfigError(problem.port or "flow",
                             f"{problem.op!r}: {problem.message}{fix}") from None
    return flow


def with_rollout_engine(flow: Flow, engine: str | None) -> list[Node]:
    """Every op of `flow` (and of its evaluation flow) that declares an `engine_key` (generation)
    set to sample on `engine`, where given; returns the ops that sample on vLLM."""
    flows = [flow] + ([flow.evaluation] if flow.evaluation is not None else [])
    on_vllm = []
    for each in flows:
        for node in each.nodes.values():
            key = getattr(node.operator, "engine_key", None)
            if key is None:
                continue
            if engine is not None:
                node.config[key] = engine
            if node.config.get(key) == "vllm":
                on_vllm.append(node)
    return on_vllm


def check_vllm_nodes(flow: Flow, nodes: list[Node], *, kind: str, device: str,
                     local: bool) -> None:
    """What a vLLM engine cannot serve, refused before any executor starts: the first problem
    of the first op as one line (flowkit.ops.vllm_problems says each). Whether vllm is
    installed is looked up here only for executors this machine starts (`local`)."""
    from flowkit.ops import vllm_problems
    from flowkit.runner.training_tasks import model_spec

    if nodes and kind != "torch":
        raise RunConfigError("rollout_engine", f"--rollout-engine vllm runs on torch executors, "
                             f"and this run's are {kind}: give --executors torch, or leave "
                             "--rollout-engine out")
    for node in nodes:
        models = flow.models if node.model in flow.models else flow.evaluation.models
        spec = model_spec(models[node.model], 1)
        problems = vllm_problems(model=node.model, build=spec["build"],
                                 model_config=spec["model_config"], sampling=node.config,
                                 dtype=spec["dtype"], lora=spec.get("lora"), device=device,
                                 installed=None if local else True)
        if problems:
            raise RunConfigError("rollout_engine", problems[0])
