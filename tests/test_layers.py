"""The layers of DESIGN's parts hold: the import-linter contracts in pyproject.toml (the core
imports no executor or flow library, the planner no torch or zmq, executors and flows meet only
in flowkit.ops, no import cycles inside a package, lazy imports included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
