"""`flowkit bench dispatch|transfer|pipeline|train|rl|rollout|checkpoint|launch|loggers`:
benchmarks, each against a baseline measured side by side in the same run (this machine is
noisy: compare ratios, not times)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
from rich.console import Console

from flowkit.cli._files import writing

_BENCHES = {
    "dispatch": "benchmarks.dispatch:run_dispatch_bench",
    "transfer": "benchmarks.transfer:run_transfer_bench",
    "pipeline": "benchmarks.pipeline:run_pipeline_bench",
    "train": "benchmarks.train:run_train_bench",
    "rl": "benchmarks.rl:run_rl_bench",
    "rollout": "benchmarks.rollout:run_rollout_bench",
    "checkpoint": "benchmarks.checkpoint:run_checkpoint_bench",
    "launch": "benchmarks.launch:run_launch_bench",
    "loggers": "benchmarks.loggers:run_loggers_bench",
}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("which", type=click.Choice(sorted(_BENCHES)))
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also write the figures as JSON.")
@click.option("--mode", type=click.Choice(["barrier", "fused", "async", "partial", "all"]),
              default=None,
              help="rl only: run the steps stage by stage with barriers, fused, "
              "asynchronously, asynchronously with partial rollouts (1.5x the prompts), or "
              "all of them side by side [default: all].")
@click.option("--max-staleness", type=click.IntRange(min=0), default=None,
              help="rl only: the async modes' staleness bound η, in weights versions "
              "[default: 2].")
@click.option("--length-sigma", type=click.FloatRange(min=0.0), default=None,
              help="rl only: sigma of the log-normal response lengths (0: all the median) "
              "[default: 1.0].")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="rl only: the response token budget; lengths' median is an eighth of it "
              "[default: 512].")
@click.option("--hosts", type=click.IntRange(1, 2), default=None,
              help="dispatch and transfer only: 2 runs the executors (and the bare-zmq "
              "baseline) on two network-namespace hosts of this machine; needs root "
              "[default: 1, this host].")
@click.option("--model", type=click.Choice(["gpt", "llama", "qwen2"]), default=None,
              help="train only: the built-in GPT, or a Hugging Face decoder of its size (needs "
              "the hf extra) [default: gpt].")
@click.option("--curve", is_flag=True,
              help="dispatch and transfer only: with and without CurveZMQ (every socket "
              "authenticated and encrypted), flowkit and the bare-zmq baseline alike, "
              "alternating round by round.")
def bench(which: str, json_out: Path | None, mode: str | None, max_staleness: int | None,
          length_sigma: float | None, max_new_tokens: int | None, hosts: int | None,
          model: str | None, curve: bool) -> None:
    """Measure dispatch, executor-to-executor transfer, pipeline execution, training, RL
    steps with barriers, fused and asynchronous, generation's rollout engine, a run
    checkpoint against writing its bytes, executors' start-up under Ray against local, or each
    --logger against JSON lines alone."""
    import importlib

    rl_options = {"--mode": mode, "--max-staleness": max_staleness,
                  "--length-sigma": length_sigma, "--max-new-tokens": max_new_tokens}
    if which == "rl":
        kwargs = _rl_kwargs(mode, max_staleness, length_sigma, max_new_tokens)
    else:
        kwargs = _refuse_rl_options(which, rl_options)
    kwargs.update(_hosts_kwargs(which, hosts))
    if model is not None:
        if which != "train":
            raise click.BadParameter(f"`flowkit bench train` only, not {which!r}",
                                     param_hint="--model")
        kwargs["model"] = model
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    module_name, function = _curve_bench(which) if curve else _BENCHES[which].split(":")
    if which == "launch":
        _check_ray()
    figures = getattr(importlib.import_module(module_name), function)(**kwargs)
    console = Console()
    console.print_json(json.dumps(figures, default=str))
    if json_out is not None:
        with writing(json_out):
            json_out.write_text(json.dumps(figures, indent=1, default=str) + "\n")
        console.print(f"wrote {json_out}")


def _curve_bench(which: str) -> list[str]:
    """`--curve`: dispatch and transfer with and without CurveZMQ (benchmarks/curve.py)."""
    if which not in ("dispatch", "transfer"):
        raise click.BadParameter(f"`flowkit bench dispatch|transfer` only, not {which!r}",
                                 param_hint="--curve")
    return ["benchmarks.curve", f"run_{which}_curve"]


def _refuse_rl_options(which: str, options: dict) -> dict:
    """The rl bench's options mean nothing to the others: say so rather than ignore them."""
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise click.BadParameter(f"{', '.join(given)}: `flowkit bench rl` only, not "
                                 f"{which!r}", param_hint=given[0])
    return {}


def _hosts_kwargs(which: str, hosts: int | None) -> dict:
    """`hosts` for the benches that take it; namespaces tried before anything starts."""
    if hosts is None:
        return {}
    if which not in ("dispatch", "transfer"):
        raise click.BadParameter(f"`flowkit bench dispatch|transfer` only, not {which!r}",
                                 param_hint="--hosts")
    if hosts > 1:
        from flowkit.runtime.netns import unavailable

        why = unavailable()
        if why is not None:
            raise click.ClickException(f"--hosts {hosts} runs on network namespaces, and {why}")
    return {"hosts": hosts}


def _check_ray() -> None:
    """`flowkit bench launch` starts executors under Ray: say so before anything starts."""
    from flowkit.runtime.launch import LaunchError
    from flowkit.runtime.raylaunch import check_installed

    try:
        check_installed()
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from None


def _rl_kwargs(mode: str | None, max_staleness: int | None, length_sigma: float | None,
               max_new_tokens: int | None) -> dict:
    """run_rl_bench's arguments: the options given, the bench's defaults for the others."""
    from benchmarks.rl import MODES, RLSetup

    if max_staleness is not None and mode in ("barrier", "fused"):
        raise click.BadParameter(f"the staleness bound is the async mode's; --mode {mode} "
                                 f"runs synchronously", param_hint="--max-staleness")
    workload = {"length_sigma": length_sigma, "max_new_tokens": max_new_tokens}
    kwargs: dict = {"setup": RLSetup(**{k: v for k, v in workload.items() if v is not None}),
                    "modes": MODES if mode in (None, "all") else (mode,)}
    if max_staleness is not None:
        kwargs["max_staleness"] = max_staleness
    return kwargs
