"""Training benchmark on the built-in GPT (or, with `model`, a Hugging Face decoder of its
size), each figure against a baseline in the same run:

(a) B + W against a fused backward of the same microbatch (benchmarks/split_backward.py);
(b) per schedule, the bubble rate measured on torch executor processes against the simulator's
    prediction from the F/B/W costs the executors profiled (and the activation hop profiled
    in the same run);
(c) tokens/s of the pipeline run against a plain single-process training loop of the same
    model, data and batch on the same machine, using all its cores.

Each schedule's run is a `flowkit.Run` (benchmarks/runs.py) on the same executors.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import attrs

from flowkit.planner import simulate

__all__ = ["run_precision_bench", "run_train_bench"]

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "auto")


@attrs.frozen
class TrainSetup:
    stages: int = 2
    microbatches: int = 8
    batch_size: int = 32  # sequences per step
    seq_len: int = 64
    steps: int = 6  # per schedule; the first (profiling, warm-up) is not counted
    gpt: dict = attrs.field(factory=lambda: {"vocab_size": 256, "block_size": 128,
                                             "n_layer": 4, "n_head": 4, "n_embd": 128})
    # "gpt" (the built-in), or a Hugging Face architecture ("llama", "qwen2") of the same size
    model: str = "gpt"


def run_train_bench(setup: TrainSetup | None = None, *,
                    schedules: tuple[str, ...] = SCHEDULES,
                    split_backward: dict | None = None, model: str | None = None) -> dict:
    """Figures (a), (b), (c) of the module docstring; `split_backward` passes options to
    run_split_backward_bench (its configs and repeats); `model` sets the setup's model (a
    Hugging Face architecture measures HF decoder layers: `flowkit bench train --model llama`)."""
    from benchmarks.split_backward import DEFAULT_CONFIGS, run_split_backward_bench
    from executors.torch.train.memory import keep_freed_memory

    keep_freed_memory()  # as the torch executors do, for (a) and the plain loop alike
    setup = setup or TrainSetup()
    if model is not None:
        setup = attrs.evolve(setup, model=model)
    if setup.model != "gpt" and not (split_backward or {}).get("configs"):
        configs = [attrs.evolve(c, architecture=setup.model) for c in DEFAULT_CONFIGS]
        split_backward = {**(split_backward or {}), "configs": configs}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = _corpus(Path(tmp))
        pipeline = _pipeline_runs(setup, corpus, schedules)
        plain = _plain_loop(setup, corpus)
    best = max(pipeline.values(), key=lambda r: r["tokens_per_s"])
    return {
        "setup": attrs.asdict(setup),
        "split_backward": run_split_backward_bench(**(split_backward or {})),
        "schedules": pipeline,
        "plain_loop": plain,
        "pipeline_over_plain_tokens_per_s": best["tokens_per_s"] / plain["tokens_per_s"],
        "best_schedule": best["schedule"],
    }


def _corpus(folder: Path) -> str:
    from dataflows.text import synthetic_corpus

    path = folder / "corpus.txt"
    path.write_text(synthetic_corpus())
    return str(path)


def _pipeline_runs(setup: TrainSetup, corpus: str, schedules: tuple[str, ...]) -> dict:
    from benchmarks.runs import bench_run
    from dataflows.pretrain import pretrain_flow
    from flowkit.runner.schedule_run import profile_hop
    from flowkit.runtime import Controller, LocalExecutors

    out = {}
    # one set of executors for every schedule, each a Run on their controller (`controller=`)
    with Controller() as ctl, LocalExecutors(
            ctl, setup.stages, kind="torch", tags=("train",)) as started:
        infos = sorted(started, key=lambda e: e.id)
        activation = (setup.batch_size // setup.microbatches) * setup.seq_len
        hop_s = profile_hop(ctl, infos, activation * setup.gpt["n_embd"] * 4)
        for kind in schedules:
            name = f"{setup.model}-{kind}"
            flow = pretrain_flow(corpus=corpus, microbatches=setup.microbatches, schedule=kind,
                                 batch_size=setup.batch_size, seq_len=setup.seq_len,
                                 model=_model(setup, name))
            with bench_run(flow, controller=ctl, steps=setup.steps, executors="torch") as run:
                reports = list(run.steps())[1:]
                schedule, _ = run.runner.trained[name]
                costs = run.runner.profiles[(name, schedule.num_stages)]
            predicted = simulate(schedule, attrs.evolve(costs, comm=hop_s))
            out[kind] = _figures(kind, reports, setup, predicted.bubble_rate, hop_s)
    return out


def _model(setup: TrainSetup, name: str):
    """The setup's model as a flow declares it: the built-in GPT or an HF decoder its size."""
    from benchmarks.split_backward import hf_config_like
    from dataflows.models import GPT_BUILD
    from flowkit.dsl import Model

    if setup.model == "gpt":
        return Model(name=name, build=GPT_BUILD, config=dict(setup.gpt), stages=setup.stages,
                     tags=("train",))
    return Model(name=name, build="hf", stages=setup.stages, tags=("train",),
                 config={"architecture": setup.model, "hf_config": hf_config_like(setup.gpt)})


def _whole_model(setup: TrainSetup):
    from benchmarks.split_backward import hf_config_like
    from executors.torch.models.gpt import GPT

    if setup.model == "gpt":
        return GPT(**setup.gpt)
    from executors.torch.models.hf import HFCausalLM

    return HFCausalLM(architecture=setup.model, hf_config=hf_config_like(setup.gpt))


def _figures(kind: str, reports: list, setup: TrainSetup, predicted: float,
             hop_s: float) -> dict:
    tokens = setup.batch_size * setup.seq_len
    measured = statistics.median(r.metrics["bubble_rate"] for r in reports)
    step_s = statistics.median(r.elapsed_s for r in reports)
    return {"schedule": kind, "measured_bubble_rate": measured,
            "predicted_bubble_rate": predicted, "hop_s": hop_s, "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "loss_first_last": [reports[0].metrics["loss"] if "loss" in reports[0].metrics
                                else reports[0].metrics.get("backprop/loss"),
                                reports[-1].metrics.get("backprop/loss")]}


def _plain_loop(setup: TrainSetup, corpus: str) -> dict:
    """The same model, batches and accumulation in one process with every core, as a user
    without flowkit would train it."""
    import torch

    from dataflows.text import token_sequences

    threads = os.cpu_count() or 1
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = _whole_model(setup)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        times = []
        per_mb = setup.batch_size // setup.microbatches
        for step in range(setup.steps):
            rows = list(token_sequences.fn(path=corpus, sequences=setup.batch_size,
                                           seq_len=setup.seq_len, step=step))
            start = time.perf_counter()
            for mb in range(setup.microbatches):
                batch = torch.stack(rows[mb * per_mb:(mb + 1) * per_mb])
                loss = model(batch[:, :-1], batch[:, 1:])
                (loss / setup.microbatches).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(old_threads)
    step_s = statistics.median(times[1:])
    return {"threads": threads, "step_s": step_s,
            "tokens_per_s": setup.batch_size * setup.seq_len / step_s}


def run_precision_bench(precisions: tuple[str, ...] = ("fp32", "bf16"), *,
                        setup: TrainSetup | None = None, schedule: str = "zb-h1",
                        device: str = "cpu", steps: int = 10) -> dict:
    """`flowkit bench train --precision bf16,fp32`: the same pipeline training (model, data,
    schedule, executors) at each precision [Note: mixed precision in flowkit/dsl/operators.py],
    side by side in one run: tokens/s and the loss of every step, and each precision's loss gap
    to the first one's (the largest over the steps, relative)."""
    from benchmarks.runs import bench_run
    from dataflows.pretrain import pretrain_flow
    from flowkit.runtime import Controller, LocalExecutors

    setup = setup or TrainSetup()
    out: dict = {"setup": attrs.asdict(setup), "schedule": schedule, "device": device,
                 "steps": steps, "precisions": {}}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = _corpus(Path(tmp))
        with Controller() as ctl, LocalExecutors(ctl, setup.stages, kind="torch",
                                                 tags=("train",), device=device):
            for precision in precisions:
                name = f"{setup.model}-{precision}"
                model = attrs.evolve(_model(setup, name), precision=precision)
                flow = pretrain_flow(corpus=corpus, microbatches=setup.microbatches,
                                     schedule=schedule, batch_size=setup.batch_size,
                                     seq_len=setup.seq_len, model=model)
                with bench_run(flow, controller=ctl, steps=steps, executors="torch") as run:
                    reports = list(run.steps())
                out["precisions"][precision] = _precision_figures(reports, setup)
    base = out["precisions"][precisions[0]]["losses"]
    for figures in out["precisions"].values():
        figures["max_loss_gap"] = max(abs(a - b) / abs(b) for a, b in zip(figures["losses"], base))
    return out


def _precision_figures(reports: list, setup: TrainSetup) -> dict:
    timed = reports[1:]  # the first step profiles and warms up
    step_s = statistics.median(r.elapsed_s for r in timed)
    losses = [r.metrics.get("loss", r.metrics.get("backprop/loss")) for r in reports]
    return {"step_s": step_s, "tokens_per_s": setup.batch_size * setup.seq_len / step_s,
            "losses": losses, "mfu": timed[-1].metrics.get("mfu")}
