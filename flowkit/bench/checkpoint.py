"""Checkpoint benchmark: a run checkpoint against writing its bytes, side by side on this machine.

Method: pipeline pretraining of the built-in GPT in 2 stages on 2 torch executor processes; one
step runs, so every stage has its AdamW state. Then, `rounds` times each, alternating:

- checkpoint: `write_checkpoint` as `flowkit run --checkpoint-every` calls it (both executors
  write their state files in parallel, with fsync; the controller writes its state and manifest,
  renames the folder in, prunes old ones);
- baseline: this process writes the same tensors (the executors' state files, loaded once
  here) with a plain `torch.save` to a file each, with fsync, one after the other.

Figures are medians; `ratio` is checkpoint / baseline and `overhead_s` their difference: what
a checkpoint costs beyond writing its bytes. The baseline writes serially and the executors in
parallel, so on a disk that parallel writes speed up the ratio can fall below 1.
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


def run_checkpoint_bench(*, rounds: int = 5, gpt: dict | None = None) -> dict:
    import torch

    from dataflows.pretrain import pretrain_flow
    from flowkit.planner.lower import lower_flow
    from flowkit.runtime import Controller, LocalExecutors
    from flowkit.runtime.checkpoint import flow_identity, write_checkpoint
    from flowkit.runtime.flowrun import FlowRunner

    corpus = Path(__file__).resolve().parents[2] / "examples" / "data" / "corpus.txt"
    flow = pretrain_flow(corpus=str(corpus), stages=2, microbatches=2, schedule="1f1b",
                         batch_size=4, seq_len=32, gpt=gpt or GPT)
    plan = lower_flow(flow)
    scratch = Path(tempfile.mkdtemp(prefix="flowkit-checkpoint-bench-"))
    checkpoint_s, write_s = [], []
    try:
        with Controller() as ctl, LocalExecutors(ctl, 2, kind="torch", tags=[("train",)] * 2,
                                                 name_prefix="exec") as started:
            runner = FlowRunner(ctl, plan)
            runner.run_step(0)
            identity = flow_identity(flow.name, plan)

            def checkpoint() -> Path:
                return write_checkpoint(scratch / "ck", runner, step=1, identity=identity,
                                        executors=started, kind="torch", records=[{}], keep=1)

            folder = checkpoint()
            parts = sorted((folder / "executors").iterdir())
            states = [torch.load(p, weights_only=True) for p in parts]
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
                      "torch.save + fsync of the same executor states in one process"}


def _plain_save(state: dict, path: Path) -> None:
    import torch

    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
