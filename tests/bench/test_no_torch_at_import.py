"""Importing a bench, the library or its command line loads no torch, transformers or Ray: they
load in the functions that run, so `flowkit bench --help` and `import flowkit` stay quick."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import benchmarks

HEAVY = ("torch", "transformers", "ray")

# Imports each module in turn in a fresh interpreter and names the first that loads a heavy
# package, with the heavy packages it loaded; then does the same for `flowkit bench`'s help.
_PROBE = """
import importlib, json, sys
from click.testing import CliRunner
heavy, modules, helps = json.loads(sys.argv[1])
def loaded():
    return [name for name in heavy if name in sys.modules]
for module in modules:
    importlib.import_module(module)
    if loaded():
        print(json.dumps([module, loaded()]))
        sys.exit(0)
from flowkit.cli import main
for args in helps:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    if loaded():
        print(json.dumps([" ".join(args), loaded()]))
        sys.exit(0)
print(json.dumps(None))
"""


def _first_heavy_import(modules: list[str], helps: list[list[str]]) -> list | None:
    result = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([HEAVY, modules, helps])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_no_bench_module_and_no_command_loads_torch_at_import():
    bench_modules = sorted(f"benchmarks.{m.name}"
                           for m in pkgutil.iter_modules(benchmarks.__path__))
    assert "benchmarks.split_backward" in bench_modules  # the one that used to
    helps = [["bench", "--help"], *(["bench", name, "--help"] for name in
                                    ("dispatch", "rl", "train", "launch"))]
    modules = ["flowkit", "flowkit.cli", "benchmarks.cli", *bench_modules]
    assert _first_heavy_import(modules, helps) is None
