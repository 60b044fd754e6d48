"""Offload in schedules (PipeOffload): O/P actions, their memory and copy-time model, the
validator's checks, and the choice under a memory limit [Note: offload in
flowkit/planner/offload.py]."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowkit.planner import Action, Costs, Kind, MemoryModel, Placement, Schedule, ScheduleError
from flowkit.planner.export import schedule_to_json
from flowkit.planner.offload import best_with_offload, offload_schedule, offloadable
from flowkit.planner.schedules import build_schedule
from flowkit.planner.simulate import simulate
from flowkit.planner.validate import validate
from tests.planner.schedule_json import schedule_from_json
from tests.planner.strategies import draw_shares


def _schedule(*device_texts: str, microbatches=2) -> Schedule:
    ops = [[Action.parse(t) for t in text.split()] for text in device_texts]
    return Schedule(kind="hand", placement=Placement(range(len(ops))),
                    microbatches=microbatches, device_ops=ops)


def _away_peaks(plain: Schedule, offloaded: Schedule, costs: Costs, memory: MemoryModel):
    """Each device's peak over time of the plain timeline's memory (an op's addition from its
    start, its release from its end) less what an F adds for each microbatch away on the host
    (its O ended, its P not started), from the copies' own intervals."""
    base = simulate(plain, costs, memory)
    copies = simulate(offloaded, costs, memory).copies
    peaks = []
    for device, intervals in enumerate(base.intervals):
        outs = {(c.action.stage, c.action.microbatch): c.end for c in copies[device]
                if c.action.kind is Kind.O}
        ins = {(c.action.stage, c.action.microbatch): c.start for c in copies[device]
               if c.action.kind is Kind.P}
        peak = 0.0
        for t in {x for iv in intervals for x in (iv.start, iv.end)}:
            level = sum(memory.delta(iv.action) for iv in intervals
                        if (iv.start if memory.delta(iv.action) > 0 else iv.end) <= t)
            away = sum(1 for k, end in outs.items() if end <= t < ins[k])
            peak = max(peak, level - memory.F * away)
        peaks.append(peak)
    return peaks


def test_actions_print_and_parse():
    assert str(Action(2, Kind.O, 3)) == "2O3" and Action.parse("2P3") == Action(2, Kind.P, 3)
    assert Kind.O.is_copy and Kind.P.is_copy and not Kind.F.is_copy


def test_offload_places_o_after_f_and_p_before_the_backward():
    costs = Costs.uniform(4, copy=0.5)
    plain = build_schedule("1f1b", devices=4, microbatches=8, costs=Costs.uniform(4))
    ops = offload_schedule(plain, costs, "all").text()[0]
    assert ops.index("0O0") == ops.index("0F0") + 1
    assert ops.index("0O0") < ops.index("0P0") < ops.index("0BW0")
    assert ops.index("0P0") == ops.index("0BW0") - 1  # late as hides it: one op's lead suffices
    last = offload_schedule(plain, costs, "all").text()[3]
    assert not any("O" in a for a in last)  # the last stage's F is followed by its BW at once


@pytest.mark.parametrize(("kind", "peaks"), [
    ("1f1b", {"none": 4, "half": 3, "all": 2}),
    ("zb-h2", {"none": 7, "half": 5, "all": 2}),
])
def test_peak_falls_by_the_offloaded_share(kind, peaks):
    """Copies that take no time: device 0 holds 4 (1F1B) or 7 (ZB-H2) microbatches at its
    peak; with all offloaded only the one in its forward and the one prefetched for the next
    backward remain, with half about half of them, and the makespan is unchanged."""
    costs = Costs.uniform(4, copy=0.0)
    plain = build_schedule(kind, devices=4, microbatches=8, costs=costs)
    base = validate(plain, costs)
    for which, peak in peaks.items():
        result = validate(offload_schedule(plain, costs, which), costs)
        assert result.peak_memory[0] == peak
        assert result.makespan == base.makespan


def test_validator_rejects_a_backward_before_its_prefetch():
    err = _bad("0F0 0O0 0F1 0B0 0P0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1")
    assert "0B0 runs before its prefetch 0P0 on device 0" in str(err)
    assert "[0B0]" in str(err) and "[0P0]" in str(err)


def test_validator_rejects_an_offload_without_prefetch_and_copies_out_of_order():
    err = _bad("0F0 0O0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1")
    assert "0O0 on device 0 has no P to bring them back" in str(err)
    err = _bad("0P0 0F0 0O0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1")
    assert "0P0 needs 0O0 listed before it" in str(err)
    err = _bad("0O0 0F0 0F1 0P0 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1")
    assert "0O0 needs 0F0 listed before it" in str(err)


def _bad(*texts):
    with pytest.raises(ScheduleError) as err:
        validate(_schedule(*texts), Costs.uniform(2, copy=0.5))
    return err.value


def test_a_late_prefetch_delays_the_backward_by_what_is_left_of_it():
    """The copy engines overlap compute: a prefetch issued one op ahead delays the backward
    only by what of it that op does not cover (the copy out must end first, too)."""
    texts = ("0F0 0O0 0F1 0P0 0B0 0W0 0B1 0W1", "1F0 1B0 1F1 1B1 1W0 1W1")
    hidden = validate(_schedule(*texts), Costs.uniform(2, copy=1.0))
    plain = validate(_schedule(*(t.replace(" 0O0", "").replace(" 0P0", "") for t in texts)),
                     Costs.uniform(2))
    assert hidden.makespan == plain.makespan
    late = validate(_schedule(*texts), Costs.uniform(2, copy=2.5))
    b0 = next(iv for iv in late.intervals[0] if str(iv.action) == "0B0")
    p0 = next(iv for iv in late.copies[0] if str(iv.action) == "0P0")
    # O0 runs 1 -> 3.5, P0 3.5 -> 6, so B0 starts at 6 instead of 3 (its gradient's arrival)
    assert (p0.start, p0.end, b0.start) == (3.5, 6.0, 6.0)
    assert late.makespan == plain.makespan + 3.0


def _one_point_five_b(*, attention_scores: bool) -> Costs:
    """A 1.5B GPT (the Zero Bubble paper's: 22 layers, h 2304, 24 heads, s 1024) on 8 devices,
    micro batch 1, at 125 TFLOP/s (an A100 at 40 %) with a 25 GB/s host link (PCIe 4 x16)."""
    return Costs.from_dims(layers_per_stage=[3, 3, 3, 3, 3, 3, 2, 2], seq=1024, micro_batch=1,
                           hidden=2304, heads=24, flops_per_s=125e12, host_bytes_per_s=25e9,
                           attention_scores=attention_scores)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zb-h2"])
def test_half_offload_at_pcie_bandwidth_costs_under_5_percent(kind):
    costs = _one_point_five_b(attention_scores=False)  # flash attention: M_B = 34sbh
    assert costs.copy[0] == pytest.approx(3 * 34 * 1024 * 2304 / 25e9)  # 9.6 ms, ~ F + B + W
    plain = build_schedule(kind, devices=8, microbatches=24, costs=costs)
    base = validate(plain, costs)
    result = validate(offload_schedule(plain, costs, "half"), costs)
    assert result.makespan < 1.05 * base.makespan
    assert max(result.peak_memory) < max(base.peak_memory)


def test_offload_fits_a_limit_the_plain_schedule_cannot():
    """The Zero Bubble paper's 1.5B costs on 4 devices, copies a third of an F: at ZB-H1's
    memory (p = 4) ZB-H2 (2p - 1 = 7) fits with all offloaded, and auto with offload finds it,
    shorter than the best schedule auto finds without offload."""
    costs = Costs.uniform(4, F=18.522, B=18.086, W=9.337, comm=0.601, copy=6.0)
    memory = MemoryModel()
    with pytest.raises(ScheduleError):
        build_schedule("zb-h2", devices=4, microbatches=8, costs=costs, memory_limit=4)
    pick = best_with_offload("zb-h2", devices=4, microbatches=8, costs=costs, memory=memory,
                             memory_limit=4)
    assert pick.offload == "all" and max(pick.result.peak_memory) <= 4
    plain = validate(build_schedule("auto", devices=4, microbatches=8, costs=costs,
                                    memory_limit=4), costs)
    auto = best_with_offload("auto", devices=4, microbatches=8, costs=costs, memory=memory,
                             memory_limit=4)
    assert max(auto.result.peak_memory) <= 4 and auto.offload != "none"
    assert auto.result.makespan < 0.95 * plain.makespan  # 425.0 against 456.6
    roomy = best_with_offload("auto", devices=4, microbatches=8, costs=costs, memory=memory,
                              memory_limit=8)
    assert roomy.offload == "none"  # nothing to gain: no copies


def test_json_keeps_the_copies():
    costs = Costs.uniform(4, copy=0.5)
    sched = offload_schedule(build_schedule("zb-h1", devices=4, microbatches=8, costs=costs),
                             costs, "half")
    result = validate(sched, costs)
    data = schedule_to_json(sched, costs=costs, memory=MemoryModel(), memory_limit=None,
                            result=result)
    loaded = schedule_from_json(data)
    assert loaded.schedule == sched and loaded.costs == costs
    assert validate(loaded.schedule, loaded.costs).peak_memory == result.peak_memory


@st.composite
def _offload_cases(draw):
    p = draw(st.integers(2, 5))
    m = draw(st.integers(1, 10))
    shares = draw_shares(draw, p)
    copy = draw(st.lists(st.floats(0.0, 4.0, allow_nan=False), min_size=p, max_size=p))
    kind = draw(st.sampled_from(["1f1b", "zb-h1", "zb-h2", "auto"]))
    which = draw(st.sampled_from(["half", "all"]))
    return p, m, Costs(**shares, copy=copy), kind, which


@settings(max_examples=60, deadline=None)
@given(_offload_cases())
def test_offload_properties(case):
    """Any schedule offloaded stays valid; a backward never starts before its prefetch ends,
    nor a prefetch before its offload ends; no device's peak rises; and with copies that take
    no time the makespan is unchanged and the peak is the plain timeline's memory less the
    microbatches away on the host."""
    p, m, costs, kind, which = case
    memory = MemoryModel()
    plain = build_schedule(kind, devices=p, microbatches=m, costs=costs)
    base = validate(plain, costs, memory)
    offloaded = offload_schedule(plain, costs, which)
    result = validate(offloaded, costs, memory)
    starts = {iv.action: iv for ivs in result.intervals for iv in ivs}
    for ivs in result.copies:
        for c in ivs:
            s, mb = c.action.stage, c.action.microbatch
            if c.action.kind is Kind.O:
                assert c.start >= starts[Action(s, Kind.F, mb)].end
            else:
                back = starts.get(Action(s, Kind.B, mb)) or starts[Action(s, Kind.BW, mb)]
                assert back.start >= c.end
    for mine, theirs in zip(result.peak_memory, base.peak_memory):
        assert mine <= theirs + 1e-9
    free = Costs(F=costs.F, B=costs.B, W=costs.W, copy=[0.0] * p)
    zero = offload_schedule(plain, free, which)
    zero_result = validate(zero, free, memory)
    assert zero_result.makespan == pytest.approx(base.makespan)
    assert list(zero_result.peak_memory) == pytest.approx(_away_peaks(plain, zero, free, memory))
    assert len(offloadable(plain)) >= sum(
        a.kind is Kind.O for ops in offloaded.device_ops for a in ops)


def test_the_runtime_hands_each_copy_to_the_compute_op_that_issues_it():
    """[Note: offload in the runtime in flowkit/ops/executor_ops.py]: an O to its F, a P to the
    compute op listed before it; no copy is a task of its own."""
    from flowkit.runner.pipeline import _carried_copies, stage_costs_config

    costs = Costs.uniform(2, copy=0.5)
    sched = offload_schedule(build_schedule("1f1b", devices=2, microbatches=4, costs=costs),
                             costs, "all")
    carried = _carried_copies(sched, stage_costs_config(costs))
    for ops in sched.device_ops:
        compute = None
        for a in ops:
            if not a.kind.is_copy:
                compute = a
            elif a.kind is Kind.O:
                assert compute == Action(a.stage, Kind.F, a.microbatch)
                assert carried[compute]["offload"] and carried[compute]["copy_seconds"] == 0.5
            else:
                assert [a.stage, a.microbatch, 0.5] in carried[compute]["prefetch"]
    copies = sum(a.kind.is_copy for ops in sched.device_ops for a in ops)
    assert copies and copies == sum(
        len(c.get("prefetch", ())) + bool(c.get("offload")) for c in carried.values())
