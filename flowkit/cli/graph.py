"""`flowkit graph FLOW -o OUT`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import click

from flowkit.cli._files import writing
from flowkit.cli._flows import load_checked_flow

_RENDERED = {".svg": "svg", ".png": "png"}


@click.command()
@click.argument("flow_spec", metavar="FLOW")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Where to write: .dot (text), or .svg / .png (drawn with Graphviz's dot).")
def graph(flow_spec: str, output: Path) -> None:
    """Draw a flow as a graph: DOT text, or SVG/PNG when Graphviz is installed."""
    suffix = output.suffix.lower()
    if suffix not in (".dot", *_RENDERED):
        raise click.BadParameter(f"{output} must end in .dot, .svg or .png", param_hint="-o")
    flow = load_checked_flow(flow_spec)
    dot_text = flow.to_dot()
    if suffix == ".dot":
        with writing(output):
            output.write_text(dot_text)
        click.echo(f"wrote {output}")
        return
    dot = shutil.which("dot")
    if dot is None:
        fallback = output.with_suffix(".dot")
        with writing(fallback):
            fallback.write_text(dot_text)
        raise click.ClickException(
            f"cannot draw {output}: Graphviz's `dot` program is not on PATH. Wrote the DOT text to "
            f"{fallback} instead; install Graphviz (e.g. `apt-get install graphviz`) to render it."
        )
    result = subprocess.run([dot, f"-T{_RENDERED[suffix]}", "-o", str(output)], input=dot_text,
                            text=True, capture_output=True, check=False)
    if result.returncode != 0:
        raise click.ClickException(f"Graphviz failed to draw {output}: {result.stderr.strip()}")
    click.echo(f"wrote {output}")
