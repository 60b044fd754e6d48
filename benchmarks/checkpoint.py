"""Checkpoint benchmark: a run checkpoint against writing its bytes, side by side on this machine.

Method: pipeline pretraining of the built-in GPT in 2 stages on 2 torch executor processes; one
step runs, so every stage has its AdamW state. Then, `rounds` times each, alternating:

- checkpoint: `write_checkpoint` as `flowkit run --checkpoint-every` calls it (both executors
  write their state files in parallel, with fsync; the controller writes its state and manifest,
  renames the folder in, prunes old ones);
- baseline: this process writes the same bytes (the executors' safetensors state files, read
  once here) to a file each, with fsync, one after the other.

Figures are medians; `ratio` is checkpoint / baseline and `overhead_s` their difference: what
a checkpoint costs beyond writing its bytes. The baseline writes serially and the executors in
parallel, so on a disk that parallel writes speed up the ratio can fall below 1.

Then `async`: what checkpoints cost an asynchronous run, whose checkpoint holds the open
steps' generation and so finishes only once it has ended, while the run goes on ([Note:
checkpoints that do not drain] in flowkit/runner/checkpoints/writer.py). A GRPO run on simulator
executors (the rl bench's costs and long-tailed lengths, a smaller batch), `async_steps` steps
with staleness bound η, with a checkpoint after every step (`--checkpoint-every 1`) and without,
alternating, `async_rounds` runs each on the same executors; steps/s from the end of the first
step to the end of the last, medians; `ratio` is with / without; `checkpoint_s` the median
seconds from a checkpoint's beginning at its step boundary to its folder renamed in.

Each run is a `flowkit.Run` (benchmarks/runs.py); the checkpoints are of its `run.runner`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

__all__ = ["run_checkpoint_bench"]

GPT = {"vocab_size": 256, "block_size": 64, "n_layer": 8, "n_head": 8, "n_embd": 256}


def run_checkpoint_bench(*, rounds: int = 5, gpt: dict | None = None, async_steps: int = 8,
                         async_rounds: int = 2, max_staleness: int = 2,
                         torch_steps: int = 12, torch_rounds: int = 4) -> dict:
    """The write figures, then (unless `async_steps` is 0) the asynchronous simulated run's,
    then (unless `torch_steps` is 0) the asynchronous torch run's."""
    figures = _write_bench(rounds=rounds, gpt=gpt)
    if async_steps:
        figures["async"] = run_async_checkpoint_bench(steps=async_steps, rounds=async_rounds,
                                                      max_staleness=max_staleness)
    if torch_steps:
        figures["async_torch"] = run_async_torch_checkpoint_bench(
            steps=torch_steps, rounds=torch_rounds, max_staleness=max_staleness)
    return figures


def _write_bench(*, rounds: int, gpt: dict | None) -> dict:
    from benchmarks.runs import bench_run
    from dataflows.pretrain import pretrain_flow
    from flowkit.runner.checkpoints.writer import write_checkpoint

    corpus = Path(__file__).resolve().parents[1] / "examples" / "data" / "corpus.txt"
    flow = pretrain_flow(corpus=str(corpus), stages=2, microbatches=2, schedule="1f1b",
                         batch_size=4, seq_len=32, gpt=gpt or GPT)
    scratch = Path(tempfile.mkdtemp(prefix="flowkit-checkpoint-bench-"))
    checkpoint_s, write_s = [], []
    try:
        with bench_run(flow, steps=1, executors="torch", num_executors=2,
                       tags=[("train",)] * 2) as run:
            for _ in run.steps():
                pass

            def checkpoint() -> Path:  # the run's runner and executors, after its step
                return write_checkpoint(scratch / "ck", run.runner.checkpoints, step=1,
                                        identity=run.identity, executors=run.executors,
                                        kind="torch", records=[{}], keep=1,
                                        run_id=run.run_id)

            folder = checkpoint()
            parts = sorted((folder / "executors").iterdir())
            states = [p.read_bytes() for p in parts]  # safetensors, as the executors wrote them
            nbytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            for _ in range(rounds):
                started_at = time.perf_counter()
                checkpoint()
                checkpoint_s.append(time.perf_counter() - started_at)
                started_at = time.perf_counter()
                for index, state in enumerate(states):
                    _plain_save(state, scratch / f"plain-{index}.pt")
                write_s.append(time.perf_counter() - started_at)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ckpt, plain = statistics.median(checkpoint_s), statistics.median(write_s)
    return {"checkpoint_s": ckpt, "plain_write_s": plain, "ratio": ckpt / plain,
            "overhead_s": ckpt - plain, "bytes": nbytes, "mb_per_s": nbytes / ckpt / 1e6,
            "plain_mb_per_s": nbytes / plain / 1e6, "rounds": rounds, "model": gpt or GPT,
            "method": "median of write_checkpoint (2 torch executors, fsync, rename) against "
                      "a write + fsync of the same executor states' bytes in one process"}


def _plain_save(state: bytes, path: Path) -> None:
    with open(path, "wb") as file:
        file.write(state)
        file.flush()
        os.fsync(file.fileno())


def run_async_checkpoint_bench(*, steps: int = 8, rounds: int = 2, max_staleness: int = 2,
                               prompts: int = 16, rollout_executors: int = 4) -> dict:
    """Steps/s of an asynchronous simulated GRPO run with a checkpoint after every step and
    without, side by side on the same executors."""
    from benchmarks.rl import RLSetup
    from dataflows.grpo import grpo_flow
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runtime import Controller, LocalExecutors

    _check_steps(steps)
    setup = RLSetup(prompts=prompts, rollout_executors=rollout_executors, steps=steps)
    costs = SimCosts(F=setup.F, B=setup.B, W=setup.W, optimizer_step=setup.optimizer_step,
                     token=setup.token, infer_token=setup.infer_token,
                     length_sigma=setup.length_sigma)
    flow = grpo_flow(prompts=setup.prompts, n=setup.n, stages=setup.train_executors,
                     schedule=setup.schedule, microbatches=setup.microbatches,
                     max_new_tokens=setup.max_new_tokens)
    tags = [("rollout",)] * setup.rollout_executors + [("train",)] * setup.train_executors
    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind="sim", tags=tags):
        # every run a Run on the same executors (its `controller=`)
        figures = _with_and_without(flow, steps, rounds, max_staleness, controller=ctl,
                                    executors="sim", sim_costs=costs)
    return {**figures, "samples_per_step": setup.prompts * setup.n,
            "method": "median steps/s over steps 2..N of an async GRPO run on simulator "
                      "executors, a checkpoint after every step against none, alternating"}


def run_async_torch_checkpoint_bench(*, steps: int = 12, rounds: int = 4,
                                     max_staleness: int = 2) -> dict:
    """The same on torch executors: the digit-sorting GRPO example from random weights on 1
    rollout and 2 train executors, each run starting its own, so that every executor's
    save_state writes real models and AdamW states."""
    from benchmarks.rl import _sorting_flow

    _check_steps(steps)
    tags = [("rollout",), ("train",), ("train",)]
    figures = _with_and_without(_sorting_flow(), steps, rounds, max_staleness,
                                executors="torch", num_executors=len(tags), tags=tags)
    return {**figures, "samples_per_step": 16 * 8,
            "method": "median steps/s over steps 2..N of the async GRPO sorting example on 3 "
                      "torch executors, a checkpoint after every step against none, "
                      "alternating"}


def _check_steps(steps: int) -> None:
    if steps < 2:
        raise ValueError(f"the bench measures the steps after the first: needs >= 2, got {steps}")


def _with_and_without(flow: object, steps: int, rounds: int, max_staleness: int,
                      **settings: object) -> dict:
    """`rounds` asynchronous runs of `flow` with a checkpoint after every step and without,
    alternating, with RunConfig `settings`: the medians and their ratio."""
    scratch = Path(tempfile.mkdtemp(prefix="flowkit-async-checkpoint-bench-"))
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    try:
        for index in range(rounds):
            for name in runs:
                root = scratch / f"{name}-{index}" if name == "with" else None
                runs[name].append(_async_run(flow, steps, max_staleness, root, settings))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    without = statistics.median(r["steps_per_s"] for r in runs["without"])
    with_ = statistics.median(r["steps_per_s"] for r in runs["with"])
    return {"steps_per_s_without": without, "steps_per_s_with": with_,
            "ratio": with_ / without,
            "checkpoint_s": statistics.median(s for r in runs["with"] for s in r["written_s"]),
            "staleness_max": max(r["staleness_max"] for rs in runs.values() for r in rs),
            "max_staleness": max_staleness, "steps": steps, "rounds": rounds}


def _async_run(flow: object, steps: int, staleness: int, root: Path | None,
               settings: dict) -> dict:
    """An asynchronous run of `flow` with RunConfig `settings`; with `root`, a checkpoint there
    after every step as `flowkit run --checkpoint-every 1` writes them: begun at the step boundary,
    finished while the run goes on [Note: checkpoints that do not drain in
    flowkit/runner/checkpoints/writer.py], each timed from its beginning to its folder renamed
    in."""
    from benchmarks.runs import bench_run
    from flowkit.runner.config import CheckpointConfig

    ends, stale = [], []
    if root is not None:
        settings = {**settings, "checkpoints": CheckpointConfig(root=root, every=1, keep=steps)}
    with bench_run(flow, steps=steps, asynchronous=True, max_staleness=staleness,
                   **settings) as run:
        for report in run.steps():
            stale.append(report.metrics.get("staleness/max", 0))
            ends.append(time.perf_counter())
    written = [] if root is None else _written_s(root)
    return {"steps_per_s": (steps - 1) / (ends[-1] - ends[0]), "written_s": written,
            "staleness_max": max(stale)}


def _written_s(root: Path) -> list[float]:
    """Each kept checkpoint's seconds from begun to renamed in (its manifest's)."""
    from flowkit.runner.checkpoints.format import complete_checkpoints, read_manifest

    return [read_manifest(folder).written_s for folder in complete_checkpoints(root)]
