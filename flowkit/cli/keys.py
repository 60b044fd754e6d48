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
@click.option("--executors", "executors", default=None, metavar="NAMES|COUNT",
              help="A key pair per executor, each let in under its own name only: names "
              "(exec-0,exec-1) or a count (4: exec-0 .. exec-3) [default: one pair all share].")
@click.option("--force", is_flag=True,
              help="Empty a DIR/allowed/ that holds keys first (they would still be let in).")
def generate(folder: Path, executors: str | None, force: bool) -> None:
    """Write the controller's and the executors' key pairs, and the allowed clients, to DIR."""
    from flowkit.wire.auth import KeysError, generate_keys

    names = executor_names(executors)
    try:
        generate_keys(folder, names, force=force)
    except KeysError as exc:
        raise click.ClickException(str(exc)) from None
    allowed = ", ".join(f"allowed/{name}.key" for name in names) or "allowed/executor.key"
    own = f", executors/NAME.key(_secret) for {', '.join(names)}" if names else ""
    click.echo(f"wrote keys to {folder}: controller.key(_secret), executor.key(_secret){own}, "
               f"{allowed}\n"
               f"controller host: flowkit run FLOW --bind tcp://ADDR:PORT --keys {folder}\n"
               f"executor hosts:  flowkit executor --connect tcp://ADDR:PORT --keys {folder} "
               f"{' --name NAME' if names else ''} (a copy without controller.key_secret is "
               f"enough{'; only executors/NAME.key_secret of its own executors' if names else ''})")


def executor_names(spec: str | None) -> list[str]:
    """`--executors`: comma-separated names, or a count of exec-0 .. exec-N-1."""
    if spec is None:
        return []
    if spec.strip().isdigit():
        count = int(spec)
        if not 1 <= count <= 10_000:
            raise click.BadParameter(f"give 1 to 10000 executors, not {count}",
                                     param_hint="--executors")
        return [f"exec-{i}" for i in range(count)]
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names or len(set(names)) != len(names):
        raise click.BadParameter(f"give distinct executor names, comma-separated, or a count, "
                                 f"not {spec!r}", param_hint="--executors")
    return names
