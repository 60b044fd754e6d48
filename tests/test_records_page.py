"""docs/records.md is the reference of the records a reward op and an advantage estimator
handle: it lists every field of Prompt, Rollout, Scored and Experience, each explained, and is
what tools/records_page.py writes from their docstrings (so it cannot go stale)."""

import importlib.util
import re
from pathlib import Path

import attrs
import pytest

from flowkit.ops.records import Experience, Prompt, Rollout, Scored

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "records.md"


def _generator():
    spec = importlib.util.spec_from_file_location("records_page", ROOT / "tools/records_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_what_the_generator_writes():
    assert PAGE.read_text(encoding="utf-8") == _generator().page(), (
        "docs/records.md is out of date: run `python tools/records_page.py`")


def _rows(section: str) -> dict[str, str]:
    """field -> what it holds, from the table of `## section`."""
    text = PAGE.read_text(encoding="utf-8").split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^\| `(\w+)` \|.*\| ([^|]+) \|$", text, re.MULTILINE)}


@pytest.mark.parametrize("record", [Prompt, Rollout, Scored, Experience])
def test_every_field_is_listed_and_explained(record):
    listed = {}
    for cls in reversed(record.__mro__):  # a subclass's section lists what it adds
        if attrs.has(cls) and cls.__module__ == "flowkit.ops.records":
            listed.update(_rows(cls.__name__))
    fields = [field.name for field in attrs.fields(record)]
    assert sorted(listed) == sorted(fields)
    unexplained = [name for name in fields if len(listed[name].split()) < 3]
    assert not unexplained, f"{record.__name__}: fields without a docstring: {unexplained}"
