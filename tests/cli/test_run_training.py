"""`flowkit run` on the pretraining example: torch executors chosen, options override the flow,
the loss falls, and the metrics carry what the issue asks for."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowkit.cli import main

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "pretrain_pp.py")


@pytest.mark.slow
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


_OWN_MODEL_FLOW = """
from dataflows.model_ops import Backprop, OptimizerStep
from dataflows.text import token_sequences
from flowkit.dsl import Flow, Model, collect

model = Model(name="mine", build="{module}:TinyLM", stages=2, tags=("train",),
              config={{"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2,
                       "n_embd": 32}})
with Flow("own") as flow:
    stats = Backprop(model)(token_sequences(path={corpus!r}, sequences=8, seq_len=16),
                            microbatches=2)
    OptimizerStep(model)(collect(stats))
"""


def _own_model_flow(tmp_path: Path, module: str) -> Path:
    (tmp_path / "mymodel.py").write_text("from executors.torch.models.gpt import GPT as TinyLM\n")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    flow = tmp_path / "flow.py"
    flow.write_text(_OWN_MODEL_FLOW.format(module=module, corpus=str(corpus)))
    return flow


@pytest.mark.slow
def test_a_model_module_beside_the_flow_file_trains_without_pythonpath(tmp_path):
    flow = _own_model_flow(tmp_path, "mymodel")
    result = CliRunner().invoke(main, ["run", str(flow), "--steps", "1", "--no-dashboard"])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_a_model_module_that_is_nowhere_is_named_with_where_it_was_looked_for(tmp_path):
    flow = _own_model_flow(tmp_path, "not_my_model")
    result = CliRunner().invoke(main, ["run", str(flow), "--steps", "1", "--no-dashboard"])
    assert result.exit_code == 1
    assert "no module 'not_my_model'" in result.output and str(tmp_path) in result.output
