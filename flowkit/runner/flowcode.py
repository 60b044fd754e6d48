"""The code a run's executors load: the modules its flow's @op functions, model builds,
environments and agent programs come from, found in this process and handed to the executors
when they start, so that `flowkit.run(flow)` needs no `code=` [Note: shipped code]."""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs

import flowkit
from flowkit.dsl import Flow
from flowkit.dsl.operators import FunctionOp
from flowkit.runner.config import RunConfigError

__all__ = ["Reference", "code_to_ship", "flow_references"]

# [Note: shipped code] An executor imports what its controller names ("module:function") from
# its own import path: its working directory (this process's), PYTHONPATH and the installed
# packages. A module this process found elsewhere (beside the script it runs, in a folder put on
# sys.path, a flow file given to load_flow) is shipped when the executors start, as `--code`:
# a flow file as the file (loaded under its own name, dsl/load.py), any other module as the
# folder its top-level package sits in, which the executor puts first on its import path. Code
# is fixed at start, by argv from the user's own process; no message names a file or folder
# (docs/security.md). A module found nowhere fails here, before anything starts.

_FLOW_FILE = "_flowkit_user_"  # dsl/load.py's module names for flow files
_SHOWN_FOLDERS = 6  # folders an error lists: enough to see where it looked


@attrs.frozen
class Reference:
    """A module the flow names, and what names it (for the errors)."""

    module: str
    by: str


def flow_references(flow: Flow) -> list[Reference]:
    """Every module the flow (and its evaluation flow) names: its @op functions', its models'
    builds, the environments and agent programs its calls name."""
    found: dict[str, Reference] = {}
    for graph in _graphs(flow):
        for ref in _graph_references(graph):
            found.setdefault(ref.module, ref)
    return list(found.values())


def code_to_ship(flow: Flow, *, given: Iterable[str] = ()) -> tuple[str, ...]:
    """What the executors of `flow` load at start (`--code`): `given` (RunConfig.code), then
    the flow files and folders of the modules they could not import otherwise, in the order
    this process searches them. A RunConfigError of one line for a module found nowhere."""
    given = tuple(str(path) for path in given)
    have = {_resolved(path) for path in given}
    files, folders = [], []
    for ref in flow_references(flow):
        shipped = _shipped(ref)
        if shipped is None or shipped in have:
            continue
        have.add(shipped)
        (files if ref.module.startswith(_FLOW_FILE) else folders).append(shipped)
    return (*given, *files, *sorted(folders, key=_search_order))


def _graphs(flow: Flow) -> Iterator[Flow]:
    while flow is not None:
        yield flow
        flow = flow.evaluation


def _graph_references(flow: Flow) -> Iterator[Reference]:
    for node in flow.nodes.values():
        if isinstance(node.operator, FunctionOp):
            yield Reference(node.operator.fn.__module__, f"op {node.operator.name!r}")
        for key, what in (("environment", "environment"), ("program", "agent program")):
            path = node.config.get(key)
            if isinstance(path, str) and ":" in path:
                yield Reference(path.partition(":")[0], f"the {what} of {node.name!r}")
    for model in flow.models.values():
        yield Reference(model.build.partition(":")[0], f"the build of model {model.name!r}")


def _shipped(ref: Reference) -> str | None:
    """The file or folder to ship for `ref`, None when the executors import it as they are."""
    if ref.module == "__main__":
        script = getattr(sys.modules.get("__main__"), "__file__", None) or "a notebook or REPL"
        raise RunConfigError("code", f"{ref.by} is defined in the script being run ({script}), "
                             "which an executor cannot import: move it into a module of its own "
                             "beside the script and import it from there")
    module = sys.modules.get(ref.module)
    if ref.module.startswith(_FLOW_FILE) and getattr(module, "__file__", None):
        return _resolved(module.__file__)
    root = _import_root(ref, module)
    if root is None or _on_executor_path(root):
        return None
    return str(root)


def _import_root(ref: Reference, module) -> Path | None:
    """The folder `ref.module`'s top-level package is imported from (None: built in, or no
    folder of its own); a module found nowhere is a RunConfigError."""
    depth = ref.module.count(".")
    if getattr(module, "__file__", None):
        path = Path(module.__file__).resolve()
        return path.parents[depth + (path.stem == "__init__")]
    top = ref.module.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)  # imports nothing: a top-level name
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise RunConfigError("code", f"{ref.by} names no module this machine has: no module "
                             f"{ref.module!r} (searched {_searched()}): put it beside the flow "
                             "file or in the working directory, install it, or give "
                             "RunConfig(code=[its folder or file])")
    if spec.submodule_search_locations:  # a package: the folder above its own
        return Path(list(spec.submodule_search_locations)[0]).resolve().parent
    if spec.origin in (None, "built-in", "frozen"):
        return None
    return Path(spec.origin).resolve().parent


def _on_executor_path(folder: Path) -> bool:
    """Whether an executor started by this process imports from `folder` without being told:
    installed packages and the standard library, the folder flowkit itself comes from (the
    executors run from it), PYTHONPATH's folders and the working directory (`python -m`)."""
    return folder in _executor_path() or any(folder.is_relative_to(p) for p in _installed())


def _executor_path() -> set[Path]:
    folders = {Path(flowkit.__file__).resolve().parents[1]}
    folders.update(Path(p or ".").resolve() for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if os.environ.get("PYTHONPATH"))
    if not os.environ.get("PYTHONSAFEPATH"):
        folders.add(Path.cwd().resolve())
    return folders


def _installed() -> list[Path]:
    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    found += [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    return [Path(p).resolve() for p in found if p]


def _search_order(folder: str) -> int:
    """Where `folder` stands on this process's import path (one it is not on: last)."""
    order = {str(Path(p or ".").resolve()): i for i, p in reversed(list(enumerate(sys.path)))}
    return order.get(folder, len(order))


def _searched() -> str:
    folders = list(dict.fromkeys(str(p) for p in [Path.cwd(), *sys.path] if str(p)))
    shown = ", ".join(folders[:_SHOWN_FOLDERS])
    return shown + (", ..." if len(folders) > _SHOWN_FOLDERS else "")


def _resolved(path: str) -> str:
    return str(Path(path).resolve())
