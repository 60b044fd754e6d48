"""`flowkit bench train --fsdp`: FSDP within a stage against whole replicas [Note: FSDP within a
stage in executors/torch/train/fsdp.py], on the CPU: the built-in GPT of `flowkit bench train`,
one stage, D = 2 replicas on two torch executor processes (gloo), the same data and steps on
the same executors, the two modes alternating for `rounds` (the first round also warms the
processes up; a shared machine's noise shows as the rounds' spread). Per mode: tokens/s of each
round (steps after the first), the last round's losses (equal up to float32's summation order),
and each replica's bytes of the stage kept between steps: its parameters, the gradients its
optimizer steps, and the AdamW states."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import attrs

__all__ = ["run_fsdp_bench"]


def run_fsdp_bench(*, steps: int = 5, replicas: int = 2, rounds: int = 2) -> dict:
    from benchmarks.runs import bench_run
    from benchmarks.train import TrainSetup, _corpus, _model
    from dataflows.pretrain import pretrain_flow
    from flowkit.runtime import Controller, LocalExecutors

    setup = TrainSetup(stages=1, microbatches=4, batch_size=16)
    out: dict = {"setup": {"gpt": setup.gpt, "replicas": replicas, "stages": 1,
                           "sequences_per_step": setup.batch_size * replicas,
                           "seq_len": setup.seq_len, "steps": steps}}
    tokens = setup.batch_size * replicas * setup.seq_len
    with tempfile.TemporaryDirectory() as tmp, Controller() as ctl, LocalExecutors(
            ctl, replicas, kind="torch", tags=("train",)):
        corpus = _corpus(Path(tmp))
        for round_ in range(rounds):
            for mode in ("replicas", "fsdp"):
                name = f"{mode}{round_}"
                flow = pretrain_flow(corpus=corpus, microbatches=setup.microbatches * replicas,
                                     batch_size=setup.batch_size * replicas,
                                     seq_len=setup.seq_len, model=_model(setup, name))
                flow.models[name] = attrs.evolve(flow.models[name], replicas=replicas,
                                                 shard="fsdp" if mode == "fsdp" else None)
                with bench_run(flow, controller=ctl, steps=steps, executors="torch") as run:
                    reports = list(run.steps())
                    speed = _speed(reports, tokens)
                    rates = out.get(mode, {}).get("tokens_per_s_by_round", [])
                    out[mode] = {**speed, "tokens_per_s_by_round": [*rates,
                                                                    speed["tokens_per_s"]],
                                 "bytes_per_replica": _state_bytes(ctl, run.runner, name)}
    whole, sharded = (out[m]["bytes_per_replica"] for m in ("replicas", "fsdp"))
    out["fsdp_over_replicas_bytes"] = max(sum(b.values()) for b in sharded) / max(
        sum(b.values()) for b in whole)
    out["fsdp_over_replicas_tokens_per_s"] = (out["fsdp"]["tokens_per_s"]
                                              / out["replicas"]["tokens_per_s"])  # last round
    return out


def _speed(reports: list, tokens: int) -> dict:
    timed = reports[1:]  # the first step profiles and warms up
    losses = [next(v for k, v in r.metrics.items() if k.endswith("/loss")) for r in reports]
    return {"step_s": statistics.median(r.elapsed_s for r in timed),
            "tokens_per_s": tokens * len(timed) / sum(r.elapsed_s for r in timed),
            "losses": losses}


def _state_bytes(ctl, runner, name: str) -> list[dict]:
    """Each replica's stage_state_bytes of its one stage."""
    _, spec = runner.trained[name]
    training = runner.training[name]
    return [ctl.submit("stage_state_bytes", config={**spec, "stage": 0},
                       executor=training.replica(r)[0].id).result(timeout=60)
            for r in range(training.replicas)]
