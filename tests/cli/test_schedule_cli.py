"""`flowkit schedule` through click's CliRunner: exit codes, tables, --json, --plot."""

import json
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from flowkit.cli import main
from flowkit.planner import simulate
from flowkit.planner.schedules import schedule_kinds
from tests.planner.schedule_json import schedule_from_json
from tests.planner.test_export_gantt import SPEC_KEYS as JSON_KEYS  # --json writes the export


def _run(*args):
    return CliRunner().invoke(main, ["schedule", *args])


def test_prints_the_device_table_and_summary():
    result = _run("zb-h1", "--stages", "4", "--microbatches", "8")
    assert result.exit_code == 0, result.output
    assert "zb-h1: 4 devices, 4 stages, 8 microbatches" in result.output
    for column in ("busy", "span", "peak memory"):
        assert column in result.output
    assert "makespan 27" in result.output and "bubble rate 0.1111" in result.output


def test_per_share_costs_and_comm():
    result = _run("1f1b", "-p", "4", "-m", "8", "--cost", "F=1,1,1,1.4,B=2,W=1", "--comm", "0.5")
    assert result.exit_code == 0, result.output


def test_compare_lists_every_kind_and_reasons():
    result = _run("compare", "-p", "4", "-m", "8", "--memory-limit", "4")
    assert result.exit_code == 0, result.output
    for kind in schedule_kinds():
        assert kind in result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines()
            if line.startswith("│")}
    # gpipe runs, just not within the limit: its figures are shown with the one reason
    assert [c.strip() for c in rows["gpipe"].split("│")[2:8]] == [
        "1", "33", "0.2727", "0.2727", "8", "over memory limit"]
    assert rows["1f1b"].rstrip("│ ").endswith("ok")
    assert "invalid" not in result.output


def test_compare_says_what_the_bubble_rate_counts():
    """ZB-H2 at 0.0000 beside ZB-H1's 0.1111 at the same makespan puzzles a reader: the rate
    leaves out the staggered start (a device's idle time before its first op), which the
    column of idle time within the makespan counts, and a legend says so."""
    result = CliRunner(env={"COLUMNS": "160"}).invoke(
        main, ["schedule", "compare", "-p", "4", "-m", "8"])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in result.output.splitlines() if line.startswith("│")}
    # chunks, makespan, bubble rate, idle of makespan, ...: 4 devices x 27 - 24 busy each
    assert rows["zb-h1"][:4] == ["1", "27", "0.1111", "0.1111"]
    assert rows["zb-h2"][:4] == ["1", "27", "0.0000", "0.1111"]
    text = " ".join(result.output.split())
    assert "staggered start" in text and "first op" in text


def test_compare_says_why_auto_cannot_fit():
    result = _run("compare", "-p", "4", "-m", "8", "--mem", "F=1,B=0,W=0", "--memory-limit", "2")
    assert result.exit_code == 0, result.output
    assert "ops never free memory" in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--memory-limit", "0.5"], "one microbatch alone needs 1 on a device"),
        (["--mem", "F=1,B=0,W=0", "--memory-limit", "2"],
         "ops never free memory, so 8 microbatches need 8×1 = 8 on a device"),
        (["--mem", "F=1,B=-0.25,W=-0.25", "--memory-limit", "4"],
         "frees only 0.5 of the 1 its forwards add, so 8 microbatches need at least "
         "7×0.5 + 1 = 4.5"),
        (["-v", "2", "--mem", "F=1,B=0,W=0", "--memory-limit", "2"], "ops never free memory"),
    ],
)
def test_an_unsatisfiable_memory_limit_for_auto_exits_1_saying_why(args, reason):
    result = _run("auto", "-p", "4", "-m", "8", *args)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: no schedule fits memory_limit=")
    assert reason in result.stderr and "Usage" not in result.stderr


def test_v_kinds_whose_memory_share_cannot_hold_say_why():
    result = _run("v-half", "-p", "4", "-m", "8", "--mem", "F=1,B=0,W=0")
    assert result.exit_code == 1, result.output
    assert "ops never free memory" in result.stderr


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_in_a_missing_folder_exits_1_without_a_traceback(tmp_path, option):
    out = tmp_path / "nodir" / ("x.json" if option == "--json" else "x.svg")
    result = _run("1f1b", "-p", "4", "-m", "8", option, str(out))
    assert result.exit_code == 1 and result.exception.__class__ is SystemExit
    assert f"cannot write {out}: the folder {out.parent} does not exist" in result.stderr
    assert "Traceback" not in result.output


def test_a_bubble_rate_is_never_printed_negative():
    # float sums leave the busiest device's time a hair above its span here
    result = _run("zb-v", "-p", "2", "-m", "5", "--cost", "F=0.1,B=0.1,W=0.1")
    assert result.exit_code == 0, result.output
    assert "bubble rate 0.0000 (0.00%)" in result.output


def test_model_dims_derive_the_memory_model(tmp_path):
    out = tmp_path / "s.json"
    dims = "s=1024,b=1,h=2304,a=24"
    result = _run("zb-h1", "-p", "4", "-m", "8", "--model-dims", dims, "--json", str(out))
    assert result.exit_code == 0, result.output
    memory = json.loads(out.read_text())["memory_model"]
    assert memory["F"] == 1 and memory["BW"] == -1
    assert memory["W"] == pytest.approx(-32 * 2304 / (34 * 2304 + 5 * 24 * 1024))
    assert memory["B"] + memory["W"] == pytest.approx(-1)
    result = _run("zb-h1", "-p", "4", "-m", "8", "--model-dims", dims, "--mem", "F=1")
    assert result.exit_code == 2 and "not both" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["warp", "-p", "2", "-m", "2"], "not a schedule kind"),
        (["1f1b", "-p", "0", "-m", "2"], "--stages"),
        (
            ["1f1b", "-p", "4", "-m", "2", "--cost", "F=1,2,B=1,W=1"],
            "1 value or one per device share (4",
        ),
        (["1f1b", "-p", "2", "-m", "2", "--cost", "F=1,B=1"], "missing W"),
        (["1f1b", "-p", "2", "-m", "2", "--cost", "F=1,X=2,B=1,W=1"], "unknown key 'X'"),
        (["1f1b", "-p", "2", "-m", "2", "--cost", "F=a,B=1,W=1"], "non-number"),
        (["1f1b", "-p", "2", "-m", "2", "--cost", "1,F=1,B=1,W=1"], "expected KEY=VALUE"),
        (["1f1b", "-p", "2", "-m", "2", "--chunks", "2"], "supports chunks = 1"),
        (["1f1b", "-p", "2", "-m", "2", "--plot", "x.pdf"], ".svg or .png"),
        (["compare", "-p", "2", "-m", "2", "--json", "x.json"], "single KIND"),
        (["1f1b", "-p", "2", "-m", "2", "--cost", "F=inf,B=1,W=1"], "F must be a finite number"),
        (["1f1b", "-p", "2", "-m", "2", "--cost", "F=1,B=1,W=nan"], "W must be a finite number"),
        (["1f1b", "-p", "2", "-m", "2", "--mem", "F=inf"], "F must be a finite number"),
        (["1f1b", "-p", "2", "-m", "2", "--comm", "inf"], "'inf' is not a finite number"),
        (["1f1b", "-p", "2", "-m", "2", "--comm", "nan"], "'nan' is not a finite number"),
        (["1f1b", "-p", "2", "-m", "2", "--memory-limit", "nan"], "'nan' is not a finite"),
        (["1f1b", "-p", "2", "-m", "2", "--memory-limit", "inf"], "'inf' is not a finite"),
        (["1f1b", "-p", "2", "-m", "2", "--model-dims", "s=1,b=1,h=2"], "missing a"),
    ],
)
def test_bad_input_is_a_usage_error(args, message):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_invalid_schedule_exits_1_with_the_grid_on_stderr():
    result = _run("1f1b", "-p", "4", "-m", "8", "--memory-limit", "3")
    assert result.exit_code == 1
    assert "peaks at 4 > memory limit 3" in result.stderr
    assert "[0F3]" in result.stderr and "step | dev 0" in result.stderr


def test_json_has_the_issue_keys_and_reloads_to_the_same_result(tmp_path):
    out = tmp_path / "s.json"
    result = _run("interleaved-1f1b", "-p", "3", "-m", "6", "-v", "2", "--cost", "F=1,2,1,B=2,W=1",
                  "--comm", "0.1", "--mem", "F=1,B=-0.4,W=-0.6", "--json", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) == JSON_KEYS | {"chunks"}
    assert data["stages"] == 6 and data["devices"] == 3 and data["memory_limit"] is None
    assert data["stage_to_device"] == [0, 1, 2, 0, 1, 2]
    assert data["costs"]["F"] == [0.5, 1.0, 0.5, 0.5, 1.0, 0.5] and data["costs"]["comm"] == 0.1
    assert data["memory_model"] == {"F": 1, "B": -0.4, "W": -0.6, "BW": -1}
    assert {"makespan", "device_span", "bubble_rate", "peak_memory"} <= set(data["result"])
    assert isinstance(data["device_ops"][0][0], str)
    loaded = schedule_from_json(data)
    again = simulate(loaded.schedule, loaded.costs, loaded.memory)
    assert again.to_json().items() <= data["result"].items()


def test_plot_svg_is_well_formed(tmp_path):
    out = tmp_path / "gantt.svg"
    result = _run("zb-h2", "-p", "4", "-m", "8", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert ET.parse(out).getroot().tag.endswith("svg")


def test_help_works_with_h():
    result = _run("-h")
    assert result.exit_code == 0 and "--microbatches" in result.output


def test_env_var_sets_costs(monkeypatch):
    monkeypatch.setenv("FLOWKIT_SCHEDULE_COST", "F=1,B=1,W=2")
    result = _run("1f1b", "-p", "2", "-m", "2")
    assert result.exit_code == 0 and "makespan 12" in result.output


@pytest.mark.slow
def test_execute_runs_the_schedule_on_simulator_executors():
    result = _run("zb-h1", "-p", "2", "-m", "4", "--execute", "2", "--unit", "0.001")
    assert result.exit_code == 0, result.output
    assert "measured on simulator executors" in result.output
    assert "makespan" in result.output and "simulated with profiled costs" in result.output


def test_execute_needs_one_executor_per_device():
    result = _run("1f1b", "-p", "4", "-m", "4", "--execute", "2")
    assert result.exit_code == 2
    assert "--execute 4" in result.output


@pytest.mark.parametrize(
    ("mem", "said"),
    [
        ("F=1,B=-0.5,W=-0.5,BW=-0.8", ["BW = -0.8", "B+W = -1", "drop BW", "BW=-1"]),
        ("B=-0.3,W=-0.7,BW=-0.5", ["BW = -0.5", "B+W = -1"]),
    ],
)
def test_a_memory_model_that_does_not_balance_is_a_usage_error(mem, said):
    result = _run("zb-h1", "-p", "4", "-m", "8", "--mem", mem)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "Invalid value for --mem" in text and "Traceback" not in text
    for fragment in said:
        assert fragment in text


@pytest.mark.parametrize("mem", ["F=1,B=-0.4,W=-0.6", "F=2,B=-1,W=-1,BW=-2", "B=-0.3,W=-0.7"])
def test_a_balanced_memory_model_is_taken(mem, tmp_path):
    out = tmp_path / "s.json"
    result = _run("zb-h1", "-p", "4", "-m", "8", "--mem", mem, "--json", str(out))
    assert result.exit_code == 0, result.output
    memory = json.loads(out.read_text())["memory_model"]
    assert memory["F"] + memory["B"] + memory["W"] == pytest.approx(0)
    assert memory["BW"] == pytest.approx(memory["B"] + memory["W"])


def test_plot_png_is_a_labelled_chart(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "gantt.png"
    result = _run("zb-h1", "-p", "4", "-m", "8", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in " ".join(result.output.split())


def test_the_help_lists_the_schedule_kinds():
    result = CliRunner().invoke(main, ["schedule", "--help"])
    assert result.exit_code == 0 and "zb-h1" in result.output and "auto" in result.output


def test_allreduce_shows_where_each_devices_reduction_runs():
    """1F1B on 4 devices: after the last op, the last three devices' all-reduces end before the
    first device's last op and the first device's shows whole; in 4 buckets inside the last W,
    the first device's shows its last bucket only (its W takes 2: a bucket is ready every 0.5,
    each reduces in 0.5)."""
    result = _run("1f1b", "-p", "4", "-m", "8", "--allreduce", "2")
    assert result.exit_code == 0, result.output
    assert "4 bucket(s) a stage" in result.output
    text = " ".join(result.output.split())
    assert "after the last op: step 35 = makespan 33 + 2 shown; 75.0% of the all-reduce" in text
    assert "inside the last W: step 33.5 = makespan 33 + 0.5 shown; 93.8% of the" in text


def test_allreduce_on_a_v_schedule_reduces_both_stages_of_a_device():
    """ZB-V holds two stages a device: each gets half the device's share, and a device's
    buckets share one stream; one bucket a stage starts each at its W's end."""
    result = _run("zb-v", "-p", "2", "-m", "4", "--allreduce", "2", "--buckets", "1")
    assert result.exit_code == 0, result.output
    rows = [line.split("│")[1:3] for line in result.output.splitlines()
            if line.startswith("│") and "-" in line.split("│")[4]]
    assert sorted((int(s), int(d)) for s, d in rows) == [(0, 0), (1, 1), (2, 1), (3, 0)]


def test_allreduce_needs_one_kind():
    result = _run("compare", "-p", "2", "-m", "4", "--allreduce", "1")
    assert result.exit_code == 2 and "need a single KIND" in result.output


@pytest.mark.parametrize("kind", ["1f1b", "compare"])
def test_buckets_need_an_allreduce_to_cut(kind):
    result = _run(kind, "-p", "2", "-m", "4", "--buckets", "2")
    assert result.exit_code == 2 and "give --allreduce TIME too" in result.output


def test_offload_prints_the_schedule_with_and_without(tmp_path):
    out = tmp_path / "zb-h2.json"
    result = _run("zb-h2", "-p", "4", "-m", "8", "--offload", "all", "--copy", "0.25",
                  "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:7]]
            for line in result.output.splitlines() if line.startswith("│")}
    assert rows["without"] == ["zb-h2", "27", "0.0000", "7", "7 6 5 4"]
    assert rows["with"] == ["zb-h2", "27", "0.0000", "4", "3 3 4 4"]
    assert "24 of 32 forwards' activations" in result.output
    loaded = schedule_from_json(json.loads(out.read_text()))
    assert "0O0" in loaded.schedule.text()[0] and loaded.costs.copy == (0.25,) * 4
    assert max(simulate(loaded.schedule, loaded.costs).peak_memory) == 4


def test_offload_auto_fits_a_shorter_schedule_under_the_limit():
    result = _run("auto", "-p", "4", "-m", "8", "--cost", "F=18.522,B=18.086,W=9.337",
                  "--comm", "0.601", "--copy", "6", "--memory-limit", "4", "--offload", "auto")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:6]]
            for line in result.output.splitlines() if line.startswith("│")}
    assert rows["without"] == ["auto", "456.585", "0.1950", "4"]
    assert rows["with"] == ["zb-h2", "424.968", "0.1351", "4"]


def test_offload_auto_needs_a_memory_limit():
    result = _run("auto", "-p", "4", "-m", "8", "--offload", "auto")
    assert result.exit_code == 2 and "--memory-limit" in result.output


def test_fuse_prints_each_alone_in_turn_and_fused():
    result = _run("1f1b", "-p", "4", "-m", "8", "--fuse", "1f1b")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
            for line in result.output.splitlines() if line.startswith("│")}
    assert rows["first (1f1b) alone"] == rows["second (1f1b) alone"] == ["33", "0.273", "4"]
    assert rows["one after the other"][0] == "63"
    assert rows["fused"] == ["51", "0.059", "5"]
    limited = _run("zb-h1", "-p", "4", "-m", "8", "--fuse", "1f1b", "--memory-limit", "4")
    assert limited.exit_code == 0, limited.output
    fused = next(line for line in limited.output.splitlines() if line.startswith("│ fused "))
    assert [c.strip() for c in fused.split("│")[2:5]] == ["54", "0.111", "4"]


def test_fuse_takes_a_kind_and_one_schedule():
    assert "'nope' is not a schedule kind" in _run("1f1b", "-p", "2", "-m", "2", "--fuse",
                                                   "nope").output
    result = _run("compare", "-p", "2", "-m", "2", "--fuse", "1f1b")
    assert result.exit_code == 2 and "need a single KIND" in result.output


def test_bubbles_lists_each_devices_idle_slots_and_fill_fits_work_into_them():
    """1F1B, p = 4, m = 8: every device idle 9 of 33; 40 units of 0.5 fit, so the makespan
    stays 33 where the same work in turn makes it 38 [Note: bubbles]."""
    result = _run("1f1b", "-p", "4", "-m", "8", "--bubbles", "--fill", "0.5x40")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in result.output.splitlines() if line.startswith("│")}
    assert rows["3"] == ["9", "0+3 (start -> 3F0), 27+6 (3BW7 -> end)"]
    text = " ".join(result.output.split())
    assert "40 of 40 units fit in the bubbles, 20 of 36 idle (55.6%)" in text
    assert "Makespan 33 alone, 38 with the units in turn" in text and "33 with them filled" in text
    wide = _run("zb-h1", "-p", "4", "-m", "8", "--fill", "7,1x2")  # 7 fits no slot of 3
    assert "2 of 3 units fit" in " ".join(wide.output.split())


def test_fill_takes_costs_and_counts_and_one_schedule():
    for bad in ("0.5y", "-1", "1x0", "nan"):
        result = _run("1f1b", "-p", "2", "-m", "2", "--fill", bad)
        assert result.exit_code == 2 and "COST or COSTxCOUNT" in result.output, bad
    result = _run("compare", "-p", "2", "-m", "2", "--bubbles")
    assert result.exit_code == 2 and "need a single KIND" in result.output
