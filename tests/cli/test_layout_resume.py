"""A checkpoint resumes on another layout [Note: layout-free checkpoints in
executors/torch/layout_free.py]: 5 steps of 10 on one layout, the rest on another (other
--stages, fewer replicas, a ZeRO-1 run resumed plain, 1F1B resumed under ZB-V), end with the
parameters and the loss curve of the run that went on uninterrupted (float64, 1e-10); the
built-in GPT, a Hugging Face Llama, and a fused GRPO. `flowkit export` writes a checkpoint's
model for tools that know nothing of flowkit. Bad input (a missing file, a changed one, an
unknown model, a build that is not flowkit's) is one line before anything starts."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from executors.torch.export import export
from tests.cli.flows import tiny_layouts
from tests.cli.runs import metrics_lines, refused, run_ok

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

FLOWS = Path(tiny_layouts.__file__)
GPT_FLOW, LLAMA, GRPO = f"{FLOWS}:flow", f"{FLOWS}:llama", f"{FLOWS}:grpo"
LORA, ASYNC = f"{FLOWS}:lora", f"{FLOWS}:grpo_async"
GPT = GPT_FLOW
LAYOUTS = {"P1": ("--stages", "1"), "P2": ("--stages", "2"), "P3": ("--stages", "3"),
           "P4": ("--stages", "4"),
           # a V schedule: 4 stages on 2 devices, two on each
           "P2-zbv": ("--stages", "2", "--schedule", "zb-v"),
           "D2P2-zero1": ("--stages", "2", "--replicas", "2", "--shard-optimizer")}


def _run(flow: str, folder: Path, *flags: str) -> tuple[dict, list[dict]]:
    """The saved weights and the metrics lines of a run of `flow` up to step 10; a resumed
    one must go on at step 5, not start again."""
    output = run_ok(flow, "--executors", "torch", "--steps", "10", "--save-weights",
                    str(folder / "w"), "--metrics", str(folder / "m.jsonl"), *flags)
    lines = metrics_lines(folder / "m.jsonl")
    assert [line["step"] for line in lines] == list(range(10))  # a resumed run's 5 restored
    assert ("(step 5 of 10)" in " ".join(output.split())) == ("--resume" in flags)
    (path,) = [*(folder / "w").glob("*.pt"), *(folder / "w").glob("*/model.safetensors")]
    if path.suffix == ".safetensors":  # a Hugging Face model's folder
        return safetensors.torch.load_file(path), lines
    return torch.load(path, weights_only=True), lines


_SOURCES: dict = {}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """`source(flow, layout)`: the uninterrupted run of 10 steps on `layout`, a checkpoint
    after step 5 and 10; run once per module."""

    def make(flow: str, layout: str) -> tuple[Path, dict, dict]:
        if (flow, layout) not in _SOURCES:
            folder = tmp_path_factory.mktemp(f"source-{layout}")
            weights, lines = _run(flow, folder, *LAYOUTS[layout], "--checkpoint-dir",
                                  str(folder / "ck"), "--checkpoint-every", "5")
            _SOURCES[(flow, layout)] = (folder / "ck" / "step-00000005", weights, lines)
        return _SOURCES[(flow, layout)]

    return make


# GRPO: fused, its backprop streams from the second step on, so the resumed run's first step
# plans its pipeline before any sample is in, on a layout the checkpoint has no profile of
@pytest.mark.parametrize(("flow", "before", "after"), [
    (GPT, "P3", "P2"), (GPT, "P2", "P4"), (LLAMA, "P3", "P2"), (LLAMA, "P2", "P4"),
    (GPT, "D2P2-zero1", "P3"), (GPT, "P2", "P2-zbv"), (GRPO, "P2", "P1"), (GRPO, "P1", "P2"),
    (LORA, "P2", "P1")])
def test_a_checkpoint_resumes_on_another_layout_as_if_never_stopped(source, tmp_path, flow,
                                                                   before, after):
    checkpoint, whole, lines = source(flow, before)
    resumed, resumed_lines = _run(flow, tmp_path, *LAYOUTS[after], "--resume", str(checkpoint))
    assert resumed.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=1e-10)
    assert resumed_lines[-1]["step"] == lines[-1]["step"] == 9
    for key in ("loss", "reward_mean"):  # the whole curve; the pretraining runs have no reward
        assert [line.get(key) for line in resumed_lines] == pytest.approx(
            [line.get(key) for line in lines], abs=1e-10)


def test_an_async_grpo_resumed_on_another_layout_keeps_its_books(source, tmp_path):
    """One weights version ahead, on torch: a token's version depends on when a weights load
    reaches the engine, so the curve may part from the writer's later; resumed on one stage,
    the open step trains its saved samples to the writer's loss (float64), every step trains
    its 4 x 4 samples once, within the staleness bound."""
    checkpoint, _, lines = source(ASYNC, "P2")
    _, resumed = _run(ASYNC, tmp_path, *LAYOUTS["P1"], "--resume", str(checkpoint))
    assert [line["loss"] for line in resumed[:5]] == [line["loss"] for line in lines[:5]]
    assert resumed[5]["loss"] == pytest.approx(lines[5]["loss"], abs=1e-10)
    assert [line["rollout/samples"] for line in resumed] == [16] * 10
    assert all(line["staleness/max"] <= 1 for line in resumed)


def test_each_file_is_safetensors_by_the_unsplit_names(source):
    """Any safetensors reader reads a checkpoint: the two stages' files of a P=2 run hold
    the whole GPT's parameters and AdamW moments between them, by its own names."""
    checkpoint, whole, _ = source(GPT, "P2")
    names = set()
    for part in sorted((checkpoint / "executors").iterdir()):
        names |= set(safetensors.torch.load_file(part))
    params = {n.removeprefix("gpt/train/param/") for n in names if "/param/" in n}
    assert params == set(whole)
    moments = {n.removeprefix("gpt/train/optim/exp_avg/") for n in names
               if "/exp_avg/" in n}
    assert moments == set(whole)


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ck" / checkpoint.name
    shutil.copytree(checkpoint, target)
    return target


def test_a_checkpoint_missing_a_file_is_refused_in_one_line(source, tmp_path):
    folder = _copy(source(GPT, "P2")[0], tmp_path)
    (folder / "executors" / "exec-1").unlink()
    out = refused(GPT, "--executors", "torch", "--steps", "6", "--resume", str(folder))
    (line,) = [text for text in out.splitlines() if text.startswith("Error:")]
    assert "executors/exec-1 is missing, and manifest.json lists it" in line


def test_a_layout_whose_memory_limit_cannot_hold_the_model_is_refused_in_one_line(source):
    """Resumed on 4 stages under a limit of half a microbatch's activations a device: no
    schedule fits, said before any executor starts."""
    checkpoint = source(GPT, "P2")[0]
    out = refused(GPT, "--executors", "torch", "--steps", "10", "--stages", "4",
                  "--memory-limit", "0.5", "--resume", str(checkpoint))
    (line,) = [text for text in out.splitlines() if text.startswith("Error:")]
    assert "memory limit 0.5" in line, out
    assert "executors: torch" not in out  # refused before any executor started


def test_a_file_whose_checksum_differs_is_refused_in_one_line(source, tmp_path):
    folder = _copy(source(GPT, "P2")[0], tmp_path)
    path = folder / "executors" / "exec-0"
    tensors = safetensors.torch.load_file(path)
    tensors["gpt/train/param/transformer.wpe.weight"] += 1.0  # a well-formed, changed file
    meta = json.loads((folder / "manifest.json").read_text())
    safetensors.torch.save_file(tensors, path, metadata=_metadata(path))
    assert meta["files"]["executors/exec-0"] != hashlib.sha256(path.read_bytes()).hexdigest()
    out = refused(GPT, "--executors", "torch", "--steps", "6", "--resume", str(folder))
    (line,) = [text for text in out.splitlines() if text.startswith("Error:")]
    assert f"{path} does not match its SHA-256 in manifest.json" in line


def _metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return file.metadata()


# -- flowkit export --------------------------------------------------------------------------
def _export(*args: str):
    """`flowkit export ARGS` (the command torch executors add to flowkit's CLI)."""
    return CliRunner().invoke(export, [*map(str, args)])


def test_an_hf_checkpoint_exported_mid_run_loads_with_from_pretrained_and_the_runs_logits(
        source, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint, _, _ = source(LLAMA, "P3")
    result = _export(checkpoint, tmp_path / "hf", "--model", "llama")
    assert result.exit_code == 0, result.output
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    # the run's own model after step 5: a run of 5 steps (on another layout) saving it
    run_ok(LLAMA, "--executors", "torch", "--steps", "5", "--stages", "2", "--save-weights",
           str(tmp_path / "w"))
    (saved,) = (tmp_path / "w").iterdir()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = [AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float64)(ids).logits
              for folder in (tmp_path / "hf", saved)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-10)


def test_a_gpt_checkpoint_exports_its_state_dict_as_safetensors(source, tmp_path):
    from executors.torch.models.gpt import GPT

    checkpoint, whole, _ = source(GPT_FLOW, "P2")
    result = _export(checkpoint.parent, tmp_path / "gpt", "--model", "gpt")  # the newest: 10
    assert result.exit_code == 0, result.output
    state = safetensors.torch.load_file(tmp_path / "gpt" / "model.safetensors")
    for name in whole:
        assert torch.equal(state[name], whole[name]), name
    config = json.loads((tmp_path / "gpt" / "config.json").read_text())
    model = GPT(**{k: v for k, v in config["model_config"].items()})
    model.load_state_dict(state)  # every key, none missing


@pytest.mark.parametrize("damage, says", [
    ("model", "no model 'critic' in this checkpoint; --model takes one of gpt"),
    ("missing", "executors/exec-1 is missing, and manifest.json lists it"),
    ("changed", "does not match its SHA-256 in manifest.json"),
    # a build path in a checkpoint is never imported: it could name any callable
    ("build", "model 'gpt' is built by 'os:system'; export builds only flowkit's own")])
def test_export_of_bad_input_is_one_line(source, tmp_path, damage, says):
    folder = _copy(source(GPT_FLOW, "P2")[0], tmp_path)
    if damage == "build":
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["identity"]["models"]["gpt"]["build"] = "os:system"
        (folder / "manifest.json").write_text(json.dumps(manifest))
    if damage == "missing":
        (folder / "executors" / "exec-1").unlink()
    if damage == "changed":
        with open(folder / "executors" / "exec-0", "r+b") as file:
            file.seek(-1, os.SEEK_END)
            last = file.read(1)
            file.seek(-1, os.SEEK_END)
            file.write(bytes([last[0] ^ 0x40]))
    result = _export(folder, tmp_path / "out", "--model",
                     "critic" if damage == "model" else "gpt")
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: ") and says in line
    assert not (tmp_path / "out").exists()
