"""`flowkit schedule`: build, validate and simulate a pipeline schedule, or compare them all."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import click
from rich.console import Console
from rich.table import Table

from flowkit.cli._files import writing
from flowkit.planner import (
    Costs,
    Kind,
    MemoryModel,
    Schedule,
    ScheduleError,
    SimResult,
    simulate,
)
from flowkit.planner.export import schedule_to_json
from flowkit.planner.offload import best_with_offload, offload_schedule
from flowkit.planner.schedules import build_schedule, get_spec, schedule_kinds
from flowkit.planner.simulate import Interval
from flowkit.planner.validate import validate

__all__ = ["parse_costs", "parse_memory", "parse_model_dims", "schedule"]


def _split_keyed(text: str, option: str, keys: tuple[str, ...]) -> dict[str, list[float]]:
    """'F=1,1,2,B=1,W=0.5' -> {'F': [1, 1, 2], 'B': [1], 'W': [0.5]}: a value without a key
    belongs to the key before it, so per-share lists need no extra quoting."""
    out: dict[str, list[float]] = {}
    current = None
    for token in (t.strip() for t in text.split(",")):
        if "=" in token:
            current, _, token = (s.strip() for s in token.partition("="))
            current = current.upper()
            if current not in keys:
                raise click.BadParameter(f"unknown key {current!r}; use {', '.join(keys)}",
                                         param_hint=option)
            if current in out:
                raise click.BadParameter(f"{current} is given twice", param_hint=option)
            out[current] = []
        if current is None:
            raise click.BadParameter(f"expected KEY=VALUE, got {token!r}", param_hint=option)
        try:
            value = float(token)
        except ValueError:
            raise click.BadParameter(f"{current} has a non-number value {token!r}",
                                     param_hint=option) from None
        if not math.isfinite(value):
            raise click.BadParameter(f"{current} must be a finite number, got {token!r}",
                                     param_hint=option)
        out[current].append(value)
    return out


class _FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses inf and nan (which compare as in range)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def parse_costs(text: str, *, devices: int, comm: float) -> Costs:
    """--cost: F, B and W, each one value for every device share or exactly `devices` values."""
    values = _split_keyed(text, "--cost", ("F", "B", "W"))
    missing = [k for k in ("F", "B", "W") if k not in values]
    if missing:
        raise click.BadParameter(f"needs F, B and W; missing {', '.join(missing)}",
                                 param_hint="--cost")
    for key, vals in values.items():
        if len(vals) == 1:
            values[key] = vals * devices
        elif len(vals) != devices:
            raise click.BadParameter(
                f"{key} needs 1 value or one per device share ({devices} for --stages "
                f"{devices}), got {len(vals)}",
                param_hint="--cost",
            )
        if any(v < 0 for v in values[key]):
            raise click.BadParameter(f"{key} costs must be >= 0", param_hint="--cost")
    return Costs(F=values["F"], B=values["B"], W=values["W"], comm=comm)


def parse_memory(text: str | None) -> MemoryModel:
    """--mem: one value each; BW defaults to B + W so the fused backward frees what B, W do."""
    if text is None:
        return MemoryModel()
    values = _split_keyed(text, "--mem", ("F", "B", "W", "BW"))
    for key, vals in values.items():
        if len(vals) != 1:
            raise click.BadParameter(f"{key} takes one value, got {len(vals)}", param_hint="--mem")
    base = MemoryModel()
    f, b, w = (values.get(k, [getattr(base, k)])[0] for k in ("F", "B", "W"))
    given = ",".join(f"{k}={values[k][0]:g}" for k in ("F", "B", "W", "BW") if k in values)
    bw = values.get("BW", [b + w])[0]
    if not math.isclose(bw, b + w, abs_tol=1e-9):
        raise click.BadParameter(
            f"{given} gives BW = {bw:g}, but BW, the fused backward, frees what B and W free: "
            f"B+W = {b + w:g}; drop BW (it defaults to B+W) or give BW={b + w:g}",
            param_hint="--mem",
        )
    return MemoryModel(F=f, B=b, W=w, BW=bw)


def parse_model_dims(text: str) -> MemoryModel:
    """--model-dims s=SEQ,b=MICROBATCH,h=HIDDEN,a=HEADS: the paper's Table 1 memory model."""
    values = _split_keyed(text, "--model-dims", ("S", "B", "H", "A"))
    missing = [k.lower() for k in ("S", "B", "H", "A") if k not in values]
    if missing:
        raise click.BadParameter(f"needs s, b, h and a; missing {', '.join(missing)}",
                                 param_hint="--model-dims")
    dims = {}
    for key, vals in values.items():
        if len(vals) != 1 or vals[0] < 1 or vals[0] != int(vals[0]):
            raise click.BadParameter(f"{key.lower()} takes one positive integer",
                                     param_hint="--model-dims")
        dims[key] = int(vals[0])
    return MemoryModel.from_dims(seq=dims["S"], micro_batch=dims["B"], hidden=dims["H"],
                                 heads=dims["A"])


def _device_table(schedule: Schedule, result: SimResult) -> Table:
    table = Table(title=_headline(schedule), title_justify="left")
    for column in ("device", "stages", "busy", "span", "idle", "peak memory"):
        table.add_column(column, justify="left" if column == "stages" else "right")
    for d in range(schedule.num_devices):
        span, busy = result.device_span[d], result.busy[d]
        table.add_row(str(d), ",".join(map(str, schedule.placement.stages_on(d))),
                      f"{busy:.6g}", f"{span:.6g}", f"{span - busy:.6g}",
                      f"{result.peak_memory[d]:.4g}")
    return table


def _headline(schedule: Schedule) -> str:
    p = schedule.placement
    return (f"{schedule.kind}: {p.num_devices} devices, {p.num_stages} stages, "
            f"{schedule.microbatches} microbatches")


def _summary(result: SimResult) -> str:
    return (f"makespan {result.makespan:.6g}   bubble rate {result.bubble_rate:.4f} "
            f"({result.bubble_rate:.2%})   peak memory {max(result.peak_memory):.4g}")


def _compare_row(kind: str, chunks: int | None, build_kwargs: dict) -> list[str]:
    spec = get_spec(kind)
    fits = chunks is not None and (spec.chunks is None or chunks in spec.chunks)
    try:
        sched = build_schedule(kind, chunks=chunks if fits else None, **build_kwargs)
    except ScheduleError as err:
        if err.over_memory and err.schedule is not None:  # runs, just not within the limit
            return _result_row(kind, err.schedule, build_kwargs, "over memory limit")
        if err.over_memory:
            return [kind, *"-----", f"over memory limit: {err.problems[0]}"]
        more = f" (+{len(err.problems) - 1} more)" if len(err.problems) > 1 else ""
        return [kind, *"-----", f"invalid: {err.problems[0]}{more}"]
    except ValueError as err:  # this kind cannot take these inputs
        return [kind, *"-----", f"n/a: {err}"]
    return _result_row(kind, sched, build_kwargs, "ok")


def _result_row(kind: str, sched: Schedule, build_kwargs: dict, status: str) -> list[str]:
    costs = build_kwargs["costs"].for_placement(sched.placement)
    result = validate(sched, costs, build_kwargs["memory"])
    return [kind, str(sched.placement.chunks), f"{result.makespan:.6g}",
            f"{result.bubble_rate:.4f}", f"{_idle_of_makespan(result):.4f}",
            f"{max(result.peak_memory):.4g}", status]


def _idle_of_makespan(result: SimResult) -> float:
    """The devices' idle share of devices x makespan: the staggered start and end included."""
    total = len(result.busy) * result.makespan
    return max(0.0, 1.0 - sum(result.busy) / total) if total > 0 else 0.0


# [Note: what the bubble rate counts] The Zero Bubble paper's rate measures each device from its
# own first op to its last, so a schedule whose devices start one after the other but never wait
# in between (ZB-H2) scores 0 at the makespan of one that waits (ZB-H1): the second column counts
# the staggered start too, and equal makespans give equal idle shares.
_RATE_LEGEND = ("bubble rate: (longest device span - busiest device's op time) / longest span, "
                "a device's span running from its first op to its last, so the staggered start "
                "is not counted; idle of makespan: all devices' idle time within the makespan, "
                "staggered start included.")


def _compare(console: Console, chunks: int | None, build_kwargs: dict) -> None:
    table = Table(title=f"{build_kwargs['devices']} devices, "
                  f"{build_kwargs['microbatches']} microbatches", title_justify="left",
                  caption=_RATE_LEGEND, caption_justify="left")
    for column in ("kind", "chunks", "makespan", "bubble rate", "idle of makespan",
                   "peak memory", "status"):
        table.add_column(column, justify="left" if column in ("kind", "status") else "right",
                         no_wrap=column != "status")
    for kind in schedule_kinds():
        table.add_row(*_compare_row(kind, chunks, build_kwargs))
    console.print(table)


def _check_kind(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if value != "compare" and value not in schedule_kinds():
        raise click.BadParameter(f"{value!r} is not a schedule kind; choose compare or one of "
                                 f"{', '.join(schedule_kinds())}")
    return value


def _check_fuse_kind(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and value not in schedule_kinds():
        raise click.BadParameter(f"{value!r} is not a schedule kind; choose one of "
                                 f"{', '.join(schedule_kinds())}")
    return value


def _parse_fill(ctx: click.Context, param: click.Parameter, value: str | None) -> list | None:
    """--fill's units: comma-separated COST or COSTxCOUNT (`0.5x40,2`)."""
    if value is None:
        return None
    units = []
    for entry in value.split(","):
        cost_text, _, count_text = entry.strip().partition("x")
        try:
            cost, count = float(cost_text), int(count_text) if count_text else 1
        except ValueError:
            cost, count = math.nan, 0
        if not (math.isfinite(cost) and cost >= 0 and 1 <= count <= 100_000):
            raise click.BadParameter(f"{entry.strip()!r}: each entry is COST or COSTxCOUNT, a "
                                     "cost >= 0 and a count from 1 to 100000 (e.g. 0.5x40)")
        units += [cost] * count
    return units


def _check_output(ctx: click.Context, param: click.Parameter, value: Path | None):
    if value is not None and param.name == "plot" and value.suffix.lower() not in (".svg", ".png"):
        raise click.BadParameter("the chart file must end in .svg or .png")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]},
               epilog=f"KIND is one of: {', '.join(schedule_kinds())}.")
@click.argument("kind", metavar="KIND|compare", callback=_check_kind)
@click.option("--stages", "-p", "devices", type=click.IntRange(min=1), required=True,
              help="Pipeline devices P (chunked kinds cut each device's share further).")
@click.option("--microbatches", "-m", type=click.IntRange(min=1), required=True,
              help="Microbatches per step.")
@click.option("--cost", "cost_text", default="F=1,B=1,W=1", show_default=True,
              envvar="FLOWKIT_SCHEDULE_COST",
              help="Time of one device's share: KEY=V or KEY=V1,...,VP for F, B, W.")
@click.option("--comm", type=_FiniteFloat(min=0), default=0.0, show_default=True,
              help="Time to move one activation or gradient between devices.")
@click.option("--memory-limit", type=_FiniteFloat(min=0, min_open=True), default=None,
              envvar="FLOWKIT_SCHEDULE_MEMORY_LIMIT",
              help="Peak activations per device, in microbatches of one device share.")
@click.option("--mem", "mem_text", default=None,
              help="Memory each op adds: F=1,B=-0.5,W=-0.5 (BW defaults to B+W).")
@click.option("--model-dims", "dims_text", default=None,
              help="Derive --mem from the model (Zero Bubble paper, Table 1): "
              "s=SEQ,b=MICROBATCH,h=HIDDEN,a=HEADS.")
@click.option("--chunks", "-v", type=click.IntRange(min=1), default=None,
              help="Stages per device for chunked kinds (interleaved-1f1b defaults to 2).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write the schedule and its simulated result as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              callback=_check_output, help="Write a Gantt chart (.svg, or .png with matplotlib).")
@click.option("--allreduce", type=_FiniteFloat(min=0, min_open=True), default=None,
              metavar="TIME",
              help="Data parallel: the all-reduce of one device share's gradients over the "
              "replicas, in cost units; shows where each device's runs, started after its "
              "last op or bucket by bucket inside each stage's last W (as the torch "
              "executors run it), and what of it the schedule hides.")
@click.option("--buckets", type=click.IntRange(min=1), default=None,
              help="With --allreduce: the buckets a stage's gradients are reduced in (the "
              "runtime's: the stage's gradient bytes / 25 MiB); 4 if not given.")
@click.option("--offload", type=click.Choice(["none", "half", "all", "auto"]), default="none",
              show_default=True,
              help="Offload stashed activations to host memory between F and B (PipeOffload): "
              "half or all of those that can be; auto picks none, half or all, and the "
              "schedule they let fit, under --memory-limit. Prints the run with and without.")
@click.option("--copy", "copy_time", type=_FiniteFloat(min=0), default=0.0, show_default=True,
              metavar="TIME",
              help="Time to copy one microbatch's activations of one device share between "
              "device and host, one way (activation bytes over the host link's bandwidth).")
@click.option("--fuse", "fuse_kind", default=None, metavar="KIND", callback=_check_fuse_kind,
              help="Also fuse the schedule with a second model's KIND schedule on the same "
              "devices, its stages the other way round (as flowkit run places PPO's critic "
              "with fuse_models), and print each alone, the two in turn, and fused. The "
              "second is built with the same costs, memory and limit, its kind's own chunks "
              "and no offload.")
@click.option("--bubbles", "show_bubbles", is_flag=True,
              help="List each device's idle slots (bubbles) with their lengths.")
@click.option("--fill", "fill_units", default=None, metavar="COSTxN,...", callback=_parse_fill,
              help="Fit units of other work of these costs (e.g. scoring forwards: 0.5x40) into "
              "the bubbles without moving any action, and print what fits and what the rest "
              "adds to the makespan.")
@click.option("--execute", type=click.IntRange(min=1), default=None, metavar="N",
              help="Also run the schedule on N simulator executor processes (N = devices) and "
              "print measured against simulated makespan and bubble rate.")
@click.option("--unit", "unit_s", type=_FiniteFloat(min=0, min_open=True), default=0.002,
              show_default=True,
              help="Seconds one cost unit takes on the simulator executors (with --execute).")
def schedule(kind, devices, microbatches, cost_text, comm, memory_limit, mem_text, dims_text,
             chunks, json_out, plot, allreduce, buckets, offload, copy_time, fuse_kind,
             show_bubbles, fill_units, execute, unit_s) -> None:
    """Build, validate and simulate a pipeline schedule (or `compare` all kinds)."""
    if mem_text is not None and dims_text is not None:
        raise click.UsageError("give --mem or --model-dims, not both")
    if buckets is not None and not allreduce:
        raise click.UsageError("--buckets cuts the all-reduce of --allreduce: give --allreduce "
                               "TIME too")
    costs = parse_costs(cost_text, devices=devices, comm=comm)
    if copy_time:
        costs = attrs.evolve(costs, copy=[copy_time] * devices)
    build_kwargs = dict(devices=devices, microbatches=microbatches, costs=costs,
                        memory=parse_model_dims(dims_text) if dims_text else
                        parse_memory(mem_text), memory_limit=memory_limit)
    console = Console()
    if not console.is_terminal:  # pipes and CliRunner: room for the compare table's reasons
        console.width = max(console.width, 120)
    if kind == "compare":
        if offload != "none":
            raise click.UsageError("--offload needs a single KIND, not compare")
        if json_out or plot:
            raise click.UsageError("--json and --plot need a single KIND, not compare")
        if execute or allreduce or fuse_kind or show_bubbles or fill_units:
            raise click.UsageError("--execute, --allreduce, --fuse, --bubbles and --fill need "
                                   "a single KIND, not compare")
        _compare(console, chunks, build_kwargs)
        return
    if execute is not None and execute != devices:
        raise click.UsageError(f"--execute {execute}: the schedule has {devices} devices and "
                               f"runs one per executor; use --execute {devices}")
    if offload == "auto" and memory_limit is None:
        raise click.UsageError("--offload auto chooses under --memory-limit; give one")
    if offload != "none" and (execute or allreduce):
        raise click.UsageError("--execute and --allreduce run schedules without offload")
    sched, stage_costs = _run_one(console, kind, chunks, build_kwargs, json_out, plot, offload)
    if show_bubbles or fill_units:
        _bubbles(console, simulate(sched, stage_costs, build_kwargs["memory"]), fill_units)
    if fuse_kind is not None:
        _fused(console, sched, stage_costs, fuse_kind, build_kwargs)
    if allreduce:
        _reductions(console, sched, stage_costs, allreduce, buckets or 4)
    if execute:
        _execute(console, sched, stage_costs, unit_s)


def _fused(console: Console, sched: Schedule, stage_costs: Costs, kind: str,
           build_kwargs: dict) -> None:
    """`sched` and a `kind` schedule of a second model fused on the same devices, the second
    model's stages the other way round [Note: fused schedules in flowkit/planner/fused.py]."""
    from flowkit.planner.fused import fuse, sequential, simulate_fused

    try:
        other = build_schedule(kind, **build_kwargs)
        other_costs = build_kwargs["costs"].for_placement(other.placement)
        devices = [range(sched.num_devices), range(sched.num_devices - 1, -1, -1)]
        memory, limit = build_kwargs["memory"], build_kwargs["memory_limit"]
        pair, costs = [sched, other], [stage_costs, other_costs]
        fused = fuse(pair, costs, devices=devices, memory=memory, memory_limit=limit,
                     names=("first", "second"))
    except ScheduleError as err:
        raise click.ClickException(str(err)) from None
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    table = Table("run", "makespan", "bubble rate", "peak memory", title="fused with "
                  f"{kind} (the second model's stages the other way round)")
    rows = [(f"first ({sched.kind}) alone", simulate(sched, stage_costs, memory)),
            (f"second ({kind}) alone", simulate(other, other_costs, memory)),
            ("one after the other", simulate_fused(sequential(pair, devices), costs, memory)),
            ("fused", simulate_fused(fused, costs, memory))]
    for name, result in rows:
        table.add_row(name, f"{result.makespan:g}", f"{result.bubble_rate:.3f}",
                      f"{max(result.peak_memory):g}")
    console.print(table)


def _bubbles(console: Console, result: SimResult, units: list[float] | None) -> None:
    """Each device's bubbles, and with `units` the fill [Note: bubbles in
    flowkit/planner/bubbles.py]."""
    from flowkit.planner.bubbles import bubbles, fill

    slots = bubbles(result)
    table = Table(title="bubbles: each device's idle slots, start + length (after -> before)",
                  title_justify="left")
    for column in ("device", "idle", "slots"):
        table.add_column(column, justify="left" if column == "slots" else "right")
    for device in range(len(result.intervals)):
        mine = [b for b in slots if b.device == device]
        shown = ", ".join(f"{b.start:g}+{b.length:g} ({_name(b.after, 'start')} -> "
                          f"{_name(b.before, 'end')})"
                          for b in mine[:8]) + (f", ... {len(mine) - 8} more"
                                                if len(mine) > 8 else "")
        table.add_row(str(device), f"{sum(b.length for b in mine):g}", shown or "none")
    console.print(table)
    if units is None:
        return
    filling = fill(slots, units)
    devices = len(result.intervals)
    in_turn, filled = filling.extra_time(units, devices)
    share = filling.used / filling.idle if filling.idle else 0.0
    console.print(f"fill: {len(filling.placed)} of {len(units)} units fit in the bubbles, "
                  f"{filling.used:g} of {filling.idle:g} idle ({share:.1%}); the actions do not "
                  f"move. Makespan {result.makespan:g} alone, {result.makespan + in_turn:g} with "
                  f"the units in turn (spread over the {devices} devices), "
                  f"{result.makespan + filled:g} with them filled")


def _name(interval: Interval | None, edge: str) -> str:
    return edge if interval is None else str(interval.action)


def _offloaded(kind: str, chunks: int | None, build_kwargs: dict,
               offload: str) -> tuple[Schedule, Schedule]:
    """The schedule with offload, and the one without it to compare: for half and all the kind
    built without a memory limit (the copies make the room; the limit is checked after), for
    auto the choice of `best_with_offload` and the kind built at the limit without copies,
    where one fits (else the unlimited build, shown over the limit)."""
    limit = build_kwargs["memory_limit"]
    kwargs = {**build_kwargs, "memory_limit": None}
    if offload != "auto":
        plain = build_schedule(kind, chunks=chunks, **kwargs)
        costs = build_kwargs["costs"].for_placement(plain.placement)
        return offload_schedule(plain, costs, offload), plain
    pick = best_with_offload(kind, chunks=chunks, **build_kwargs)
    try:
        plain = build_schedule(kind, chunks=chunks, **build_kwargs)
    except ScheduleError:
        plain = build_schedule(kind, chunks=chunks, **kwargs)
    if pick.offload == "none" and limit is not None:
        plain = pick.schedule
    return pick.schedule, plain


def _offload_table(sched: Schedule, result: SimResult, plain: Schedule, stage_costs: Costs,
                   memory: MemoryModel) -> Table:
    """The schedule with and without offload, side by side, from the same costs."""
    base = validate(plain, stage_costs, memory)
    copies = sum(a.kind is Kind.O for ops in sched.device_ops for a in ops)
    forwards = sum(a.kind is Kind.F for ops in sched.device_ops for a in ops)
    table = Table(title=f"offload: {copies} of {forwards} forwards' activations to host memory "
                  f"and back", title_justify="left")
    for column in ("", "schedule", "makespan", "bubble rate", "peak memory",
                   "peak memory per device"):
        table.add_column(column, justify="left" if column in ("", "schedule") else "right")
    for name, s, r in (("without", plain, base), ("with", sched, result)):
        table.add_row(name, s.kind, f"{r.makespan:.6g}", f"{r.bubble_rate:.4f}",
                      f"{max(r.peak_memory):.4g}", " ".join(f"{x:.3g}" for x in r.peak_memory))
    growth = result.makespan / base.makespan - 1 if base.makespan else 0.0
    drop = 1 - max(result.peak_memory) / max(base.peak_memory) if max(base.peak_memory) else 0.0
    table.caption = f"makespan {growth:+.2%}, peak memory {-drop:+.2%}"
    table.caption_justify = "left"
    return table


def _reductions(console: Console, sched: Schedule, stage_costs: Costs, allreduce: float,
                buckets: int) -> None:
    """Each stage's all-reduce started after its device's last op, and bucket by bucket inside
    the stage's last W or BW (flowkit/planner/replicas.py; the torch executors run the latter
    [Note: all-reduce in the last W in executors/torch/train/replicas.py])."""
    from flowkit.planner.replicas import simulate_replicas

    placement = sched.placement
    per_stage = [allreduce / len(placement.stages_on(placement.device_of(s)))
                 for s in range(placement.num_stages)]
    after = simulate_replicas(sched, stage_costs, per_stage)
    inside = simulate_replicas(sched, stage_costs, per_stage, overlap=True, buckets=buckets)
    table = Table(title=f"all-reduce over the replicas: {allreduce:g} a device share, "
                  f"{buckets} bucket(s) a stage", title_justify="left")
    for column in ("stage", "device", "gradients final", "after the last op",
                   "inside the last W", "past the makespan"):
        table.add_column(column, justify="right")
    end = inside.first + inside.pipeline.makespan
    for a, i in zip(after.reductions, inside.reductions, strict=True):
        table.add_row(str(a.stage), str(a.device), f"{i.ready:.6g}",
                      f"{a.start:.6g} - {a.end:.6g}", f"{i.start:.6g} - {i.end:.6g}",
                      f"{max(0.0, a.end - end):.6g} / {max(0.0, i.end - end):.6g}")
    console.print(table)
    for name, result in (("after the last op", after), ("inside the last W", inside)):
        console.print(f"{name}: step {result.step:.6g} = makespan "
                      f"{result.pipeline.makespan:.6g} + {result.exposed:.6g} shown; "
                      f"{result.hidden:.1%} of the all-reduce time hidden behind other ops")


def _execute(console: Console, sched: Schedule, stage_costs: Costs, unit_s: float) -> None:
    from flowkit.runner.schedule_run import execute_on_simulators

    console.print(f"running on {sched.num_devices} simulator executors, 1 unit = "
                  f"{unit_s * 1e3:g} ms ...")
    figures = execute_on_simulators(sched, stage_costs, unit_s=unit_s)
    table = Table(title="measured on simulator executors (median of 3 runs)",
                  title_justify="left")
    for column in ("", "measured", "simulated"):
        table.add_column(column, justify="right")
    for column in ("measured / simulated", "simulated, nominal costs"):
        table.add_column(column, justify="right")
    table.add_row("makespan", f"{figures['measured_makespan_s'] * 1e3:.2f} ms",
                  f"{figures['simulated_makespan_s'] * 1e3:.2f} ms",
                  f"{figures['makespan_ratio']:.3f}",
                  f"{figures['nominal_makespan_s'] * 1e3:.2f} ms")
    table.add_row("bubble rate", f"{figures['measured_bubble_rate']:.4f}",
                  f"{figures['simulated_bubble_rate']:.4f}", "",
                  f"{figures['nominal_bubble_rate']:.4f}")
    console.print(table)
    overhead_us = figures["op_overhead_s"] * 1e6
    console.print(f"simulated with profiled costs: each op + {overhead_us:.0f} µs "
                  f"of executor time, comm = {figures['hop_s'] * 1e6:.0f} µs per activation hop "
                  f"between executors (medians measured in this run)")


def _run_one(
    console: Console,
    kind: str,
    chunks: int | None,
    build_kwargs: dict,
    json_out: Path | None,
    plot: Path | None,
    offload: str = "none",
) -> tuple[Schedule, Costs]:
    try:
        if offload == "none":
            sched = build_schedule(kind, chunks=chunks, **build_kwargs)
            plain = None
        else:
            sched, plain = _offloaded(kind, chunks, build_kwargs, offload)
        stage_costs = build_kwargs["costs"].for_placement(sched.placement)
        result = validate(sched, stage_costs, build_kwargs["memory"], build_kwargs["memory_limit"])
    except ScheduleError as err:  # a schedule that cannot run: exit 1 with the grid
        raise click.ClickException(str(err)) from None
    except ValueError as err:  # inputs this kind cannot take: a usage error, exit 2
        raise click.UsageError(str(err)) from None
    console.print(_device_table(sched, result))
    console.print(_summary(result))
    if plain is not None:
        console.print(_offload_table(sched, result, plain, stage_costs, build_kwargs["memory"]))
    if json_out is not None:
        data = schedule_to_json(
            sched,
            costs=stage_costs,
            memory=build_kwargs["memory"],
            memory_limit=build_kwargs["memory_limit"],
            result=result,
        )
        with writing(json_out):
            json_out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {json_out}")
    if plot is not None:
        from flowkit.planner.gantt import write_chart

        try:
            with writing(plot):
                write_chart(plot, sched, result)
        except RuntimeError as err:  # matplotlib missing for .png
            raise click.ClickException(str(err)) from None
        console.print(f"wrote {plot}")
    return sched, stage_costs
