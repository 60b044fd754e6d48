"""JSON export round trip and Gantt charts."""

import json
import xml.etree.ElementTree as ET

import pytest

from flowkit.planner import Costs, MemoryModel, simulate
from flowkit.planner.export import schedule_to_json
from flowkit.planner.gantt import COLOURS, png_figure, render_svg, write_chart
from flowkit.planner.schedules import build_schedule
from tests.planner.schedule_json import schedule_from_json

SPEC_KEYS = {"kind", "stages", "devices", "microbatches", "stage_to_device", "costs",
             "memory_limit", "memory_model", "device_ops", "result"}


def _planned(kind="interleaved-1f1b", p=3, m=6):
    shares = Costs(F=[1, 1.5, 1], B=[2, 2, 2], W=[1, 0.5, 1], comm=0.25)
    schedule = build_schedule(kind, devices=p, microbatches=m, costs=shares)
    costs = shares.for_placement(schedule.placement)
    return schedule, costs, simulate(schedule, costs)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h2", "interleaved-1f1b"])
def test_json_round_trip_gives_the_same_result(kind):
    schedule, costs, result = _planned(kind)
    data = json.loads(json.dumps(schedule_to_json(
        schedule, costs=costs, memory=MemoryModel(), memory_limit=None, result=result)))
    assert SPEC_KEYS <= set(data) and set(data) - SPEC_KEYS == {"chunks"}
    assert set(data["costs"]) == {"F", "B", "W", "comm"}
    assert data["memory_model"] == {"F": 1, "B": -0.5, "W": -0.5, "BW": -1}
    assert data["stages"] == len(data["stage_to_device"]) == len(data["costs"]["F"])
    loaded = schedule_from_json(data)
    assert loaded.schedule == schedule and loaded.costs == costs
    again = simulate(loaded.schedule, loaded.costs, loaded.memory)
    assert again.to_json().items() <= data["result"].items()


def test_loader_names_what_is_missing():
    schedule, costs, result = _planned("1f1b")
    data = schedule_to_json(schedule, costs=costs, memory=MemoryModel(), memory_limit=2.0,
                            result=result)
    del data["device_ops"]
    with pytest.raises(ValueError, match="'device_ops'"):
        schedule_from_json(data)


def test_svg_is_well_formed_and_labelled():
    schedule, _, result = _planned()
    root = ET.fromstring(render_svg(schedule, result))
    assert root.tag.endswith("svg")
    text = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    assert "interleaved-1f1b: p=3, m=6, v=2" in text and "bubble rate" in text
    fills = {r.get("fill") for r in root.iter() if r.tag.endswith("rect")}
    assert COLOURS[next(iter(COLOURS))] in fills
    boxes = [g for g in root.iter() if g.tag.endswith("title")]
    assert len(boxes) == sum(len(ops) for ops in schedule.device_ops)


def test_write_chart_rejects_unknown_suffix(tmp_path):
    schedule, _, result = _planned()
    with pytest.raises(ValueError, match=".svg or .png"):
        write_chart(tmp_path / "chart.pdf", schedule, result)


def test_png_without_matplotlib_says_what_to_do(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    schedule, _, result = _planned()
    with pytest.raises(RuntimeError, match="pip install .*svg"):
        write_chart(tmp_path / "chart.png", schedule, result)


def _equal_costs(kind, p, m):
    shares = Costs(F=[1] * p, B=[1] * p, W=[1] * p)
    schedule = build_schedule(kind, devices=p, microbatches=m, costs=shares)
    return schedule, simulate(schedule, shares.for_placement(schedule.placement))


@pytest.mark.parametrize(("kind", "p", "m"), [("zb-h1", 4, 8), ("zb-h1", 8, 24), ("zb-v", 4, 8)])
def test_png_chart_labels_every_box_like_the_svg(kind, p, m):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_hex

    schedule, result = _equal_costs(kind, p, m)
    ax = png_figure(schedule, result).axes[0]
    ops = [a for device in schedule.device_ops for a in device]
    boxes = [r for r in ax.patches if r.get_width() > 0]
    assert len(boxes) == len(ops)
    # thin white borders keep neighbouring ops of one kind apart
    assert {to_hex(r.get_edgecolor()) for r in boxes} == {"#ffffff"}
    assert all(0 < r.get_linewidth() <= 1.5 for r in boxes)
    # every box carries its microbatch number at these sizes
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(str(a.microbatch) for a in ops)
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"dev {d}" for d in range(p)]
    assert ax.get_xlabel() == "time" and len(ax.get_xticks()) > 2
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"F forward", "B input grad", "W weight grad"} <= set(legend)
    assert any("numbers are microbatches" in t for t in legend)
    assert f"{kind}: p={p}, m={m}" in ax.get_title(loc="left")


def test_png_chart_drops_labels_that_do_not_fit():
    pytest.importorskip("matplotlib")
    shares = Costs(F=[1] * 4, B=[1] * 4, W=[0.001] * 4)
    schedule = build_schedule("zb-h1", devices=4, microbatches=8, costs=shares)
    result = simulate(schedule, shares.for_placement(schedule.placement))
    ax = png_figure(schedule, result).axes[0]
    assert len(ax.texts) == sum(a.kind.value != "W" for ops in schedule.device_ops for a in ops)


def test_png_file_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    schedule, result = _equal_costs("zb-h1", 4, 8)
    out = write_chart(tmp_path / "chart.png", schedule, result)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matplotlib_is_a_main_dependency():
    """PNG charts work on a plain install: matplotlib is in [project] dependencies."""
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = pathlib.Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert any(d.replace(" ", "").startswith("matplotlib") for d in project["dependencies"])
