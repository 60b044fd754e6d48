"""The sandbox for tools and rewards [Note: sandbox in dataflows/sandbox.py]: each attack a
model's code could make is contained, answers with a defined outcome, and takes no longer than
the timeout: a sleeper, a crash, a CPU spinner, a memory hog, a fork bomb, a daemon that
detaches, a reach for the network, a write outside its folder, a flood of output. `code_reward`
scores code against tests through it."""

from __future__ import annotations

import os
import sys
import time

import pytest

from dataflows.rewards import code_reward, response_code
from dataflows.sandbox import (
    Limits,
    _memory_cgroups,
    interpreter_folders,
    run_python,
    sandbox_features,
    sandbox_status,
)
from flowkit.ops.records import Rollout

ISOLATION = sandbox_status()
isolated = pytest.mark.skipif(ISOLATION is not None,
                              reason=f"no network and PID namespaces here: {ISOLATION}")
FAST = Limits(timeout_s=1.5)


def test_a_program_runs_with_its_input_and_files_and_answers():
    outcome = run_python("import helper\nprint(helper.X + int(input()))", stdin="5",
                         files={"helper.py": "X = 2"})
    assert (outcome.status, outcome.stdout, outcome.returncode) == ("ok", "7\n", 0)
    assert outcome.isolated == (ISOLATION is None)
    failed = run_python("raise SystemExit(3)")
    assert (failed.status, failed.returncode) == ("failed", 3)
    assert "ZeroDivisionError" in run_python("1 / 0").stderr


def test_a_sleeper_is_killed_at_the_timeout():
    started = time.monotonic()
    outcome = run_python("import time\ntime.sleep(60)", limits=FAST)
    assert outcome.status == "timeout"
    assert time.monotonic() - started < FAST.timeout_s + 3


def test_a_crash_and_a_cpu_spinner_are_crashes():
    segfault = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert segfault.status == "crashed"
    spinner = run_python("while True:\n    pass", limits=Limits(timeout_s=10, cpu_s=1))
    assert spinner.status == "crashed" and spinner.seconds < 8


def test_memory_past_the_limit_is_refused_to_the_code():
    outcome = run_python("x = bytearray(1 << 31)", limits=Limits(memory_mib=256))
    assert outcome.status == "failed" and "MemoryError" in outcome.stderr


@isolated
def test_a_fork_bomb_is_contained_and_leaves_nothing_behind():
    bomb = ("import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    try:\n"
            "        os.fork()\n    except OSError:\n        pass\n")
    started = time.monotonic()
    outcome = run_python(bomb, limits=FAST)
    assert outcome.status == "timeout"
    assert time.monotonic() - started < FAST.timeout_s + 3
    assert _all_gone(outcome.stdout.splitlines()[0])


@isolated
def test_a_daemon_that_detaches_dies_with_the_call():
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
              "    time.sleep(120)\nprint(os.getcwd())\n")
    outcome = run_python(daemon)
    assert outcome.ok
    assert _all_gone(outcome.stdout.strip())


@isolated
def test_the_network_is_out_of_reach():
    outcome = run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert outcome.status == "failed" and "unreachable" in outcome.stderr


@isolated
def test_as_root_the_code_runs_as_nobody_and_cannot_write_outside_its_folder():
    if os.geteuid() != 0:
        pytest.skip("runs as nobody only when flowkit runs as root")
    outcome = run_python("import os\nprint(os.getuid())\nopen('/etc/flowkit-sandbox', 'w')")
    assert outcome.stdout == "65534\n" and "PermissionError" in outcome.stderr
    assert not os.path.exists("/etc/flowkit-sandbox")


def test_output_is_capped():
    outcome = run_python("print('x' * 1_000_000)", limits=Limits(output_bytes=1000))
    assert outcome.ok and len(outcome.stdout) == 1000


def test_bad_limits_and_file_names_are_refused():
    with pytest.raises(ValueError, match="timeout_s=0 must be a number > 0"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="must be a plain name"):
        run_python("pass", files={"../escape.py": ""})


def _rollout(response: str, tests: str) -> Rollout:
    return Rollout(prompt_id=0, sample=0, prompt_tokens=[1], response_tokens=[2],
                   logprobs=[0.0], response_text=response, prompt_text="write add",
                   answer=tests)


def test_code_reward_scores_the_answer_against_its_tests_through_the_sandbox():
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    right = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    endless = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert response_code(right) == "def add(a, b):\n    return a + b\n"
    scores = [code_reward.fn(_rollout(r, tests), timeout_s=1.0).reward
              for r in (right, wrong, endless)]
    assert scores == [1.0, 0.0, 0.0]


def _all_gone(folder: str, wait_s: float = 5.0) -> bool:
    """Whether every process working in the call's scratch `folder` is gone (the kernel ends a
    PID namespace's processes once its first one dies, a moment after the call returns).
    Found by their working folder, which no other test's process shares."""
    deadline = time.monotonic() + wait_s
    while _working_in(folder):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _working_in(folder: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # gone, or not ours to read
            continue
        if cwd.removesuffix(" (deleted)") == folder:
            found.append(int(pid))
    return found


def test_without_prlimit_the_child_sets_the_limits_itself(monkeypatch):
    import shutil

    from dataflows import sandbox

    which = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which",
                        lambda name: None if name == "prlimit" else which(name))
    outcome = run_python("import resource\nprint(resource.getrlimit(resource.RLIMIT_NOFILE)[0])",
                         limits=Limits(open_files=33))
    assert outcome.ok and outcome.stdout == "33\n"


def test_a_flood_of_output_is_read_to_the_cap_and_the_rest_dropped():
    """Gigabytes written within the timeout never reach the caller's memory."""
    flood = "import sys\nchunk = 'y' * (1 << 20)\nwhile True:\n    sys.stdout.write(chunk)\n"
    outcome = run_python(flood, limits=Limits(timeout_s=1.5, output_bytes=4096))
    assert outcome.status == "timeout" and len(outcome.stdout) == 4096


def test_input_the_code_never_reads_does_not_block_the_call():
    outcome = run_python("print('done')", stdin="x" * (1 << 22))
    assert outcome.ok and outcome.stdout == "done\n"


FEATURES = sandbox_features()
private = pytest.mark.skipif(FEATURES["private_tmp_and_proc"] is not None,
                             reason=f"no mount namespace here: {FEATURES['private_tmp_and_proc']}")


@private
def test_a_call_writes_its_own_tmp_and_sees_no_other_process():
    """[Note: sandbox per call]: /tmp, /var/tmp and /dev/shm are the call's own tmpfs, gone
    with it; its /proc holds its PID namespace alone; TMPDIR is its scratch folder."""
    name = f"flowkit-sandbox-left-{os.getpid()}"
    code = ("import os, tempfile\n"
            f"for folder in ('/tmp', '/var/tmp', '/dev/shm'):\n"
            f"    open(os.path.join(folder, {name!r}), 'wb').write(bytes(8 << 20))\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "print(len(pids), tempfile.gettempdir() == os.getcwd())\n")
    outcome = run_python(code, limits=Limits(memory_mib=256))
    assert outcome.ok, outcome.stderr
    seen, tmpdir_is_scratch = outcome.stdout.split()
    assert int(seen) <= 3 and tmpdir_is_scratch == "True"  # unshare's child, the code's
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(os.path.join(folder, name))


@pytest.mark.skipif(FEATURES["memory_per_call"] is not None,
                    reason=f"no memory cgroup here: {FEATURES['memory_per_call']}")
def test_memory_is_limited_per_call_not_per_process():
    """Eight processes of 200 MiB each, each under RLIMIT_AS's 512 MiB: the call's cgroup of
    512 MiB holds two or so of them at once; the rest are killed."""
    hog = ("import os, time\n"
           "for i in range(8):\n"
           "    if os.fork() == 0:\n"
           "        block = bytearray(200 << 20)\n"
           "        block[::4096] = bytes(len(block[::4096]))  # its pages, touched\n"
           "        print('held', flush=True)\n"
           "        time.sleep(3)\n"
           "        os._exit(0)\n"
           "print(*(os.waitstatus_to_exitcode(os.wait()[1]) for _ in range(8)))\n")
    outcome = run_python(hog, limits=Limits(memory_mib=512, timeout_s=15))
    held, codes = outcome.stdout.count("held"), outcome.stdout.split("\n")[-2].split()
    print(held, codes)  # 2 held, six -9 (killed at the call's limit)
    assert outcome.ok and held <= 3 and codes.count("-9") >= 5, outcome
    parent = _memory_cgroups()[0]  # the call's cgroup goes with it
    assert not [n for n in os.listdir(parent) if n.startswith(f"flowkit-sandbox-{os.getpid()}-")]


@private
def test_an_interpreter_under_tmp_still_runs_the_call_and_its_folder_is_read_only(tmp_path,
                                                                               monkeypatch):
    """A fresh clone's venv in /tmp: the call's own tmpfs on /tmp would hide its python (exit
    127, no word why); its folders are bound back, read-only (`interpreter_folders`)."""
    venv = tmp_path / "venv"
    venv_bin = venv / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    # the venv's prefix too, as a venv's python has it (and the suite's own, when its clone
    # is itself under /tmp, left out)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    assert interpreter_folders() == (str(venv),)
    # how its folder is mounted in the call's namespace (as nobody the code could not write a
    # root's folder anyway: the mount's own flag is what is asserted)
    code = ("import os, sys\n"
            "folder = os.path.dirname(os.path.dirname(sys.executable))\n"
            "mounts = [m.split() for m in open('/proc/self/mounts')]\n"
            "flags = [m[3].split(',')[0] for m in mounts if m[1] == folder]\n"
            "print(sys.executable, flags[-1] if flags else 'unmounted')\n")
    outcome = run_python(code)
    assert outcome.ok, (outcome.returncode, outcome.stderr)
    assert outcome.stdout.split() == [str(venv_bin / "python"), "ro"]


def test_an_interpreter_in_tmp_itself_is_refused_naming_the_path(monkeypatch):
    monkeypatch.setattr(sys, "prefix", "/tmp")
    with pytest.raises(ValueError, match="lives in /tmp itself.*folder of its own"):
        interpreter_folders()
