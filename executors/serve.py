"""An executor process: `flowkit executor --connect ADDRESS`, or `python -m executors` as the
local launcher starts it (flowkit/runtime/launch.py)."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import warnings
from pathlib import Path

import click

from executors.kinds import kinds
from flowkit.wire.collection import fewer_collections_for_good
from flowkit.wire.limits import CONTROL_FRAME_BYTES

__all__ = ["executor", "load_code", "route_source", "run_secret"]


def _address(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A zmq endpoint the executor can connect to: tcp://HOST:PORT or ipc://PATH."""
    match = re.fullmatch(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", value or "")
    if match and 0 < int(match.group(2)) < 65536:
        return value
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    raise click.BadParameter(f"{value[:200]!r} is not a controller address: give "
                             "tcp://HOST:PORT (e.g. tcp://10.0.0.5:5555) or ipc://PATH")


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@click.command(name="executor")
@click.option("--connect", required=True, envvar="FLOWKIT_CONTROLLER", callback=_address,
              help="The controller's address, e.g. tcp://10.0.0.5:5555 [env FLOWKIT_CONTROLLER].")
@click.option("--name", default=None, help="A name for traces and errors [default: host-pid].")
@click.option("--tags", default="", help="Comma-separated tags ops can ask for, e.g. gpu,train.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--kind", type=click.Choice(kinds()), default="base", show_default=True,
              help="Which ops to load: built-ins, + the timed simulator, + torch stages.")
@click.option("--peer-host", default=None,
              help="Address peers reach this executor's data socket at [default: the address "
              "this machine reaches the controller from; 127.0.0.1 for a local controller].")
@click.option("--host-id", default=None, envvar="FLOWKIT_HOST_ID",
              help="Executors with one host id share memory; others get chunked frames "
              "[default: this machine's boot and /dev/shm identity] [env FLOWKIT_HOST_ID].")
@click.option("--code", "code_files", multiple=True,
              type=click.Path(exists=True),
              help="A flow file whose @op functions this executor may run, or a folder it "
              "imports the flow's modules from, first on its import path (repeatable).")
@click.option("--keys", "keys_dir", default=None, envvar="FLOWKIT_KEYS",
              type=click.Path(file_okay=False, path_type=Path),
              help="Authenticate and encrypt every socket with the CurveZMQ keys in DIR "
              "(`flowkit keys generate DIR`; the controller's --keys) [env FLOWKIT_KEYS].")
@click.option("--secret-file", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="The run's secret, which the controller asks of every executor: the file "
              "the controller wrote (`flowkit run --secret-file`) [default: the environment "
              "variable FLOWKIT_RUN_SECRET, set by the launchers].")
@click.option("--insecure", is_flag=True,
              help="Bind the data socket beyond loopback without keys: anyone who reaches it "
              "can send this executor objects.")
@click.option("--max-frame-bytes", type=click.IntRange(1 << 16, 1 << 40),
              default=CONTROL_FRAME_BYTES, show_default=True,
              help="The largest frame the controller may send this executor (its "
              "max_frame_bytes; the controller's launchers pass it).")
@click.option("--log-level", default="WARNING", show_default=True,
              type=click.Choice(_LEVELS, case_sensitive=False))
def executor(connect: str, name: str | None, tags: str, device: str, kind: str,
             peer_host: str | None, host_id: str | None, code_files: tuple[str, ...],
             keys_dir: Path | None, secret_file: Path | None, insecure: bool,
             max_frame_bytes: int,
             log_level: str) -> None:
    """Start an executor that serves a controller until it shuts down."""
    from flowkit.wire.auth import InsecureBindError, Keys, KeysError, check_bind

    secret = run_secret(secret_file)

    name = name or f"{socket.gethostname()}-{os.getpid()}"
    try:  # before anything loads or binds
        # with keys pinned to executor names, this executor's own pair [Note: authenticated
        # transport in flowkit/wire/auth.py]
        keys = None if keys_dir is None else Keys.load(keys_dir, name=name)
        if keys is not None:
            keys.secret("executor")
    except KeysError as exc:
        raise click.BadParameter(str(exc), param_hint="--keys") from None
    peer_host = peer_host or route_source(connect)
    try:
        check_bind(f"tcp://{peer_host}:0", keys=keys, insecure=insecure,
                   who="this executor's data socket")
    except InsecureBindError as exc:
        raise click.UsageError(str(exc)) from None
    # One compute thread per executor: several share the machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch's CPU wheel warns on import when numpy is absent; flowkit does not need numpy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from executors.kinds import op_table
    from executors.process import Executor

    load_code(code_files)
    if secret is None:
        raise click.UsageError("no run secret: an executor joins a run with it; give "
                               "--secret-file PATH (`flowkit run --secret-file PATH` writes "
                               "one), or start executors with the run's launcher")
    ops = op_table(kind)
    tag_list = tuple(t for t in tags.split(",") if t)
    worker = Executor(connect=connect, name=name, ops=ops, tags=tag_list, device=device,
                      peer_host=peer_host, host_id=host_id, keys=keys, insecure=insecure,
                      max_frame_bytes=max_frame_bytes, secret=secret)
    # [Note: garbage collection] in flowkit/wire/collection.py: the code loaded is frozen out
    # of the collector's walks, and young collections are rarer
    fewer_collections_for_good()
    raise SystemExit(worker.serve())


def load_code(paths: tuple[str, ...] | list[str]) -> None:
    """The run's code, fixed when the executor starts: a message can name an @op, never a file
    to load. Folders go first on the import path, in their order; then each flow file loads
    [Note: shipped code in flowkit/runner/flowcode.py]."""
    from flowkit.dsl.load import import_flow_file

    folders = [str(Path(p).resolve()) for p in paths if Path(p).is_dir()]
    sys.path[0:0] = [f for f in folders if f not in sys.path]
    for path in (p for p in paths if not Path(p).is_dir()):
        try:
            import_flow_file(Path(path))
        except Exception as exc:  # noqa: BLE001 - the user's file failed: one line, no traceback
            raise click.BadParameter(f"{path}: importing it raised {type(exc).__name__}: "
                                     f"{str(exc)[:300]}", param_hint="--code") from None


def run_secret(secret_file: Path | None) -> bytes | None:
    """The run's secret from --secret-file, else from the environment the launcher set (taken
    out of it: processes the ops start need not see it) [Note: joining a run in
    flowkit/wire/hello.py]; a file that holds none is a usage error."""
    from flowkit.wire.hello import read_secret_file, secret_from_environment

    try:
        from_environment = secret_from_environment()
        return read_secret_file(secret_file) if secret_file is not None else from_environment
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--secret-file") from None


def route_source(address: str) -> str:
    """The local address this machine reaches `address` (a zmq endpoint) from: where a peer
    that reaches the controller can reach this executor too [Note: hosts in flowkit/wire/shm.py]."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    if scheme != "tcp" or host in ("localhost", "*") or host.startswith("127."):
        return "127.0.0.1"
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, int(port or 0) or 9,
                                                            type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)  # UDP: nothing is sent, the kernel only picks the route
            return probe.getsockname()[0]
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"cannot find a route to the controller at {address} to bind "
                               f"the data socket on ({exc}); give --peer-host") from None
