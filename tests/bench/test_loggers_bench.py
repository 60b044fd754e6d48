"""`flowkit bench loggers`: every configuration measured against JSON lines alone."""

import json
import sys

from click.testing import CliRunner

from benchmarks.loggers import CONFIGS, run_loggers_bench
from flowkit.cli import main


def test_the_loggers_bench_measures_each_logger_against_json_lines():
    figures = run_loggers_bench(steps=5, rounds=1)
    assert figures["jsonl"]["ratio"] == 1.0
    for name in CONFIGS:
        assert figures[name]["step_us"] > 0 and figures[name]["ratio"] > 0
    assert figures["jsonl+wandb"]["open_s"] > 0  # a W&B run starts W&B's service


def test_a_missing_package_is_reported_not_measured(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as when it is absent
    out = tmp_path / "figures.json"
    result = CliRunner().invoke(main, ["bench", "loggers", "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert "flowkit[tensorboard]" in figures["jsonl+tensorboard"]["missing"]
    assert figures["jsonl+wandb"]["ratio"] > 0
