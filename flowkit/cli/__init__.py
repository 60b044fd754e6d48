"""The `flowkit` command line: one module per command, loaded only when that command runs, and
the commands installed packages add through the entry-point group `flowkit.commands` (the
executor process's `flowkit executor`, the benchmarks' `flowkit bench`)."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import click

from flowkit import __version__

__all__ = ["main"]

# name -> "module:attribute": flowkit's own commands.
_COMMANDS = {
    "check": "flowkit.cli.check:check",
    "graph": "flowkit.cli.graph:graph",
    "keys": "flowkit.cli.keys:keys",
    "run": "flowkit.cli.run:run",
    "schedule": "flowkit.cli.schedule:schedule",
}

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class _LazyGroup(click.Group):
    """Imports a command's module only when it is invoked, so `flowkit --help` stays instant
    and a command that needs torch does not slow down one that does not."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_commands())

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _commands().get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)


    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # an argument error is one line, not click's three
            raise _OneLineError(exc) from None


class _OneLineError(click.ClickException):
    """A usage error (a bad option, a missing argument, an unknown command) as one line that
    names the help to read, instead of click's usage block above it."""

    exit_code = 2

    def __init__(self, error: click.UsageError) -> None:
        where = f" (see `{error.ctx.command_path} --help`)" if error.ctx is not None else ""
        super().__init__(f"{error.format_message()}{where}")

    def show(self, file: object = None) -> None:
        click.echo(f"Error: {self.format_message()}", err=True)


def _commands() -> dict[str, str]:
    """Every command by name: the installed packages' (`flowkit.commands`), then flowkit's,
    which no package can replace."""
    added = {entry.name: entry.value for entry in entry_points(group="flowkit.commands")}
    return {**added, **_COMMANDS}


@click.group(cls=_LazyGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "-V", "--version", prog_name="flowkit")
def main() -> None:
    """Declare, check, plan and run RL and pipeline-parallel training flows."""
