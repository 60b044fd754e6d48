"""Executor kinds: which ops an executor process loads. Every kind, the built-in ones included,
is an entry of the group `flowkit.executors` (name -> `register(table)`, see pyproject.toml), so
the `flowkit` command offers the installed kinds without importing any of them."""

from __future__ import annotations

from executors.optable import OpTable, builtin_ops, installed_entries, load_plugin_ops

__all__ = ["base", "kinds", "op_table"]

GROUP = "flowkit.executors"


def base(table: OpTable) -> None:
    """The `base` kind: the built-in ops alone (flows of @op functions)."""


def kinds() -> tuple[str, ...]:
    """The installed kinds, by name."""
    return tuple(sorted({entry.name for entry in installed_entries(GROUP)}))


def op_table(kind: str) -> OpTable:
    table = builtin_ops()
    found = {entry.name: entry for entry in installed_entries(GROUP)}
    if kind not in found:
        raise ValueError(f"unknown executor kind {kind!r}: known are {', '.join(sorted(found))}"
                         " (a kind is an entry of the `flowkit.executors` group; is the package"
                         " that declares it installed?)")
    found[kind].load()(table)
    load_plugin_ops(table)
    return table
