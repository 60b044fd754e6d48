"""Writing a command's output files: a path that cannot be written is a plain error (exit 1)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import click

__all__ = ["writing"]


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError raised while writing `path` into one line on stderr and exit 1."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if isinstance(exc, FileNotFoundError) and not path.parent.is_dir():
            reason = f"the folder {path.parent} does not exist"
        raise click.ClickException(f"cannot write {path}: {reason}") from None
