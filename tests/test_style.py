"""The code's style holds: ruff's rules in pyproject.toml, the 100-character line limit (E501)
among them, over every package, test and example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_runner_module_runs_past_450_lines():
    """The runner's modules stay readable in one sitting: a part that grows past 450 lines is
    reshaped into a module of its own (as checks before the start went to run_checks.py)."""
    long = {path.name: n for path in (ROOT / "flowkit" / "runner").rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 450}
    assert not long, long
