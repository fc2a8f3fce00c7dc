"""The code of the README and of the docs pages is cut from the programs in examples/ (which
tests/integration/test_examples.py runs), so that it cannot drift from code that runs.

A block is tied to its file by a comment on the line before it, `<!-- example: examples/F -->`.
It must be the file's lines as they are, or pieces of them in order, with a line `...` (Python)
or `# ...` (shell) where lines are left out; each piece may be shown less indented than in the
file (a loop's body shown on its own). Every Python and bash block of README.md, and of each
docs/*.md page that ties any block to an example (docs/api.md), is tied to a file, and every
file that README.md or a docs page names under examples/ exists."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from tests.helpers import ROOT

README = ROOT / "README.md"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and the docs pages: every markdown file a user reads."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- example: (\S+) -->$")
FENCE = re.compile(r"^```(\w*)$")
CHECKED_LANGUAGES = {"python", "bash"}
ELISIONS = {"...", "# ..."}


def blocks(text: str) -> list[tuple[int, str, str | None, list[str]]]:
    """(line number, language, the file its marker names or None, lines) of each top-level
    fenced block."""
    found = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
        found.append((i + 1, fence.group(1), marker.group(1) if marker else None, lines[i + 1:end]))
        i = end + 1
    return found


def pieces(block: list[str]) -> list[list[str]]:
    """The block cut at its elision lines, each piece without blank lines at its ends."""
    result: list[list[str]] = [[]]
    for line in block:
        if line.strip() in ELISIONS:
            result.append([])
        else:
            result[-1].append(line.rstrip())
    trimmed = []
    for piece in result:
        while piece and not piece[0]:
            piece.pop(0)
        while piece and not piece[-1]:
            piece.pop()
        if piece:
            trimmed.append(piece)
    return trimmed


def dedented(lines: list[str]) -> list[str]:
    return textwrap.dedent("\n".join(lines)).split("\n")


def excerpt_problem(block: list[str], source: list[str]) -> str | None:
    """None when the block is the source's lines, or pieces of them in order; else the first
    piece that is not there."""
    source = [line.rstrip() for line in source]
    at = 0
    for piece in pieces(block):
        want = dedented(piece)
        for start in range(at, len(source) - len(piece) + 1):
            if dedented(source[start:start + len(piece)]) == want:
                at = start + len(piece)
                break
        else:
            return "\n".join(piece)
    return None


def problems(readme: str, root: Path = ROOT, name: str = "README.md", all_tied: bool = True) -> list[str]:
    """What is wrong with the markdown text `readme` (the file `name`): with all_tied, every
    Python and bash block must be tied to an example (README.md, and a docs page that ties
    any); tied blocks must be their file's lines; files named under examples/ must exist."""
    found = []
    for line, language, path, lines in blocks(readme):
        if path is None:
            if all_tied and language in CHECKED_LANGUAGES:
                found.append(f"{name}:{line}: a {language} block tied to no example "
                             "(put `<!-- example: examples/FILE -->` on the line before it)")
            continue
        source = root / path
        if not path.startswith("examples/") or not source.is_file():
            found.append(f"{name}:{line}: {path} is no file of examples/")
            continue
        missing = excerpt_problem(lines, source.read_text().splitlines())
        if missing is not None:
            found.append(f"{name}:{line}: these lines are not in {path} (in this order):\n{missing}")
    for named in sorted(set(re.findall(r"examples/[\w.-]+\.\w+", readme))):
        if not (root / named).is_file():
            found.append(f"{name} names {named}, which does not exist")
    return found


def has_markers(text: str) -> bool:
    return any(MARKER.match(line) for line in text.splitlines())


def test_every_code_block_of_the_readme_and_the_docs_is_cut_from_an_example_that_runs():
    found, tied = [], set()
    for page in pages():
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        found += problems(text, name=name, all_tied=page == README or has_markers(text))
        tied |= {path for _, _, path, _ in blocks(text) if path}
    assert found == []
    assert {"examples/callbacks_agent.py", "examples/journal_agent.py", "examples/socket_agent.sh"} <= tied


def test_the_pages_with_examples_are_checked_whole():
    """The API's page ties its blocks to examples/, so an untied Python block added there
    would be found, as in the README."""
    api = (ROOT / "docs" / "api.md").read_text()
    assert has_markers(api)
    assert problems(api + "\n```python\nimport ckpt\n```\n", name="docs/api.md")[-1].endswith(
        "a python block tied to no example (put `<!-- example: examples/FILE -->` on the line before it)")


def test_the_check_finds_a_block_that_drifted(tmp_path):
    """So that a passing check means something: a changed line, pieces out of order, a block
    tied to nothing, a missing file."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "a.py").write_text("import ckpt\n\n\ndef f():\n    for i in x:\n        g(i)\n")
    good = "<!-- example: examples/a.py -->\n```python\nimport ckpt\n...\nfor i in x:\n    g(i)\n```\n"
    assert problems(good, tmp_path) == []
    assert problems(good.replace("g(i)", "h(i)"), tmp_path)[0].startswith("README.md:2: these lines are not in")
    swapped = "<!-- example: examples/a.py -->\n```python\nfor i in x:\n    g(i)\n...\nimport ckpt\n```\n"
    assert len(problems(swapped, tmp_path)) == 1
    assert problems("```python\nimport ckpt\n```\n", tmp_path) == [
        "README.md:1: a python block tied to no example (put `<!-- example: examples/FILE -->` on the line before it)"]
    assert problems("```console\n# ckpt list\n```\nrun examples/b.py\n", tmp_path) == [
        "README.md names examples/b.py, which does not exist"]
