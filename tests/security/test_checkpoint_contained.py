"""A checkpoint is contained and verified [Note: contained files in flowkit/wire/files.py]:
`--resume` of a FIFO, a sparse 3 GiB run state, a symbolic link in place of the executors'
folder, a placement that climbs out of the folder, or a flipped byte in any file is refused in
one line within seconds, and nothing outside the folder is read. Each resume is a `flowkit run`
process of its own, so a hang is a timeout and its memory is its own (issue 53, findings 7-9)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowkit.runner.checkpoints.format import MANIFEST, RUN_STATE
from tests.cli.runs import GRPO, PRETRAIN, one_step_checkpoint

pytestmark = pytest.mark.slow  # end to end: runs that start their own executor processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sim_checkpoint(tmp_path_factory) -> Path:
    return one_step_checkpoint(tmp_path_factory.mktemp("sim") / "ck", GRPO, "sim")


@pytest.fixture(scope="module")
def torch_checkpoint(tmp_path_factory) -> Path:
    return one_step_checkpoint(tmp_path_factory.mktemp("torch") / "ck", PRETRAIN, "torch")


def _copy(root: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of checkpoint root `root`, and its step folder."""
    target = tmp_path / "ck"
    shutil.copytree(root, target, symlinks=True)
    (folder,) = target.glob("step-*")
    return target, folder


def _resume(flow: str, kind: str, root: Path) -> tuple[int, str, float, str]:
    """`flowkit run --resume root` as a process: (exit code, its error lines, seconds, all it
    wrote)."""
    start = time.monotonic()
    process = subprocess.run(
        [sys.executable, "-m", "flowkit", "run", flow, "--no-dashboard", "--executors", kind,
         "--steps", "2", "--resume", str(root)], cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    seconds = time.monotonic() - start
    errors = [line for line in process.stdout.splitlines() + process.stderr.splitlines()
              if line.startswith("Error:")]
    return process.returncode, "\n".join(errors), seconds, process.stdout + process.stderr


def _refused(flow: str, kind: str, root: Path) -> str:
    code, errors, seconds, _ = _resume(flow, kind, root)
    print(f"refused in {seconds:.1f} s: {errors}")
    assert code != 0 and len(errors.splitlines()) == 1, errors
    assert seconds < 60
    return errors


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def test_a_fifo_as_the_run_state_is_refused_not_waited_on(sim_checkpoint, tmp_path):
    root, folder = _copy(sim_checkpoint, tmp_path)
    (folder / RUN_STATE).unlink()
    os.mkfifo(folder / RUN_STATE)
    line = _refused(GRPO, "sim", root)
    assert f"{folder / RUN_STATE} is not a regular file" in line


def test_a_sparse_3_gib_run_state_is_refused_before_it_is_read(sim_checkpoint, tmp_path):
    root, folder = _copy(sim_checkpoint, tmp_path)
    with open(folder / RUN_STATE, "r+b") as file:
        file.truncate(3 << 30)
    line = _refused(GRPO, "sim", root)
    assert f"{folder / RUN_STATE} has {3 << 30} bytes, more than the" in line


def test_a_fifo_as_an_executor_state_is_refused_not_waited_on(torch_checkpoint, tmp_path):
    root, folder = _copy(torch_checkpoint, tmp_path)
    part = folder / "executors" / "exec-0"
    part.unlink()
    os.mkfifo(part)
    line = _refused(PRETRAIN, "torch", root)
    assert f"{part} is not a regular file" in line


def test_a_symlinked_executors_folder_is_refused_and_nothing_outside_read(torch_checkpoint,
                                                                          tmp_path):
    root, folder = _copy(torch_checkpoint, tmp_path)
    outside = tmp_path / "outside"
    (folder / "executors").rename(outside)
    (folder / "executors").symlink_to(outside)
    before = {p: p.stat().st_atime_ns for p in outside.iterdir()}
    os.utime(outside / "exec-0", ns=(0, (outside / "exec-0").stat().st_mtime_ns))
    line = _refused(PRETRAIN, "torch", root)
    assert f"{folder / 'executors'} is a symbolic link" in line
    assert (outside / "exec-0").stat().st_atime_ns == 0, "a file outside was read"
    assert set(before) == set(outside.iterdir())


def test_a_placement_that_climbs_out_of_the_folder_is_refused(torch_checkpoint, tmp_path):
    root, folder = _copy(torch_checkpoint, tmp_path)
    outside = tmp_path / "outside_states"
    outside.mkdir()
    shutil.copy(folder / "executors" / "exec-0", outside / "exec-0")
    manifest = _manifest(folder)
    (model,) = manifest["placement"]
    manifest["placement"][model] = ["../../../outside_states/exec-0"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    os.utime(outside / "exec-0", ns=(0, (outside / "exec-0").stat().st_mtime_ns))
    line = _refused(PRETRAIN, "torch", root)
    assert "'../../../outside_states/exec-0' is not a plain name" in line
    assert (outside / "exec-0").stat().st_atime_ns == 0, "a file outside was read"


@pytest.mark.parametrize("name", ["executors/exec-0", RUN_STATE])
def test_a_flipped_byte_is_one_line_naming_the_file(torch_checkpoint, tmp_path, name):
    root, folder = _copy(torch_checkpoint, tmp_path)
    path = folder / name
    with open(path, "r+b") as file:
        file.seek(path.stat().st_size // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x40]))
    line = _refused(PRETRAIN, "torch", root)
    assert f"{path} does not match its SHA-256 in {MANIFEST}" in line


def test_every_file_has_its_sha256_in_the_manifest(torch_checkpoint):
    import hashlib

    (folder,) = torch_checkpoint.glob("step-*")
    files = _manifest(folder)["files"]
    assert set(files) == {RUN_STATE, *(f"executors/{part.name}"
                                       for part in (folder / "executors").iterdir())}
    for name, digest in files.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest


def test_a_checkpoint_written_before_checksums_resumes_with_a_warning(sim_checkpoint, tmp_path):
    root, folder = _copy(sim_checkpoint, tmp_path)
    manifest = _manifest(folder)
    del manifest["files"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    code, _, _, output = _resume(GRPO, "sim", root)
    assert code == 0, output
    assert "written before checkpoints carried checksums" in output
