"""`flowkit check FLOW`."""

from __future__ import annotations

import click
from rich.console import Console

from flowkit.cli._flows import load_checked_flow
from flowkit.dsl.models import checkpoint_problems, stages_problems
from flowkit.dsl.render import summary


@click.command()
@click.argument("flow_spec", metavar="FLOW")
def check(flow_spec: str) -> None:
    """Validate a flow (file.py or file.py:name) and print its summary; exit 1 on any error."""
    flow = load_checked_flow(flow_spec)
    # what a run would refuse before any executor starts, beyond the flow's own rules
    problems = stages_problems(flow) + checkpoint_problems(flow)
    for problem in problems:
        click.echo(f"error: {problem}", err=True)
    if problems:
        raise SystemExit(1)
    console = Console()
    console.print(summary(flow))
    console.print(f"[green]ok[/green]: flow {flow.name!r} is valid")
