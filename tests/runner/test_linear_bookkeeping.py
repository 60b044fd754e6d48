"""The runner's bookkeeping is linear in a step's items: doubling the items doubles the lines of
flowkit/runner it executes (counted with a tracer, not timed), so a step of 16k samples costs per
sample what one of 1k does."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from rich.console import Console

import flowkit
from flowkit import RunConfig
from tests.harness import shared_run
from tests.runner import flowdefs

RUNNER = str(Path(flowkit.__file__).parent / "runner")


def _runner_lines(pool, items: int) -> int:
    """Lines of flowkit/runner executed by one step of `flowdefs.paired_flow(items)`: per-item
    ops, one of them pairing two streams by sample, then a barrier."""
    count = 0

    def lines(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return lines

    def calls(frame, event, arg):
        return lines if frame.f_code.co_filename.startswith(RUNNER) else None

    config = RunConfig(steps=1, executors="base", code=[flowdefs.__file__], dashboard=False)
    with shared_run(pool, flowdefs.paired_flow(items), config,
                    console=Console(quiet=True)) as run:
        threading.settrace(calls)
        sys.settrace(calls)
        try:
            (report,) = run.steps()
        finally:
            sys.settrace(None)
            threading.settrace(None)
    assert report.step == 0
    return count


def test_doubling_a_steps_items_doubles_the_runners_work(pool):
    counts = {items: _runner_lines(pool, items) for items in (100, 200, 400)}
    assert counts[200] / counts[100] < 2.3, counts
    assert counts[400] / counts[200] < 2.3, counts
