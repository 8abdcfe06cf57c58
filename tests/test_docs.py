"""The README and docs/ hold together: every relative link resolves (file and, for Markdown,
heading), and docs/flags.md is the `expresslane serve` flag list the config tree makes today.

Regenerate docs/flags.md after changing a flag: `python tests/test_docs.py`."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS_MD = REPO / "docs" / "flags.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def broken_links() -> list[str]:
    broken = []
    for page in _markdown_files():
        text = page.read_text()
        for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    return broken


def test_every_relative_link_in_readme_and_docs_resolves():
    assert not broken_links(), "\n".join(broken_links())


def _serve_parser() -> argparse.ArgumentParser:
    from expresslane.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _render_flags() -> str:
    parser = _serve_parser()
    formatter = parser._get_formatter()
    lines = ["# `expresslane serve` flags", "",
             "Generated from the config tree (`expresslane/config/`) by `python tests/test_docs.py`;",
             "`tests/test_docs.py` checks it is current. `expresslane serve --help` prints the same.",
             "`expresslane generate` takes the engine's flags too; `expresslane --log-level LEVEL` goes",
             "before the command.", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                   and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| flag | meaning |", "| --- | --- |"]
        for action in actions:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.choices:
                name += " `{" + ",".join(map(str, action.choices)) + "}`"
            elif action.metavar:
                name += f" `{action.metavar}`"
            text = " ".join(formatter._expand_help(action).split()).replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")
            lines.append(f"| {name} | {text} |")
        lines.append("")
    return "\n".join(lines)


def flags_markdown() -> str:
    """The page as a fresh process without the test suite's environment renders it (a default may
    come from the environment: tests/conftest.py sets $EXPRESSLANE_STEP_COST_MODEL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXPRESSLANE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, __file__, "--print"], env=env, capture_output=True, text=True,
                          check=True).stdout


def test_flags_md_is_current():
    assert FLAGS_MD.read_text() == flags_markdown(), "docs/flags.md is stale: run `python tests/test_docs.py`"


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if sys.argv[1:] == ["--print"]:
        sys.stdout.write(_render_flags())
    else:
        FLAGS_MD.write_text(flags_markdown())
        print(f"wrote {FLAGS_MD.relative_to(REPO)}")
