"""`flowkit run` on the pretraining example: torch executors chosen, options override the flow,
the loss falls, and the metrics carry what the issue asks for."""

import json
from pathlib import Path

from click.testing import CliRunner

from flowkit.cli import main

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "pretrain_pp.py")


def test_the_pretraining_example_trains_on_torch_executors_and_the_loss_falls(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = CliRunner().invoke(main, [
        "run", EXAMPLE, "--stages", "2", "--microbatches", "4", "--schedule", "1f1b",
        "--steps", "6", "--no-dashboard", "--metrics", str(metrics)])
    assert result.exit_code == 0, result.output
    assert "executors: torch" in result.output
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(6))
    assert all({"step", "loss", "tokens_per_s", "bubble_rate"} <= set(line) for line in lines)
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5  # from ln(256) = 5.5 down


def test_an_unknown_schedule_is_a_usage_error_before_anything_starts():
    result = CliRunner().invoke(main, ["run", EXAMPLE, "--schedule", "zb-h9"])
    assert result.exit_code == 2
    assert "unknown schedule kind 'zb-h9'" in result.output and "1f1b" in result.output
