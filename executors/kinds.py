"""Executor kinds: which ops an executor process loads. Kinds from other packages plug in through
the entry-point group `flowkit.executors` (name -> `register(table)`)."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from executors.optable import OpTable, builtin_ops, load_plugin_ops

__all__ = ["KINDS", "op_table"]

# kind -> modules whose `register(table)` adds its ops, on top of the built-ins
_KINDS: dict[str, tuple[str, ...]] = {
    "base": (),
    "sim": ("executors.sim",),
    "torch": ("executors.torch",),
}
KINDS = tuple(_KINDS)  # the built-in kinds; plugins add theirs


def op_table(kind: str) -> OpTable:
    table = builtin_ops()
    modules = _KINDS.get(kind)
    if modules is None:
        plugins = {e.name: e for e in entry_points(group="flowkit.executors")}
        if kind not in plugins:
            raise ValueError(f"unknown executor kind {kind!r}: known are "
                             f"{', '.join([*_KINDS, *plugins])}")
        plugins[kind].load()(table)
    for module in modules or ():
        importlib.import_module(module).register(table)
    load_plugin_ops(table)
    return table
