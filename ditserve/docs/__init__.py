"""The generated reference pages: docs/flags.md (from the parsers and flag declarations) and docs/errors.md (from
the error classes). `python scripts/gen_docs.py` writes them; `--check` exits 1 with a diff when the committed
files differ from what the code says (a default-suite test runs it).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
"""The repository's docs/ (this package lives in ditserve/docs/)."""


def generators() -> dict[str, Callable[[], str]]:
    """{file name under docs/: the function that renders it}."""
    from . import error_table, flag_tables

    return {"flags.md": flag_tables.render, "errors.md": error_table.render}


def stale(docs_dir: Path = DOCS_DIR) -> dict[str, str]:
    """{file name: unified diff from the committed file to the generated one} for every file that differs."""
    out: dict[str, str] = {}
    for name, render in generators().items():
        path = docs_dir / name
        committed = path.read_text() if path.is_file() else ""
        generated = render()
        if committed != generated:
            diff = difflib.unified_diff(
                committed.splitlines(keepends=True),
                generated.splitlines(keepends=True),
                f"docs/{name} (committed)",
                f"docs/{name} (generated from the code)",
            )
            out[name] = "".join(diff)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gen_docs.py", description="Write docs/flags.md and docs/errors.md from the code.")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff if a file is stale")
    p.add_argument("--docs-dir", type=Path, default=DOCS_DIR, help="the docs directory (default: the repository's)")
    args = p.parse_args(argv)
    if args.check:
        diffs = stale(args.docs_dir)
        for diff in diffs.values():
            sys.stdout.write(diff)
        if diffs:
            print(f"stale: {', '.join(sorted(diffs))}; run: python scripts/gen_docs.py", file=sys.stderr)
            return 1
        return 0
    for name, render in generators().items():
        path = args.docs_dir / name
        text = render()
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path}")
    return 0
