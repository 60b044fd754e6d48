"""`flowkit bench trl` at its smallest: a one-step warm-up, then flowkit's GRPO and TRL's
GRPOTrainer two steps each from the same weights; the report's shape and sanity (no timing
assertions). Without TRL, the bench says how to install it."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from flowkit.cli import main

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes


def test_both_sides_run_the_steps_asked_and_report_curves_and_times(tmp_path):
    pytest.importorskip("trl", reason="the trl extra: pip install -e '.[trl]'")
    out = tmp_path / "figures.json"
    result = CliRunner().invoke(main, ["bench", "trl", "--steps", "2", "--seeds", "1",
                                       "--warm-steps", "1", "--pipeline", "--scored-reference",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "flowkit / TRL" in result.output and "flowkit, 2 stages" in result.output
    assert "flowkit, ref op" in result.output
    figures = json.loads(out.read_text())
    assert figures["setup"]["steps"] == 2 and figures["setup"]["trl"]
    # the same cores: TRL's process as many threads as flowkit's executors together
    assert figures["setup"]["threads"] == {"flowkit_executors": 2, "flowkit_per_executor": 1,
                                           "trl": 2}
    assert figures["warm_up"]["steps"] == 1 and figures["warm_up"]["wall_s"] > 0
    (run,) = figures["runs"]
    assert run["seed"] == 0 and sorted(run["order"]) == ["flowkit", "flowkit_pipeline",
                                                         "flowkit_scored", "trl"]
    for where in (run, figures):
        for side in ("flowkit", "flowkit_pipeline", "flowkit_scored", "trl"):
            got = where[side]
            assert len(got["reward_curve"]) == 2
            assert all(0.0 <= reward <= 1.0 for reward in got["reward_curve"])
            assert 0.0 <= got["reward_last10"] <= 1.0
            assert 0 < got["step_s"] < got["wall_s"]
        assert where["step_ratio"] == where["flowkit"]["step_s"] / where["trl"]["step_s"]
        assert where["pipeline_step_ratio"] == (where["flowkit_pipeline"]["step_s"]
                                                / where["trl"]["step_s"])
        assert where["scored_step_ratio"] == (where["flowkit_scored"]["step_s"]
                                              / where["trl"]["step_s"])
    assert run["flowkit"]["steps"] == run["flowkit_pipeline"]["steps"] == run["trl"]["steps"] == 2
    assert run["flowkit_scored"]["steps"] == 2
    assert 0.0 <= figures["reward_curve_gap"] <= 1.0


def test_without_trl_the_bench_says_how_to_install_it(monkeypatch):
    from benchmarks.trl import TRLMissingError, require_trl, run_trl_bench

    monkeypatch.setitem(sys.modules, "trl", None)  # as when it is absent
    with pytest.raises(TRLMissingError, match=r"pip install -e '\.\[trl\]'"):
        require_trl()
    with pytest.raises(ImportError, match=r"\[trl\]"):
        run_trl_bench(steps=2, seeds=1, warm_steps=1)
    result = CliRunner().invoke(main, ["bench", "trl"])
    assert result.exit_code == 1
    assert "TRL is not installed" in result.output and "pip install -e '.[trl]'" in result.output


def test_the_bench_runs_the_examples_flows_with_their_settings(tmp_path, monkeypatch):
    """flowkit's side is examples/qwen2_sft.py's and examples/qwen2_grpo.py's flows, model
    folders and sampling seed aside, and GRPOSetup (what TRL is given) says the same values."""
    import runpy

    pytest.importorskip("transformers", reason="the hf extra: pip install 'flowkit[hf]'")
    from benchmarks.trl import EXAMPLES, GRPOSetup, grpo_flow, warm_up_flow
    from tests.hf_folders import save_tiny_qwen2

    monkeypatch.chdir(tmp_path)  # the examples name their folders relative to it
    (tmp_path / "examples").symlink_to(EXAMPLES)
    for folder in ("models/qwen2-tiny", "checkpoints/actor"):
        save_tiny_qwen2(tmp_path / folder)
    setup = GRPOSetup()
    pairs = [(runpy.run_path(str(EXAMPLES / "qwen2_sft.py"))["flow"],
              warm_up_flow(setup, tmp_path / "models/qwen2-tiny")),
             (runpy.run_path(str(EXAMPLES / "qwen2_grpo.py"))["flow"],
              grpo_flow(setup, tmp_path / "checkpoints/actor", seed=3))]
    for example, bench in pairs:
        assert list(bench.nodes) == list(example.nodes)
        for name, node in example.nodes.items():
            assert _settings(bench.nodes[name].config) == _settings(node.config), name
        assert {k: (m.stages, m.replicas) for k, m in bench.models.items()} == {
            k: (m.stages, m.replicas) for k, m in example.models.items()}
    assert pairs[1][1].nodes["generate"].config["sample_seed"] == 3
    update, step = (pairs[1][0].nodes[name].config for name in ("update_actor", "optimizer_step"))
    assert (setup.clip_ratio, setup.kl_coef, setup.temperature) == (
        update["clip_ratio"], update["kl_coef"], update["temperature"])
    assert (setup.lr, setup.weight_decay, setup.betas, setup.clip_grad_norm) == (
        step["lr"], step["weight_decay"], tuple(step["betas"]), step["clip_grad_norm"])
    assert update["kl_kind"] == "k3" and update["microbatches"] == setup.microbatches
    assert update["reference"] == ("reference" if setup.reference_in_forward else None)


def _settings(config: dict) -> dict:
    """A node's config without what names a folder or the sampling seed."""
    return {k: v for k, v in config.items() if k not in ("path", "tokenizer", "sample_seed")}
