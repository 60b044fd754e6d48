"""What many tests build: executor clusters, op contexts and tiny models, each made one way."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from executors.optable import OpContext
from flowkit.runtime import Controller, LocalExecutors
from flowkit.runtime.dispatch import Dispatcher
from flowkit.runtime.futures import new_condition
from flowkit.runtime.launch import per_executor_tags
from flowkit.runtime.registry import ExecutorInfo
from flowkit.wire.auth import plain_client
from flowkit.wire.protocol import Msg


@contextlib.contextmanager
def executor_cluster(count: int = 2, *, kind: str = "base", tags=(), code=(),
                     name_prefix: str = "exec", **controller: Any
                     ) -> Iterator[tuple[Controller, list[ExecutorInfo]]]:
    """A controller (its options in `controller`) with `count` local executor processes; yields
    it and the executors in the order of their names, so a test can say which is which. The
    processes stop even when the test fails: a straggler would slow every later test."""
    with Controller(**controller) as ctl, LocalExecutors(
            ctl, count, kind=kind, tags=tags, code=code, name_prefix=name_prefix) as infos:
        yield ctl, sorted(infos, key=lambda e: int(e.name.rsplit("-", 1)[1]))


class ExecutorPool:
    """Clusters of executor processes that outlive one test: `pool.cluster(count, kind=...,
    tags=..., code=...)` is executor_cluster's (ctl, infos), started the first time those
    settings are asked for and handed out again after that, each executor reset first (models,
    engines, replica groups: the built-in op `reset_executor` in executors/optable.py).
    Starting a cluster costs each process its imports of flowkit and torch, seconds of a core;
    the suite asks for a few settings many times. At most `keep` clusters stay up (the least
    recently used stops first, never one a `shared` block holds); one that lost an executor (a
    test killed it) starts again. Objects a test left in an executor's store go when their
    futures do (the controller releases them), not at the reset."""

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self._clusters: dict[tuple, tuple[contextlib.ExitStack, Controller, list]] = {}
        self._held: dict[tuple, int] = {}

    @staticmethod
    def _key(count: int, kind: str = "base", tags=(), code=(), name_prefix: str = "exec"
             ) -> tuple:
        return (count, kind, tuple(map(tuple, per_executor_tags(tags, count))),
                tuple(str(path) for path in code), name_prefix)

    def cluster(self, count: int = 2, *, kind: str = "base", tags=(), code=(),
                name_prefix: str = "exec") -> tuple[Controller, list[ExecutorInfo]]:
        key = self._key(count, kind, tags, code, name_prefix)
        found = self._clusters.pop(key, None)
        if found is not None:
            stack, ctl, infos = found
            alive = {e.id for e in ctl.executors()}
            if all(e.id in alive for e in infos) and len(alive) == count:
                ctl.cancel_pending("the test before ended")  # none may hold a lane
                for reset in [ctl.submit("reset_executor", executor=e.id) for e in infos]:
                    reset.result(timeout=60)
                self._clusters[key] = found  # the most recently used last
                return ctl, infos
            stack.close()
        idle = [k for k in self._clusters if not self._held.get(k)]
        while idle and len(self._clusters) >= self.keep:
            self._clusters.pop(idle.pop(0))[0].close()
        stack = contextlib.ExitStack()
        ctl, infos = stack.enter_context(executor_cluster(
            count, kind=kind, tags=tags, code=code, name_prefix=name_prefix))
        self._clusters[key] = (stack, ctl, infos)
        return ctl, infos

    @contextlib.contextmanager
    def shared(self, count: int = 2, **settings: Any
               ) -> Iterator[tuple[Controller, list[ExecutorInfo]]]:
        """`with pool.shared(...) as (ctl, infos):` where a test had `with executor_cluster(...)`
        (a module fixture too): the cluster stays up while the block runs, and after it for the
        next test that asks for the same settings."""
        key = self._key(count, **settings)
        started = self.cluster(count, **settings)
        self._held[key] = self._held.get(key, 0) + 1
        try:
            yield started
        finally:
            self._held[key] -= 1

    def close(self) -> None:
        while self._clusters:
            self._clusters.popitem()[1][0].close()


def shared_run(pool: ExecutorPool, flow: Any, config: Any, **options: Any) -> Any:
    """`Run(flow, config)` on the executors the run would start itself (its kind, count and
    tags, config.code loaded), drawn from `pool` and shared through `Run(flow, config,
    controller=ctl)`. For runs whose steps, not their launch, are under test: a local launch
    on the CPU, no controller settings, no restarts."""
    from flowkit.runner.api import Run

    assert config.launcher == "local" and config.device == "cpu" and not config.max_restarts
    assert config.controller == type(config.controller)()
    planned = Run(flow, config, **options)  # plans the run and starts nothing
    ctl, _ = pool.cluster(planned.count, kind=planned.kind, tags=planned.tags,
                          code=config.code)
    return Run(flow, config, controller=ctl, **options)


def pooled_run(pool: ExecutorPool, flow: Any, config: Any, **options: Any) -> Any:
    """`flowkit.run(flow, config)` as a shared_run: its RunResult."""
    with shared_run(pool, flow, config, **options) as run:
        for _ in run.steps():
            pass
    return run.result


def requires(package: str, extra: str) -> None:
    """At a test module's top: skip the module where `package` is missing, as
    pytest.importorskip does, but without importing it. Every xdist worker imports every test
    module to collect it (transformers' top level took 2.5 s, peft 6 s, of each worker), so a
    heavy package is imported by the tests that use it, in the worker that runs them."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {extra} extra: pip install 'flowkit[{extra}]'",
                    allow_module_level=True)


class _DispatcherOwner:
    condition = new_condition()

    def release(self, object_id: int) -> None:
        pass


def bare_dispatcher(executors: tuple[str, ...] = ("a", "b"), *,
                    send_raw: Any = None) -> Dispatcher:
    """A controller's bookkeeping alone, no sockets: a Dispatcher whose `executors` (ids 1, 2,
    ... in order, each running op "op") have said hello; what it sends goes to `send_raw`."""
    secret = b"s" * 32
    state = Dispatcher(owner=_DispatcherOwner(), send_raw=send_raw or (lambda frames: None),
                       ping_interval=1.0, ping_timeout=5.0, heartbeat_address="inproc://unused",
                       secret=secret)
    for name in executors:
        state.on_message(name.encode(), {"t": Msg.HELLO, "name": name, "tags": [],
                                         "ops": ["op"], "pid": 1, "secret": secret.hex()}, [])
    return state


def process_of(ctl: Controller, info: ExecutorInfo) -> Any:
    """The Popen of a local executor: LocalExecutors has its controller watch each one."""
    return ctl._processes[info.pid]


def dealer(address: str, *, secret: bytes | None = None, linger: int = 0) -> zmq.Socket:
    """A bare socket to a controller's or an executor's address, to send what no flowkit peer
    would send: with the run's `secret` an insider's, whose messages get past the gate; without,
    a stranger's, dropped in its handshake [Note: strangers stop at the handshake]."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, linger)
    if secret is not None:
        plain_client(sock, secret)
    sock.connect(address)
    return sock


def op_context(name: str = "exec0") -> OpContext:
    """A fresh executor's context, for running op functions in the test process."""
    return OpContext(name=name, device="cpu", tags=())


def finished(ctx: OpContext, result: Any) -> Any:
    """What an op returned, or, if it handed its work to a Background (a Deferred), what the
    task ends with once the context's backgrounds are stepped to its end, as an executor's
    loop steps them [Note: deferred ops in executors/optable.py]."""
    from executors.optable import Deferred

    if not isinstance(result, Deferred):
        return result
    outcome: list = []
    result.bind(type("Sink", (), {"emit": lambda s, item: None,
                                  "done": lambda s, value: outcome.append(value),
                                  "fail": lambda s, error: outcome.append(error)})())
    while not outcome:
        for background in list(ctx.background.values()):
            if background.busy():
                background.step()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def generating(items: list, name: str = "exec0", **settings: Any) -> tuple[OpContext, Any, list]:
    """A generate request started in a fresh executor context and not stepped: the context,
    its rollout engine (the test steps it, aborts it...) and the list the request's rollouts
    stream into as they end."""
    from executors.torch.rollout import generate as gen

    ctx, streamed = op_context(name), []
    gen._generate(ctx, items, **settings).bind(type("Sink", (), {
        "emit": lambda s, r: streamed.append(r), "done": lambda s, r: None,
        "fail": lambda s, e: None})())
    return ctx, next(iter(ctx.background.values())), streamed


def printed(renderable: Any, *, width: int) -> str:
    """What rich prints of `renderable` on a plain-text console `width` columns wide."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def tiny_gpt(*, vocab_size: int = 64, block_size: int = 32, n_layer: int = 2, n_embd: int = 32,
             **extra: Any) -> dict:
    """A built-in GPT config small enough for a CPU test to train it many times over."""
    return {"vocab_size": vocab_size, "block_size": block_size, "n_layer": n_layer, "n_head": 2,
            "n_embd": n_embd, **extra}


def seeded_gpt(config: dict, *, seed: int = 0, dtype: Any = None) -> Any:
    """The built-in GPT as every holder of `config` and `seed` builds it: seeded, then cast to
    `dtype` (a torch dtype; None keeps float32)."""
    import torch

    from executors.torch.models.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(**config)
    return model if dtype is None else model.to(dtype)


def gpt_spec(model: str, config: dict, *, seed: int, dtype: str = "float64") -> dict:
    """A model as the torch ops take it. float64 by default: the tests compare against plain
    autograd to 1e-10, which float32's rounding would not meet."""
    return {"model": model, "build": "executors.torch.models.gpt:GPT", "model_config": config,
            "dtype": dtype, "seed": seed}


def critic_of(spec: dict) -> dict:
    """The same GPT with a value head, as a critic or reward model."""
    return {**spec, "model": "critic", "model_config": {**spec["model_config"],
                                                        "value_head": True}}


def tiny_split_bench(stages: int) -> Any:
    """The split-backward bench's smallest useful config: one block per stage."""
    from benchmarks.split_backward import SplitBenchConfig

    return SplitBenchConfig(n_embd=16, n_layer=stages, n_head=2, vocab_size=32, stages=stages,
                            batch=2, seq=8)


def plain_training(parameters: Any, loss_of: Any, *, corpus: str, steps: int, sequences: int,
                   seq_len: int, microbatches: int, lr: float, clip_grad_norm: float
                   ) -> list[float]:
    """The reference a pipeline run must equal: one process, the corpus's batches of each step
    cut into the runner's microbatches, `loss_of(batch)` (the mean next-token loss of a (B, T+1)
    batch) accumulated by each microbatch's share, global-norm clipping, AdamW with decay on
    matrices only (as the optimizer step does). Returns each step's mean microbatch loss."""
    import torch

    from dataflows.text import token_sequences
    from flowkit.runner.feeding import chunk as _chunk

    parameters = list(parameters)
    decay = [p for p in parameters if p.dim() >= 2]
    plain = [p for p in parameters if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), foreach=False)
    losses = []
    for step in range(steps):
        rows = list(token_sequences.fn(path=corpus, sequences=sequences, seq_len=seq_len,
                                       step=step))
        step_losses = []
        for mb in range(microbatches):
            batch = torch.stack(_chunk(rows, microbatches, mb))
            loss = loss_of(batch)
            (loss * len(batch) / sequences).backward()
            step_losses.append(loss.detach().item())
        torch.nn.utils.clip_grad_norm_(parameters, clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / len(step_losses))
    return losses


def trained_on_executors(ctl: Controller, flow: Any, model: str, steps: int) -> tuple:
    """Run `steps` steps of `flow` (one that trains `model`, such as pretrain_flow's) on
    `ctl`'s executors: (each step's backprop/loss, the runner)."""
    from flowkit.planner.lower import lower_flow
    from flowkit.runner.flowrun import FlowRunner

    runner = FlowRunner(ctl, lower_flow(flow))
    losses = [runner.run_step(step).metrics["backprop/loss"] for step in range(steps)]
    assert model in runner.trained
    return losses, runner


def per_stage(ctl: Controller, runner: Any, model: str, op: str,
              timeout: float = 60.0) -> dict[int, Any]:
    """`op` (stage_parameters, export_weights) run on each stage of `model` where the runner
    trained it, by stage."""
    schedule, spec = runner.trained[model]
    return {stage: ctl.submit(op, config={**spec, "stage": stage}, executor=runner.placement[
        model][schedule.placement.device_of(stage)].id).result(timeout=timeout)
        for stage in range(schedule.num_stages)}
