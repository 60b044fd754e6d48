"""Placement benchmark: what lending the training executors to generation buys a synchronous
GRPO run whose training executors idle while it generates (`flowkit run --placement`).

Method: `grpo_flow` (32 prompts x 8 samples, log-normal lengths up to 256 tokens, the actor in 2
stages, 8 microbatches) synchronously on 4 simulator executors, whose decode iterations cost
2 ms plus 0.2 ms per live sequence (what reading each sequence's KV cache costs a GPU engine, so
an engine with half the sequences decodes faster: generation is bound by the engines' number,
not only by its longest sample), and three placements of the same executors, each its own run:

- `disaggregated`: 2 train and 2 rollout executors (the baseline);
- `multiplexed`: the same, the train executors also running generation;
- `colocated`: all 4 executors both.

Per placement: steps/s from the end of the first step to the end of the last; and from the
run's trace over the same steps, each executor's idle share (the part of the window in which
none of its ops or rollout requests was running), averaged over the training executors and over
the others. What the training executors' idle time allows (`allowed_speedup`, measured in the
same run): lent to generation, those executors can at best do what as many more dedicated
rollout executors would, free of training (`bound`: 4 rollout and 2 train executors,
disaggregated); `realized` is the share of that growth, (speedup - 1) / (allowed - 1), a
placement gets.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import attrs

__all__ = ["PLACEMENT_MODES", "PlacementSetup", "run_placement_bench"]

PLACEMENT_MODES = ("disaggregated", "multiplexed", "colocated")  # the baseline first


@attrs.frozen
class PlacementSetup:
    prompts: int = 32
    n: int = 8
    max_new_tokens: int = 256
    length_sigma: float = 1.0
    rollout_executors: int = 2
    train_executors: int = 2  # = pipeline stages
    microbatches: int = 8
    steps: int = 6  # the first warms up, the rest are measured
    token: float = 0.002  # seconds: a decode iteration's fixed part
    token_per_seq: float = 0.0002  # and per live sequence
    F: float = 0.012
    B: float = 0.012
    W: float = 0.008
    infer_token: float = 0.00002
    optimizer_step: float = 0.01

    def tags(self, placement: str) -> list[tuple[str, ...]]:
        """The executors' tags: train ones, then the others, as `placement` lends them."""
        from benchmarks.rl import placement_groups

        rest, train = placement_groups(placement)
        return [train] * self.train_executors + [rest] * self.rollout_executors


def run_placement_bench(setup: PlacementSetup | None = None,
                        placements: tuple[str, ...] = PLACEMENT_MODES) -> dict:
    """Per placement: steps/s, idle shares, and the ratios to the first placement."""
    setup = setup or PlacementSetup()
    unknown = sorted(set(placements) - set(PLACEMENT_MODES))
    if unknown:
        raise ValueError(f"unknown placements {unknown}: choose from {list(PLACEMENT_MODES)}")
    if setup.steps < 2:
        raise ValueError(f"the bench measures the steps after the first: needs >= 2, got "
                         f"{setup.steps}")
    runs = {placement: _measured(setup, placement) for placement in PLACEMENT_MODES
            if placement in placements}
    # the ceiling: the training executors' idle time as good as that many more dedicated
    # rollout executors, free of any training of their own
    more = attrs.evolve(setup, rollout_executors=setup.rollout_executors
                        + setup.train_executors)
    bound = _measured(more, "disaggregated")
    first = next(iter(runs))
    for run in (*runs.values(), bound):
        run["speedup"] = run["steps_per_s"] / runs[first]["steps_per_s"]
    allowed = bound["speedup"]
    for run in runs.values():
        run["realized"] = (run["speedup"] - 1) / (allowed - 1) if allowed > 1 else None
    return {"setup": attrs.asdict(setup), "baseline": first, "allowed_speedup": allowed,
            "bound": bound, **runs}


def _measured(setup: PlacementSetup, placement: str) -> dict:
    from benchmarks.runs import bench_run
    from dataflows.grpo import grpo_flow
    from flowkit.planner.simcosts import SimCosts
    from flowkit.runtime import Controller, LocalExecutors

    costs = SimCosts(F=setup.F, B=setup.B, W=setup.W, optimizer_step=setup.optimizer_step,
                     token=setup.token, token_per_seq=setup.token_per_seq,
                     infer_token=setup.infer_token, length_sigma=setup.length_sigma)
    flow = grpo_flow(prompts=setup.prompts, n=setup.n, stages=setup.train_executors,
                     microbatches=setup.microbatches, max_new_tokens=setup.max_new_tokens)
    tags = setup.tags(placement)
    trace = Path(tempfile.mkdtemp(prefix="flowkit-placement-bench-")) / "trace.json"
    ends = []
    with Controller() as ctl, LocalExecutors(ctl, len(tags), kind="sim", tags=tags):
        with bench_run(flow, controller=ctl, steps=setup.steps, executors="sim",
                       sim_costs=costs, trace=trace) as run:
            for _ in run.steps():
                ends.append(time.perf_counter())
        training = {e.id for e in ctl.executors() if "train" in e.tags}
        everyone = {e.id for e in ctl.executors()}
    idle = _idle_shares(json.loads(trace.read_text())["traceEvents"], everyone)
    trace.unlink()
    trace.parent.rmdir()
    steps = len(ends) - 1
    return {"steps_per_s": steps / (ends[-1] - ends[0]),
            "train_idle_share": statistics.fmean(idle[e] for e in training),
            "other_idle_share": statistics.fmean(idle[e] for e in everyone - training)
            if everyone - training else None,
            "busy_share": 1 - statistics.fmean(idle.values()),
            "tags": [list(group) for group in tags]}


def _idle_shares(events: list[dict], executors: set[int]) -> dict[int, float]:
    """Each executor's share of the measured steps' window (the first span of step 1 to the
    last end of any later step's) in which none of its spans ran."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("step", 0) >= 1]
    begin = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    busy: dict[int, list[tuple[float, float]]] = {executor: [] for executor in executors}
    for e in spans:
        if e["pid"] in busy:
            busy[e["pid"]].append((max(begin, e["ts"]), min(end, e["ts"] + e["dur"])))
    return {executor: 1 - _covered(intervals) / (end - begin)
            for executor, intervals in busy.items()}


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of `intervals`."""
    total, reach = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= reach:
            continue
        total += stop - max(start, reach)
        reach = stop
    return total
