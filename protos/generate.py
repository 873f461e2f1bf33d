"""Regenerate the Python code of every .proto under protos/ (one command, never hand-edited).

    python -m protos.generate          # write protos/ditserve/**/_pb2*.py(i)
    python -m protos.generate --check  # exit 1 if the checked-in code is stale

Protos are compiled with the repository root as include path, so generated modules live at
`protos.ditserve.<service>.v1.<name>_pb2` and import each other by that path.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("ditserve/**/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into out_dir (mirroring the repo layout); returns generated files."""
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
    args += [f"--grpc_python_out={out_dir}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if checked-in generated code is stale")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        fresh = {p.relative_to(out) for p in generate(out)}
        current = {p.relative_to(ROOT) for p in PROTO_DIR.rglob("*") if p.name.endswith(GENERATED_SUFFIXES)}
        if args.check:
            stale = sorted(
                str(r)
                for r in fresh | current
                if r not in fresh or r not in current or not filecmp.cmp(out / r, ROOT / r, shallow=False)
            )
            if stale:
                print("generated protobuf code is stale; run `python -m protos.generate`:", *stale, sep="\n  ")
                return 1
            print(f"generated protobuf code is up to date ({len(fresh)} files)")
            return 0
        for r in current - fresh:
            (ROOT / r).unlink()
        for r in fresh:
            (ROOT / r).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out / r, ROOT / r)
        for d in {(ROOT / r).parent for r in fresh}:
            while d != PROTO_DIR and d.is_relative_to(PROTO_DIR):
                (d / "__init__.py").touch()
                d = d.parent
        print(f"wrote {len(fresh)} files")
        return 0


if __name__ == "__main__":
    sys.exit(main())
