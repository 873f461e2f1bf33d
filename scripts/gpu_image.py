"""The lent H200's image, for the offline GPU check: the Python packages its system `python3` holds, and `emulate`,
which builds an interpreter here that sees only those packages (less the ones the check carries), so the check's
dry run on this machine meets the same missing modules the device would.

    python scripts/gpu_image.py DIR [--carried scripts/gpu-wheels.txt]    # builds DIR, prints DIR's python

The list is the device tool's (its KINDS.md, "Python packages already there", as read on 2026-11-17); the versions
known there are in IMAGE_VERSIONS. Nothing can be installed on that machine: what it lacks travels as wheels
(scripts/gpu_wheels.sh, installed by scripts/gpu_check.sh --offline). Standard library only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

IMAGE_PYTHON = "3.12.3"
IMAGE_TORCH = "2.11.0+cu130"
_PACKAGE_LIST = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
"""
IMAGE_PACKAGES = frozenset(_PACKAGE_LIST.split())
"""Distribution names (canonical) the image's python3 has."""
IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0",
}  # fmt: skip
"""The versions a session saw there (KINDS.md's pip list); grpcio's and protobuf's were not read (older than ours)."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_manifest(path: Path) -> list[tuple[str, str]]:
    """(canonical name, version) of each `name==version` line of a wheel manifest (scripts/gpu-wheels.txt)."""
    out: list[tuple[str, str]] = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", text)
        if not m:
            raise ValueError(f"{path}:{n}: {text!r} is not `name==version`")
        out.append((canonical(m.group(1)), m.group(2)))
    return out


def _top_levels(dist: importlib.metadata.Distribution) -> set[str]:
    """The entries a distribution puts directly in site-packages (packages, modules, its .dist-info, .pth files)."""
    tops = set()
    for f in dist.files or []:
        parts = Path(str(f)).parts
        if parts and parts[0] not in ("..", "__pycache__") and not parts[0].endswith(".data"):
            tops.add(parts[0])
    return tops


def emulate(dest: Path, exclude: Iterable[str] = (), source_site: Path | None = None) -> Path:
    """Build at `dest` a virtual environment (no pip, no system site) whose site-packages holds symlinks to what the
    image's python3 holds, as far as `source_site` (default: this interpreter's) has it, less the distributions in
    `exclude`; returns its python. A directory two distributions share (nvidia/, google/) is linked entry by entry
    when one of them is excluded, so nothing of an excluded one shows through."""
    source = Path(source_site or sysconfig.get_paths()["purelib"])
    skip = {canonical(n) for n in exclude}
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(dest), "platbase": str(dest)})["purelib"])
    owners: dict[str, set[tuple[str, bool]]] = {}
    for dist in importlib.metadata.distributions(path=[str(source)]):
        name = canonical(dist.metadata["Name"])
        keep = name in IMAGE_PACKAGES and name not in skip
        for top in _top_levels(dist):
            owners.setdefault(top, set()).add((name, keep))
    for top, who in sorted(owners.items()):
        kept = {n for n, keep in who if keep}
        if not kept or not (source / top).exists():
            continue
        if len(kept) == len(who) or not (source / top).is_dir():
            os.symlink(source / top, site / top)
            continue
        _link_shared(source, site, top, kept)
    return dest / "bin" / "python"


def _link_shared(source: Path, site: Path, top: str, kept: set[str]) -> None:
    """Link, inside a directory several distributions share, only the second-level entries of the kept ones."""
    (site / top).mkdir(exist_ok=True)
    for dist in importlib.metadata.distributions(path=[str(source)]):
        if canonical(dist.metadata["Name"]) not in kept:
            continue
        for f in dist.files or []:
            parts = Path(str(f)).parts
            if len(parts) > 2 and parts[0] == top and not (site / top / parts[1]).exists():
                os.symlink(source / top / parts[1], site / top / parts[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="where to build the emulated interpreter (must not exist)")
    parser.add_argument("--carried", type=Path, help="a wheel manifest whose distributions are left out")
    args = parser.parse_args(argv)
    exclude = [n for n, _ in read_manifest(args.carried)] if args.carried else []
    print(emulate(args.dest, exclude))
    return 0


if __name__ == "__main__":
    sys.exit(main())
