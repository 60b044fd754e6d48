"""`flowkit keys generate DIR`: the CurveZMQ keys that let a controller and its executors talk
across machines [Note: authenticated transport in flowkit/wire/auth.py]."""

from __future__ import annotations

from pathlib import Path

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def keys() -> None:
    """Make the keys that authenticate and encrypt a run's sockets (CurveZMQ)."""


@keys.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("folder", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True,
              help="Empty a DIR/allowed/ that holds keys first (they would still be let in).")
def generate(folder: Path, force: bool) -> None:
    """Write the controller's and the executors' key pairs, and the allowed clients, to DIR."""
    from flowkit.wire.auth import KeysError, generate_keys

    try:
        generate_keys(folder, force=force)
    except KeysError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote keys to {folder}: controller.key(_secret), executor.key(_secret), "
               f"allowed/executor.key\n"
               f"controller host: flowkit run FLOW --bind tcp://ADDR:PORT --keys {folder}\n"
               f"executor hosts:  flowkit executor --connect tcp://ADDR:PORT --keys {folder} "
               f"(a copy without controller.key_secret is enough)")
