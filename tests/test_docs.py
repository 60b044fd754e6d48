"""The README is a front door and the rest is the docs site: the site builds with `mkdocs build
--strict` (a broken link, a missing page or a docstring mkdocstrings cannot render fails it),
and the README stays short and links only to files that exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250

# [text](target) and ![alt](target); a target ends at whitespace (a title may follow) or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[^)]*)?\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def test_site_builds_strictly(tmp_path):
    # Material prints a banner about MkDocs 2.0 on every build; it is no warning of ours
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = built.stdout + built.stderr
    assert built.returncode == 0, output
    assert "WARNING" not in output, output
    for page in ("index.html", "performance/index.html", "api/runtime/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it at most {README_MAX_LINES} and move the "
        "rest to a page under docs/")


def readme_links() -> list[str]:
    """The link targets of README.md outside fenced code blocks."""
    targets, fenced = [], False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            targets += LINK.findall(line)
    return targets


def test_readme_relative_links_point_to_files():
    relative = [t for t in readme_links() if not EXTERNAL.match(t) and not t.startswith("#")]
    assert relative, "README.md links to no page of docs/"
    missing = [t for t in relative if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to paths that do not exist: {missing}"


def test_link_pattern_finds_targets_and_ignores_titles():
    line = 'See [the docs](docs/index.md#top "Docs") and ![plot](docs/figures/a.svg).'
    assert LINK.findall(line) == ["docs/index.md#top", "docs/figures/a.svg"]
