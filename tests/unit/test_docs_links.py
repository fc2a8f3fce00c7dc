"""The README is a short user's guide and docs/ holds the rest: every relative link of README.md
and docs/*.md reaches a file (and, with `#anchor`, a heading of it), the README links every
docs page, and it stays short enough to read in ten minutes."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import ROOT

README = ROOT / "README.md"
MAX_README_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    lines, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces
    as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose(path.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    found = []
    for number, line in prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:...
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            name = f"{page.relative_to(root)}:{number}"
            if not where.exists():
                found.append(f"{name}: {target}: no such file")
            elif anchor and (where.suffix != ".md" or anchor not in anchors(where)):
                found.append(f"{name}: {target}: no heading #{anchor} in {where.relative_to(root)}")
    return found


def test_every_relative_link_of_the_readme_and_the_docs_reaches_its_file_and_heading():
    assert [problem for page in pages() for problem in broken_links(page)] == []


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for _, line in prose(README.read_text()) for target in LINK.findall(line)}
    missing = [str(page.relative_to(ROOT)) for page in pages()[1:] if page.resolve() not in linked]
    assert missing == [], f"README.md's 'Where to read more' does not link {missing}"


def test_the_readme_stays_a_short_guide():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines: move details into docs/"


def test_the_check_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    """So that a passing check means something."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Exit codes\n\n## `ckpt run`: supervision\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#exit-codes) [ok](docs/a.md#ckpt-run-supervision) [web](https://criu.org)\n"
        "[gone](docs/b.md) [no anchor](docs/a.md#exit-code)\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md:2: docs/b.md: no such file",
        "README.md:2: docs/a.md#exit-code: no heading #exit-code in docs/a.md"]
    assert anchors(tmp_path / "docs" / "a.md") == {"a-page", "exit-codes", "ckpt-run-supervision"}
