"""Loading a flow for a command: the one place CLI commands turn flow problems into exit codes."""

from __future__ import annotations

import traceback

import click

from flowkit.dsl import Flow, FlowError, FlowLoadError, load_flow

__all__ = ["load_checked_flow"]


def load_checked_flow(spec: str) -> Flow:
    """Load and validate the flow named by `spec`, or exit: 2 if the spec names nothing loadable,
    1 with every problem listed if the flow is invalid or its file raises."""
    try:
        flow = load_flow(spec)
        flow.validate()
    except FlowLoadError as exc:
        raise click.BadParameter(str(exc), param_hint="FLOW") from None
    except FlowError as exc:
        click.echo(str(exc), err=True)
        raise SystemExit(1) from None
    except Exception:  # the user's file itself failed: show where, as Python would
        click.echo(f"error: loading {spec} raised:\n{traceback.format_exc()}", err=True)
        raise SystemExit(1) from None
    return flow
