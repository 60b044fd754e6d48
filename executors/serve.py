"""An executor process: `flowkit executor --connect ADDRESS`, or `python -m executors` as the
local launcher starts it (flowkit/runtime/launch.py)."""

from __future__ import annotations

import logging
import os
import socket
import warnings
from pathlib import Path

import click

from executors.kinds import KINDS

__all__ = ["executor"]


@click.command(name="executor")
@click.option("--connect", required=True, envvar="FLOWKIT_CONTROLLER",
              help="The controller's address, e.g. tcp://10.0.0.5:5555 [env FLOWKIT_CONTROLLER].")
@click.option("--name", default=None, help="A name for traces and errors [default: host-pid].")
@click.option("--tags", default="", help="Comma-separated tags ops can ask for, e.g. gpu,train.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--kind", type=click.Choice(KINDS), default="base", show_default=True,
              help="Which ops to load: built-ins, + the timed simulator, + torch stages.")
@click.option("--peer-host", default="127.0.0.1", show_default=True,
              help="Address peers reach this executor's data socket at (set for multi-host).")
@click.option("--code", "code_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False),
              help="A flow file whose @op functions this executor may run (repeatable).")
@click.option("--log-level", default="WARNING", show_default=True)
def executor(connect: str, name: str | None, tags: str, device: str, kind: str, peer_host: str,
             code_files: tuple[str, ...], log_level: str) -> None:
    """Start an executor that serves a controller until it shuts down."""
    # One compute thread per executor: several share the machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch's CPU wheel warns on import when numpy is absent; flowkit does not need numpy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from executors.kinds import op_table
    from executors.process import Executor
    from flowkit.dsl.load import import_flow_file

    # Code is fixed when the executor starts: a message can name an @op, never a file to load.
    for path in code_files:
        import_flow_file(Path(path))

    ops = op_table(kind)
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    tag_list = tuple(t for t in tags.split(",") if t)
    worker = Executor(connect=connect, name=name, ops=ops, tags=tag_list, device=device,
                      peer_host=peer_host)
    raise SystemExit(worker.serve())
