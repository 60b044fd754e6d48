"""What the `flowkit run` tests share: running a flow in-process, expecting it to succeed or to
be refused with one line, and reading the metrics lines it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from click.testing import CliRunner

from flowkit.cli import main

FLOWS = Path(__file__).parent / "flows"
GRPO = str(FLOWS / "tiny_grpo.py")
PRETRAIN = str(FLOWS / "tiny_pretrain.py")


def run_ok(flow: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["run", flow, "--no-dashboard", *args])
    assert result.exit_code == 0, result.output + _traceback(result)
    return result.output


def one_step_checkpoint(root: Path, flow: str, executors: str) -> Path:
    """A checkpoint folder `root` holding one step of `flow` on `executors` (sim or torch)."""
    run_ok(flow, "--executors", executors, "--steps", "1", "--checkpoint-dir", str(root),
           "--checkpoint-every", "1")
    return root


def _traceback(result) -> str:
    """An exception the CLI did not turn into its one error line, with where it came from."""
    if result.exc_info is None or isinstance(result.exception, SystemExit):
        return ""
    return "\n" + "".join(traceback.format_exception(*result.exc_info))


def run_ok_in(folder: Path, flow: str, *args: str) -> str:
    """run_ok with `folder` as the working directory: the examples read and write paths such
    as checkpoints/ relative to it."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return run_ok(flow, *args)
    finally:
        os.chdir(cwd)


def refused(flow: str, *args: str) -> str:
    """The output of a run that must fail with a message, not a traceback."""
    result = CliRunner().invoke(main, ["run", flow, "--no-dashboard", *args])
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    return result.output


def metrics_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def conserved(lines: list[dict]) -> None:
    """Partial rollouts' books balance over a run's metrics lines: every sample started (or
    grown by a resumed tree) is trained once, dropped, or still carried after the last step,
    and each step resumes what the step before carried over."""
    started = sum(line["rollout/started"] + line["rollout/grown"] for line in lines)
    trained = sum(line["rollout/samples"] for line in lines)
    assert started == trained + sum(line["rollout/dropped"] for line in lines) \
        + lines[-1]["rollout/carried_over"]
    for before, after in zip(lines, lines[1:]):
        assert after["rollout/resumed"] == before["rollout/carried_over"]


def default_sigint() -> None:
    """In the child, before it runs: Ctrl-C's default, as a terminal gives its foreground job.
    A process that starts with SIGINT ignored keeps it ignored (Python installs no
    KeyboardInterrupt then), as pytest-xdist's workers have it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def output_of(process: subprocess.Popen, timeout: float) -> str:
    """The whole output of a `flowkit run` process once it ends; one still running after
    `timeout` seconds is killed, and the failure shows all it printed (a TimeoutExpired shows
    a cut repr of its first line only)."""
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        output = process.communicate()[0]
        raise AssertionError(f"the run did not end within {timeout:g} s; it printed:\n"
                             f"{output}") from None


def interrupted(flow: str, *args: str, metrics: Path) -> tuple[str, int]:
    """`flowkit run FLOW ARGS` (writing `metrics`) in a process of its own, Ctrl-C'd once two
    steps are written: its output and the steps it wrote. It must exit 130."""
    run = subprocess.Popen(
        [sys.executable, "-m", "flowkit", "run", flow, *args, "--steps", "100000",
         "--no-dashboard", "--metrics", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=default_sigint)
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert run.poll() is None, run.stdout.read()
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGINT)
    output = output_of(run, 120)
    assert run.returncode == 130, output
    return output, len(metrics_lines(metrics))
