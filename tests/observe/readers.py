"""Reading back what the loggers wrote, with each tool's own reader: TensorBoard's
EventAccumulator and W&B's `wandb leet inspect` of an offline run's .wandb file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> its (step, value) points in order, as TensorBoard shows them: purged events left
    out, a step logged twice there twice."""
    events = _events(folder)
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def tensorboard_histograms(folder: Path) -> dict[str, list[tuple[int, Any]]]:
    """tag -> its (step, histogram) points in order; a histogram has min, max, num, sum,
    bucket_limit and bucket."""
    events = _events(folder)
    return {tag: [(event.step, event.histogram_value) for event in events.Histograms(tag)]
            for tag in events.Tags()["histograms"]}


def wandb_offline_runs(folder: Path) -> list[Path]:
    """The .wandb files of the offline runs W&B wrote under `folder`, oldest first."""
    return sorted(Path(folder).glob("wandb/offline-run-*/run-*.wandb"))


def wandb_history(run_file: Path) -> list[dict]:
    """The rows `run.log` wrote to an offline run, in order, each with its `_step`, as W&B's
    own `wandb leet inspect` reads them (newer wandb releases have it; 0.31 here)."""
    inspect = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                              str(run_file)], capture_output=True, text=True, timeout=120,
                             check=True)
    records = [json.loads(line) for line in inspect.stdout.splitlines() if line.startswith("{")]
    return [record["history"]["item"] for record in records if record["type"] == "history"]
