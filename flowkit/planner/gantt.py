"""Gantt charts of simulated schedules: SVG written by hand, PNG drawn with matplotlib.

Devices are rows and time runs left to right. Colours are the Okabe-Ito palette, which stays
distinct under the common colour-vision deficiencies; chunk stages of one device (interleaved, V
shapes) get lighter shades of their kind's colour, chunk 0 darkest.
"""

from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

from flowkit.planner.ir import Kind, Schedule
from flowkit.planner.simulate import SimResult

__all__ = ["COLOURS", "chart_title", "png_figure", "render_svg", "write_chart"]

COLOURS = {Kind.F: "#0072B2", Kind.B: "#E69F00", Kind.W: "#009E73", Kind.BW: "#CC79A7"}
_NAMES = {Kind.F: "F forward", Kind.B: "B input grad", Kind.W: "W weight grad",
          Kind.BW: "BW backward"}

_LEFT, _RIGHT, _TOP, _ROW, _GAP, _PLOT_W = 64, 24, 56, 26, 6, 1000
# PNG: inches per device row, and the least width of the shortest box (room for two digits).
_PNG_ROW_IN, _PNG_MIN_BOX_IN = 0.42, 0.2


def _shade(colour: str, chunk: int, chunks: int) -> str:
    """Mix towards white by up to 55 % for the last chunk; chunk 0 keeps the base colour."""
    t = 0.55 * chunk / (chunks - 1) if chunks > 1 else 0.0
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * t):02x}" for c in rgb)


def _text_colour(fill: str) -> str:
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def chart_title(schedule: Schedule, result: SimResult) -> str:
    p = schedule.placement
    chunks = f", v={p.chunks}" if p.chunks > 1 else ""
    return (f"{schedule.kind}: p={p.num_devices}, m={schedule.microbatches}{chunks}, "
            f"makespan {result.makespan:.6g}, bubble rate {result.bubble_rate:.2%}")


def _ticks(end: float) -> list[float]:
    if end <= 0:
        return [0.0]
    raw = end / 8
    step = 10 ** math.floor(math.log10(raw))
    step *= next(f for f in (1, 2, 5, 10) if f * step >= raw)
    return [i * step for i in range(int(end / step) + 1)]


def _boxes(schedule: Schedule, result: SimResult, scale: float) -> list[str]:
    placement = schedule.placement
    chunk_of = {s: placement.stages_on(placement.device_of(s)).index(s)
                for s in range(placement.num_stages)}
    out = []
    for device, intervals in enumerate(result.intervals):
        y = _TOP + device * (_ROW + _GAP)
        for iv in intervals:
            a = iv.action
            fill = _shade(COLOURS[a.kind], chunk_of[a.stage], placement.chunks)
            x, w = _LEFT + iv.start * scale, max((iv.end - iv.start) * scale, 0.5)
            tip = escape(f"{a} (stage {a.stage}, {a.kind.value}, microbatch {a.microbatch}): "
                         f"{iv.start:.6g} to {iv.end:.6g}")
            out.append(f'<g><title>{tip}</title><rect x="{x:.2f}" y="{y}" width="{w:.2f}" '
                       f'height="{_ROW}" fill="{fill}" stroke="#ffffff" stroke-width="0.5"/>')
            label = str(a.microbatch)
            if w >= 7 * len(label) + 2:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + _ROW / 2 + 4}" font-size="11" '
                           f'text-anchor="middle" fill="{_text_colour(fill)}">{label}</text>')
            out.append("</g>")
    return out


def _axes(schedule: Schedule, end: float, scale: float) -> list[str]:
    bottom = _TOP + schedule.num_devices * (_ROW + _GAP)
    out = [f'<text x="{_LEFT - 8}" y="{_TOP + d * (_ROW + _GAP) + _ROW / 2 + 4}" '
           f'font-size="12" text-anchor="end">dev {d}</text>' for d in range(schedule.num_devices)]
    for t in _ticks(end):
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{_TOP - 4}" x2="{x:.2f}" y2="{bottom}" '
                   f'stroke="#dddddd" stroke-width="0.5"/>')
        out.append(
            f'<text x="{x:.2f}" y="{bottom + 14}" font-size="10" text-anchor="middle">{t:g}</text>')
    return out


def _legend(schedule: Schedule, y: float) -> list[str]:
    kinds = [k for k in Kind if not k.is_copy
             and any(a.kind is k for ops in schedule.device_ops for a in ops)]
    out, x = [], _LEFT
    for k in kinds:
        out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="{COLOURS[k]}"/>')
        out.append(f'<text x="{x + 20}" y="{y + 11}" font-size="12">{escape(_NAMES[k])}</text>')
        x += 140
    if schedule.placement.chunks > 1:
        out.append(f'<text x="{x}" y="{y + 11}" font-size="12">lighter shade = later chunk; '
                   "numbers are microbatches</text>")
    return out


def render_svg(schedule: Schedule, result: SimResult) -> str:
    """The chart as an SVG document (UTF-8 text)."""
    end = max(result.makespan, 1e-9)
    scale = _PLOT_W / end
    height = _TOP + schedule.num_devices * (_ROW + _GAP) + 56
    width = _LEFT + _PLOT_W + _RIGHT
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
             f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
             f'<text x="{_LEFT}" y="24" font-size="15" font-weight="bold">'
             f"{escape(chart_title(schedule, result))}</text>", *_legend(schedule, 32),
             *_axes(schedule, end, scale), *_boxes(schedule, result, scale), "</svg>"]
    return "\n".join(parts) + "\n"


def _write_png(path: Path, schedule: Schedule, result: SimResult) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(
            f"writing {path.name} needs matplotlib, a dependency of flowkit that is not "
            "importable here: pip install matplotlib (or reinstall flowkit), "
            "or write an .svg chart instead, which needs nothing") from None
    png_figure(schedule, result).savefig(path, dpi=150, bbox_inches="tight", pad_inches=0.15)


def png_figure(schedule: Schedule, result: SimResult):
    """The chart as a matplotlib Figure, drawn like the SVG: boxes with thin white borders, each
    labelled with its microbatch where the number fits, a legend of the kinds, device rows and a
    time axis. A bare Figure: no pyplot, so no display backend and nothing to close."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    placement = schedule.placement
    end = max(result.makespan, 1e-9)
    durations = [iv.end - iv.start for ivs in result.intervals for iv in ivs if iv.end > iv.start]
    # Wide enough that the shortest box holds a two-digit number, within a sane page size.
    plot_w = min(max(_PNG_MIN_BOX_IN * end / min(durations, default=end), 10.0), 24.0)
    width, height = plot_w + 1.2, _PNG_ROW_IN * schedule.num_devices + 1.9
    fig = Figure(figsize=(width, height))
    ax = fig.subplots()
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.3 / width, top=1 - 1.05 / height,
                        bottom=0.6 / height)
    points_per_unit = plot_w * 72 / end
    bar_h = 0.8
    for device, intervals in enumerate(result.intervals):
        stages = placement.stages_on(device)
        for iv in intervals:
            a = iv.action
            fill = _shade(COLOURS[a.kind], stages.index(a.stage), placement.chunks)
            dur = iv.end - iv.start
            ax.barh(device, dur, left=iv.start, height=bar_h, color=fill, edgecolor="#ffffff",
                    linewidth=0.8)
            label = str(a.microbatch)
            size = _label_size(dur * points_per_unit, len(label))
            if size:
                ax.text(iv.start + dur / 2, device, label, ha="center", va="center",
                        fontsize=size, color=_text_colour(fill))
    ax.set_xlim(0, end)
    ax.set_ylim(schedule.num_devices - 0.5, -0.5)  # device 0 on top
    ax.set_yticks(range(schedule.num_devices), [f"dev {d}" for d in range(schedule.num_devices)])
    ax.tick_params(axis="y", length=0)
    ax.set_xticks(_ticks(end))
    ax.set_xlabel("time")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in Kind if not k.is_copy
             and any(a.kind is k for ops in schedule.device_ops for a in ops)]
    handles = [Patch(facecolor=COLOURS[k], label=_NAMES[k]) for k in kinds]
    if placement.chunks > 1:
        handles.append(Patch(facecolor="none", edgecolor="none",
                             label="lighter shade = later chunk; numbers are microbatches"))
    else:
        handles.append(Patch(facecolor="none", edgecolor="none", label="numbers are microbatches"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(handles),
              frameon=False, fontsize=9, handlelength=1.2, columnspacing=1.6, borderaxespad=0.3)
    ax.set_title(chart_title(schedule, result), loc="left", fontsize=11, fontweight="bold",
                 pad=24)
    return fig


def _label_size(box_points: float, chars: int) -> float | None:
    """The largest font size (9 down to 5 pt) at which `chars` digits fit in a box that wide,
    or None: digits are about 0.6 em wide, and a point of padding stays on each side."""
    for size in (9, 8, 7, 6, 5):
        if 0.6 * size * chars + 2 <= box_points:
            return size
    return None


def write_chart(path: str | Path, schedule: Schedule, result: SimResult) -> Path:
    """Write an .svg or .png chart; ValueError for any other suffix."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".svg":
        path.write_text(render_svg(schedule, result), encoding="utf-8")
    elif suffix == ".png":
        _write_png(path, schedule, result)
    else:
        raise ValueError(f"cannot write a chart to {path.name!r}: use a .svg or .png file name")
    return path
