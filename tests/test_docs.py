"""Docstring examples, and the code blocks of README.md and docs/*.md, run as written.

* Every docstring example of every module of `qcollect` and `transforms` runs
  (doctest).
* Every ```python block of README.md and of each docs/*.md runs, in a fresh
  namespace, unless its first line is ``# continued``: then it runs in the
  namespace of the previous block of the same file. Blocks that are not meant
  to run use another fence language (```text, ```bash). Every fence names its
  language, so no block is skipped by accident.
* Relative links (files and ``#anchors``) of those pages resolve.
* Every measured table row of docs/compressors.md, docs/collectives.md and
  docs/multiprocess.md also appears, character for character, in
  docs/benchmarks.md, which collects every measured table.
"""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import qcollect
import transforms

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
MODULES = sorted(m.name for package in (qcollect, transforms)
                 for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
                 if not m.name.endswith("__main__"))
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
CONTINUED = "# continued"


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def fenced_blocks(text: str):
    """``(language, first line number of the code, code)`` for every fence."""
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start(2)) + 1
        yield match.group(1), line, match.group(2)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def _chains():
    """Each Python block with the ``# continued`` blocks that follow it, per page."""
    chains = []
    for page in PAGES:
        for language, line, code in fenced_blocks(page.read_text()):
            if language != "python":
                continue
            if code.startswith(CONTINUED) and chains and chains[-1][0] == page:
                chains[-1][1].append((line, code))
            else:
                chains.append((page, [(line, code)]))
    return chains


CHAINS = _chains()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_fences_name_their_language(page):
    text = page.read_text()
    for language, line, code in fenced_blocks(text):
        assert language, f"{_name(page)}:{line - 1}: a fence without a language"
        if language == "python" and code.startswith(CONTINUED):
            previous = [c for lang, n, c in fenced_blocks(text) if lang == "python" and n < line]
            assert previous, f"{_name(page)}:{line}: '{CONTINUED}' on the first Python block"


@pytest.mark.parametrize("page, blocks", CHAINS,
                         ids=[f"{_name(page)}:{blocks[0][0]}" for page, blocks in CHAINS])
def test_python_blocks_run(page, blocks):
    namespace = {"__name__": f"docs_block_{blocks[0][0]}"}
    for line, code in blocks:
        # Padding keeps tracebacks pointing at the page's own line numbers.
        exec(compile("\n" * (line - 1) + code, _name(page), "exec"), namespace)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set:
    text = FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page):
    text = FENCE.sub("", page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{_name(page)}: broken link {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{_name(page)}: no heading for {target}"


NUMBER = re.compile(r"[+-]?[\d,]*\d(\.\d+)?(x|%|e[+-]\d+)?")


def _measured_rows(page: pathlib.Path) -> list:
    """The rows of every table with a purely numeric cell (a measured table)."""
    text = FENCE.sub("", page.read_text())
    rows = []
    for table in re.findall(r"(?:^ *\|.*\| *\n)+", text, re.M):
        lines = [line.strip() for line in table.splitlines()]
        cells = [c.strip() for line in lines[2:] for c in line.strip("|").split("|")]
        if any(NUMBER.fullmatch(c) for c in cells):
            rows += lines
    return rows


@pytest.mark.parametrize("name", ["compressors.md", "collectives.md", "multiprocess.md"])
def test_benchmarks_page_holds_every_measured_table(name):
    catalogue = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [row for row in _measured_rows(ROOT / "docs" / name) if row not in catalogue]
    assert not missing, (f"docs/{name} has measured rows that docs/benchmarks.md lacks "
                         f"(add the table there too, with its command): {missing[:3]}")
