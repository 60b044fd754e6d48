"""Writes docs/records.md, the reference of the records a flow's ops pass along (Prompt,
Rollout, Scored, Experience), from flowkit/ops/records.py: each class's docstring and a table
of its fields, each with the docstring under it. tests/test_records_page.py fails when the
page is not what this writes, so edit the docstrings and run

    python tools/records_page.py

Plain file reading (ast): nothing is imported.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "flowkit" / "ops" / "records.py"
PAGE = ROOT / "docs" / "records.md"
CLASSES = ("Prompt", "Rollout", "Scored", "Experience")
_NOTE = re.compile(r"\s*\[Note: [^\]]*\]")  # pointers for the code's readers, not the page's

_INTRO = """\
# The records

What a flow's ops pass each other in an RL step, in `flowkit.ops.records`: a prompt source
yields `Prompt`s, generation turns each into `Rollout`s (n samples a prompt), a reward op
turns each `Rollout` into a `Scored`, and the advantage estimators turn `Scored` records into
the `Experience`s that training consumes. Each is a frozen attrs class taking keyword
arguments. `Scored` is a `Rollout` with more fields and `Experience` a `Scored` with more, so a
reward op builds its `Scored` from the rollout's fields and the reward
([Your own task](your-own-task.md)):

```python
return Scored(**attrs.asdict(rollout, recurse=False), reward=reward)
```

Per-token fields are plain lists, one entry per response token, so records stay free of torch.
This page is written by `python tools/records_page.py` from the docstrings in
`flowkit/ops/records.py`; a test fails when it is out of date.
"""


def _fields(node: ast.ClassDef) -> list[tuple[str, str, str, str]]:
    """(name, type, default, docstring) of each annotated field, in order."""
    fields, body = [], node.body
    for index, statement in enumerate(body):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        after = body[index + 1] if index + 1 < len(body) else None
        doc = (after.value.value if isinstance(after, ast.Expr)
               and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
               else "")
        fields.append((statement.target.id, ast.unparse(statement.annotation),
                       _default(statement.value), _prose(doc)))
    return fields


def _prose(docstring: str) -> str:
    return _NOTE.sub("", " ".join(inspect.cleandoc(docstring).split()))


def _default(value: ast.expr | None) -> str:
    if value is None:
        return "required"
    if isinstance(value, ast.Call) and any(k.arg == "factory" for k in value.keywords):
        factory = next(k.value for k in value.keywords if k.arg == "factory")
        return {"list": "`[]`", "dict": "`{}`"}.get(ast.unparse(factory), ast.unparse(factory))
    return f"`{ast.unparse(value)}`"


def _section(node: ast.ClassDef) -> str:
    bases = [ast.unparse(base) for base in node.bases]
    doc = _prose(ast.get_docstring(node) or "")
    lines = [f"## {node.name}", "", doc, ""]
    if bases:
        lines += [f"Every field of [{bases[0]}](#{bases[0].lower()}), and:", ""]
    lines += ["| field | type | default | what it holds |", "|---|---|---|---|"]
    lines += [f"| `{name}` | `{kind}` | {default} | {doc} |"
              for name, kind, default, doc in _fields(node)]
    return "\n".join(lines) + "\n"


def page() -> str:
    """The page's text, from the source as it is now."""
    classes = {node.name: node for node in ast.parse(SOURCE.read_text(encoding="utf-8")).body
               if isinstance(node, ast.ClassDef)}
    return "\n".join([_INTRO, *(_section(classes[name]) for name in CLASSES)])


if __name__ == "__main__":
    PAGE.write_text(page(), encoding="utf-8")
    sys.stdout.write(f"wrote {PAGE.relative_to(ROOT)}\n")
