"""Flows run end to end on real executor processes: per-item, per-group and barrier calls."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowkit.cli import main
from flowkit.planner.lower import Call, lower_flow
from flowkit.planner.simcosts import SimCosts
from flowkit.runner.flowrun import FlowRunError, FlowRunner
from tests.runner import flowdefs

FLOWDEFS = str(Path(flowdefs.__file__))
EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def sim_cluster(pool):
    with pool.shared(2, kind="sim", tags=("train", "rollout"), code=[FLOWDEFS]) as (ctl, _):
        yield ctl


@pytest.fixture(scope="module")
def map_reduce(pool):
    with pool.shared(3, tags=[("map",), ("map",), ("reduce",)], code=[FLOWDEFS]) as (ctl, _):
        yield ctl


def _value(runner, node, port="out"):
    return [ref.result(timeout=5) if hasattr(ref, "result") else ref.future.result(timeout=5)
            [ref.index] for ref in runner.previous[(node, port)].ordered()]


def test_lowering_follows_the_port_types():
    calls = {node.name: node.call for node in lower_flow(flowdefs.grouped_flow())}
    assert calls == {"samples": Call.SOURCE, "slow_double": Call.PER_ITEM,
                     "plus_one": Call.PER_ITEM, "pair": Call.PER_ITEM,
                     "group_sum": Call.PER_GROUP, "total": Call.ONCE}


def test_items_pair_by_sample_groups_form_by_key_and_the_barrier_sees_all(sim_cluster):
    runner = FlowRunner(sim_cluster, lower_flow(flowdefs.grouped_flow()))
    runner.run_step(0)
    # pair(i) = 2i + (i + 1); groups of key k hold i = k and k + 3; total = sum over i of 3i + 1
    assert sorted(s.value for s in _value(runner, "group_sum")) == [
        (3 * k + 1) + (3 * (k + 3) + 1) for k in range(3)]
    assert _value(runner, "total") == [sum(3 * i + 1 for i in range(6))]


def test_groups_start_as_soon_as_they_are_complete_while_the_long_tail_runs(map_reduce):
    runner = FlowRunner(map_reduce, lower_flow(flowdefs.tail_flow(last_delay=1.0)))
    runner.run_step(0)
    tail_end = runner.states["slow_double_on_map"].last_end
    group_starts = sorted(ref.timing[0]
                          for ref in runner.previous[("group_sum_on_reduce", "out")].ordered())
    # the samples a group needs move from the executor busy with the slow one (its watch serves
    # them), so keys 0 and 1 are complete early; key 2 waits for the slow sample 5, and so does
    # the total
    assert group_starts[1] < tail_end - 0.3
    assert group_starts[2] >= tail_end
    assert runner.states["total"].first_start >= tail_end


def test_groups_cut_short_at_the_end_of_the_step_run_with_a_warning_and_a_metric(sim_cluster):
    runner = FlowRunner(sim_cluster, lower_flow(flowdefs.short_groups_flow()))
    report = runner.run_step(0)
    assert sorted(s.value for s in _value(runner, "group_sum")) == [3.0, 5.0, 7.0]  # nothing lost
    assert report.metrics["group_sum/incomplete_groups"] == 3
    assert report.metrics["groups"] == 3.0
    short, reported = report.warnings
    assert "3 group(s) by 'key' had 2 of 3 items" in short
    assert reported == "something to act on"


def test_flowkit_run_prints_each_warning_once():
    result = CliRunner().invoke(main, ["run", f"{FLOWDEFS}:short_groups_flow", "--steps", "2",
                                       "--executors", "sim", "--no-dashboard"])
    assert result.exit_code == 0, result.output
    assert result.output.count("warning: something to act on") == 1
    assert result.output.count("warning: group_sum: 3 group(s)") == 1


def test_unfused_every_op_waits_for_its_producers_and_the_outputs_are_the_same(map_reduce):
    outputs = {}
    for fuse in (True, False):
        runner = FlowRunner(map_reduce, lower_flow(flowdefs.tail_flow(last_delay=0.3)), fuse=fuse)
        runner.run_step(0)
        outputs[fuse] = [ref.result(timeout=5) for ref in
                         runner.previous[("group_sum_on_reduce", "out")].ordered()]
    tail_end = runner.states["slow_double_on_map"].last_end
    group_starts = [ref.timing[0]
                    for ref in runner.previous[("group_sum_on_reduce", "out")].ordered()]
    assert min(group_starts) >= tail_end  # no group starts before the last sample is doubled
    assert outputs[True] == outputs[False]


def test_a_failing_op_fails_the_step_with_its_traceback_and_nothing_hangs(sim_cluster):
    runner = FlowRunner(sim_cluster, lower_flow(flowdefs.failing_flow()), step_timeout=30)
    with pytest.raises(FlowRunError, match="explode.*exploded") as raised:
        runner.run_step(0)
    assert "Traceback" in str(raised.value)


def test_an_op_returning_what_its_signature_does_not_promise_is_blamed_for_it(sim_cluster):
    runner = FlowRunner(sim_cluster, lower_flow(flowdefs.mislabelled_flow()), step_timeout=30)
    with pytest.raises(FlowRunError, match=r"op 'mislabelled' failed") as raised:
        runner.run_step(0)
    assert re.search(r"@op 'mislabelled' returned float [01]\.0", str(raised.value))
    assert "promises Stream[Sample]" in str(raised.value)


# each RL example and the samples its step generates (prompts x n)
_RL_EXAMPLES = {"ppo.py": 64, "grpo.py": 16 * 8, "rloo_sort.py": 16 * 8,
                "reinforce_pp_sort.py": 64}


@pytest.mark.parametrize("example", list(_RL_EXAMPLES))
def test_the_rl_examples_run_on_simulator_executors(sim_cluster, example):
    from flowkit.dsl import load_flow

    plan = lower_flow(load_flow(str(EXAMPLES / example)))
    runner = FlowRunner(sim_cluster, plan, sim_costs=SimCosts(F=0.001, B=0.001, W=0.0005))
    for step in range(2):  # the second step reads the first one's weights (feedback)
        report = runner.run_step(step)
    assert all(state.closed for state in runner.states.values())
    assert set(report.timing_s) == {node.name for node in plan}
    assert 0 <= report.metrics["bubble_rate"] < 1
    generated = runner.previous[("generate", "rollouts")].ordered()
    assert len(generated) == _RL_EXAMPLES[example]


@pytest.mark.slow
def test_flowkit_run_writes_a_trace_and_metrics(tmp_path):
    trace, metrics = tmp_path / "t.json", tmp_path / "m.jsonl"
    result = CliRunner().invoke(main, ["run", str(EXAMPLES / "grpo.py"), "--no-dashboard",
                                       "--steps", "2", "--trace", str(trace),
                                       "--metrics", str(metrics), "--sim-cost", "F=0.001"])
    assert result.exit_code == 0, result.output
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert {e["args"]["microbatch"] for e in spans if "microbatch" in e["args"]} == set(range(8))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    assert all({"loss", "bubble_rate", "tokens_per_s", "step_s"} <= set(line) for line in lines)


def test_flowkit_run_reports_a_failing_op_and_exits_1():
    result = CliRunner().invoke(main, ["run", f"{FLOWDEFS}:failing_flow", "--no-dashboard"])
    assert result.exit_code == 1
    assert "exploded" in result.output


def test_flowkit_run_shows_the_remote_traceback_only_with_debug():
    plain = CliRunner().invoke(main, ["run", f"{FLOWDEFS}:failing_flow", "--no-dashboard"])
    debug = CliRunner().invoke(main, ["run", f"{FLOWDEFS}:failing_flow", "--no-dashboard",
                                      "--debug"])
    assert plain.exit_code == debug.exit_code == 1
    assert "Traceback" not in plain.output and "--debug shows the traceback" in plain.output
    assert "Traceback" in debug.output


def test_flowkit_run_rejects_bad_sim_costs():
    result = CliRunner().invoke(main, ["run", str(EXAMPLES / "grpo.py"), "--sim-cost", "X=1"])
    assert result.exit_code == 2 and "NAME=SECONDS" in result.output
