"""Markdown helpers shared by the generated docs and their tests: table cells, GitHub heading anchors, and the
text of a class or a dataclass field's docstring."""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import re
import textwrap
from collections.abc import Iterable, Sequence

_HTML = str.maketrans({"<": "&lt;", ">": "&gt;", "|": "\\|"})
_NOT_WORD = re.compile(r"[^\w\- ]", re.UNICODE)


def cell(text: str) -> str:
    """`text` as one table cell: one line, pipes escaped (inside code spans too, as GitHub tables need), `<...>`
    outside code spans shown rather than taken for HTML (inside them GitHub would print `&lt;` literally)."""
    parts = " ".join(text.split()).split("`")
    return "`".join(p.replace("|", "\\|") if i % 2 else p.translate(_HTML) for i, p in enumerate(parts))


def code(text: str) -> str:
    """`text` as a code span (a table cell's pipes escaped inside it too)."""
    return f"`{text}`".replace("|", "\\|")


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A GitHub table; each row's cells are already rendered."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped but `-` and `_`, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return _NOT_WORD.sub("", text.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a markdown document (repeats numbered `-1`, `-2` as GitHub does); fenced code
    blocks are skipped."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def class_doc(cls: type) -> str:
    """The class's own docstring (not inherited), on one line; empty when it has none."""
    return one_line(inspect.cleandoc(cls.__dict__.get("__doc__") or ""))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: the docstring under it} of a class body, read from its source (Python keeps no field
    docstrings at run time)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for stmt, after in itertools.pairwise(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[stmt.target.id] = one_line(inspect.cleandoc(after.value.value))
    return docs


def field_doc(owner: type, name: str) -> str:
    """The docstring of field `name` as the nearest class in `owner`'s MRO declares it; empty when none does."""
    for klass in owner.__mro__:
        if klass is not object and name in getattr(klass, "__annotations__", {}):
            return field_docs(klass).get(name, "")
    return ""
