"""The Python standard library's own source as a corpus: what the built-in model pair was
trained on (benchmarks/train_pair.py) and what its benchmarks complete.

Every machine with Python has it (PSF-licensed). Files are split by a hash of their path
relative to the stdlib root, so the split is the same on every Python version and machine:
2% of the files are held out (reported losses, benchmarks), 2% are the validation split
(training keeps the weights that do best on it), the rest is training text. Third-party
packages (site-packages) are never part of it.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SPLITS = ("train", "validation", "held-out")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "little") % 1000
    return "held-out" if bucket < 20 else "validation" if bucket < 40 else "train"


def stdlib_files(split: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib .py file in ``split`` (one of SPLITS), sorted by path."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel.split("/") or "dist-packages" in rel.split("/"):
            continue
        if split_of(rel) != split:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
        if text.strip():
            out.append((rel, text))
    return out
