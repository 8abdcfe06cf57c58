"""Comments say what and why, not when (issue #40): the engine, runner and scheduler carry at most
100 words of comment per 100 lines of code, and no comment or docstring in the package holds a
date, a past run, a GPU measurement or a document that is not in the repository."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import expresslane

PACKAGE = Path(expresslane.__file__).parent
REPO = PACKAGE.parent


def comments(src: str) -> list[tuple[int, str, str]]:
    """(line, text, the code before it on its line) of every # comment and docstring."""
    lines = src.splitlines()
    out = [(t.start[0], t.string.lstrip("#"), lines[t.start[0] - 1][:t.start[1]])
           for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc, ""))
    return out


def docstring_lines(src: str) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if ast.get_docstring(node, clean=False) is not None:
                lines |= set(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return lines


def density(package: Path) -> tuple[int, int]:
    """(words of docstrings and # comments, lines of code) over a package's files."""
    words = code = 0
    for path in package.rglob("*.py"):
        src = path.read_text()
        words += sum(len(text.split()) for _, text, _ in comments(src))
        docs = docstring_lines(src)
        code += sum(1 for i, line in enumerate(src.splitlines(), 1)
                    if line.strip() and not line.strip().startswith("#") and i not in docs)
    return words, code


@pytest.mark.parametrize("package", ["engine", "runner", "scheduler"])
def test_at_most_100_words_of_comment_per_100_lines_of_code(package):
    words, code = density(PACKAGE / package)
    assert words <= code, f"expresslane/{package}: {100 * words / code:.0f} words per 100 lines"


def test_the_density_counts_docstrings_and_comments_not_code():
    src = '"""One two."""\n\n\ndef f():\n    """Three."""\n    return 1  # four five\n'
    assert sum(len(t.split()) for _, t, _ in comments(src)) == 5
    assert docstring_lines(src) == {1, 5}


GPU = re.compile(r"\b(?:A100|H100|H200|GH200|B200|L40S?)\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
PAST_RUN = re.compile(r"\bsession \d+\b|\b(?:main|commit) [0-9a-f]{7,40}\b")
MISSING_DOC = re.compile(r"\bDESIGN\b")  # "DESIGN §5": a document the repository never had
CITED = re.compile(r"\b((?:docs|benchmarks|tests|expresslane)/[\w./-]+\.(?:md|py|json|sh))\b")


def findings(src: str, name: str) -> list[str]:
    found = []
    for line, text, code in comments(src):
        where = f"{name}:{line}"
        found += [f"{where}: date {m}" for m in DATE.findall(text)]
        found += [f"{where}: past run {m!r}" for m in PAST_RUN.findall(text)]
        found += [f"{where}: cites {m!r}" for m in MISSING_DOC.findall(text)]
        found += [f"{where}: cites {m}, not in the repository" for m in CITED.findall(" ".join(text.split()))
                  if not (REPO / m).exists()]
        # a GPU named in prose is a measurement's; a constant named after one (H200_PEAK_FLOPS) may say its unit
        found += [f"{where}: GPU {m}" for m in GPU.findall(text) if m not in code]
    return found


def test_no_comment_holds_a_date_a_past_run_a_gpu_measurement_or_a_missing_document():
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in findings(path.read_text(), path.relative_to(REPO))]
    assert not found, "\n".join(found)


def test_the_checks_see_what_they_look_for():
    found = " | ".join(findings('"""Measured on the H200 (2026-12-01, session 13); DESIGN §5."""\n'
                                'H200_PEAK_FLOPS = 805e12  # FLOP/s: bf16 matmul on one H200\n'
                                'x = 1  # docs/architecture.md holds it; docs/nowhere.md does not\n'
                                'HELP = "runs on an H100 or an H200"\n', "probe.py"))
    for what in ("GPU H200", "date 2026-12-01", "past run 'session 13'", "cites 'DESIGN'", "docs/nowhere.md"):
        assert what in found, (what, found)
    assert found.count("GPU") == 1 and "architecture.md" not in found
