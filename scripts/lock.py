"""The lock files: every package ditserve installs, pinned with its sha256 hashes.

    python scripts/lock.py            # re-compile after editing pyproject.toml or requirements-torch.txt
    python scripts/lock.py --check    # fail if a lock is stale (scripts/test.sh runs this; offline, stdlib)

Three files, from one universal resolution (every platform, Python >= requires-python) of the project's
dependencies, its `dev` extra, its build backend and the torch / torchvision pins of requirements-torch.txt:

* requirements.lock       what the services run (and the build backend), but the torch stack: everywhere
* requirements-dev.lock   the dev tools on top of it: bootstrap.sh (CI, development)
* requirements-cuda.lock  the torch stack: torch and torchvision as PyPI builds them (CUDA 13.0 on Linux;
                          they run on a CPU too), triton and the CUDA libraries they need: everywhere

Every install (scripts/bootstrap.sh, both images) is `pip install --require-hashes --no-deps` of the locks it
needs, then ditserve itself with `--no-deps --no-build-isolation`, then `pip check`: nothing is resolved at
install time and nothing unhashed is installed.

Compiling needs uv (a pinned dev tool, so `.venv/bin/python scripts/lock.py` finds it) and PyPI. Existing pins
are kept where they still satisfy pyproject.toml (uv's preferences); pass --upgrade to move everything to the
newest releases (note: the torch stack's pins that torch leaves open, triton and nvidia-nvjitlink, are the
versions whose wheels CI's machine keeps on local disk, where pip finds them with the same hashes; --upgrade
may move them to newer ones that pip then downloads). Each lock's header records a digest of the inputs; --check recomputes it and also checks
that every pin satisfies pyproject.toml, so CI fails on a lock that pyproject.toml has moved away from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # pragma: no cover - requires-python is >= 3.11
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = REPO / "pyproject.toml"
TORCH_PIN = REPO / "requirements-torch.txt"
RUNTIME_LOCK = REPO / "requirements.lock"
DEV_LOCK = REPO / "requirements-dev.lock"
CUDA_LOCK = REPO / "requirements-cuda.lock"
LOCKS = (RUNTIME_LOCK, DEV_LOCK, CUDA_LOCK)
INDEX = "https://pypi.org/simple"
UV_VERSION = "0.13.8"  # = the dev extra's pin
# bump when the way the locks are made changes, so --check asks for a re-lock
SCHEME = 2
# the torch stack (torch, torchvision, torchaudio and what only their CUDA wheels need): requirements-cuda.lock only
TORCH_STACK = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")
DIGEST_LINE = re.compile(r"^# input-sha256: ([0-9a-f]{64})$", re.M)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_requirements() -> list[str]:
    lines = [ln.split("#", 1)[0].strip() for ln in TORCH_PIN.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("-")]


def input_digest() -> str:
    """sha256 of what the locks are compiled from (parsed, so comments and formatting do not count)."""
    data = tomllib.loads(PYPROJECT.read_text())
    project = data["project"]
    inputs = {
        "scheme": SCHEME,
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
        "build-system": data.get("build-system", {}).get("requires", []),
        "torch": torch_requirements(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- parsing a lock
def blocks(text: str) -> dict[str, list[str]]:
    """uv's output split per package: canonical name -> the lines of its entries (a universal lock may
    hold one entry per marker fork)."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name = canonical(re.split(r"[=<>!~; \[]", line, maxsplit=1)[0])
            current = out.setdefault(name, [])
        if current is not None:
            current.append(line)
    return out


def pins(text: str) -> dict[str, list[tuple[str, str]]]:
    """canonical name -> [(version, marker)] of a lock's entries."""
    out: dict[str, list[tuple[str, str]]] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ ;\\]+)\s*(?:;\s*([^\\]*?))?\s*\\?$", line)
        if m:
            out.setdefault(canonical(m.group(1)), []).append((m.group(2), (m.group(3) or "").strip()))
    return out


# ----------------------------------------------------------------------------- --check
def check() -> list[str]:
    problems: list[str] = []
    want = input_digest()
    for lock in LOCKS:
        if not lock.exists():
            problems.append(f"{lock.name} is missing")
            continue
        m = DIGEST_LINE.search(lock.read_text())
        if not m:
            problems.append(f"{lock.name} has no '# input-sha256:' header line")
        elif m.group(1) != want:
            problems.append(
                f"{lock.name} is stale: pyproject.toml's dependencies (or requirements-torch.txt's pins) "
                "changed since it was compiled"
            )
    if problems:
        return problems
    # the digest matches; the pins must also satisfy what pyproject.toml asks (a hand-edited lock)
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - packaging is in requirements.lock
        return problems
    locked: dict[str, list[tuple[str, str]]] = {}
    for lock in LOCKS:
        for name, entries in pins(lock.read_text()).items():
            locked.setdefault(name, []).extend(entries)
    data = tomllib.loads(PYPROJECT.read_text())["project"]
    reqs = [
        *(
            (r, PYPROJECT.name)
            for r in [*data.get("dependencies", []), *data.get("optional-dependencies", {}).get("dev", [])]
        ),
        *((r, TORCH_PIN.name) for r in torch_requirements()),
    ]
    for text, source in reqs:
        req = Requirement(text)
        name = canonical(req.name)
        if name not in locked:
            problems.append(f"{req.name} ({text!r} in {source}) is in no lock file")
            continue
        for version, marker in locked[name]:
            if not req.specifier.contains(version, prereleases=True):
                where = f" ; {marker}" if marker else ""
                problems.append(f"{req.name}=={version}{where} is locked but {source} asks {text!r}")
        # a requirement of the services must be in a lock the images install: the torch stack in
        # requirements-cuda.lock, the rest in requirements.lock
        if text in data.get("optional-dependencies", {}).get("dev", []):
            continue
        home = CUDA_LOCK if TORCH_STACK.match(name) else RUNTIME_LOCK
        if name not in pins(home.read_text()):
            problems.append(f"{req.name} is a runtime dependency but not in {home.name}")
    return problems


# ----------------------------------------------------------------------------- compile
def find_uv(explicit: str | None) -> str:
    for cand in (explicit, str(Path(sys.executable).parent / "uv"), shutil.which("uv")):
        if cand and Path(cand).is_file():
            version = subprocess.run([cand, "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
            if version != UV_VERSION:
                print(f"note: {cand} is uv {version}; the locks were made with uv {UV_VERSION}", file=sys.stderr)
            return cand
    sys.exit(f"uv not found: install the dev tools (scripts/bootstrap.sh) or `pip install uv=={UV_VERSION}`")


def uv_compile(uv: str, out: Path, *args: str) -> None:
    cmd = [
        uv, "pip", "compile", "--no-config", "--quiet", "--universal", "--no-header",
        "--index-url", INDEX, "-o", str(out), *args,
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True)


def header(title: str, digest: str, install: str) -> str:
    return (
        f"# {title}\n"
        f"# Made by `python scripts/lock.py` (uv {UV_VERSION}, universal, PyPI) from pyproject.toml and\n"
        f"# requirements-torch.txt; do not edit by hand. Install with: {install}\n"
        f"# input-sha256: {digest}\n"
    )


def compile_locks(uv: str, upgrade: bool) -> None:
    digest = input_digest()
    build = tomllib.loads(PYPROJECT.read_text()).get("build-system", {}).get("requires", [])
    with tempfile.TemporaryDirectory(prefix="ditserve-lock-") as tmp:
        t = Path(tmp)
        (t / "build.in").write_text("".join(f"{r}\n" for r in build))
        (t / "torch.txt").write_text("".join(f"{r}\n" for r in torch_requirements()))
        full = t / "full.txt"
        if not upgrade:  # uv prefers the pins already in its output file
            full.write_text("".join(p.read_text() for p in LOCKS if p.exists()))
        # 1. everything: the project with its dev extra, the build backend, torch and torchvision at their pins
        uv_compile(uv, full, "pyproject.toml", str(t / "build.in"), "--extra", "dev", "-c", str(t / "torch.txt"),
                   "--generate-hashes", "--no-annotate")  # fmt: skip
        everything = blocks(full.read_text())
        pinned = t / "pinned.txt"
        pinned.write_text("".join(ln + "\n" for b in everything.values() for ln in b if not ln[0].isspace()))
        pinned.write_text(pinned.read_text().replace(" \\\n", "\n"))
        # 2. which of them the services (and the build) need: the same pins, without the dev extra
        runtime = t / "runtime.txt"
        uv_compile(uv, runtime, "pyproject.toml", str(t / "build.in"), "-c", str(pinned), "--no-annotate")
        runtime_names = set(pins(runtime.read_text()))
        parts: dict[Path, list[str]] = {RUNTIME_LOCK: [], DEV_LOCK: [], CUDA_LOCK: []}
        for name in sorted(everything):
            if name == "ditserve":
                continue
            dest = CUDA_LOCK if TORCH_STACK.match(name) else RUNTIME_LOCK if name in runtime_names else DEV_LOCK
            parts[dest].extend(everything[name])
    texts = {
        RUNTIME_LOCK: header(
            "What ditserve's services run, and its build backend (every platform), but the torch stack (requirements-cuda.lock).",
            digest,
            "pip install --require-hashes --no-deps -r requirements.lock -r requirements-cuda.lock",
        ),
        DEV_LOCK: header(
            "The dev tools and what they need, on top of requirements.lock.",
            digest,
            "pip install --require-hashes --no-deps -r requirements.lock -r requirements-dev.lock -r requirements-cuda.lock",
        ),
        CUDA_LOCK: header(
            "The torch stack: torch, torchvision and torchaudio at requirements-torch.txt's pins as PyPI builds them (CUDA; they run on a CPU too), and the CUDA libraries they need.",
            digest,
            "pip install --require-hashes --no-deps -r requirements.lock -r requirements-cuda.lock",
        ),
    }
    for path, lines in parts.items():
        path.write_text(texts[path] + "".join(ln + "\n" for ln in lines))
        print(f"wrote {path.relative_to(REPO)} ({len(blocks(path.read_text()))} packages)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the locks are current (offline)")
    parser.add_argument("--upgrade", action="store_true", help="ignore the current pins: newest releases")
    parser.add_argument("--uv", help="the uv executable (default: beside this Python, then PATH)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(f"lock check: {p}", file=sys.stderr)
        if problems:
            print(
                "lock check: re-compile with `.venv/bin/python scripts/lock.py` and commit the lock files",
                file=sys.stderr,
            )
            return 1
        print("lock check: requirements.lock, requirements-dev.lock, requirements-cuda.lock are current")
        return 0
    compile_locks(find_uv(args.uv), args.upgrade)
    return 0


if __name__ == "__main__":
    sys.exit(main())
