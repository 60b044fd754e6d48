"""A resume loads data, never code [Note: run state on disk in
flowkit/runner/checkpoints/state_codec.py]: crafted checkpoints (a pickle payload, a record class or
a model build that names a command, wrong types, a truncated file, missing keys, symbolic links) run
no code (the sentinel file a payload would create never exists) and are refused with one line naming
the file; the untouched checkpoint still resumes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import msgpack
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from flowkit.runner.checkpoints.format import RUN_STATE, CheckpointError, read_run_state
from flowkit.runner.checkpoints.state_codec import allowed_records
from tests.cli.runs import GRPO, PRETRAIN, one_step_checkpoint, refused, run_ok

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

_RECORD = 2  # state_codec's extension type of a record


class _Payload:
    """Unpickling it runs a shell command that creates the sentinel file."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


@pytest.fixture(scope="module")
def sim_checkpoint(tmp_path_factory) -> Path:
    """A synchronous GRPO checkpoint on the simulator: its run state holds a record (the
    weights version fed back)."""
    return one_step_checkpoint(tmp_path_factory.mktemp("sim") / "ck", GRPO, "sim")


@pytest.fixture(scope="module")
def torch_checkpoint(tmp_path_factory) -> Path:
    return one_step_checkpoint(tmp_path_factory.mktemp("torch") / "ck", PRETRAIN, "torch")


def _copy(root: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ck"
    shutil.copytree(root, target, symlinks=True)
    return target


def _step(root: Path) -> Path:
    (folder,) = root.glob("step-*")
    return folder


def _reseal(root: Path) -> None:
    """The manifest's checksums made those of the files as they are now, as whoever can write
    the folder can [Note: checkpoint checksums in flowkit/runner/checkpoints/writer.py]: what
    follows tests the checks behind them."""
    folder = _step(root)
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest.get("files") or {}:
        path = folder / name
        if path.is_file() and not path.is_symlink():
            manifest["files"][name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _resume_refused(flow: str, kind: str, root: Path, sentinel: Path) -> str:
    _reseal(root)
    output = refused(flow, "--executors", kind, "--steps", "2", "--resume", str(root))
    assert not sentinel.exists(), "a checkpoint ran code"
    (line,) = [text for text in output.splitlines() if text.startswith("Error:")]
    return line


def _rewrite_state(folder: Path, change) -> None:
    """Change the run state's plain values (extension values kept as they are) and write it."""
    path = folder / RUN_STATE
    state = msgpack.unpackb(path.read_bytes(), ext_hook=msgpack.ExtType, raw=False,
                            strict_map_key=False)
    change(state)
    path.write_bytes(msgpack.packb(state, use_bin_type=True))


# -- the run state --------------------------------------------------------------------------------
def test_a_pickle_payload_as_the_run_state_runs_nothing(sim_checkpoint, tmp_path):
    root, sentinel = _copy(sim_checkpoint, tmp_path), tmp_path / "sentinel"
    (_step(root) / RUN_STATE).write_bytes(pickle.dumps(_Payload(sentinel)))
    line = _resume_refused(GRPO, "sim", root, sentinel)
    assert str(_step(root) / RUN_STATE) in line and "not a run state" in line


def test_an_older_pickled_checkpoint_is_refused_unread(sim_checkpoint, tmp_path):
    root, sentinel = _copy(sim_checkpoint, tmp_path), tmp_path / "sentinel"
    folder = _step(root)
    (folder / RUN_STATE).unlink()
    (folder / "run.pkl").write_bytes(pickle.dumps(_Payload(sentinel)))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format"] = "flowkit.run_checkpoint/1"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    line = _resume_refused(GRPO, "sim", root, sentinel)
    assert "run.pkl is a pickle, which this flowkit never loads" in line


def _crafted_record(path: str, sentinel: Path) -> msgpack.ExtType:
    return msgpack.ExtType(_RECORD, msgpack.packb(
        [path, {"args": f"touch {sentinel}", "shell": True}], use_bin_type=True))


def test_a_record_class_the_flow_does_not_use_is_refused_and_nothing_imported(
        sim_checkpoint, tmp_path):
    root, sentinel = _copy(sim_checkpoint, tmp_path), tmp_path / "sentinel"
    crafted = _crafted_record("subprocess:Popen", sentinel)
    _rewrite_state(_step(root), lambda state: state["feedback"][0].__setitem__(2, crafted))
    line = _resume_refused(GRPO, "sim", root, sentinel)
    assert "record class 'subprocess:Popen' is not one this flow uses" in line


def _read_refused(folder: Path, sentinel: Path) -> str:
    """What reading the run state of `folder` (as a resume does, with the records a run
    allows) is refused with: one line."""
    with pytest.raises(CheckpointError) as refusal:
        read_run_state(folder, allowed_records())
    assert not sentinel.exists(), "a checkpoint ran code"
    (line,) = str(refusal.value).splitlines()
    return line


@pytest.mark.parametrize("path", ["os:system", "venv.__main__:x", "builtins:eval"])
def test_a_record_class_names_no_module_to_import(sim_checkpoint, tmp_path, path):
    import sys

    root, sentinel = _copy(sim_checkpoint, tmp_path), tmp_path / "sentinel"
    crafted = _crafted_record(path, sentinel)
    _rewrite_state(_step(root), lambda state: state["feedback"][0].__setitem__(2, crafted))
    line = _read_refused(_step(root), sentinel)
    assert f"record class '{path}' is not one this flow uses" in line
    assert "venv.__main__" not in sys.modules


@pytest.mark.parametrize(("change", "expected"), [
    (lambda s: s.__setitem__("step", "1"), "step: '1' is not a whole number"),
    (lambda s: s.__setitem__("step", -5), "step: -5 is not a whole number"),
    (lambda s: s.__setitem__("records", {"a": 1}), "records: a dict, not a list"),
    (lambda s: s.pop("profiles"), "the state: missing ['profiles']"),
    (lambda s: s.__setitem__("training", {"actor": {"item_counts": {}}}),
     "training['actor']: missing"),
    (lambda s: s["feedback"][0].__setitem__(0, 7), "feedback[0] node: 7 is not a name"),
    (lambda s: s.__setitem__("open_work", [1, 2]), "open_work: a list, not a map"),
], ids=["step-str", "step-negative", "records-map", "missing-key", "training", "feedback-node",
        "open-work"])
def test_a_run_state_of_wrong_types_or_missing_keys_is_one_line_naming_the_field(
        sim_checkpoint, tmp_path, change, expected):
    root, sentinel = _copy(sim_checkpoint, tmp_path), tmp_path / "sentinel"
    _rewrite_state(_step(root), change)
    line = _read_refused(_step(root), sentinel)
    assert str(_step(root) / RUN_STATE) in line and expected in line, line


def test_a_wrong_typed_run_state_is_one_line_from_flowkit_run(sim_checkpoint, tmp_path):
    root, sentinel = _copy(sim_checkpoint, tmp_path), tmp_path / "sentinel"
    _rewrite_state(_step(root), lambda state: state.__setitem__("step", "1"))
    line = _resume_refused(GRPO, "sim", root, sentinel)
    assert f"{_step(root) / RUN_STATE}: step: '1' is not a whole number" in line


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.0])
def test_a_truncated_run_state_is_one_line(sim_checkpoint, tmp_path, keep):
    root, sentinel = _copy(sim_checkpoint, tmp_path), tmp_path / "sentinel"
    path = _step(root) / RUN_STATE
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    line = _read_refused(_step(root), sentinel)
    assert f"{path}: not a run state" in line


def test_a_symlinked_run_state_is_refused_naming_it(sim_checkpoint, tmp_path):
    root, sentinel = _copy(sim_checkpoint, tmp_path), tmp_path / "sentinel"
    path = _step(root) / RUN_STATE
    elsewhere = tmp_path / "elsewhere.msgpack"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    line = _read_refused(_step(root), sentinel)
    assert f"{path} is a symbolic link" in line


def test_the_untouched_checkpoint_still_resumes(sim_checkpoint, tmp_path):
    root = _copy(sim_checkpoint, tmp_path)
    output = run_ok(GRPO, "--executors", "sim", "--steps", "2", "--resume", str(root))
    assert "(step 1 of 2)" in output


# -- executor states ------------------------------------------------------------------------------
def _rewrite_executor_state(root: Path, change) -> Path:
    """Change the plain values of exec-0's state (its safetensors metadata) and write it."""
    path = _step(root) / "executors" / "exec-0"
    with safe_open(str(path), "pt") as file:
        meta = file.metadata()
    state = json.loads(meta["flowkit"])
    change(state)
    tensors = safetensors.torch.load_file(path)
    safetensors.torch.save_file(tensors, path, metadata={"flowkit": json.dumps(state)})
    return path


def test_a_build_swapped_in_an_executor_state_is_refused_naming_both(torch_checkpoint,
                                                                      tmp_path):
    root, sentinel = _copy(torch_checkpoint, tmp_path), tmp_path / "sentinel"

    def swap(state: dict) -> None:
        config = state["models"][0]["config"]
        config["build"], config["model_config"] = "os:system", {"command": f"touch {sentinel}"}

    path = _rewrite_executor_state(root, swap)
    line = _resume_refused(PRETRAIN, "torch", root, sentinel)
    assert (f"{path}: model 'gpt' was saved with build='os:system', this flow has "
            "'executors.torch.models.gpt:GPT'") in line


def test_an_executor_state_of_another_config_is_refused_naming_both(torch_checkpoint,
                                                                     tmp_path):
    root, sentinel = _copy(torch_checkpoint, tmp_path), tmp_path / "sentinel"
    path = _rewrite_executor_state(
        root, lambda state: state["models"][0]["config"]["model_config"].update(n_embd=32))
    line = _resume_refused(PRETRAIN, "torch", root, sentinel)
    assert f"{path}: model 'gpt' was saved with model_config=" in line and "n_embd" in line


def test_a_pickle_payload_as_an_executor_state_runs_nothing(torch_checkpoint, tmp_path):
    root, sentinel = _copy(torch_checkpoint, tmp_path), tmp_path / "sentinel"
    path = _step(root) / "executors" / "exec-0"
    with open(path, "wb") as file:
        torch.save({"format": "flowkit.executor_state/1", "models": _Payload(sentinel)}, file)
    line = _resume_refused(PRETRAIN, "torch", root, sentinel)
    # refused unread before any executor starts: executor states are safetensors now
    assert "executors/exec-0 is a torch.save file, an executor state of an older" in line


def test_an_executor_state_of_wrong_types_is_one_line(torch_checkpoint, tmp_path):
    root, sentinel = _copy(torch_checkpoint, tmp_path), tmp_path / "sentinel"
    path = _rewrite_executor_state(root, lambda state: state.__setitem__("models", "gpt"))
    line = _resume_refused(PRETRAIN, "torch", root, sentinel)
    assert f"{path}: models is a str, not a list" in line


def test_a_symlinked_executor_state_is_refused_naming_it(torch_checkpoint, tmp_path):
    root, sentinel = _copy(torch_checkpoint, tmp_path), tmp_path / "sentinel"
    path = _step(root) / "executors" / "exec-0"
    elsewhere = tmp_path / "exec-0"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    line = _resume_refused(PRETRAIN, "torch", root, sentinel)
    assert f"{path} is a symbolic link" in line
