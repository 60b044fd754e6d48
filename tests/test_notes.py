"""Notes hold: every `[Note: X]` reference names a note that exists, and a note stays short.

A note is a named comment block explaining an invariant that spans files. It is defined where a
comment or docstring line starts with `[Note: X]` followed by its text; other places refer to it
with `[Note: X]`, `[Note: X in path/file.py]` or `[Note: X] in path/file.py`, and a reference
that names a file must find the note in that file (or under that folder). Plain file reading:
nothing is imported."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("flowkit", "executors", "dataflows", "benchmarks", "tests", "examples")
NOTE_MAX_LINES = 15
_OPEN = "[Note: "
# what may stand before a definition's tag on its line: a comment's or a docstring's opening
_DEFINITION_LEAD = re.compile(r'^\s*(#\s*|[rbuRBU]?("""|\'\'\'))?\s*$')
# `X in path`: the last " in " followed by something that reads as a path
_IN_PATH = re.compile(r"^(?P<name>.+?) in `?(?P<path>[\w./-]*(/|\.py\b)[\w./-]*)`?$")
# `[Note: X] in path` after the tag
_AFTER_IN_PATH = re.compile(r"^\s+in\s+`?(?P<path>[\w./-]*(/|\.py\b)[\w./-]*?)`?(?=[\s:;,.)]|$)")
# a definition's text goes on after its tag on the same line, in words
_DEFINITION_TEXT = re.compile(r" (?!in )[\w`'\"]")
_CONTINUATION = re.compile(r"\s*\n\s*(#\s*)?")


@dataclass(frozen=True)
class Tag:
    file: Path
    line: int
    name: str
    path: str | None  # the file or folder the reference names, as written
    definition: bool

    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def source_files() -> list[Path]:
    files = [path for folder in CODE_DIRS for path in sorted((ROOT / folder).rglob("*.py"))
             if path != Path(__file__).resolve()]  # this file writes tags about tags
    # the performance log is a dated record: its references name the code as it was then
    return files + [path for path in sorted((ROOT / "docs").rglob("*.md"))
                    if path.name != "performance-log.md"]


def tags_in(file: Path, text: str | None = None) -> list[Tag]:
    """The note tags of one file, definitions and references, in order. A tag may be broken
    over lines of a comment or a docstring. Under tests/ and docs/ every tag is a reference:
    a test's docstring that opens with the note it checks does not define it."""
    text = file.read_text(encoding="utf-8") if text is None else text
    rel = file.relative_to(ROOT).parts
    may_define = file.suffix == ".py" and rel[0] != "tests"
    found = []
    start = text.find(_OPEN)
    while start >= 0:
        end = text.find("]", start)
        inner = text[start + len(_OPEN):end] if end >= 0 else ""
        if end < 0 or "[" in inner or len(inner) > 200:  # not a tag: prose about the syntax
            start = text.find(_OPEN, start + 1)
            continue
        name = _CONTINUATION.sub(" ", inner).strip()
        after = _CONTINUATION.sub(" ", text[end + 1:end + 200])
        line_end = text.find("\n", end)
        rest_of_line = text[end + 1:line_end if line_end >= 0 else len(text)]
        line_start = text.rfind("\n", 0, start) + 1
        path = None
        named = _IN_PATH.match(name)
        if named:
            name, path = named["name"], named["path"]
        else:
            trailing = _AFTER_IN_PATH.match(after)
            if trailing:
                path = trailing["path"]
        definition = (may_define and path is None
                      and bool(_DEFINITION_LEAD.match(text[line_start:start]))
                      and bool(_DEFINITION_TEXT.match(rest_of_line)))
        found.append(Tag(file, text.count("\n", 0, start) + 1, name, path, definition))
        start = text.find(_OPEN, end)
    return found


def note_lengths(file: Path, text: str | None = None) -> dict[int, int]:
    """Each note defined in `file`, by the line of its tag: its lines, from its tag to the end of
    its comment block or its docstring, or to the next note's tag."""
    text = file.read_text(encoding="utf-8") if text is None else text
    lines = text.splitlines()
    tags = tags_in(file, text)
    starts = {tag.line for tag in tags if tag.definition}
    lengths = {}
    for tag in tags:
        if not tag.definition:
            continue
        first = lines[tag.line - 1].strip()
        comment = first.startswith("#")
        quotes = first.count('"""') + first.count("'''")
        count = 1
        if not comment and quotes % 2 == 0 and quotes:  # a one-line docstring
            lengths[tag.line] = 1
            continue
        for number, line in enumerate(lines[tag.line:], start=tag.line + 1):
            stripped = line.strip()
            if (number in starts or (comment and not stripped.startswith("#"))
                    or stripped in ('"""', "'''")):
                break
            count += 1
            if not comment and ('"""' in stripped or "'''" in stripped):
                break
        lengths[tag.line] = count
    return lengths


def _definitions() -> dict[str, set[Path]]:
    notes: dict[str, set[Path]] = {}
    for file in source_files():
        for tag in tags_in(file):
            if tag.definition:
                notes.setdefault(tag.name, set()).add(file)
    return notes


def _resolve(path: str, referrer: Path) -> list[Path]:
    """The files a reference's path names: from the repository root, or from the referrer's
    folder or one above it (`wire/hello.py` from inside flowkit/); a folder names every file
    under it."""
    for base in (ROOT, *referrer.parents):
        if ROOT not in (base, *base.parents):
            break
        target = (base / path.rstrip("./")).resolve()
        if target.is_file():
            return [target]
        if target.is_dir():
            return sorted(target.rglob("*.py"))
    return []


def dangling_references() -> list[str]:
    notes = _definitions()
    problems = []
    for file in source_files():
        for tag in tags_in(file):
            if tag.definition:
                continue
            homes = notes.get(tag.name, set())
            if not homes:
                problems.append(f"{tag.where()}: [Note: {tag.name}] is defined nowhere")
                continue
            if tag.path is None:
                continue
            targets = _resolve(tag.path, file)
            if not targets:
                problems.append(f"{tag.where()}: [Note: {tag.name}] names {tag.path}, which does "
                                f"not exist; the note is in {_listed(homes)}")
            elif not homes & set(targets):
                problems.append(f"{tag.where()}: [Note: {tag.name}] is not in {tag.path} but in "
                                f"{_listed(homes)}")
    return problems


def _listed(files: set[Path]) -> str:
    return ", ".join(sorted(str(f.relative_to(ROOT)) for f in files))


def long_notes(limit: int = NOTE_MAX_LINES) -> list[tuple[str, str, int]]:
    """(file:line, name, lines) of each note over `limit` lines."""
    over = []
    for file in source_files():
        if file.suffix != ".py":
            continue
        lines_of = note_lengths(file)
        for tag in tags_in(file):
            if tag.definition and lines_of[tag.line] > limit:
                over.append((tag.where(), tag.name, lines_of[tag.line]))
    return over


def test_every_note_reference_names_a_note():
    problems = dangling_references()
    assert not problems, (f"{len(problems)} note reference(s) point nowhere: fix the name or the "
                          "path (a note is defined by a comment or docstring line that starts with "
                          "`[Note: NAME]` and its text)\n" + "\n".join(problems))


def test_notes_stay_short():
    problems = [f"{where}: [Note: {name}] has {lines} lines, more than {NOTE_MAX_LINES}: say what, "
                "why and the number with its command; move a design to a page of docs/ and point "
                "to it" for where, name, lines in long_notes()]
    assert not problems, "\n".join(problems)


if __name__ == "__main__":  # the dangling references and the long notes, as the tests see them
    for problem in dangling_references():
        print(problem)
    for where, name, lines in sorted(long_notes(), key=lambda row: -row[2]):
        print(f"{lines:4d}  {where}  {name}")
