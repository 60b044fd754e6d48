"""Chaos from the first second (benchmarks/chaos.py; `flowkit bench chaos --seeds 20` runs
more): kill -9 random executors of a pretraining run at random moments from its start on
(while they start, in the first step, during a recovery or a checkpoint's writing). Under
--max-restarts every run ends with the weights of the run without faults, bit for bit; without
restarts each fails within 2 s of the kill, naming the executor."""

from __future__ import annotations

import time

import pytest

from benchmarks.chaos import (
    STEPS,
    chaos_run,
    clean_run,
    fails_fast_naming,
    kill_window,
    same_weights,
    throughput_after,
)

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

SEEDS = (0, 1)  # a few: each run takes seconds on this machine; the bench runs 20


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(the clean run's weights, how long it took)."""
    return clean_run(tmp_path_factory.mktemp("clean"))


def _under_kills(tmp_path, seed: int, span_s: float):
    """A run under two kills in the window a run of `span_s` takes: once more in a window
    from its own length when it ended before its kills (the clean run was timed while the
    machine was busier), so that the kills always land. (the run, its folder)"""
    for attempt in range(3):
        folder = tmp_path / f"try{attempt}"
        started = time.monotonic()
        run = chaos_run(folder, seed, "--max-restarts", "3", kills=2, **kill_window(span_s))
        if len(run.killed) == 2 or run.returncode != 0:
            break
        span_s = time.monotonic() - started
    return run, folder


@pytest.mark.parametrize("seed", SEEDS)
def test_kills_at_any_moment_are_recovered_to_the_clean_weights(tmp_path, clean, seed):
    weights, span_s = clean
    run, folder = _under_kills(tmp_path, seed, span_s)
    assert run.returncode == 0, run.output
    assert len(run.killed) == 2, f"the run ended before its kills: {run.output}"
    assert run.output.count("restart ") >= 2
    assert same_weights(folder / "w", weights)


@pytest.mark.parametrize("seed", SEEDS)
def test_without_restarts_a_kill_fails_the_run_at_once_naming_the_executor(tmp_path, seed):
    run = chaos_run(tmp_path, seed, kills=1, steps=10 * STEPS, first_s=(0.2, 5.0))
    assert run.killed, run.output
    assert fails_fast_naming(run), (run.killed, run.exit_after_kill_s, run.output)


def test_throughput_after_a_recovery_compares_step_rates_either_side_of_it():
    """The bench's `throughput_after_x`: steps a second after the recovery (its own step left
    out) over before; None without two intervals on a side."""
    ends = [0.0, 1.0, 2.0, 3.0, 10.0, 12.0, 14.0, 16.0]  # killed at 3.5, recovered at 10
    assert throughput_after(ends, 3.5) == 0.5
    assert throughput_after(ends[:6], 3.5) is None and throughput_after(ends, 1.5) is None
