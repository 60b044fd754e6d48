"""What the `flowkit run` tests share: running a flow in-process, expecting it to succeed or to
be refused with one line, and reading the metrics lines it wrote."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from flowkit.cli import main

FLOWS = Path(__file__).parent / "flows"
GRPO = str(FLOWS / "tiny_grpo.py")
PRETRAIN = str(FLOWS / "tiny_pretrain.py")


def run_ok(flow: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["run", flow, "--no-dashboard", *args])
    assert result.exit_code == 0, result.output
    return result.output


def refused(flow: str, *args: str) -> str:
    """The output of a run that must fail with a message, not a traceback."""
    result = CliRunner().invoke(main, ["run", flow, "--no-dashboard", *args])
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    return result.output


def metrics_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
