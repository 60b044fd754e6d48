"""`flowkit bench dispatch|transfer|pipeline|train|rl|rollout|checkpoint`: benchmarks, each
against a baseline measured side by side in the same run (this machine is noisy: compare
ratios, not times)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
from rich.console import Console

from flowkit.cli._files import writing

_BENCHES = {
    "dispatch": "flowkit.bench.dispatch:run_dispatch_bench",
    "transfer": "flowkit.bench.transfer:run_transfer_bench",
    "pipeline": "flowkit.bench.pipeline:run_pipeline_bench",
    "train": "flowkit.bench.train:run_train_bench",
    "rl": "flowkit.bench.rl:run_rl_bench",
    "rollout": "flowkit.bench.rollout:run_rollout_bench",
    "checkpoint": "flowkit.bench.checkpoint:run_checkpoint_bench",
}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("which", type=click.Choice(sorted(_BENCHES)))
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also write the figures as JSON.")
def bench(which: str, json_out: Path | None) -> None:
    """Measure dispatch, executor-to-executor transfer, pipeline execution, training, an RL
    step fused against stage by stage, generation's rollout engine, or a run checkpoint
    against writing its bytes."""
    import importlib

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    module_name, function = _BENCHES[which].split(":")
    figures = getattr(importlib.import_module(module_name), function)()
    console = Console()
    console.print_json(json.dumps(figures, default=str))
    if json_out is not None:
        with writing(json_out):
            json_out.write_text(json.dumps(figures, indent=1, default=str) + "\n")
        console.print(f"wrote {json_out}")
