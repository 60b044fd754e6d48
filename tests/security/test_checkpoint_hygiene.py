"""Checkpoint and shared-memory hygiene [Note: run checkpoints in
flowkit/runner/checkpoints/format.py]: files 0600 in 0700 folders whatever the umask; a fresh run
refuses a folder holding another run's checkpoints; pruning touches only this run's steps; a
tampered manifest or a symlinked step folder is one line naming the right path; dead processes'
segments are swept when a run starts."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from flowkit.runner.checkpoints import writer
from flowkit.runner.checkpoints.format import complete_checkpoints, read_manifest
from flowkit.wire.shm import SHM_DIR, sweep_stale
from tests.cli.runs import PRETRAIN, refused, run_ok

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

_SIM = ("--executors", "sim")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Two checkpoints of one run, written under umask 0 (which would make them 0666/0777)."""
    root = tmp_path_factory.mktemp("written") / "ck"
    previous = os.umask(0)
    try:
        run_ok(PRETRAIN, *_SIM, "--steps", "2", "--checkpoint-dir", str(root),
               "--checkpoint-every", "1")
    finally:
        os.umask(previous)
    return root


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_checkpoint_files_are_0600_in_0700_folders_whatever_the_umask(written):
    paths = list(written.rglob("*"))
    assert {p.name for p in paths} >= {"manifest.json", "run.msgpack", "exec-0", "exec-1"}
    assert _mode(written) == 0o700  # the run made the root
    for path in paths:
        assert _mode(path) == (0o700 if path.is_dir() else 0o600), path


def test_each_checkpoint_names_its_run(written):
    runs = [read_manifest(folder).run for folder in complete_checkpoints(written)]
    assert len(runs) == 2 and runs[0] == runs[1]
    assert runs[0]["flow"] == "pretrain" and len(runs[0]["id"]) == 16 and runs[0]["flow_hash"]


def _copy(root: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ck"
    shutil.copytree(root, target, symlinks=True)
    return target


def test_a_fresh_run_into_another_runs_folder_is_refused_and_touches_nothing(written,
                                                                            tmp_path):
    root = _copy(written, tmp_path)
    before = sorted(p.name for p in root.iterdir())
    output = refused(PRETRAIN, *_SIM, "--steps", "1", "--checkpoint-dir", str(root),
                     "--checkpoint-every", "1")
    (line,) = [text for text in output.splitlines() if text.startswith("Error:")]
    assert f"--checkpoint-dir {root} holds checkpoints of another run" in line
    assert f"--resume {root}, or give another --checkpoint-dir" in line
    assert sorted(p.name for p in root.iterdir()) == before


def test_a_resumed_run_goes_on_in_its_own_folder_and_prunes_its_own_steps(written, tmp_path):
    root = _copy(written, tmp_path)
    run_ok(PRETRAIN, *_SIM, "--steps", "3", "--resume", str(root), "--checkpoint-dir", str(root),
           "--checkpoint-every", "1", "--keep-checkpoints", "2")
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000002", "step-00000003"]


def _as_other_run(folder: Path, step: int) -> Path:
    """A copy of checkpoint `folder` as step `step` of another run."""
    other = folder.parent / f"step-{step:08d}"
    shutil.copytree(folder, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["run"]["id"], manifest["step"] = "0123456789abcdef", step
    (other / "manifest.json").write_text(json.dumps(manifest))
    return other


def test_pruning_touches_only_this_runs_steps(written, tmp_path):
    root = _copy(written, tmp_path)
    own = complete_checkpoints(root)
    theirs = [_as_other_run(own[0], 77), _as_other_run(own[0], 78)]
    run_id = read_manifest(own[0]).run["id"]
    writer._prune(root, 1, run_id)
    assert complete_checkpoints(root) == [own[1], *theirs]


def test_a_resume_from_a_folder_of_two_runs_is_refused(written, tmp_path):
    root = _copy(written, tmp_path)
    _as_other_run(complete_checkpoints(root)[0], 78)  # the newest: not the run to go on with
    output = refused(PRETRAIN, *_SIM, "--steps", "3", "--resume", str(root),
                     "--checkpoint-dir", str(root))
    assert "holds checkpoints of another run (step-00000001, step-00000002" in output


@pytest.mark.parametrize(("change", "expected"), [
    (lambda m: m.__setitem__("identity", 3), "identity is not {flow, nodes, models}"),
    (lambda m: m.__setitem__("step", "2"), "step is not a whole number"),
    (lambda m: m.pop("run"), "fields ["),
    (lambda m: m["executors"].append(7), "executors is not a list of {name, tags, kind}"),
], ids=["identity", "step", "run", "executors"])
def test_a_tampered_manifest_is_one_line_naming_it(written, tmp_path, change, expected):
    root = _copy(written, tmp_path)
    path = complete_checkpoints(root)[-1] / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    output = refused(PRETRAIN, *_SIM, "--steps", "3", "--resume", str(path.parent))
    (line,) = [text for text in output.splitlines() if text.startswith("Error:")]
    assert f"--resume {path}: {expected}" in line


def test_a_manifest_that_is_not_json_is_one_line(written, tmp_path):
    root = _copy(written, tmp_path)
    path = complete_checkpoints(root)[-1] / "manifest.json"
    path.write_text('{"step": 2, "iden')
    output = refused(PRETRAIN, *_SIM, "--steps", "3", "--resume", str(root))
    assert "unreadable manifest.json" in output and str(path.parent) in output


def test_a_symlinked_step_folder_is_refused_naming_it(written, tmp_path):
    root = _copy(written, tmp_path)
    newest = complete_checkpoints(root)[-1]
    elsewhere = tmp_path / "elsewhere"
    newest.rename(elsewhere)
    newest.symlink_to(elsewhere)
    output = refused(PRETRAIN, *_SIM, "--steps", "3", "--resume", str(root))
    (line,) = [text for text in output.splitlines() if text.startswith("Error:")]
    assert f"--resume {newest}: the checkpoint folder is a symbolic link" in line
    assert str(elsewhere) not in line


# -- shared memory --------------------------------------------------------------------------------
def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _segment(pid: int) -> Path:
    path = Path(SHM_DIR) / f"flowkit-{pid}-990"
    path.write_bytes(b"\0" * 4096)
    return path


def test_stale_segments_of_dead_processes_are_swept_and_live_ones_kept():
    dead, live = _segment(_dead_pid()), _segment(os.getpid())
    try:
        removed = sweep_stale()
        assert dead.name in removed and not dead.exists()
        assert live.exists()
    finally:
        for path in (dead, live):
            path.unlink(missing_ok=True)


def test_a_run_sweeps_stale_segments_when_it_starts(tmp_path):
    dead, live = _segment(_dead_pid()), _segment(os.getpid())
    try:
        run_ok(PRETRAIN, *_SIM, "--steps", "1")
        assert not dead.exists() and live.exists()
    finally:
        for path in (dead, live):
            path.unlink(missing_ok=True)
