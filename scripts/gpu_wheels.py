"""Fetch, here, the wheels the offline GPU check carries (scripts/gpu-wheels.txt) for the lent H200's Python.

    scripts/gpu_wheels.sh [--python-version 3.12] [--dest .whl] [--platform TAG ...] [--max-mib 60]

Each manifest pin must be requirements.lock's (the lock is universal: it holds every platform's sha256); pip
downloads exactly those files (`--no-deps --only-binary=:all: --require-hashes`, CPython of `--python-version`,
manylinux x86_64), each file's sha256 is checked again against the lock, and `--dest` ends up holding exactly one
wheel per pin (stale ones removed: two versions of one package stop the install there). Fails when the total is
over `--max-mib` (a device run carries at most 64 MiB, the working tree included) and prints it either way.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_image import canonical, read_manifest  # scripts/ is not a package: its own folder is on the path
from lock import RUNTIME_LOCK, blocks

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "scripts" / "gpu-wheels.txt"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
"""pip matches each manylinux tag exactly, so every tag a wheel of the manifest may carry is listed."""
MAX_MIB = 60.0
MIB = 1024**2


class WheelError(RuntimeError):
    """A pin the lock does not hold, a download pip refused, a file whose hash is not the lock's, or too many bytes."""


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    hashes: frozenset[str]  # sha256 hex digests the lock allows for this pin (every platform's)

    def requirement(self) -> str:
        return f"{self.name}=={self.version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(self.hashes))


def lock_pins(manifest: Path = MANIFEST, lock: Path = RUNTIME_LOCK) -> list[Pin]:
    """The manifest's pins with the lock's hashes; WheelError naming each pin the lock does not hold as written."""
    entries = blocks(lock.read_text())
    out: list[Pin] = []
    problems: list[str] = []
    seen: set[str] = set()
    for name, version in read_manifest(manifest):
        if name in seen:
            problems.append(f"{name} is listed twice")
        seen.add(name)
        lines = entries.get(name)
        if lines is None:
            problems.append(f"{name}=={version} is not in {lock.name}")
            continue
        hashes = _hashes(lines, version)
        if not hashes:
            have = sorted({ln.split("==", 1)[1].split()[0] for ln in lines if "==" in ln and not ln[0].isspace()})
            problems.append(f"{name}=={version}: {lock.name} pins {', '.join(have)}")
            continue
        out.append(Pin(name, version, frozenset(hashes)))
    if problems:
        raise WheelError(f"{manifest.name} disagrees with {lock.name}: " + "; ".join(problems))
    return out


def _hashes(lines: list[str], version: str) -> set[str]:
    """The sha256 digests of the lock entry pinned at `version` (an entry runs from its `name==` line to the next)."""
    hashes: set[str] = set()
    current = False
    for ln in lines:
        if not ln[0].isspace():
            current = re.match(rf"^\S+=={re.escape(version)}[\s;\\]", ln + " ") is not None
        if current:
            hashes.update(re.findall(r"--hash=sha256:([0-9a-f]{64})", ln))
    return hashes


def wheel_name(filename: str) -> tuple[str, str]:
    """(canonical distribution, version) of a wheel's file name (PEP 427)."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) < 5:
        raise WheelError(f"{filename} is not a wheel file name")
    return canonical(parts[0]), parts[1]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(pins: list[Pin], dest: Path, python_version: str, platforms: tuple[str, ...]) -> None:
    """pip download of exactly `pins` into `dest` (empty), for CPython `python_version` on `platforms`."""
    req = dest / "requirements.txt"
    req.write_text("".join(p.requirement() + "\n" for p in pins))
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--require-hashes", "--implementation", "cp", "--python-version", python_version,
           *(a for tag in platforms for a in ("--platform", tag)), "--dest", str(dest), "-r", str(req)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    req.unlink()
    if proc.returncode != 0:
        raise WheelError(f"pip download failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}")


def verify(pins: list[Pin], folder: Path) -> dict[str, Path]:
    """One wheel per pin in `folder`, each with a sha256 the lock holds for it; name -> file."""
    by_name = {p.name: p for p in pins}
    found: dict[str, Path] = {}
    for f in sorted(folder.glob("*.whl")):
        name, version = wheel_name(f.name)
        pin = by_name.get(name)
        if pin is None or pin.version != version:
            raise WheelError(f"{f.name} is not in the manifest")
        if name in found:
            raise WheelError(f"two wheels of {name}: {found[name].name} and {f.name}")
        digest = sha256(f)
        if digest not in pin.hashes:
            raise WheelError(f"{f.name} has sha256 {digest}, which requirements.lock does not hold for {name}")
        found[name] = f
    missing = [p.name for p in pins if p.name not in found]
    if missing:
        raise WheelError(f"pip fetched no wheel of {', '.join(missing)}")
    return found


def install_into(found: dict[str, Path], dest: Path) -> None:
    """Replace the wheels in `dest` by `found` (other files there are left alone)."""
    dest.mkdir(parents=True, exist_ok=True)
    keep = {f.name for f in found.values()}
    for old in dest.glob("*.whl"):
        if old.name not in keep:
            old.unlink()
    for f in found.values():
        os.replace(f, dest / f.name)


def report(files: list[Path], max_mib: float) -> float:
    """Print one line per wheel and the total; returns the total in MiB."""
    total = sum(f.stat().st_size for f in files)
    for f in sorted(files, key=lambda p: -p.stat().st_size):
        print(f"  {f.stat().st_size / MIB:7.2f} MiB  {f.name}")
    print(f"gpu_wheels: {len(files)} wheels, {total / MIB:.2f} MiB in all (limit {max_mib:g} MiB)")
    return total / MIB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python-version", default="3.12", help="the target CPython, X.Y (default %(default)s: the H200's)"
    )
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl", help="where the wheels go (default .whl/)")
    parser.add_argument(
        "--platform", action="append", help=f"a platform tag, repeatable (default {' '.join(PLATFORMS)})"
    )
    parser.add_argument("--max-mib", type=float, default=MAX_MIB, help="fail above this many MiB (default %(default)s)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.[0-9]{1,2}", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: give X.Y, e.g. 3.12")
    try:
        pins = lock_pins(args.manifest)
        args.dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".gpu-wheels-", dir=args.dest) as tmp:
            download(pins, Path(tmp), args.python_version, tuple(args.platform or PLATFORMS))
            found = verify(pins, Path(tmp))
            total = report(list(found.values()), args.max_mib)
            if total > args.max_mib:
                raise WheelError(f"{total:.2f} MiB of wheels is over the {args.max_mib:g} MiB limit (--max-mib)")
            install_into(found, args.dest)
    except WheelError as e:
        print(f"gpu_wheels: {e}", file=sys.stderr)
        return 1
    print(f"gpu_wheels: {len(pins)} wheels for CPython {args.python_version} in {args.dest}, sha256 as in "
          f"requirements.lock")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
