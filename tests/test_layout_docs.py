"""The layout the docs describe is the tree: every module and package that docs/development.md#layout or the README's
layout table names exists, and every module of the five packages is named in docs/development.md#layout (so a module
added, moved or removed without its line there fails here). "Job" names one class, the durable record's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from servicekit import REPO_ROOT

PACKAGES = ("ditserve", "generator_service", "plancache_service", "ditruntime", "ditcore")
PATH = re.compile(r"`((?:" + "|".join(PACKAGES) + r"|protos|tests|docs|scripts)(?:/[\w.-]+)*/?)`")


def section(doc: Path, heading: str) -> str:
    """The text of `## heading` in `doc` (up to the next `## `)."""
    text = doc.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def named(text: str) -> set[str]:
    """The repository paths a text names in backticks (`generator_service/execution/queue.py`, `ditserve/openai/`)."""
    return {m.rstrip("/") for m in PATH.findall(text)}


def tree_modules() -> set[str]:
    """Every module and subpackage of the five packages, as repository paths (no __init__ / __main__ modules)."""
    found: set[str] = set()
    for pkg in PACKAGES:
        for path in (REPO_ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(REPO_ROOT)
            if path.name == "__init__.py":
                if path.parent != REPO_ROOT / pkg:
                    found.add(rel.parent.as_posix())
            elif path.name != "__main__.py":
                found.add(rel.as_posix())
    return found


DEV_LAYOUT = section(REPO_ROOT / "docs" / "development.md", "Layout")
README_LAYOUT = section(REPO_ROOT / "README.md", "Layout")


@pytest.mark.parametrize("where", ["docs/development.md#layout", "README.md#layout"])
def test_every_path_the_layout_names_exists(where: str) -> None:
    text = DEV_LAYOUT if where.startswith("docs") else README_LAYOUT
    paths = named(text)
    assert len(paths) >= 6, f"{where} names no paths in backticks"
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists())
    assert not missing, f"{where} names paths that are not in the tree: {missing}"


def test_every_module_of_the_tree_is_in_the_development_layout() -> None:
    unnamed = sorted(tree_modules() - named(DEV_LAYOUT))
    assert not unnamed, f"docs/development.md#layout does not say what these own: {unnamed}"


def test_the_readme_names_every_package_and_every_generator_subpackage() -> None:
    subpackages = {
        p.parent.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "generator_service").glob("*/__init__.py")
    }
    assert subpackages >= {f"generator_service/{s}" for s in ("serving", "jobs", "execution", "replica", "backends")}
    unnamed = sorted(({*PACKAGES, "protos"} | subpackages) - named(README_LAYOUT))
    assert not unnamed, f"the README's layout table misses {unnamed}"


def test_the_layout_check_catches_a_missing_module(tmp_path: Path) -> None:
    assert named("`generator_service/execution/queue.py` and `ditserve/openai/`") == {
        "generator_service/execution/queue.py", "ditserve/openai",
    }  # fmt: skip
    assert "generator_service/execution/queue.py" in tree_modules()
    assert "generator_service/execution" in tree_modules() and "generator_service" not in tree_modules()


def test_job_names_one_class_the_durable_record() -> None:
    classes = [
        f"{path.relative_to(REPO_ROOT)}:{n}"
        for pkg in (*PACKAGES, "tests", "scripts")
        for path in (REPO_ROOT / pkg).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*class Job\b", line)
    ]
    assert [c.split(":")[0] for c in classes] == ["generator_service/jobs/schema.py"], classes
