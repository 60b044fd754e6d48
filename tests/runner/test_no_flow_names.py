"""The generic runtime names no op, loss or config key of a flow library: what it needs to know
of an op is declared on the op class (ModelOp.resumable, ModelOp.loss_spec, ...) and reaches
the runner through the lowering's NodePlan. Prose in comments and docstrings may mention the
names; code may not: every string constant, keyword argument and identifier of flowkit/runtime
and flowkit/runner is checked."""

from __future__ import annotations

import ast
from pathlib import Path

import dataflows.model_ops as declared_ops
from flowkit.dsl import ModelOp
from flowkit.ops import LOSS_KNOBS, LOSSES, LOWERED_OPS

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("flowkit/runtime", "flowkit/runner")

# what the issue names, so the check never passes only because a declaration went away
NAMED = {"generate", "generation", "logprobs", "take", "stale_segments", "min_version",
         "decoupled", "loss", "grpo", "ppo"}
# the flow library's tables in flowkit.ops: importing one is naming what it lists
TABLES = {"LOSSES", "LOSS_KNOBS", "SUM_FORM_LOSSES", "PROXIMAL_LOSSES", "LOSS_SPEC",
          "KL_KINDS", "KL_ALIASES", "STALE_SEGMENTS", "POLICY_LOSSES"}


def _declared_op_classes() -> list[type[ModelOp]]:
    return [value for value in vars(declared_ops).values()
            if isinstance(value, type) and issubclass(value, ModelOp) and value is not ModelOp]


def _flow_names() -> set[str]:
    """The executor ops the ready-made flows' ops run as (not those the engine lowers them
    to), the ops that abort them, the losses and the config keys the runtime is told of."""
    lowered = {name for names in LOWERED_OPS.values() for name in names}
    names = set(NAMED) | set(LOSSES) | set(LOSS_KNOBS)
    for cls in _declared_op_classes():
        if cls.lowering is None and cls.executor_op not in lowered:
            names.add(cls.executor_op)
        if cls.resumable is not None:  # not its `request`: the wire's fetches say it too
            names |= {cls.resumable.take, cls.resumable.version_floor, cls.resumable.abort_op}
        if cls.loss_spec is not None:
            names |= {cls.loss_spec.key, cls.loss_spec.proximal_knob, *cls.loss_spec.names}
    return names - {None}


def _hits(path: Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and (body := node.body) and isinstance(body[0], ast.Expr)
                  and isinstance(body[0].value, ast.Constant)}
    where = path.relative_to(ROOT)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings and node.value in names:
            hits.append(f"{where}:{node.lineno}: the string {node.value!r}")
        elif isinstance(node, ast.keyword) and node.arg in names:
            hits.append(f"{where}:{node.lineno}: the keyword {node.arg}=")
        elif isinstance(node, ast.Name) and node.id in TABLES:
            hits.append(f"{where}:{node.lineno}: the name {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in TABLES:
            hits.append(f"{where}:{node.lineno}: the name .{node.attr}")
        elif isinstance(node, ast.alias) and node.name in TABLES:
            hits.append(f"{where}:{node.lineno}: the import of {node.name}")
    return hits


def test_the_flow_names_are_known():
    names = _flow_names()
    assert {"generate", "generation", "min_version", "take", "decoupled", "loss",
            "grpo", "ppo"} <= names


def test_the_runtime_and_the_runner_name_no_op_loss_or_key_of_a_flow_library():
    names = _flow_names()
    files = sorted(p for folder in CHECKED for p in (ROOT / folder).rglob("*.py"))
    assert files
    hits = [hit for path in files for hit in _hits(path, names)]
    assert not hits, ("the runtime names what a flow library declares; read it from the "
                      "NodePlan instead:\n" + "\n".join(hits))
