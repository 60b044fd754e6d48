"""What is refused before any executor starts, in one line with the fix: more pipeline stages
than the model has layers, a model config's checkpoint that is no file (`flowkit check` finds
both), a --bind address another process holds, and --resume of a --save-weights folder."""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import flowkit
from flowkit import Run, RunConfig, RunConfigError
from flowkit.cli import main
from flowkit.dsl import Model
from flowkit.dsl.models import GPT_DEFAULT_LAYERS, model_layers

from .runs import PRETRAIN

_TINY = ('{"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, '
         '"dtype": "float64"}')


def _flow_file(tmp_path: Path, *, gpt: str = _TINY, stages: int = 2) -> str:
    path = tmp_path / "own.py"
    path.write_text(textwrap.dedent(f"""
        from dataflows.pretrain import pretrain_flow
        flow = pretrain_flow(corpus={str(Path(PRETRAIN).parents[3] / "examples" / "data"
                                         / "corpus.txt")!r}, stages={stages}, microbatches=4,
                             batch_size=8, seq_len=16, gpt={gpt})
    """))
    return str(path)


def _one_line_error(result, code: int = 1) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    return " ".join(lines)


# -- stages against layers ------------------------------------------------------------------------
def test_the_built_in_gpts_default_layers_are_what_the_check_assumes():
    from executors.torch.models.gpt import GPTConfig

    assert GPT_DEFAULT_LAYERS == GPTConfig().n_layer


@pytest.mark.parametrize(("build", "config", "layers"), [
    ("executors.torch.models.gpt:GPT", {"n_layer": 2}, 2),
    ("executors.torch.models.gpt:GPT", {}, GPT_DEFAULT_LAYERS),
    ("hf", {"architecture": "llama", "hf_config": {"num_hidden_layers": 3}}, 3),
    ("mymodels:Tiny", {"n_layer": 2}, None),  # a build of the user's own: its own split says
])
def test_model_layers(build, config, layers):
    assert model_layers(Model(name="m", build=build, config=config)) == layers


def test_model_layers_of_a_hugging_face_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 6}))
    assert model_layers(Model(name="m", build="hf", config={"path": str(tmp_path)})) == 6


def test_more_stages_than_layers_is_a_run_config_error_before_anything_starts():
    from flowkit.dsl import load_flow

    with pytest.raises(RunConfigError) as raised:
        Run(load_flow(PRETRAIN), RunConfig(stages=5, dashboard=False))
    assert raised.value.setting == "stages"
    text = str(raised.value)
    assert "\n" not in text and "2 layers" in text and "not 5" in text and "2 or fewer" in text


def test_flowkit_run_stages_beyond_the_layers_is_a_usage_error_of_one_line():
    result = CliRunner().invoke(main, ["run", PRETRAIN, "--no-dashboard", "--stages", "5"])
    text = _one_line_error(result, code=2)
    assert "--stages" in text and "2 layers" in text and "2 or fewer" in text


def test_flowkit_check_finds_a_flow_cut_into_more_stages_than_layers(tmp_path):
    result = CliRunner().invoke(main, ["check", _flow_file(tmp_path, stages=5)])
    text = _one_line_error(result)
    assert "model 'gpt'" in text and "2 layers" in text and "not 5" in text


# -- a checkpoint that is no file -----------------------------------------------------------------
def _with_checkpoint(tmp_path: Path, checkpoint: str) -> str:
    return _flow_file(tmp_path, gpt=_TINY[:-1] + f', "checkpoint": {checkpoint!r}}}')


def test_a_missing_checkpoint_is_a_run_config_error_and_flowkit_check_finds_it(tmp_path,
                                                                                monkeypatch):
    from flowkit.dsl import load_flow

    monkeypatch.chdir(tmp_path)
    flow_file = _with_checkpoint(tmp_path, "checkpoints/model.pt")
    with pytest.raises(RunConfigError, match="checkpoints/model.pt") as raised:
        Run(load_flow(flow_file), RunConfig(executors="torch", dashboard=False))
    assert "\n" not in str(raised.value) and "--save-weights" in str(raised.value)
    for command in (["check", flow_file], ["run", flow_file, "--no-dashboard"]):
        text = _one_line_error(CliRunner().invoke(main, command))
        assert "checkpoints/model.pt" in text and "no such file" in text
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "model.pt").touch()  # there: the check passes
    assert CliRunner().invoke(main, ["check", flow_file]).exit_code == 0


def test_the_simulator_loads_no_checkpoint_and_is_not_refused_for_one(tmp_path, monkeypatch):
    from flowkit.dsl import load_flow

    monkeypatch.chdir(tmp_path)
    Run(load_flow(_with_checkpoint(tmp_path, "nowhere.pt")),
        RunConfig(executors="sim", dashboard=False))


# -- a busy port ----------------------------------------------------------------------------------
def test_a_bind_address_another_process_holds_is_one_line_naming_it_and_the_fix():
    import zmq

    holder = zmq.Context.instance().socket(zmq.REP)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        address = f"tcp://127.0.0.1:{port}"
        result = CliRunner().invoke(main, ["run", PRETRAIN, "--no-dashboard", "--executors",
                                           "sim", "--bind", address])
        text = _one_line_error(result)
        assert address in text and "in use" in text and "tcp://127.0.0.1:0" in text
        with pytest.raises(flowkit.RunError, match="in use"):
            flowkit.run(flowkit.dsl.load_flow(PRETRAIN), RunConfig(
                executors="sim", dashboard=False,
                controller=flowkit.ControllerConfig(bind=address)))
    finally:
        holder.close(linger=0)


def test_a_plain_socket_holding_the_port_too():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        address = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        result = CliRunner().invoke(main, ["run", PRETRAIN, "--no-dashboard", "--executors",
                                           "sim", "--bind", address])
        assert address in _one_line_error(result)


# -- --resume of a --save-weights folder ----------------------------------------------------------
def test_resume_of_a_save_weights_folder_says_where_checkpoints_come_from(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.pt").touch()  # what --save-weights writes
    result = CliRunner().invoke(main, ["run", PRETRAIN, "--no-dashboard", "--executors", "sim",
                                       "--resume", str(tmp_path / "weights")])
    text = _one_line_error(result)
    assert "--checkpoint-dir" in text and "--checkpoint-every" in text
    assert "checkpoint=" in text and "model.pt" in text
