"""The offline GPU check's import smoke test, run by scripts/gpu_check.sh --offline with the device's python before
anything is measured: one line per problem, exit 1 on any (2 when torch is outside the supported range).

    python scripts/gpu_smoke.py [--site DIR] [--manifest scripts/gpu-wheels.txt]

1. torch: its version must be in SUPPORTED_TORCH (else REFUSED, exit 2, before anything imports it further).
2. Every module the check needs: each third-party module imported anywhere in the code the check runs (the
   project's packages, scripts/gpu_check*.py and gpu_probe*.py, the `gpu`-marked tests and their helpers; found by
   reading their imports, function-level ones too, so the list cannot drift), each imported name resolved (diffusers'
   lazy names load their module), then every project module. One MISSING line per module that cannot be imported,
   naming what is missing and who imports it; a BROKEN line per one that fails otherwise.
3. The generated protobuf / gRPC code (protos/) against the protobuf and grpcio found: their gencode versions.
4. With `--site`: every carried distribution (`--manifest`) is found there at its pinned version (a SHADOWED line
   otherwise), and a WARN line per requirement of one that the interpreter's distributions do not meet.

Standard library only at the top: it must run where half the modules are missing.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import pkgutil
import re
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_image import read_manifest  # scripts/ is not a package: its own folder is on the path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ditcore", "ditruntime", "ditserve", "generator_service", "plancache_service", "protos")
SUPPORTED_TORCH = ((2, 6), (2, 15))
"""[low, high): diffusers 0.42.1 and transformers 5.24.0 require torch >= 2.6 (their `torch` extras); 2.14 is the
newest the locks pin and the suite runs on (requirements-torch.txt). What ditserve calls in torch is in every release
between: `UntypedStorage._share_cuda_` / `_new_shared_cuda` (CUDA IPC of the slab), `cuda.cudart().cudaHostRegister`,
`from_file(shared=True)`, `frombuffer`, `cuda.set_sync_debug_mode` (the gpu tests), `nn.RMSNorm` (diffusers, 2.4)."""
OPTIONAL = {
    "av": "PyAV, for MP4 output: the check's requests ask for latents",
    "matplotlib": "ditserve bench's chart",
    "grpc_tools": "protos.generate, which regenerates the code (a dev tool)",
    "fastapi": "ditserve.openai.app, the /v1/videos facade (the check does not serve it)",
    "uvicorn": "ditserve.openai.app's HTTP server",
    "starlette": "FastAPI's own toolkit, which ditserve.openai.app and .guards import (Host, key and body guards)",
    "anyio": "ditserve.openai.app's task group (carried anyway, for huggingface-hub's HTTP client)",
    "psycopg": "a PostgreSQL job store (--job-store postgresql://...; the check's is SQLite)",
}
"""Modules the code imports that the check never reaches, and why."""
SKIP_MODULES = ("protos.generate", "ditserve.openai.app", "ditserve.openai.guards")
"""Project modules not imported (their imports are OPTIONAL); `__main__` modules are never imported either."""


def parse_version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "2.11.0+cu130" -> (2, 11, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if not m:
        raise ValueError(f"{text!r} is not a version")
    return tuple(int(x) for x in m.group(1).split("."))


def torch_range() -> str:
    (a, b), (c, d) = SUPPORTED_TORCH
    return f">={a}.{b}, <{c}.{d}"


def torch_supported(version: str) -> bool:
    low, high = SUPPORTED_TORCH
    return low <= parse_version(version)[:2] < high


# ---------------------------------------------------------------------------- what the check imports
def checked_files() -> list[Path]:
    """The code the check runs: the project, its scripts, the `gpu`-marked tests and the tests' helpers."""
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    files += sorted((ROOT / "scripts").glob("gpu_check*.py")) + sorted((ROOT / "scripts").glob("gpu_probe*.py"))
    tests = ROOT / "tests"
    for p in sorted(tests.rglob("*.py")):
        helper = not p.name.startswith("test_") and "bench" not in p.relative_to(tests).parts
        if helper or "pytest.mark.gpu" in p.read_text(errors="replace"):
            files.append(p)
    return files


def local_names() -> set[str]:
    """Top-level names that are the project's or the tests' own modules (pytest puts tests/ dirs on the path)."""
    names = set(PACKAGES) | {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests"}
    return names | {p.stem for p in (ROOT / "scripts").glob("*.py")}


def imports(path: Path) -> Iterator[tuple[str, str | None]]:
    """(module, imported name or None) of every absolute import in a file, at any depth."""
    tree = ast.parse(path.read_text(errors="replace"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.module, None if alias.name == "*" else alias.name


def needed_modules() -> dict[tuple[str, str | None], list[str]]:
    """Third-party (module, name) pairs the check imports -> the files that import them."""
    local, std = local_names(), set(sys.stdlib_module_names)
    needed: dict[tuple[str, str | None], list[str]] = {}
    for path in checked_files():
        for module, name in imports(path):
            top = module.split(".")[0]
            if top in local or top in std or top in OPTIONAL or top == "__future__":
                continue
            needed.setdefault((module, name), []).append(str(path.relative_to(ROOT)))
    return needed


class Problems:
    """What the smoke test found: printed as it is found, one line per cause."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.missing: dict[str, tuple[set[str], set[str]]] = {}  # missing module -> (modules needing it, files)
        self.failed: set[str] = set()  # needed modules that did not import
        self.errors: set[str] = set()

    def add(self, kind: str, text: str) -> None:
        self.lines.append(f"{kind} {text}")
        print(f"{kind:<8} {text}", flush=True)

    def explained(self, e: BaseException) -> bool:
        """An error already reported: a module found missing, or the same exception text."""
        if isinstance(e, ModuleNotFoundError) and e.name in self.missing:
            return True
        return f"{type(e).__name__}: {e}" in self.errors


def _who(files: Iterable[str]) -> str:
    uniq = sorted(set(files))
    return ", ".join(uniq[:3]) + (f" and {len(uniq) - 3} more" if len(uniq) > 3 else "")


def resolve(module: str, name: str | None) -> None:
    """Import `module` and, for `from module import name`, the name (a submodule, or a lazy attribute)."""
    mod = importlib.import_module(module)
    if name is not None and not hasattr(mod, name):
        importlib.import_module(f"{module}.{name}")


def check_modules(problems: Problems) -> int:
    """Import every needed third-party module (one MISSING line per module missing, naming what needs it), resolve
    each imported name, then import every project module; returns how many modules imported."""
    needed = needed_modules()
    by_module: dict[str, list[str]] = {}
    for (module, _), files in needed.items():
        by_module.setdefault(module, []).extend(files)
    count = 0
    for module, files in sorted(by_module.items()):
        try:
            importlib.import_module(module)
            count += 1
        except ModuleNotFoundError as e:
            problems.failed.add(module)
            wanted, where = problems.missing.setdefault(e.name or module, (set(), set()))
            wanted.add(module)
            where.update(files)
        except Exception as e:  # an import that fails otherwise (a version check, a missing symbol)
            problems.failed.add(module)
            if not problems.explained(e):
                problems.errors.add(f"{type(e).__name__}: {e}")
                problems.add("BROKEN", f"{module}: {type(e).__name__}: {e} (imported by {_who(files)})")
    for missing, (wanted, where) in sorted(problems.missing.items()):
        problems.add("MISSING", f"{missing} (needed for {_who(wanted)}; imported by {_who(where)})")
    for (module, name), files in sorted(needed.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        if name is None or module in problems.failed:
            continue
        try:
            resolve(module, name)
        except Exception as e:
            problems.add("BROKEN", f"from {module} import {name}: {type(e).__name__}: {e} (in {_who(files)})")
    for info in project_modules():
        try:
            importlib.import_module(info)
            count += 1
        except Exception as e:
            if problems.explained(e):
                continue
            problems.errors.add(f"{type(e).__name__}: {e}")
            if isinstance(e, ModuleNotFoundError) and e.name in PACKAGES:
                problems.missing[e.name] = ({info}, set())
                problems.add("MISSING", f"{e.name}: the repository root ({ROOT}) is not on the path (PYTHONPATH)")
            elif isinstance(e, ModuleNotFoundError):
                problems.missing[e.name or info] = ({info}, set())
                problems.add("MISSING", f"{e.name} (needed for {info})")
            else:
                problems.add("BROKEN", f"{info}: {type(e).__name__}: {e}")
    return count


def project_modules() -> list[str]:
    out: list[str] = []
    for pkg in PACKAGES:
        out.append(pkg)
        for info in pkgutil.walk_packages([str(ROOT / pkg)], prefix=f"{pkg}."):
            if info.name.rsplit(".", 1)[-1] != "__main__" and info.name not in SKIP_MODULES:
                out.append(info.name)
    return out


# ---------------------------------------------------------------------------- generated code, carried versions
def gencode_versions() -> tuple[str, str]:
    """(protobuf, grpcio) versions the generated code in protos/ was made with (the oldest runtimes it accepts)."""
    pb = sorted(ROOT.glob("protos/ditserve/*/v1/*_pb2.py"))[0].read_text()
    grpc = sorted(ROOT.glob("protos/ditserve/*/v1/*_pb2_grpc.py"))[0].read_text()
    m = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb
    )
    g = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc)
    if not m or not g:
        raise ValueError("protos/: no gencode version found in the generated files (regenerate them)")
    return ".".join(m.groups()), g.group(1)


def check_gencode(problems: Problems) -> None:
    pb_gen, grpc_gen = gencode_versions()
    try:
        import grpc
        from google.protobuf import __version__ as pb_version
        from google.protobuf.internal import api_implementation

        for mod in sorted(ROOT.glob("protos/ditserve/*/v1/*_pb2*.py")):
            importlib.import_module(".".join(mod.relative_to(ROOT).with_suffix("").parts))
    except Exception as e:
        if not problems.explained(e):
            major = int(pb_gen.split(".")[0])
            problems.add("BROKEN", f"protos/ generated code (made for protobuf >= {pb_gen}, < {major + 1}; grpcio >= "
                         f"{grpc_gen}): {type(e).__name__}: {e}")  # fmt: skip
        return
    print(f"ok       protos/ generated code imports: protobuf {pb_version} ({api_implementation.Type()}; the code needs "
          f">= {pb_gen} of major {pb_gen.split('.')[0]}), grpcio {grpc.__version__} (needs >= {grpc_gen})", flush=True)  # fmt: skip


def check_carried(problems: Problems, site: Path, manifest: Path) -> None:
    """Each carried distribution is the one found first, at its pin, from `site`; WARN on unmet requirements."""
    for name, version in read_manifest(manifest):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            problems.add("SHADOWED", f"{name}=={version} is not installed (no wheel of it in the carried folder?)")
            continue
        where = Path(str(dist.locate_file(""))).resolve()
        if dist.version != version or where != site.resolve():
            problems.add("SHADOWED", f"{name}: {dist.version} from {where} is found first, not the carried {version}")
        for warning in unmet_requirements(dist):
            print(f"WARN     {name} {dist.version} requires {warning}", flush=True)


def unmet_requirements(dist: importlib.metadata.Distribution) -> list[str]:
    """Requirements of `dist` (markers evaluated, extras left out) no installed distribution meets."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return []
    out: list[str] = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{req}: {have} installed")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="the folder the carried wheels were installed into")
    parser.add_argument("--manifest", type=Path, default=ROOT / "scripts" / "gpu-wheels.txt")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    print(f"smoke: python {sys.version.split()[0]} ({sys.executable})", flush=True)
    problems = Problems()
    try:
        import torch
    except Exception:
        pass  # reported with every other module that does not import (below)
    else:
        if not torch_supported(torch.__version__):
            print(f"REFUSED  torch {torch.__version__} (at {Path(torch.__file__).parent}) is not supported: ditserve "
                  f"runs on torch {torch_range()} (diffusers 0.42.1 needs >= 2.6; the locks pin 2.14)", flush=True)  # fmt: skip
            return 2
        print(f"ok       torch {torch.__version__} (CUDA {torch.version.cuda}) is in the supported range "
              f"{torch_range()}", flush=True)  # fmt: skip
    if args.site is not None:
        check_carried(problems, args.site, args.manifest)
    count = check_modules(problems)
    check_gencode(problems)
    verdict = f"{len(problems.lines)} problem(s)" if problems.lines else "every module imports"
    print(f"smoke: {verdict}; {count} modules imported in {time.monotonic() - t0:.1f} s", flush=True)
    return 1 if problems.lines else 0


if __name__ == "__main__":
    sys.exit(main())
