"""The `flowkit` command line: one module per command, loaded only when that command runs."""

from __future__ import annotations

import importlib

import click

from flowkit import __version__

__all__ = ["main"]

# name -> "module:attribute".
_COMMANDS = {
    "bench": "flowkit.cli.bench:bench",
    "check": "flowkit.cli.check:check",
    "executor": "executors.serve:executor",
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
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _COMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)


@click.group(cls=_LazyGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "-V", "--version", prog_name="flowkit")
def main() -> None:
    """Declare, check, plan and run RL and pipeline-parallel training flows."""
