"""Sandboxed execution for tools and rewards: `run_python` runs untrusted code (a model's answer,
a tool's input) in a process of its own, bounded, and always answers.

[Note: sandbox] Each call runs in a fresh scratch folder, under `Limits`: a wall-clock timeout
past which the call's whole process tree is killed; rlimits on CPU seconds, address space, file
size and open files, set in the child before it runs anything; where the machine allows it,
`unshare --net --pid --fork --kill-child` (no network; a PID namespace whose first process is
the call's, so killing it kills whatever the code forked or detached), and as root the user
`nobody`, which makes RLIMIT_NPROC hold; a minimal environment and `python -I`; output capped
at `output_bytes`; `retries` only for a sandbox that failed to start. A call never raises for
what the code does: its `Outcome` says "ok", "failed", "crashed", "timeout" or "unavailable",
with the output, the seconds and `isolated` (False where namespaces are forbidden: the limits
still hold, the network does not; `sandbox_status()` says why). Where the machine allows, a
call also has its own /tmp and /proc and a memory limit for all its processes together
([Note: sandbox per call]; `sandbox_features()` says what holds). Each attack and what stops
it: docs/security.md, "Sandboxed code".
"""

from __future__ import annotations

import functools
import itertools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs

from flowkit.runtime.spawn import spawn

__all__ = ["Limits", "Outcome", "run_python", "sandbox_features", "sandbox_status"]

_NOBODY = 65534
_CALLS = itertools.count()


@attrs.frozen(kw_only=True)
class Limits:
    timeout_s: float = 5.0
    cpu_s: int | None = None  # CPU seconds (None: the timeout's, rounded up, plus one)
    memory_mib: int = 1024  # address space
    file_mib: int = 16  # the largest file the code may write
    open_files: int = 64
    processes: int = 32  # as `nobody`: processes of that user at once
    output_bytes: int = 65536  # of stdout and of stderr, each
    retries: int = 1

    def __attrs_post_init__(self) -> None:
        for name in ("timeout_s", "memory_mib", "file_mib", "open_files", "processes",
                     "output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox Limits: {name}={value!r} must be a number > 0")
        if self.retries < 0:
            raise ValueError(f"sandbox Limits: retries={self.retries!r} must be >= 0")


@attrs.frozen
class Outcome:
    status: str  # ok | failed | crashed | timeout | unavailable
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    isolated: bool  # network and PID namespaces were on
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(code: str, *, stdin: str = "", limits: Limits | None = None,
               files: Mapping[str, str] | None = None) -> Outcome:
    """Run `code` as a Python program in the sandbox [Note: sandbox], `stdin` as its input and
    `files` (name -> text) beside it in its scratch folder."""
    limits = limits or Limits()
    attempts = 0
    while True:
        attempts += 1
        outcome = _run_once(code, stdin, limits, dict(files or {}))
        if outcome.status != "unavailable" or attempts > limits.retries:
            return attrs.evolve(outcome, attempts=attempts)
        time.sleep(0.05 * attempts)


def _run_once(code: str, stdin: str, limits: Limits, files: dict[str, str]) -> Outcome:
    isolated = sandbox_status() is None
    cgroup = None
    scratch = tempfile.mkdtemp(prefix="flowkit-sandbox-")
    started = time.monotonic()
    try:
        for name, text in {**files, "main.py": code}.items():
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"sandbox file name {name!r} must be a plain name")
            with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
                f.write(text)
        as_nobody = isolated and os.geteuid() == 0 and shutil.which("setpriv") is not None
        if as_nobody:  # the code runs as nobody: its folder must be its own
            for path in [scratch, *(os.path.join(scratch, n) for n in os.listdir(scratch))]:
                os.chown(path, _NOBODY, _NOBODY)
        prlimit = shutil.which("prlimit")
        mounts = isolated and _private_mounts() is None
        cgroup = _new_cgroup(limits)
        wrapper = _wrapper(scratch, limits, cgroup, mounts) if mounts or cgroup else ()
        command = [*(_prlimit(prlimit, limits, as_nobody) if prlimit else ()),
                   *((*_UNSHARE, *_MOUNT_NS) if mounts else _UNSHARE if isolated else ()),
                   *wrapper, *(_NOBODY_USER if as_nobody else ()),
                   sys.executable, "-I", *(("-c", _INIT) if isolated else ()), "main.py"]
        settings = dict(cwd=scratch, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "HOME": scratch,
                                                     "TMPDIR": scratch,
                                                     "PYTHONIOENCODING": "utf-8"},
                        start_new_session=True, close_fds=True)
        try:
            # a call dies with its executor (spawn's parent-death signal; unshare's
            # --kill-child takes the namespace with it); without prlimit (util-linux) the
            # limits are set in the child itself, which that hook would displace
            process = spawn(command, **settings) if prlimit else subprocess.Popen(
                command, preexec_fn=functools.partial(_limit, limits, as_nobody), **settings)
        except OSError as exc:
            return Outcome("unavailable", None, "", str(exc), 0.0, isolated)
        stdout, stderr, timed_out = _communicate(process, stdin, limits)
        seconds = time.monotonic() - started
        code_ = process.returncode
        status = "timeout" if timed_out else "ok" if code_ == 0 else (
            "crashed" if code_ is not None and code_ < 0 else "failed")
        if isolated and code_ is not None and code_ > 128 and not timed_out:
            status = "crashed"  # unshare reports its child's signal as 128 + the signal
        return Outcome(status, code_, stdout, stderr, seconds, isolated)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if cgroup is not None:
            _remove_cgroup(cgroup)


def _communicate(process: subprocess.Popen, stdin: str,
                 limits: Limits) -> tuple[str, str, bool]:
    """The output, each stream cut at `output_bytes` as it is read (a flood never reaches this
    process's memory), and whether the timeout killed the process tree."""
    cap = int(limits.output_bytes)
    kept: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
    workers = [threading.Thread(target=_drain, args=(process.stdout, kept["out"], cap),
                                daemon=True),
               threading.Thread(target=_drain, args=(process.stderr, kept["err"], cap),
                                daemon=True),
               threading.Thread(target=_feed, args=(process.stdin, stdin.encode()), daemon=True)]
    for worker in workers:
        worker.start()
    try:
        process.wait(timeout=limits.timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_tree(process)
        process.wait()
        timed_out = True
    for worker in workers:  # the pipes close once every process of the call is gone
        worker.join(timeout=2.0)
    return (kept["out"].decode(errors="replace"), kept["err"].decode(errors="replace"),
            timed_out)


def _drain(pipe: Any, into: bytearray, cap: int) -> None:
    """Read `pipe` to its end, keeping its first `cap` bytes."""
    try:
        for chunk in iter(lambda: pipe.read1(65536), b""):
            if len(into) < cap:
                into += chunk[:cap - len(into)]
    except (OSError, ValueError):
        pass
    finally:
        pipe.close()


def _feed(pipe: Any, data: bytes) -> None:
    """Write the input (the code may never read it) and close it."""
    try:
        if data:
            pipe.write(data)
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the call's process group (unshare and, through --kill-child, the namespace's
    first process, whose death ends every process of the namespace)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _rlimits(limits: Limits, as_nobody: bool) -> list[tuple[str, int, int]]:
    """(prlimit's name, resource, value) of each limit the call runs under; every process it
    starts inherits them (the process count binds once setpriv has made the code `nobody`:
    root is exempt from it)."""
    mib = 1 << 20
    found = [("cpu", resource.RLIMIT_CPU, limits.cpu_s or int(limits.timeout_s) + 2),
             ("as", resource.RLIMIT_AS, int(limits.memory_mib * mib)),
             ("fsize", resource.RLIMIT_FSIZE, int(limits.file_mib * mib)),
             ("nofile", resource.RLIMIT_NOFILE, int(limits.open_files)),
             ("core", resource.RLIMIT_CORE, 0)]
    if as_nobody:
        found.append(("nproc", resource.RLIMIT_NPROC, int(limits.processes)))
    return found


def _prlimit(path: str, limits: Limits, as_nobody: bool) -> list[str]:
    """The limits set by util-linux's prlimit on the command it runs: nothing runs in the
    forked child before exec, which a threaded executor makes the safe way."""
    return [path, *(f"--{name}={value}" for name, _, value in _rlimits(limits, as_nobody)),
            "--"]


def _limit(limits: Limits, as_nobody: bool) -> None:
    """The limits set in the child itself, where prlimit is missing."""
    for _, which, value in _rlimits(limits, as_nobody):
        resource.setrlimit(which, (value, value))


_UNSHARE = ("unshare", "--net", "--pid", "--fork", "--kill-child")
# The namespace's first process: the kernel spares it the signals it has no handler for (a
# segfault, SIGXCPU), so the code runs as its child, and it exits with the code's status, a
# signal N as 128 + N. When it exits, every process left in the namespace is killed.
_INIT = """
import os, sys
pid = os.fork()
if pid == 0:  # the code, as `python main.py` would run it
    import runpy, traceback
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.getcwd())
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
os._exit(status if status >= 0 else 128 - status)
"""
# inside the namespaces (unshare needs root's rights, the code must not keep them)
_NOBODY_USER = ("setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", "--")


# [Note: sandbox per call] Where the machine allows a mount namespace (root, as unshare's
# namespaces need here), a call gets its own empty tmpfs on /tmp, /var/tmp and /dev/shm (each at
# most the call's memory_mib), its scratch folder bound back at its path (and, read-only, the
# interpreter's folders there: a venv in /tmp), and a /proc of its PID namespace alone: what it
# writes there goes with the namespace, and it sees no other process.
# Where a memory cgroup can be made (v1 `memory`, or v2 with `memory` delegated), the call runs
# in one of its own whose limit is memory_mib for all of its processes together, tmpfs pages
# included (removed after it; a killed executor's are removed by the next process's first
# call); elsewhere RLIMIT_AS bounds each process, and the processes limit their number.
_MOUNT_NS = ("--mount", "--propagation", "private", "--mount-proc")
_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
# as root, inside the namespaces, before setpriv: $1 the scratch folder, $2 tmpfs MiB, $3 the
# cgroup's procs file or "", $4 1 to mount, $5 how many of the next arguments are folders of the
# interpreter to keep (bound back over the tmpfs from a descriptor opened before it); then the
# command
_WRAP = """set -e
scratch=$1 mib=$2 procs=$3 mounts=$4 kept=$5
shift 5
[ -z "$procs" ] || echo $$ > "$procs"
if [ "$mounts" = 1 ]; then
  i=0
  for p in "$@"; do
    [ "$i" -lt "$kept" ] || break
    i=$((i + 1)); eval "exec $((i + 2))<\\"\\$p\\""
  done
  for d in /tmp /var/tmp /dev/shm; do
    [ ! -d "$d" ] || mount -t tmpfs -o "size=${mib}m,mode=1777,nosuid,nodev" tmpfs "$d"
  done
  i=0
  for p in "$@"; do
    [ "$i" -lt "$kept" ] || break
    i=$((i + 1)); mkdir -p "$p"
    mount --no-canonicalize --bind "/proc/self/fd/$((i + 2))" "$p"
    mount -o remount,bind,ro "$p"
    eval "exec $((i + 2))<&-"
  done
  mkdir -p "$scratch" && mount --no-canonicalize --bind . "$scratch" && cd "$scratch"
fi
shift "$kept"
exec "$@"
"""


def _wrapper(scratch: str, limits: Limits, cgroup: tuple[str, str] | None,
             mounts: bool) -> tuple[str, ...]:
    procs = os.path.join(cgroup[0], "cgroup.procs") if cgroup else ""
    kept = interpreter_folders() if mounts else ()
    return ("sh", "-c", _WRAP, "sh", scratch, str(int(limits.memory_mib)), procs,
            "1" if mounts else "0", str(len(kept)), *kept)


def interpreter_folders() -> tuple[str, ...]:
    """This interpreter's folders under /tmp, /var/tmp or /dev/shm (a fresh clone's venv in
    /tmp), which a call's own tmpfs there would hide, its python exiting 127 unfound: they are
    bound back into the call's namespace, read-only. One of those roots itself cannot be kept
    apart from the rest of it: a ValueError names it."""
    paths = set()
    for path in (sys.executable, os.path.realpath(sys.executable)):
        paths.add(os.path.dirname(path))
    for path in (sys.prefix, sys.exec_prefix, sys.base_prefix):
        paths.update((path, os.path.realpath(path)))
    under = sorted(p for p in paths if any(p == root or p.startswith(root + "/")
                                           for root in _SHARED_TMP))
    roots = [p for p in under if p in _SHARED_TMP]
    if roots:
        raise ValueError(f"this python lives in {roots[0]} itself ({sys.executable}), which "
                         "each sandboxed call gets empty: install it (or its venv) in a folder "
                         "of its own, e.g. python -m venv ~/venv")
    return tuple(p for p in under if not any(p.startswith(q + "/") for q in under))


@functools.cache
def _private_mounts() -> str | None:
    """None when a call can have its own /tmp, /var/tmp, /dev/shm and /proc, else why not."""
    if sandbox_status() is not None:
        return sandbox_status()
    try:
        done = subprocess.run([*_UNSHARE, *_MOUNT_NS, "sh", "-c",
                               "mount -t tmpfs -o size=1m tmpfs /tmp"],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --mount failed: {exc}"
    if done.returncode != 0:
        return f"no mount namespace here: {done.stderr.decode(errors='replace').strip()}"
    return None


@functools.cache
def _memory_cgroups() -> tuple[str, str] | str:
    """(the folder under which a call's cgroup is made, its limit file's name), or why none."""
    try:
        with open("/proc/self/cgroup") as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError as exc:
        return f"no /proc/self/cgroup: {exc}"
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            return _swept(f"/sys/fs/cgroup/memory{path.rstrip('/')}"), "memory.limit_in_bytes"
    for number, controllers, path in entries:
        if number == "0" and not controllers:
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                folder = f"{root}{path.rstrip('/')}"
                try:
                    with open(os.path.join(folder, "cgroup.subtree_control")) as enabled:
                        if "memory" in enabled.read().split():
                            return _swept(folder), "memory.max"
                except OSError:
                    continue
    return "no memory cgroup to make calls' own in (v1 memory, or v2 with memory delegated)"


def _swept(parent: str) -> str:
    """`parent`, rid of the empty cgroups of calls whose process is gone (an executor killed
    mid-call could not remove its call's)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return parent
    for name in names:
        parts = name.split("-")
        if name.startswith("flowkit-sandbox-") and len(parts) == 4 and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass
            except (PermissionError, OverflowError):
                pass
    return parent


def _new_cgroup(limits: Limits) -> tuple[str, str] | None:
    """A memory cgroup of its own for one call, limited to memory_mib, or None where the
    machine allows none [Note: sandbox per call]."""
    found = _memory_cgroups()
    if isinstance(found, str):
        return None
    parent, limit_file = found
    folder = os.path.join(parent, f"flowkit-sandbox-{os.getpid()}-{next(_CALLS)}")
    try:
        os.mkdir(folder)
    except OSError:
        return None
    limit = str(int(limits.memory_mib) << 20)
    try:
        with open(os.path.join(folder, limit_file), "w") as f:
            f.write(limit)
    except OSError:
        _remove_cgroup((folder, limit_file))
        return None
    for extra in ("memory.memsw.limit_in_bytes", "memory.swap.max"):  # no swapping past it
        try:
            with open(os.path.join(folder, extra), "w") as f:
                f.write(limit if extra.endswith("bytes") else "0")
        except OSError:
            pass
    return folder, limit_file


def _remove_cgroup(cgroup: tuple[str, str]) -> None:
    """rmdir the call's cgroup once its processes are gone (killed with the namespace: a
    moment)."""
    for _ in range(100):
        try:
            os.rmdir(cgroup[0])
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def sandbox_features() -> dict[str, str | None]:
    """What holds on this machine, each None when it does, else why not: "namespaces"
    (network and PID), "private_tmp_and_proc" (its own /tmp, /var/tmp, /dev/shm and /proc),
    "memory_per_call" (a cgroup)."""
    cgroups = _memory_cgroups()
    return {"namespaces": sandbox_status(), "private_tmp_and_proc": _private_mounts(),
            "memory_per_call": cgroups if isinstance(cgroups, str) else None}


@functools.cache
def sandbox_status() -> str | None:
    """None when calls run in their own network and PID namespaces, else why they cannot."""
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux) on this machine"
    try:
        done = subprocess.run([*_UNSHARE, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if done.returncode != 0:
        return f"unshare is not allowed here: {done.stderr.decode(errors='replace').strip()}"
    return None
