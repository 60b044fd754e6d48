"""Your own model end to end, as the README runs it: the LSTM of examples/tiny_lstm.py warms up
on digit sorting (here in two pipeline stages, through its own `split`), its checkpoint is
saved, and GRPO starts from it, generating without a cache."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowkit.cli import main

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

EXAMPLES = Path(__file__).parents[2] / "examples"


def _run(folder: Path, *args: str):
    cwd = os.getcwd()
    os.chdir(folder)  # the GRPO example reads checkpoints/lstm.pt from the working directory
    try:
        result = CliRunner().invoke(main, ["run", *args, "--no-dashboard"])
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    assert "executors: torch" in result.output
    return [json.loads(line) for line in (folder / args[-1]).read_text().splitlines()]


def test_the_lstm_pretrains_saves_its_weights_and_runs_grpo_from_them(tmp_path):
    sft = _run(tmp_path, str(EXAMPLES / "lstm_sort_sft.py"), "--steps", "4", "--stages", "2",
               "--microbatches", "2", "--save-weights", "checkpoints", "--metrics", "sft.jsonl")
    assert sft[-1]["loss"] < sft[0]["loss"] - 0.5  # from ln 128 = 4.85 down
    assert (tmp_path / "checkpoints" / "lstm.pt").is_file()
    grpo = _run(tmp_path, str(EXAMPLES / "lstm_grpo_sort.py"), "--steps", "2", "--metrics",
                "grpo.jsonl")
    assert [line["step"] for line in grpo] == [0, 1]
    assert all({"reward_mean", "response_length_mean", "timing_s/generate"} <= set(line)
               for line in grpo)
