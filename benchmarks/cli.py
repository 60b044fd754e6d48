"""`flowkit bench codec|dispatch|transfer|pipeline|train|rl|placement|fused|fill|rollout|scale|
checkpoint|launch|loggers|trl|chaos|flood|adaptive`:
benchmarks, each against a baseline measured side by side in the same run (this machine is
noisy: compare ratios, not times).

The benches live outside the library, in the top-level `benchmarks` package, which adds this
group to `flowkit` through the entry-point group `flowkit.commands` (pyproject.toml): the library
never imports them. Each subcommand imports its bench only when it runs, so `flowkit bench
--help` loads neither them nor torch."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from flowkit.cli._files import writing


class _BenchCommand(click.Command):
    """One bench's subcommand. An option that belongs to other benches is refused by naming
    them, so that `flowkit bench dispatch --mode async` says where --mode goes."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as unknown:
            owners = _benches_taking(unknown.option_name)
            if not owners:
                raise
            raise click.UsageError(f"{unknown.option_name}: `flowkit bench {'|'.join(owners)}` "
                                   f"only, not {self.name!r}", ctx) from None


@click.group()
def bench() -> None:
    """Measure flowkit against baselines taken side by side in the same run; each bench has
    its own options (`flowkit bench BENCH --help`)."""


def _benches_taking(option: str) -> list[str]:
    return [name for name, command in bench.commands.items()
            if any(option in param.opts for param in command.params)]


def _json_option(command: Callable) -> Callable:
    return click.option("--json", "json_out", default=None,
                        type=click.Path(dir_okay=False, path_type=Path),
                        help="Also write the figures as JSON.")(command)


def _timed_steps_option(default: int) -> Callable[[Callable], Callable]:
    return click.option("--steps", type=click.IntRange(min=2), default=default,
                        show_default=True, help="GRPO steps per run (the first is not timed).")


def _width_option(help_text: str) -> Callable[[Callable], Callable]:
    return click.option("--n-embd", type=click.IntRange(min=8), default=256, show_default=True,
                        help=help_text)


def _hosts_option(command: Callable) -> Callable:
    return click.option("--hosts", type=click.IntRange(1, 2), default=None,
                        help="2 runs the executors (and the bare-zmq baseline) on two "
                        "network-namespace hosts of this machine; needs root "
                        "[default: 1, this host].")(command)


def _curve_option(command: Callable) -> Callable:
    return click.option("--curve", is_flag=True,
                        help="With and without CurveZMQ (every socket authenticated and "
                        "encrypted), flowkit and the bare-zmq baseline alike, alternating "
                        "round by round.")(command)


@bench.command(cls=_BenchCommand)
@_hosts_option
@_curve_option
@_json_option
def dispatch(hosts: int | None, curve: bool, json_out: Path | None) -> None:
    """A no-op's round trip and throughput against bare zmq."""
    _run_zmq_bench("dispatch", hosts, curve, json_out)


@bench.command(cls=_BenchCommand)
@_hosts_option
@_curve_option
@_json_option
def transfer(hosts: int | None, curve: bool, json_out: Path | None) -> None:
    """A tensor between executors against a memcpy."""
    _run_zmq_bench("transfer", hosts, curve, json_out)


@bench.command(cls=_BenchCommand)
@_json_option
def pipeline(json_out: Path | None) -> None:
    """1f1b and zb-h1 run against their simulation."""
    _report(_bench_function("pipeline", "run_pipeline_bench")(), json_out)


@bench.command(cls=_BenchCommand)
@click.option("--model", type=click.Choice(["gpt", "llama", "qwen2"]), default=None,
              help="The built-in GPT, or a Hugging Face decoder of its size (needs the hf "
              "extra) [default: gpt].")
@click.option("--replicas", default=None, metavar="D,D,...",
              help="Instead: data parallel x pipeline parallel, tokens/s at these replica "
              "counts on this CPU against one replica (e.g. 1,2), then on the simulator and "
              "the planner at D = 1, 2, 4, 8.")
@click.option("--sim-replicas", default="1,2,4", show_default=True, metavar="D,D,...",
              help="With --replicas: the replica counts run on simulator executor processes.")
@click.option("--sim-stages", type=click.IntRange(min=1), default=2, show_default=True,
              help="With --replicas: the simulator runs' pipeline devices P.")
@click.option("--sim-microbatches", type=click.IntRange(min=1), default=8, show_default=True,
              help="With --replicas: the simulator runs' microbatches a replica.")
@click.option("--sim-cost", default=None,
              help="With --replicas or --microbatch-tokens: the simulator runs' costs, "
              "NAME=VALUE,... (grad_bytes, allreduce_gbps, F, B, W, F_token, ...) [default: "
              "the bench's].")
@click.option("--precision", "precisions", default=None, metavar="P,P,...",
              help="Instead: the same pipeline training at each precision (fp32, bf16) side "
              "by side: tokens/s, each step's loss and the loss gap to the first one's.")
@click.option("--device", default="cpu", show_default=True,
              help="With --precision: the executors' device (cpu, cuda:0, cuda, ...).")
@click.option("--fsdp", is_flag=True,
              help="Instead: FSDP over 2 replicas against 2 whole replicas on the CPU, the same "
              "model, data and executors: tokens/s and each replica's state bytes.")
@click.option("--packing", is_flag=True,
              help="Instead: tokens/s of packed rows against padded ones, the same model, data "
              "(log-normal response lengths: median 64, sigma 1, budget 512) and executors.")
@click.option("--allreduce-overlap", is_flag=True,
              help="Instead: the planner's timing of a 1B model at D = 8, P = 4 (in a second): "
              "the all-reduce's hidden share and the step, after each device's last action "
              "against overlapped bucket by bucket with its last W, at 10-400 Gb/s.")
@click.option("--microbatch-tokens", type=click.IntRange(min=1), default=None, metavar="N",
              help="Instead: D = 4 simulator replicas with per-token F/B/W costs, a step's "
              "microbatches cut by count against by N tokens: the step and each replica's wait "
              "before its all-reduce (e.g. 1024).")
@_json_option
def train(model: str | None, replicas: str | None, sim_replicas: str, sim_stages: int,
          sim_microbatches: int, sim_cost: str | None, precisions: str | None, device: str,
          fsdp: bool, packing: bool, allreduce_overlap: bool, microbatch_tokens: int | None,
          json_out: Path | None) -> None:
    """Pipeline training steps against their simulation.

    Also B + W against a fused backward, and tokens/s against a plain training loop."""
    if fsdp:
        _report(_bench_function("fsdp", "run_fsdp_bench")(), json_out)
        return
    if packing:
        _report(_bench_function("packing", "run_packing_bench")(), json_out)
        return
    if allreduce_overlap:
        _report(_bench_function("replicas", "run_overlap_bench")(), json_out)
        return
    if microbatch_tokens is not None:
        _report(_token_balance(microbatch_tokens, sim_cost), json_out)
        return
    if precisions is not None:
        chosen = tuple(p.strip() for p in precisions.split(",") if p.strip())
        bad = [p for p in chosen if p not in ("fp32", "bf16")]
        if bad or not chosen:
            raise click.BadParameter(f"{', '.join(bad) or 'nothing'}: give fp32 and/or bf16, "
                                     "e.g. bf16,fp32", param_hint="--precision")
        setup = None if model is None else _train_setup(model)
        bench_fn = _bench_function("train", "run_precision_bench")
        _report(bench_fn(chosen, setup=setup, device=device), json_out)
        return
    if replicas is not None:
        sim = {"sim_replicas": _replica_counts(sim_replicas, "--sim-replicas"),
               "sim_stages": sim_stages, "sim_microbatches": sim_microbatches}
        if sim_cost is not None:
            _check_sim_cost(sim_cost)
            sim["sim_costs"] = sim_cost
        bench_fn = _bench_function("replicas", "run_replicas_bench")
        _report(bench_fn(cpu_replicas=_replica_counts(replicas, "--replicas"), **sim), json_out)
        return
    kwargs = {} if model is None else {"model": model}
    _report(_bench_function("train", "run_train_bench")(**kwargs), json_out)


def _token_balance(microbatch_tokens: int, sim_cost: str | None) -> dict:
    from benchmarks.token_balance import BalanceSetup

    setup = BalanceSetup(microbatch_tokens=microbatch_tokens)
    if sim_cost is not None:
        _check_sim_cost(sim_cost)
        setup = BalanceSetup(microbatch_tokens=microbatch_tokens, costs=sim_cost)
    return _bench_function("token_balance", "run_token_balance_bench")(setup)


def _train_setup(model: str):
    from benchmarks.train import TrainSetup

    return TrainSetup(model=model)


def _replica_counts(text: str, option: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1 or 1 not in counts:
        raise click.BadParameter(f"expected replica counts like 1,2 (1 among them: the "
                                 f"baseline), got {text!r}", param_hint=option)
    return counts


def _check_sim_cost(text: str) -> None:
    from flowkit.planner.simcosts import SimCosts

    try:
        SimCosts.parse(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sim-cost") from None


@bench.command(cls=_BenchCommand)
@click.option("--mode", type=click.Choice(["barrier", "fused", "async", "partial",
                                           "multiplexed", "colocated", "all"]),
              default=None,
              help="Run the steps stage by stage with barriers, fused, asynchronously, "
              "asynchronously with partial rollouts (1.5x the prompts), asynchronously with "
              "the train executors also generating (multiplexed) or with every executor doing "
              "both (colocated), or all of them side by side [default: all].")
@click.option("--max-staleness", type=click.IntRange(min=0), default=None,
              help="The async modes' staleness bound η, in weights versions [default: 2].")
@click.option("--length-sigma", type=click.FloatRange(min=0.0), default=None,
              help="Sigma of the log-normal response lengths (0: all the median) "
              "[default: 1.0].")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="The response token budget; lengths' median is an eighth of it "
              "[default: 512].")
@click.option("--train-scale", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="The training side's simulated costs (F, B, W, optimizer step, inference) "
              "times this: 0.25 makes generation about three quarters of a stage-by-stage "
              "step, as RL systems report; at 1 the async modes are bound by training "
              "[default: 0.25].")
@click.option("--stale-segments", type=click.Choice(["drop", "recompute"]), default=None,
              help="The partial mode's carried groups too stale for the next step: dropped "
              "(the step's own prompts all start at once) or sampled again from their prompts "
              "(they wait for a place) [default: drop].")
@_json_option
def rl(mode: str | None, max_staleness: int | None, length_sigma: float | None,
       max_new_tokens: int | None, train_scale: float | None, stale_segments: str | None,
       json_out: Path | None) -> None:
    """RL steps: barrier, fused, async, partial rollouts."""
    kwargs = _rl_kwargs(mode, max_staleness, length_sigma, max_new_tokens, train_scale,
                        stale_segments)
    _report(_bench_function("rl", "run_rl_bench")(**kwargs), json_out)


@bench.command(cls=_BenchCommand)
@click.option("--steps", type=click.IntRange(2), default=6, show_default=True,
              help="Steps per placement; the first is left out.")
@_json_option
def placement(steps: int, json_out: Path | None) -> None:
    """Lending the train executors to generation: disaggregated, multiplexed, colocated."""
    from benchmarks.placement import PlacementSetup

    _report(_bench_function("placement", "run_placement_bench")(PlacementSetup(steps=steps)),
            json_out)


@bench.command(cls=_BenchCommand)
@click.option("--steps", type=click.IntRange(2), default=4, show_default=True,
              help="PPO steps per way; the first is left out.")
@click.option("--torch/--no-torch", "with_torch", default=True, show_default=True,
              help="Also measure on torch CPU executors.")
@_json_option
def fused(steps: int, with_torch: bool, json_out: Path | None) -> None:
    """PPO's actor and critic: one fused pipeline schedule against the two in turn."""
    from benchmarks.fused import FusedSetup

    _report(_bench_function("fused", "run_fused_bench")(FusedSetup(steps=steps,
                                                                    torch=with_torch)),
            json_out)


@bench.command(cls=_BenchCommand)
@click.option("--steps", type=click.IntRange(2), default=5, show_default=True,
              help="GRPO steps per way; the first is left out.")
@_json_option
def fill(steps: int, json_out: Path | None) -> None:
    """Scoring in the trainers' pipeline bubbles against beside them and apart."""
    from benchmarks.fill import FillSetup

    _report(_bench_function("fill", "run_fill_bench")(FillSetup(steps=steps)), json_out)


@bench.command(cls=_BenchCommand)
@click.option("--engine", "engines", default=None,
              help="Rollout engines to measure instead, comma-separated (flowkit,vllm): each "
              "one's tokens/s on the same prompts and Hugging Face model, and its weight sync "
              "per step.")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="With --engine: a Hugging Face model folder [default: a tiny Qwen2 built "
              "here].")
@_json_option
def rollout(engines: str | None, model: str | None, json_out: Path | None) -> None:
    """A step's generation against its lower bound; with --engine, the rollout engines."""
    if engines is None:
        _report(_bench_function("rollout", "run_rollout_bench")(), json_out)
        return
    names = tuple(name.strip() for name in engines.split(",") if name.strip())
    try:
        figures = _bench_function("rollout_engines", "engines_figures")(names, model=model)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--engine") from None
    _report(figures, json_out)


@bench.command(cls=_BenchCommand)
@click.option("--records", type=click.IntRange(1), default=4096, show_default=True,
              help="Records in the body (a step's experiences).")
@click.option("--rounds", type=click.IntRange(1), default=7, show_default=True,
              help="Times each way; the medians are reported.")
@_json_option
def codec(records: int, rounds: int, json_out: Path | None) -> None:
    """A step's records through the wire codec against plain msgpack."""
    _report(_bench_function("codec", "run_codec_bench")(records=records, rounds=rounds),
            json_out)


@bench.command(cls=_BenchCommand)
@click.option("--samples", default="1024,4096,16384", show_default=True, metavar="N,N,...",
              help="Samples a step, one size after the other (multiples of 8).")
@click.option("--steps", type=click.IntRange(2), default=4, show_default=True,
              help="Steps per size and mode; the first is left out of the medians.")
@_json_option
def scale(samples: str, steps: int, json_out: Path | None) -> None:
    """The engine's cost per sample as a GRPO step grows."""
    try:
        sizes = [int(part) for part in samples.split(",")]
    except ValueError:
        raise click.BadParameter(f"{samples!r}: give sizes as N,N,...",
                                 param_hint="--samples") from None
    if any(size < 8 or size % 8 for size in sizes):
        raise click.BadParameter(f"{samples!r}: each size is a multiple of 8 (8 samples a "
                                 "prompt)", param_hint="--samples")
    _report(_bench_function("scale", "run_scale_bench")(samples=sizes, steps=steps), json_out)


@bench.command(cls=_BenchCommand)
@_json_option
def checkpoint(json_out: Path | None) -> None:
    """A run checkpoint against writing its bytes."""
    _report(_bench_function("checkpoint", "run_checkpoint_bench")(), json_out)


@bench.command(cls=_BenchCommand)
@_json_option
def launch(json_out: Path | None) -> None:
    """Executors' start-up: fresh processes, forked, under Ray.

    Fresh local processes against the fork server's children (cold and warm), and Ray actors
    where the ray extra is installed."""
    _report(_bench_function("launch", "run_launch_bench")(), json_out)


@bench.command(name="eval", cls=_BenchCommand)
@click.option("--steps", type=click.IntRange(min=2), default=20, show_default=True,
              help="GRPO steps per run (the first is not timed).")
@click.option("--every", type=click.IntRange(min=1), default=2, show_default=True,
              help="The runs with evaluation evaluate every this many steps.")
@_json_option
def evaluation(steps: int, every: int, json_out: Path | None) -> None:
    """What --eval-every costs a synchronous and an asynchronous run against none."""
    _report(_bench_function("evaluation", "run_eval_bench")(steps=steps, every=every),
            json_out)


@bench.command(cls=_BenchCommand)
@click.option("--samples", type=click.IntRange(min=1), default=32, show_default=True,
              help="Trajectories in the request.")
@click.option("--turns", type=click.IntRange(min=1), default=4, show_default=True,
              help="Model turns of each trajectory.")
@click.option("--latency", type=click.FloatRange(min=0), default=0.02, show_default=True,
              help="Seconds each environment step takes.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Times each way runs (medians).")
@click.option("--programs", is_flag=True,
              help="Instead: an agent program through the endpoint against the same "
                   "environment in-process (the hf and agents extras).")
@_json_option
def agent(samples: int, turns: int, latency: float, repeats: int, programs: bool,
          json_out: Path | None) -> None:
    """Multi-turn rollouts with a slow environment: the engine's overlap against one call at
    a time, and keeping cache rows against prefilling again; with --programs, what the
    OpenAI-compatible endpoint costs a turn."""
    if programs:
        _report(_bench_function("agent", "run_program_bench")(
            samples=samples, turns=turns, repeats=repeats), json_out)
        return
    _report(_bench_function("agent", "run_agent_bench")(
        samples=samples, turns=turns, latency=latency, repeats=repeats), json_out)


@bench.command(cls=_BenchCommand)
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Times each budget and batching is timed (medians).")
@_json_option
def infer(repeats: int, json_out: Path | None) -> None:
    """Reference log-probs at a CPU's 256 tokens a forward against a GPU's 4096."""
    _report(_bench_function("infer", "run_infer_bench")(repeats=repeats), json_out)


@bench.command(cls=_BenchCommand)
@_timed_steps_option(8)
@click.option("--rank", type=click.IntRange(min=1), default=8, show_default=True,
              help="The adapters' rank.")
@_width_option("The GPT's width (n_layer 4).")
@_json_option
def lora(steps: int, rank: int, n_embd: int, json_out: Path | None) -> None:
    """GRPO training LoRA adapters against training every weight."""
    _report(_bench_function("lora", "run_lora_bench")(steps=steps, rank=rank, n_embd=n_embd),
            json_out)


@bench.command("weight-sync", cls=_BenchCommand)
@_timed_steps_option(6)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Runs of each side, alternating.")
@_width_option("The GPT's width.")
@click.option("--n-layer", type=click.IntRange(min=1), default=4, show_default=True,
              help="The GPT's layers.")
@_json_option
def weight_sync(steps: int, rounds: int, n_embd: int, n_layer: int,
                json_out: Path | None) -> None:
    """GRPO whose weights reach the generator by broadcast against through the host."""
    _report(_bench_function("weight_sync", "run_weight_sync_bench")(
        steps=steps, rounds=rounds, n_embd=n_embd, n_layer=n_layer), json_out)


@bench.command(cls=_BenchCommand)
@_json_option
def loggers(json_out: Path | None) -> None:
    """What each --logger costs a step against JSON lines."""
    _report(_bench_function("loggers", "run_loggers_bench")(), json_out)


@bench.command(cls=_BenchCommand)
@click.option("--steps", type=click.IntRange(min=2), default=40, show_default=True,
              help="GRPO steps per side and seed (the first is not timed).")
@click.option("--seeds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Seeds 0 .. N-1, each side once per seed.")
@click.option("--warm-steps", type=click.IntRange(min=1), default=600, show_default=True,
              help="Steps of the supervised warm-up both sides start from.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Torch threads of each flowkit executor (the example runs two).")
@click.option("--trl-threads", type=click.IntRange(min=1), default=None,
              help="Torch threads of TRL's process [default: the same cores, as many as "
              "flowkit's executors have together].")
@click.option("--pipeline", is_flag=True,
              help="Also run flowkit with the actor in 2 pipeline stages (1F1B, 4 microbatches) "
              "on the same executors: the layout against the example's replicas.")
@click.option("--scored-reference", is_flag=True,
              help="Also run flowkit with the reference's log-probs scored by a LogProbs op "
              "instead of in the actor's forward (the example's reference_in_forward).")
@_json_option
def trl(steps: int, seeds: int, warm_steps: int, threads: int, trl_threads: int | None,
        pipeline: bool, scored_reference: bool, json_out: Path | None) -> None:
    """flowkit's GRPO beside TRL's GRPOTrainer on the Qwen2 example.

    Same model, data, reward and settings, on this CPU, one after the other. Needs the trl
    extra."""
    from benchmarks.trl import TRLMissingError, require_trl

    try:  # before anything starts
        require_trl()
    except TRLMissingError as exc:
        raise click.ClickException(str(exc)) from None
    figures = _bench_function("trl", "run_trl_bench")(steps=steps, seeds=seeds,
                                                       warm_steps=warm_steps, threads=threads,
                                                       trl_threads=trl_threads,
                                                       pipeline=pipeline,
                                                       scored_reference=scored_reference)
    Console().print(_trl_table(figures))
    if json_out is not None:
        with writing(json_out):
            json_out.write_text(json.dumps(figures, indent=1, default=str) + "\n")
        Console().print(f"wrote {json_out}")


def _trl_table(figures: dict) -> Any:
    """Per seed and side, then over seeds: seconds a step, wall time, the last 10 steps' mean
    reward; and the ratio of the step times."""
    from rich.table import Table

    setup = figures["setup"]
    threads = setup["threads"]
    table = Table(title=f"GRPO beside TRL {setup['trl']}: {setup['prompts']} x {setup['n']} "
                  f"a step, {setup['steps']} steps; threads: flowkit "
                  f"{threads['flowkit_executors']} x {threads['flowkit_per_executor']}, TRL "
                  f"{threads['trl']}")
    for column in ("seed", "side", "s/step", "wall s", "reward, last 10", "flowkit / TRL"):
        table.add_column(column, justify="left" if column == "side" else "right")
    names = {"flowkit": "flowkit", "flowkit_pipeline": "flowkit, 2 stages",
             "flowkit_scored": "flowkit, ref op", "trl": "TRL"}
    ratios = {"flowkit": "step_ratio", "flowkit_pipeline": "pipeline_step_ratio",
              "flowkit_scored": "scored_step_ratio"}
    rows = [(str(run["seed"]), run) for run in figures["runs"]] + [("all", figures)]
    for seed, where in rows:
        for side in [name for name in names if name in where]:
            got = where[side]
            table.add_row(seed, names[side], f"{got['step_s']:.3f}", f"{got['wall_s']:.1f}",
                          f"{got['reward_last10']:.3f}",
                          f"{where[ratios[side]]:.2f}x" if side in ratios else "",
                          end_section=side == "trl")
    table.caption = (f"reward curves' mean gap {figures['reward_curve_gap']:.3f} a step; "
                     f"warm-up {figures['warm_up']['steps']} steps, "
                     f"{figures['warm_up']['wall_s']:.0f} s")
    return table


@bench.command(cls=_BenchCommand)
@click.option("--seeds", "adaptive_seeds", type=click.IntRange(min=1), default=3,
              show_default=True, help="Seeds; each runs both sides, alternating.")
@click.option("--warm-steps", type=click.IntRange(min=1), default=600, show_default=True,
              help="Steps of the supervised warm-up (examples/sort_sft.py).")
@click.option("--token-budget", type=click.IntRange(min=1), default=40_000,
              show_default=True, help="Response tokens each side generates.")
@click.option("--pool", type=click.IntRange(min=1), default=64, show_default=True,
              help="Distinct prompts the steps take in turn.")
@click.option("--n-min", type=click.IntRange(min=1), default=2, show_default=True,
              help="The adaptive side's samples for every prompt.")
@click.option("--n-max", type=click.IntRange(min=1), default=8, show_default=True,
              help="The adaptive side's most samples for one prompt (8: never more than the "
                   "fixed side, so a settled prompt's samples are saved; 16: spent on the "
                   "uncertain ones).")
@click.option("--budget", type=click.IntRange(min=1), default=None,
              help="The adaptive side's samples a step (default: the fixed side's, 16 x 8).")
@click.option("--tree", is_flag=True,
              help="Compare tree rollouts with the fixed side instead of adaptive sampling.")
@click.option("--branch-at", default="1,2", show_default=True,
              help="The tree side's branch depths, comma-separated.")
@click.option("--branches", type=click.IntRange(min=2), default=2, show_default=True,
              help="The samples each branch point of the tree side forks into.")
@click.option("--branch-entropy", type=click.FloatRange(min=0), default=None,
              help="The tree side forks at its first token from each branch depth whose "
                   "distribution has at least this entropy (nats), not at the depth itself.")
@click.option("--adaptive", "adaptive_tree", is_flag=True,
              help="With --tree: the tree side spreads its roots by pass rate too; --n-min, "
                   "--n-max and --budget then count roots (e.g. --n-min 1 --n-max 4).")
@click.option("--shared-prefix", type=click.Choice(["per_leaf", "once"]), default="per_leaf",
              show_default=True,
              help="How the tree side's leaves train the tokens they share: once in each "
                   "leaf, or once in all.")
@click.option("--second-round", type=click.IntRange(min=0), default=0, show_default=True,
              help="The adaptive side samples each prompt whose first samples agree this many "
                   "more times within the step (DARS; e.g. --n-min 4 --n-max 4 "
                   "--second-round 4).")
@click.option("--second-round-budget", type=click.IntRange(min=0), default=None,
              help="The adaptive side's second-round samples a step (default: no bound).")
@click.option("--second-round-when", type=click.Choice(["agree", "fail"]), default="agree",
              show_default=True,
              help="Which prompts a second round samples again: those whose first samples "
                   "agree, or only those none of whose samples passed (DARS's hard ones).")
@_json_option
def adaptive(adaptive_seeds: int, warm_steps: int, token_budget: int, pool: int, n_min: int,
             n_max: int, budget: int | None, tree: bool, branch_at: str, branches: int,
             branch_entropy: float | None, adaptive_tree: bool, shared_prefix: str,
             second_round: int, second_round_budget: int | None, second_round_when: str,
             json_out: Path | None) -> None:
    """Adaptive samples per prompt (or, with --tree, tree rollouts) against fixed n=8 at an
    equal budget of generated tokens: tokens to a mean reward of 0.8, and the share of
    zero-advantage groups."""
    if branch_entropy is not None and not tree:
        raise click.UsageError("--branch-entropy is for the tree side: add --tree")
    if adaptive_tree and not tree:
        raise click.UsageError("--adaptive spreads the tree side's roots: add --tree (without "
                               "it the second side is adaptive sampling already)")
    if (second_round or second_round_budget is not None) and tree:
        raise click.UsageError("--second-round samples the adaptive side again: drop --tree")
    if (second_round_budget is not None or second_round_when != "agree") and not second_round:
        raise click.UsageError("--second-round-budget and --second-round-when shape a second "
                               "round: add --second-round")
    try:
        depths = tuple(int(d) for d in branch_at.split(","))
    except ValueError:
        raise click.BadParameter(f"{branch_at!r}: whole numbers, comma-separated",
                                 param_hint="--branch-at") from None
    module = importlib.import_module("benchmarks.adaptive")
    _bench_function("adaptive", "run_adaptive_bench")  # one thread per op, as the others
    setup = module.AdaptiveBench(seeds=adaptive_seeds, warm_steps=warm_steps,
                                 token_budget=token_budget, pool=pool, n_min=n_min,
                                 n_max=n_max, budget=budget, tree=tree, branch_at=depths,
                                 branches=branches, branch_entropy=branch_entropy,
                                 adaptive_tree=adaptive_tree, shared_prefix=shared_prefix,
                                 second_round=second_round,
                                 second_round_budget=second_round_budget,
                                 second_round_when=second_round_when)
    _report(module.run_adaptive_bench(setup), json_out)


@bench.command(cls=_BenchCommand)
@click.option("--seeds", type=click.IntRange(min=1), default=20, show_default=True,
              help="Runs with kills (as many again without restarts).")
@_json_option
def chaos(seeds: int, json_out: Path | None) -> None:
    """kill -9 executors at random moments: runs recovered to the clean weights under
    --max-restarts, runs failing fast and naming the executor without, and each recovery's
    time (MTTR) and throughput after, for restarts, elastic runs that shrink, and a resume by
    hand from the newest checkpoint."""
    _report(_bench_function("chaos", "run_chaos_bench")(seeds=seeds), json_out)


@bench.command(cls=_BenchCommand)
@click.option("--seconds", type=click.FloatRange(min=1), default=60, show_default=True,
              help="How long the flood lasts.")
@click.option("--target", type=click.Choice(["controller", "data"]), default="controller",
              show_default=True, help="The controller's socket, or an executor's data socket.")
@click.option("--frames", "kind", type=click.Choice(["1-byte", "done"]), default="1-byte",
              show_default=True, help="What the stranger sends: 1-byte frames or DONEs.")
@click.option("--rate", type=click.FloatRange(min=0), default=0, show_default=True,
              help="Messages a second (0: as fast as it can).")
@click.option("--who", type=click.Choice(["stranger", "past-gate"]), default="stranger",
              show_default=True, help="A stranger (no password: dropped in its handshake), or "
              "a client with the run's transport password that says no HELLO.")
@_json_option
def flood(seconds: float, target: str, kind: str, rate: float, who: str,
          json_out: Path | None) -> None:
    """A non-reading flood against a run: the controller's RSS and log growth, the answers it
    got, the run's rounds before and under it."""
    _report(_bench_function("flood", "run_flood_bench")(seconds=seconds, target=target,
                                                         kind=kind, rate=rate, who=who),
            json_out)


def _bench_function(module: str, function: str) -> Callable[..., dict]:
    """The bench, imported now that it runs; one thread per op, as the baselines run."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return getattr(importlib.import_module(f"benchmarks.{module}"), function)


def _report(figures: Any, json_out: Path | None) -> None:
    console = Console()
    console.print_json(json.dumps(figures, default=str))
    if json_out is not None:
        with writing(json_out):
            json_out.write_text(json.dumps(figures, indent=1, default=str) + "\n")
        console.print(f"wrote {json_out}")


def _run_zmq_bench(which: str, hosts: int | None, curve: bool, json_out: Path | None) -> None:
    """dispatch or transfer: flowkit against bare zmq, `--curve` with and without CurveZMQ
    (benchmarks/curve.py)."""
    kwargs = _hosts_kwargs(hosts)
    run = (_bench_function("curve", f"run_{which}_curve") if curve
           else _bench_function(which, f"run_{which}_bench"))
    _report(run(**kwargs), json_out)


def _hosts_kwargs(hosts: int | None) -> dict:
    """`hosts` as given; namespaces tried before anything starts."""
    if hosts is None:
        return {}
    if hosts > 1:
        from flowkit.runtime.netns import unavailable

        why = unavailable()
        if why is not None:
            raise click.ClickException(f"--hosts {hosts} runs on network namespaces, and {why}")
    return {"hosts": hosts}


def _rl_kwargs(mode: str | None, max_staleness: int | None, length_sigma: float | None,
               max_new_tokens: int | None, train_scale: float | None = None,
               stale_segments: str | None = None) -> dict:
    """run_rl_bench's arguments: the options given, the bench's defaults for the others."""
    from benchmarks.rl import MODES, RLSetup

    if max_staleness is not None and mode in ("barrier", "fused"):  # the rest are async
        raise click.BadParameter(f"the staleness bound is the async mode's; --mode {mode} "
                                 f"runs synchronously", param_hint="--max-staleness")
    workload = {"length_sigma": length_sigma, "max_new_tokens": max_new_tokens,
                "train_scale": train_scale, "stale_segments": stale_segments}
    kwargs: dict = {"setup": RLSetup(**{k: v for k, v in workload.items() if v is not None}),
                    "modes": MODES if mode in (None, "all") else (mode,)}
    if max_staleness is not None:
        kwargs["max_staleness"] = max_staleness
    return kwargs
