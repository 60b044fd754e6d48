"""`flowkit bench chaos --seeds N`: kill -9 random executors of a `flowkit run` at random
moments from its first second on (while they start, in the first step, during a recovery or a
checkpoint's writing) and count the runs under --max-restarts that end with the weights of a
run without faults, bit for bit; and, without restarts, the runs that fail within 2 s of the
kill with an error naming the executor. Each recovery's time (MTTR), from a kill in a run that
was stepping to the first step it completed after it, in runs of 2 replicas killed once after
their first step: under --max-restarts, elastic (--elastic, no restart: it shrinks), and resumed
by hand (no restart: the run fails, and `flowkit run --resume` its newest checkpoint); with
each run's steps a second after its recovery over before (`throughput_after_x`).
tests/security/test_chaos.py runs a few seeds."""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from flowkit.runner.checkpoints.format import complete_checkpoints
from flowkit.runtime.forkserver import executor_processes

ROOT = Path(__file__).resolve().parents[1]
FLOW = str(Path(__file__).with_name("chaos_flow.py"))
STEPS = 30  # a few seconds a run: start-up, steps, recoveries and checkpoints all get kills
FAIL_WITHIN_S = 2.0  # without restarts, a kill ends the run this soon, naming the executor


@attrs.define
class ChaosRun:
    """One run under kills: what was killed (names, seconds after the run started) and how the
    run ended."""

    returncode: int
    output: str
    killed: list[tuple[str, float]]
    exit_after_kill_s: float | None  # from the last kill to the run's exit
    kill_times: list[float] = attrs.field(factory=list)  # time.time() of each kill


def command(folder: Path, *args: str) -> list[str]:
    """`flowkit run` of the chaos flow on torch executors, its final weights into folder/w."""
    return [sys.executable, "-m", "flowkit", "run", FLOW, "--no-dashboard", "--executors",
            "torch", "--save-weights", str(folder / "w"), "--metrics", str(folder / "m.jsonl"),
            *args]


def clean_run(folder: Path, steps: int = STEPS) -> tuple[Path, float]:
    """The run without faults whose weights every recovered run must end with, and how long
    it took: the kills of the runs under test fall within that span, whatever the machine."""
    started = time.monotonic()
    subprocess.run(command(folder, "--steps", str(steps)), cwd=ROOT, check=True,
                   capture_output=True)
    return folder / "w", time.monotonic() - started


def kill_window(span_s: float) -> dict:
    """When kills fall in a run that takes `span_s` without faults: the first from 0.2 s to
    half the span (start-up included), each next within a fraction of it (a recovery), so two
    kills land within 0.8 of the span: a run with recoveries takes longer, not shorter."""
    return {"first_s": (0.2, max(0.3, 0.5 * span_s)), "gap_s": (0.0, max(0.1, 0.3 * span_s))}


def chaos_run(folder: Path, seed: int, *args: str, kills: int = 2, steps: int = STEPS,
              first_s: tuple[float, float] = (0.2, 5.0), gap_s: tuple[float, float] = (0.0, 3.0),
              after_steps: int = 0) -> ChaosRun:
    """Run the flow and kill -9 a random executor `kills` times: the first a random moment in
    `first_s` after the start (with `after_steps`: after that many steps' metrics lines), each
    next one a random moment in `gap_s` after the one before (during the recovery, often). A
    kill due while no executor process exists waits for one."""
    rng = random.Random(seed)
    moments, at = [], rng.uniform(*first_s)
    for _ in range(kills):
        moments.append(at)
        at += rng.uniform(*gap_s)
    started = time.monotonic()
    # a user's run forks its executors from a fork server of its own; the suite's runs share
    # the suite's (FLOWKIT_FORKSERVER), which says which of its children are this run's
    process = subprocess.Popen(command(folder, "--steps", str(steps), *args), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed: list[tuple[str, float]] = []
    kill_times: list[float] = []
    # a process killed a moment ago may still be exiting (a torch process takes tens of ms
    # to give its memory back), named as it was: a kill is never spent on it again
    dead: set[int] = set()
    last_kill = None
    while process.poll() is None and len(killed) < kills:
        if not killed and after_steps and len(step_times(folder)) < after_steps:
            started = time.monotonic()  # the clock starts once those steps are done
        now = time.monotonic() - started
        if now >= moments[len(killed)]:
            executors = {pid: name for pid, name in executor_processes(process.pid).items()
                         if pid not in dead}
            if executors:
                pid = rng.choice(sorted(executors))
                with _gone_ok():
                    os.kill(pid, signal.SIGKILL)
                    dead.add(pid)
                    killed.append((executors[pid], round(now, 3)))
                    kill_times.append(time.time())
                    last_kill = time.monotonic()
        time.sleep(0.005)
    output, _ = process.communicate(timeout=600)
    after = None if last_kill is None else time.monotonic() - last_kill
    return ChaosRun(process.returncode, output, killed, after, kill_times)


def step_times(folder: Path) -> list[float]:
    """When each step the run logged ended (time.time()), in the order written."""
    path = folder / "m.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line)["time"] for line in lines if line.endswith("}")]


def recovery_times(run: ChaosRun, folder: Path) -> list[float]:
    """For each kill of a run that was stepping (a step ended before it), the seconds to the
    first step that ended after it: the time to recover (detection, waiting for the survivors'
    tasks, replacement or re-planning, restore, the replayed step)."""
    ends = step_times(folder)
    times = []
    for kill in run.kill_times:
        after = [end for end in ends if end > kill]
        if after and any(end < kill for end in ends):
            times.append(after[0] - kill)
    return times


def throughput_after(ends: list[float], kill: float) -> float | None:
    """Steps a second after the recovery from a kill at `kill` over those before it (the
    median time between two steps' ends on each side, the recovery's own step left out);
    None without two intervals on each side."""
    before = [b - a for a, b in zip(ends, ends[1:]) if b < kill]
    later = [end for end in ends if end > kill][1:]  # from the first step after the recovery
    after = [b - a for a, b in zip(later, later[1:])]
    if len(before) < 2 or len(after) < 2:
        return None
    return statistics.median(before) / statistics.median(after)


def summary(times: list[float], throughputs: list[float] = ()) -> dict:
    """Median and max of recovery times, in seconds, and how many; with `throughputs`, the
    median of each run's steps a second after its recovery over before."""
    if not times:
        return {"kills": 0}
    out = {"kills": len(times), "median_s": round(statistics.median(times), 3),
           "max_s": round(max(times), 3)}
    if throughputs:
        out["throughput_after_x"] = round(statistics.median(throughputs), 3)
    return out


class _gone_ok:
    """A process that exited between the listing and the kill is no error."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, *rest: Any) -> bool:
        return kind is ProcessLookupError


def same_weights(got: Path, want: Path) -> bool:
    """Bit-for-bit the same tensors in every model file of two --save-weights folders."""
    import torch

    files = sorted(p.name for p in want.glob("*.pt"))
    if not files or sorted(p.name for p in got.glob("*.pt")) != files:
        return False
    for name in files:
        mine = torch.load(got / name, weights_only=True)
        theirs = torch.load(want / name, weights_only=True)
        if mine.keys() != theirs.keys():
            return False
        if not all(torch.equal(mine[key], theirs[key]) for key in theirs):
            return False
    return True


def run_chaos_bench(seeds: int = 20, kills: int = 2) -> dict:
    """`seeds` runs under --max-restarts with `kills` kills each, and `seeds` runs without
    restarts with one kill each: how many recovered to the clean weights, how many failed
    fast naming the executor; and the recovery times of `seeds` runs killed once under
    restarts, and as many elastic ones."""
    with tempfile.TemporaryDirectory(prefix="flowkit-chaos-") as tmp:
        root = Path(tmp)
        clean, span_s = clean_run(root / "clean")
        recovered, failures = 0, []
        for seed in range(seeds):
            run = chaos_run(root / f"r{seed}", seed, "--max-restarts", str(kills + 1),
                            kills=kills, **kill_window(span_s))
            if run.returncode == 0 and same_weights(root / f"r{seed}" / "w", clean):
                recovered += 1
            else:
                failures.append({"seed": seed, "killed": run.killed, "code": run.returncode,
                                 "tail": run.output.strip().splitlines()[-3:]})
        restarted, restart_times, restart_rates = one_kill_runs(
            root / "mttr-restart", seeds, "--max-restarts", "1")
        shrunk, shrink_times, shrink_rates = one_kill_runs(
            root / "mttr-elastic", seeds, "--elastic", "--elastic-wait", "0")
        resumed, resume_times, resume_rates = resumed_runs(root / "mttr-resume", seeds)
        fast, slow = 0, []
        for seed in range(seeds):
            run = chaos_run(root / f"f{seed}", seed, kills=1, steps=10 * STEPS)
            if fails_fast_naming(run):
                fast += 1
            else:
                slow.append({"seed": seed, "killed": run.killed, "code": run.returncode,
                             "after_s": run.exit_after_kill_s,
                             "tail": run.output.strip().splitlines()[-2:]})
    return {"seeds": seeds, "kills_per_run": kills, "recovered": recovered,
            "not_recovered": failures, "failed_fast_naming_the_executor": fast,
            "without_restarts_otherwise": slow, "restarted_after_one_kill": restarted,
            "mttr_restart": summary(restart_times, restart_rates), "elastic_went_on": shrunk,
            "mttr_elastic_shrink": summary(shrink_times, shrink_rates),
            "resumed_after_one_kill": resumed,
            "mttr_resume": summary(resume_times, resume_rates)}


def _one_kill(folder: Path, seed: int, *args: str) -> ChaosRun:
    """A run of 2 replicas (4 executors) with `args`, a checkpoint each step, killed once at
    a random moment after a random step (in an op, a weight sync, a checkpoint's writing)."""
    return chaos_run(folder, seed, "--replicas", "2", "--checkpoint-dir", str(folder / "ck"),
                     "--checkpoint-every", "1", *args, kills=1, first_s=(0.0, 0.05),
                     after_steps=random.Random(seed).randint(1, STEPS // 2))


def one_kill_runs(root: Path, seeds: int, *args: str) -> tuple[int, list[float], list[float]]:
    """`seeds` _one_kill runs with `args` (restarts, or elastic): how many ended well, the
    recovery times, and each run's throughput after its recovery over before."""
    ended, times, rates = 0, [], []
    for seed in range(seeds):
        folder = root / f"s{seed}"
        run = _one_kill(folder, seed, *args)
        times += recovery_times(run, folder)
        rates += [r for r in (throughput_after(step_times(folder), k) for k in run.kill_times)
                  if r is not None]
        ended += run.returncode == 0 and len(run.killed) == 1
    return ended, times, rates


def resumed_runs(root: Path, seeds: int) -> tuple[int, list[float], list[float]]:
    """`seeds` _one_kill runs without restarts, each then resumed by hand from its newest
    checkpoint (`flowkit run ... --resume`, a fresh process): how many resumed runs ended
    well, the times from the kill to the resumed run's first step, and the throughputs."""
    ended, times, rates = 0, [], []
    for seed in range(seeds):
        folder = root / f"s{seed}"
        run = _one_kill(folder, seed)
        # the newest complete one: a kill may land while a checkpoint is being written
        newest = complete_checkpoints(folder / "ck")
        if run.returncode == 0 or not newest or not run.kill_times:
            continue  # it ended before its kill: nothing to resume
        again = folder / "resumed"  # checkpointing each step as before, for a fair throughput
        resumed = subprocess.run(command(again, "--steps", str(STEPS), "--replicas", "2",
                                         "--checkpoint-dir", str(again / "ck"),
                                         "--checkpoint-every", "1", "--resume", str(newest[-1])),
                                 cwd=ROOT, capture_output=True, text=True)
        ended += resumed.returncode == 0
        kill = run.kill_times[0]
        after = [end for end in step_times(folder / "resumed") if end > kill]
        if after:
            times.append(after[0] - kill)
            rate = throughput_after([e for e in step_times(folder) if e < kill] + after, kill)
            rates += [rate] if rate is not None else []
    return ended, times, rates


def fails_fast_naming(run: ChaosRun) -> bool:
    """A run without restarts that lost an executor: a one-line error naming it, within
    FAIL_WITHIN_S of the kill."""
    if run.returncode == 0 or not run.killed or run.exit_after_kill_s is None:
        return False
    name = run.killed[-1][0]
    return (run.exit_after_kill_s < FAIL_WITHIN_S and name in run.output
            and "Traceback" not in run.output)
