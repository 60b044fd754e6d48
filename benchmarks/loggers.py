"""Logger benchmark: what each `--logger` costs a step, against JSON lines alone, side by side.

Method: the step records of a GRPO run as `flowkit run` makes them (30 numbers, the
`staleness/versions` histogram, a string; values change every step). `rounds` times,
alternating, each configuration is opened in a fresh folder, logs `steps` records and is
closed:

- jsonl: the JSON-lines logger alone (`--metrics`), the baseline;
- jsonl+tensorboard: and TensorBoard (one event a step, flushed);
- jsonl+wandb: and an offline W&B run (no network; `wandb.log` hands each row to W&B's
  service process, which writes the run file).

Figures are medians over rounds: `step_us`, the time of one step's `log` to every logger;
`ratio`, that over the baseline's; `open_s` and `close_s`, opening (a W&B run starts its
service) and closing (W&B waits for its service to write everything). A configuration whose
package is missing is reported as such, not measured.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from flowkit.observe.loggers import LoggerError
from flowkit.observe.logsetup import LogSetup

__all__ = ["CONFIGS", "run_loggers_bench", "step_record"]

CONFIGS = {"jsonl": (), "jsonl+tensorboard": ("tensorboard",), "jsonl+wandb": ("wandb",)}


def step_record(step: int) -> dict:
    """A GRPO step's metrics line, its values moved by `step`."""
    wave = 1.0 + 0.1 * math.sin(step)
    record: dict = {"time": time.time(), "step": step, "step_s": 0.08 * wave,
                    "update_actor/loss": 2.6 * wave, "update_actor/tokens": 178 + step % 7,
                    "reward_mean": 0.4 * wave, "reward_max": 1.0, "rollout/samples": 16,
                    "response_length_mean": 2.1 * wave, "response_length_max": 4.0,
                    "finished_fraction": 1.0, "response/clipped_fraction": 0.0,
                    "staleness/mean": 0.5, "staleness/max": 1.0,
                    "staleness/versions": {str(step): 30, str(step + 1): 4},
                    "generate/work_imbalance": 1.18 * wave, "bubble_rate": 0.51 * wave,
                    "predicted_bubble_rate": 0.33, "tokens_per_s": 2195.0 * wave,
                    "loss": 2.6 * wave, "perf/ops_per_s": 1586.0 * wave, "note": "grpo"}
    for op in ("sort_prompts", "generate", "sort_reward", "rollout_metrics", "ref_logprobs",
               "with_reference", "grpo_advantages", "update_actor", "optimizer_step"):
        record[f"timing_s/{op}"] = 0.004 * wave
    return record


def run_loggers_bench(*, steps: int = 200, rounds: int = 3) -> dict:
    """The per-step cost of each configuration and its ratio to JSON lines alone."""
    samples: dict[str, dict[str, list[float]]] = {
        name: {"step_us": [], "open_s": [], "close_s": []} for name in CONFIGS}
    missing: dict[str, str] = {}
    records = [step_record(step) for step in range(steps)]
    # W&B's own report of each run it closes would bury the figures
    quiet = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = "true"
    try:
        with tempfile.TemporaryDirectory(prefix="flowkit-bench-loggers-") as tmp:
            _measure(Path(tmp), records, rounds, samples, missing)
    finally:
        if quiet is None:
            os.environ.pop("WANDB_SILENT")
        else:
            os.environ["WANDB_SILENT"] = quiet
    return _figures(samples, missing, steps=steps, rounds=rounds)


def _measure(tmp: Path, records: list[dict], rounds: int, samples: dict, missing: dict) -> None:
    """Each configuration `rounds` times, alternating; a missing package noted once."""
    for round_ in range(rounds):
        for name, loggers in CONFIGS.items():
            if name in missing:
                continue
            folder = tmp / f"{round_}-{name.replace('+', '-')}"
            try:
                measured = _one_round(folder, loggers, records)
            except LoggerError as exc:
                missing[name] = str(exc)
                continue
            for key, value in measured.items():
                samples[name][key].append(value)


def _one_round(folder: Path, loggers: tuple[str, ...], records: list[dict]) -> dict:
    # W&B offline whatever WANDB_MODE says: a bench must not depend on a network
    setup = LogSetup(loggers=loggers, log_dir=folder, metrics=folder / "metrics.jsonl",
                     wandb_mode="offline")
    started = time.perf_counter()
    opened = setup.open(name="bench")
    opened_at = time.perf_counter()
    for record in records:
        opened.log(record["step"], record)
    logged_at = time.perf_counter()
    opened.close()
    return {"open_s": opened_at - started,
            "step_us": (logged_at - opened_at) / len(records) * 1e6,
            "close_s": time.perf_counter() - logged_at}


def _figures(samples: dict, missing: dict, *, steps: int, rounds: int) -> dict:
    figures: dict = {"steps": steps, "rounds": rounds}
    base = statistics.median(samples["jsonl"]["step_us"])
    for name, measured in samples.items():
        if name in missing:
            figures[name] = {"missing": missing[name]}
            continue
        step_us = statistics.median(measured["step_us"])
        figures[name] = {"step_us": round(step_us, 1), "ratio": round(step_us / base, 2),
                         "open_s": round(statistics.median(measured["open_s"]), 3),
                         "close_s": round(statistics.median(measured["close_s"]), 3)}
    return figures
