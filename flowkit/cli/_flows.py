"""Loading a flow for a command: the one place CLI commands turn flow problems into exit codes."""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

import click

import flowkit
from flowkit.dsl import Flow, FlowError, FlowLoadError, load_flow
from flowkit.dsl.load import FlowExitError

__all__ = ["load_checked_flow"]

# Code that is not the user's: flowkit itself, the standard library and installed packages.
# Frames from these are hidden when a flow file raises; importlib's are "<frozen ...>".
_NOT_USER = tuple(
    Path(p).resolve()
    for p in {str(Path(flowkit.__file__).parent),
              *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
)


def load_checked_flow(spec: str) -> Flow:
    """Load and validate the flow named by `spec`, or exit: 2 if the spec names nothing loadable,
    1 with every problem listed if the flow is invalid or its file raises."""
    try:
        flow = load_flow(spec)
        flow.validate()
    except FlowLoadError as exc:
        raise click.BadParameter(str(exc), param_hint="FLOW") from None
    except FlowExitError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None
    except FlowError as exc:
        click.echo(str(exc), err=True)
        raise SystemExit(1) from None
    except SyntaxError as exc:
        click.echo(_syntax_error(exc), err=True)
        raise SystemExit(1) from None
    except Exception as exc:  # the user's file itself failed: show where, in their code
        click.echo(f"error: loading {spec} raised:\n{_user_traceback(exc)}", err=True)
        raise SystemExit(1) from None
    return flow


def _syntax_error(exc: SyntaxError) -> str:
    """`file:line: message`, the offending line and a caret under the spot, like a compiler."""
    lines = [f"error: {exc.filename}:{exc.lineno}: {exc.msg}"]
    text = (exc.text or "").rstrip("\n")
    code = text.lstrip()
    if code:
        lines.append(f"    {code}")
        if exc.offset:
            column = exc.offset - 1 - (len(text) - len(code))
            lines.append("    " + " " * max(column, 0) + "^")
    return "\n".join(lines)


def _user_traceback(exc: BaseException) -> str:
    """The traceback with only the frames of the user's own files (the flow file and helpers)."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if _is_user_file(f.filename)] or frames[-1:]
    return "Traceback (most recent call last):\n" + "".join(
        traceback.format_list(mine) + traceback.format_exception_only(type(exc), exc)
    )


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return not any(path.is_relative_to(root) for root in _NOT_USER)
