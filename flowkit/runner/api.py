"""The public way to run a flow: `flowkit.run(flow, RunConfig(...))`, or a `Run` to go step by
step. `flowkit run` and the benchmarks are thin shells over it.

Everything that can be checked without executors is checked when the Run is made (a wrong
setting is a RunConfigError naming it); entering it starts the controller, the executors, the
loggers and the dashboard; leaving it shuts them down whatever happened, and writes the trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console

from flowkit.dsl import Flow
from flowkit.observe import Dashboard, RunStats, TraceRecorder
from flowkit.observe.loggers import LoggerError, Loggers
from flowkit.ops.peak import peak_override
from flowkit.planner.lower import Call, lower_flow
from flowkit.runner.bubble_fill import bubble_scorers
from flowkit.runner.checkpoints.format import (
    CheckpointError,
    Manifest,
    check_root,
    flow_identity,
    flow_models,
    new_run_id,
)
from flowkit.runner.checkpoints.policy import Checkpointing, resume_point
from flowkit.runner.checkpoints.restarts import Restarts, start_executors, temporary_checkpoints
from flowkit.runner.checkpoints.state_codec import allowed_records
from flowkit.runner.config import RunConfig, RunConfigError, RunError
from flowkit.runner.elastic import (
    Elastic,
    check_elastic,
    layout_for,
    relayout,
    trained_layout,
)
from flowkit.runner.evaluation import Evaluation
from flowkit.runner.flowcode import code_to_ship
from flowkit.runner.flowrun import FlowRunError, FlowRunner, StepReport, check_async
from flowkit.runner.run_checks import check_checkpoints, check_devices, check_stages, run_keys
from flowkit.runner.setup import (
    check_kind,
    check_vllm_nodes,
    choose_executors,
    executor_tags,
    with_rollout_engine,
    with_training_options,
)
from flowkit.runner.steploop import STEP_FAILURES, StepLoop
from flowkit.runtime import Controller, RemoteError
from flowkit.runtime.controller import BindError
from flowkit.runtime.futures import wait
from flowkit.runtime.launch import Launcher, LaunchError
from flowkit.runtime.launchers import make_launcher
from flowkit.wire.collection import fewer_collections

__all__ = ["Run", "RunResult", "run"]


@attrs.frozen(kw_only=True)
class RunResult:
    """How a run ended."""

    flow: str
    steps: int  # the steps done, a resumed checkpoint's included
    interrupted: bool  # stopped by Ctrl-C before the last step
    records: tuple[dict, ...]  # every step's metrics line, as the loggers got it
    checkpoint: int | None  # the step count of the newest checkpoint written, if any
    weights: tuple[Path, ...] = ()  # what `save_weights` wrote


def run(flow: Flow, config: RunConfig | None = None, *,
        console: Console | None = None) -> RunResult:
    """Run `config.steps` steps of `flow` and return how it ended. RunConfigError when a setting
    cannot work (before anything starts), RunError when the run fails."""
    with Run(flow, config, console=console) as session:
        for _ in session.steps():
            pass
    return session.result


class Run:
    """A flow's run, step by step:

        with Run(flow, RunConfig(steps=10, executors="sim")) as run:
            for report in run.steps():
                print(report.step, report.metrics)

    `run.controller`, `run.executors` and `run.runner` are there while it is entered (a
    restart replaces the last two); `run.result` after. Given a `controller` whose executors
    are already in, the run uses them and leaves them running (several runs side by side on the
    same processes, as benchmarks compare); a run that ends early (an error, a `break`) may
    leave tasks of its open steps on them. Otherwise it starts its own executors as
    `config.launcher` says and stops them."""

    def __init__(self, flow: Flow, config: RunConfig | None = None, *,
                 console: Console | None = None, controller: Controller | None = None) -> None:
        self.config = config = config or RunConfig()
        if controller is not None and config.max_restarts:
            raise RunConfigError("max_restarts", "restarts replace lost executors through the "
                                 "launcher that started them: give no controller, or no "
                                 "max_restarts")
        check_elastic(config, shared=controller is not None)
        self.console = console or Console()
        self.flow = with_training_options(flow, stages=config.stages, replicas=config.replicas,
                                          shard_optimizer=config.shard_optimizer,
                                          fsdp=config.fsdp,
                                          microbatches=config.microbatches,
                                          microbatch_tokens=config.microbatch_tokens,
                                          schedule=config.schedule,
                                          offload=config.offload,
                                          memory_limit=config.memory_limit,
                                          precision=config.precision,
                                          packing=config.packing)
        on_vllm = with_rollout_engine(self.flow, config.rollout_engine)
        check_stages(self.flow, config)
        self.plan = lower_flow(self.flow)
        self.staleness = config.staleness(self.flow.max_staleness)
        if self.staleness is not None:
            try:
                check_async(self.plan, self.staleness)
            except FlowRunError as exc:
                raise RunConfigError("asynchronous", f"--async: {exc}") from None
        if config.fill_bubbles and not bubble_scorers(self.plan):  # [Note: bubble filling]
            raise RunConfigError("fill_bubbles", "--fill-bubbles: the flow scores nothing with a "
                                 "model it does not train (reference log-probs, a frozen reward "
                                 "model), so the trainers' bubbles have nothing to run; give the "
                                 "flow a reference (kl_coef > 0) or leave --fill-bubbles out")
        self.kind, chosen = choose_executors(self.plan, config.executors)
        check_kind(self.kind)
        check_vllm_nodes(self.flow, on_vllm, kind=self.kind, device=config.device,
                         local=controller is None and config.launcher == "local")
        if chosen and controller is None:
            self.console.print(chosen, soft_wrap=True)
        stages = max((n.model.stages * n.model.replicas for n in self.plan
                      if n.model is not None), default=1)
        # a split placement: as many executors again as training takes, for the rest
        split = config.placement in ("disaggregated", "multiplexed") and config.tags is None
        self.count = config.num_executors or (2 * stages if split else max(2, stages))
        if controller is not None:
            self.count = len(controller.executors())
        self.tags = executor_tags(self.plan, self.count, config.tags, config.placement)
        if controller is None and config.launcher == "local":
            check_devices(config.device, self.count, self.plan)
        # the simulator loads no weights; executors elsewhere read their own hosts' files
        if self.kind == "torch" and controller is None and config.launcher == "local":
            check_checkpoints(self.flow)
        try:  # an MFU setting that cannot be read fails here, not after the first step
            peak_override()
        except ValueError as exc:
            raise RunConfigError("environment", str(exc)) from None
        self.keys = run_keys(config)
        # what its own executors load at start [Note: shipped code in flowkit/runner/flowcode.py]
        self.code = code_to_ship(self.flow, given=config.code)
        self.identity = flow_identity(self.flow.name, self.plan)
        self.evaluation = None if config.eval_every is None else Evaluation(
            self.flow, config.eval_every,
            sim_costs=config.sim_costs if self.kind == "sim" else None,
            step_timeout=config.step_timeout)
        self.resumed = self._resume_point()
        # a resumed run goes on with the run it resumes: its checkpoints are that run's
        self.run_id = new_run_id() if self.resumed is None else self.resumed[1].run["id"]
        self._check_checkpoint_root()
        self.shared = controller
        self.controller: Controller | None = None
        self.result: RunResult | None = None
        self.loop: StepLoop | None = None
        self._first_runner: FlowRunner | None = None
        self._started = False  # the executors are in: the trace is worth writing
        self._startup_restarts = 0  # executors that exited while they started, started again
        self._exits = contextlib.ExitStack()

    @property
    def runner(self) -> FlowRunner | None:
        """The FlowRunner running the steps (a restart makes a new one)."""
        if self.loop is not None and self.loop.runner is not None:
            return self.loop.runner
        return self._first_runner

    @property
    def executors(self) -> list:
        """The run's executors (ExecutorInfo), as the last restart left them."""
        return [] if self.loop is None else self.loop.executors

    # -- entering: everything starts ----------------------------------------------------------
    def __enter__(self) -> Run:
        try:
            self._start()
        except BaseException:
            self._exits.close()
            raise
        return self

    def _start(self) -> None:
        config, exits = self.config, self._exits
        exits.enter_context(fewer_collections())
        checkpoints = self._checkpointing(exits)
        loggers = exits.enter_context(self._open_loggers(checkpoints))
        self.recorder, self.stats = TraceRecorder(), RunStats()
        if config.trace is not None:
            exits.callback(self._write_trace, config.trace)
        launcher, started = self._executors(exits)
        self._started, ctl = True, self.controller
        for listener in (self.recorder, self.stats):
            listener.attach(ctl)
            exits.callback(ctl.remove_listener, listener)
        with self._failures():  # a flow the runner refuses (settings it cannot run)
            self._first_runner = self._make_runner()
        self.loop = StepLoop(steps=config.steps, loggers=loggers, stats=self.stats,
                             checkpoints=checkpoints, say=self.console.print,
                             executors=started, allowed_records=allowed_records(self.flow),
                             models=flow_models(self.plan), evaluation=self.evaluation)
        if config.max_restarts or config.elastic:
            self.loop.restarts = Restarts(allowed=config.max_restarts, launcher=launcher,
                                          used=self._startup_restarts,
                                          make_runner=self._make_runner,
                                          names=frozenset(e.name for e in started))
        if config.elastic:  # [Note: elastic runs in flowkit/runner/elastic.py]
            self._full_layout = trained_layout(self.flow) or (1, 1)
            self.loop.restarts.elastic = Elastic(wait_s=config.elastic_wait,
                                                 replan=self._replan, larger=self._larger)
        if self.resumed is not None:
            with self._failures():
                self.loop.resume(self.runner, self.resumed[0])
        self.board = exits.enter_context(Dashboard(
            ctl, stats=self.stats, console=self.console, enabled=config.dashboard,
            title=f"flowkit run {self.flow.name}"))
        self._checkpoints = checkpoints

    def _executors(self, exits: contextlib.ExitStack) -> tuple[Launcher | None, list]:
        """The launcher (None for a shared controller's) and the executors it started."""
        config = self.config
        if self.shared is not None:
            self.controller = self.shared
            return None, self.shared.executors()
        try:  # before any executor starts
            self.controller = ctl = exits.enter_context(Controller(
                bind=config.controller.bind, keys=self.keys, insecure=config.controller.insecure,
                max_frame_bytes=config.controller.max_frame_mib << 20))
        except BindError as exc:
            raise RunError(exc.strerror) from None
        if config.controller.secret_file is not None:
            self._write_secret(ctl, config.controller.secret_file)
        launcher = make_launcher(config.launcher, ctl, self.count, kind=self.kind,
                                 tags=self.tags, code=list(self.code), device=config.device,
                                 settings=config.launcher_settings,
                                 threads=config.executor_threads)
        exits.callback(launcher.stop)
        exits.callback(ctl.shutdown)
        try:  # with restarts, one that exits while they start is started again
            started, self._startup_restarts = start_executors(
                launcher, config.max_restarts, lambda line: self.console.print(f"[yellow]{line}"))
            return launcher, started
        except LaunchError as exc:  # e.g. Ray cannot place the executors
            raise RunError(str(exc)) from None

    def _write_secret(self, ctl: Controller, path: Path) -> None:
        """The run's secret for executors started by hand, and the line that starts one."""
        try:
            ctl.write_secret(path)
        except OSError as exc:
            raise RunError(f"cannot write the run's secret to {path} ({exc.strerror}): give "
                           f"--secret-file a new file in a folder you may write") from None
        self.console.print(f"executors started by hand: flowkit executor --connect "
                           f"{ctl.address} --secret-file {path}", markup=False, highlight=False,
                           soft_wrap=True)  # one line: a command to copy

    def _make_runner(self) -> FlowRunner:
        config = self.config
        costs = config.sim_costs if self.kind == "sim" else None  # other kinds time for real
        return FlowRunner(self.controller, self.plan, sim_costs=costs,
                          fuse=config.fuse, balance=config.balance, staleness=self.staleness,
                          steps=config.steps, step_timeout=config.step_timeout,
                          fill_bubbles=config.fill_bubbles, weight_sync=config.weight_sync)

    def _replan(self, count: int) -> tuple[FlowRunner, str]:
        """A fresh runner of the flow on the layout `count` executors allow, and that layout
        in words [Note: elastic runs in flowkit/runner/elastic.py]."""
        layout = layout_for(self._full_layout, count)
        if layout != trained_layout(self.flow):
            relayout(self.flow, *layout)
            self.plan = lower_flow(self.flow)
            self.identity = flow_identity(self.flow.name, self.plan)
            self._checkpoints.identity = self.identity  # what its next checkpoints say
            self.loop.models = flow_models(self.plan)
        return self._make_runner(), f"--stages {layout[0]} --replicas {layout[1]}"

    def _larger(self, count: int) -> bool:
        stages, replicas = layout_for(self._full_layout, count)
        now = trained_layout(self.flow) or (1, 1)
        return stages * replicas > now[0] * now[1]

    # -- the steps ----------------------------------------------------------------------------
    def steps(self) -> Iterator[StepReport]:
        """Each step's report as it ends, until `config.steps` are done or Ctrl-C stops the
        run (then `result.interrupted`). A failed step raises RunError."""
        if self.controller is None:
            raise RuntimeError("enter the Run first: `with Run(flow, config) as run:`")
        with self._failures():
            yield from self.loop.run(self.runner, self.board)

    def __exit__(self, *exc: Any) -> None:
        loop = self.loop
        if exc[0] is KeyboardInterrupt:  # between two steps, outside the step loop's reach
            loop.stopped = True
        try:
            if loop.stopped:
                self.console.print(f"{self.flow.name}: interrupted at step {loop.completed}")
            weights = self._finish(exc[0] in (None, KeyboardInterrupt),
                                   at_once=exc[0] is KeyboardInterrupt)
            if self.shared is not None:  # its executors go on: the run's replica groups end
                if exc[0] is not None or loop.stopped:  # and no task of its waits there
                    self.shared.cancel_pending(f"the run of {self.flow.name!r} ended")
                self._leave_groups()
        finally:
            self._exits.close()
        self.result = RunResult(
            flow=self.flow.name, steps=loop.completed, interrupted=loop.stopped,
            records=tuple(loop.records), weights=tuple(weights),
            checkpoint=None if self._checkpoints is None else self._checkpoints.written)
        if exc[0] is None and not loop.stopped:
            done = loop.completed
            self.console.print(f"{self.flow.name}: {done} step{'s' * (done > 1)} done")

    def _finish(self, ok: bool, at_once: bool = False) -> list[Path]:
        """What the end of a run writes while the executors are still there; `at_once`: a
        Ctrl-C outside the step loop (its second) waits for no checkpoint still open."""
        config = self.config
        if self._checkpoints is not None and self._checkpoints.pending:  # the steps were left
            if not ok or at_once:
                self._checkpoints.discard()
            else:
                with self._failures():
                    self._checkpoints.finish_pending(self.runner.checkpoints)
        if not ok:
            return []
        if (self._checkpoints is not None and self._checkpoints.written is not None
                and not self._temporary):
            self.console.print(f"checkpoint of step {self._checkpoints.written} in "
                               f"{self._checkpoints.root}")
        if config.save_weights is None:
            return []
        with self._failures():
            paths = self.runner.save_weights(config.save_weights)
        for path in paths:
            self.console.print(f"wrote {path}")
        return paths

    def _leave_groups(self) -> None:
        runner = self.runner
        if runner is not None:
            left = [f for t in runner.training.values() for f in t.leave_groups()]
            wait(left, timeout=30)  # best effort: an executor lost meanwhile has none left

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """A step's failure as a RunError of one line (the op's traceback with `debug`)."""
        try:
            yield
        except STEP_FAILURES as exc:
            raise RunError(_error_line(exc, self.config.debug)) from exc

    # -- before anything starts ---------------------------------------------------------------
    def _resume_point(self) -> tuple[Path, Manifest] | None:
        if self.config.resume is None:
            return None
        layout = [{"name": f"exec-{i}", "tags": sorted(t), "kind": self.kind}
                  for i, t in enumerate(self.tags)]
        try:
            trained = {n.model.name: n.model.replicas for n in self.plan
                       if n.model is not None and n.call is Call.PIPELINE}
            return resume_point(self.config.resume, self.identity,
                                sorted(layout, key=lambda e: e["name"]), self.staleness,
                                trained)
        except CheckpointError as exc:
            raise RunConfigError("resume", str(exc)) from None

    def _checkpointing(self, exits: contextlib.ExitStack) -> Checkpointing | None:
        """The run's checkpoints; restarts without any keep temporary ones, each step."""
        config = self.config
        self._temporary = False
        if config.checkpoints is not None:
            ck = config.checkpoints
            checkpoints = Checkpointing(root=ck.root, every=ck.every, keep=ck.keep)
        elif config.max_restarts:  # restarts reload the newest checkpoint
            root, cleanup = temporary_checkpoints()
            exits.callback(cleanup)
            checkpoints, self._temporary = Checkpointing(root=root, every=1, keep=1), True
        else:
            return None
        checkpoints.identity, checkpoints.kind = self.identity, self.kind
        checkpoints.run_id = self.run_id
        return checkpoints

    def _check_checkpoint_root(self) -> None:
        """A --checkpoint-dir holding another run's checkpoints is refused before anything
        starts [Note: run checkpoints in flowkit/runner/checkpoints/format.py]."""
        if self.config.checkpoints is None:
            return
        try:
            check_root(self.config.checkpoints.root, self.run_id)
        except CheckpointError as exc:
            raise RunConfigError("checkpoints", str(exc)) from None

    def _open_loggers(self, checkpoints: Checkpointing | None) -> Loggers:
        """The run's loggers, opened before any executor starts: a missing extra is one
        error."""
        logs = self.config.logs
        try:
            kept = self.config.checkpoints  # not restarts' temporary ones: they go at the end
            return logs.open(name=self.flow.name,
                             resume=None if self.resumed is None else self.resumed[0].parent,
                             checkpoints=None if kept is None else kept.root)
        except LoggerError as exc:
            raise RunConfigError("logs", str(exc)) from None
        except OSError as exc:  # the metrics file or the log dir: name which
            raise RunConfigError("logs", f"cannot write {exc.filename or logs.log_dir}: "
                                 f"{exc.strerror or exc}") from None

    def _write_trace(self, path: Path) -> None:
        if not self._started:  # nothing ran
            return
        self.recorder.write_chrome(path)
        self.console.print(f"wrote {path} (open it in https://ui.perfetto.dev)")


def _error_line(error: BaseException, debug: bool) -> str:
    """What failed and why; the op's remote traceback only with `debug`."""
    text, found, _ = str(error).partition(RemoteError.MARK)
    return str(error) if debug or not found else f"{text} (--debug shows the traceback)"
