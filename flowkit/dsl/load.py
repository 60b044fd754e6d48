"""Load a flow from `path/to/file.py` (its module-level `flow`) or `file.py:name`."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

from flowkit.dsl.flow import Flow

__all__ = ["FlowExitError", "FlowLoadError", "import_flow_file", "load_flow"]


class FlowLoadError(Exception):
    """The flow spec does not name a loadable flow (missing file, missing name, not a Flow)."""


class FlowExitError(Exception):
    """A flow file that called sys.exit (raised SystemExit) while it was imported."""


def load_flow(spec: str) -> Flow:
    """Import the file and return its flow, unvalidated. `name` may also be a function that takes
    no arguments and returns a Flow. A FlowError raised while the file builds its flow
    propagates."""
    path_text, _, name = spec.partition(":") if spec.count(":") == 1 else (spec, "", "")
    path = Path(path_text)
    if path.suffix != ".py":
        raise FlowLoadError(f"{spec!r} is not a flow file: give path/to/flow.py or "
                            "path/to/flow.py:name")
    if not path.is_file():
        raise FlowLoadError(f"no such file: {path}")
    module = import_flow_file(path)
    name = name or "flow"
    if not hasattr(module, name):
        flows = [k for k, v in vars(module).items() if isinstance(v, Flow)]
        hint = f"; it defines {', '.join(flows)}: use {path}:{flows[0]}" if flows else ""
        raise FlowLoadError(f"{path} defines no {name!r}{hint}")
    value = getattr(module, name)
    if callable(value) and not isinstance(value, Flow):
        value = value()
    if not isinstance(value, Flow):
        raise FlowLoadError(f"{path}:{name} is a {type(value).__name__}, not a flowkit Flow")
    return value


def import_flow_file(path: Path):
    """Import a flow file under a name that depends only on its path, so that executors that
    import the same file (`flowkit executor --code`) find its @op functions by the same name."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"_flowkit_user_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # The file's folder goes on sys.path, and stays there, so a flow can import helpers that
    # sit beside it, now or later: an executor imports a model's `build` module on first use.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # a flow file that exits would end the command silently
        sys.modules.pop(module_name, None)
        raise FlowExitError(f"{path} called sys.exit({exc.code!r}) while it was imported: a flow "
                            "file defines its flow; move what exits under "
                            "`if __name__ == \"__main__\":`") from None
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
