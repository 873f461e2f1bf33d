"""scripts/gpu_check.sh, the one-shot accelerator check.

gpu_check.py alone: without any GPU it skips every check cleanly (exit 0); a GPU that torch cannot use (`nvidia-smi -L`
lists one, `torch.cuda.is_available()` is False) is a FAIL (exit 1), never a silent skip. `nvidia-smi` is a stand-in
script on PATH here.

The offline layout (`gpu_check.sh --offline`, what a lent H200 runs), dry-run here end to end on the CPU: the wheels
fetched by scripts/gpu_wheels.sh (for this Python, from PyPI, sha256-checked against requirements.lock), a copy of the
tree as the device tool sends it (tracked and unignored files only: no .venv), and an emulated device python
(scripts/gpu_image.py: a venv that sees only the image's packages, less everything carried, and no console scripts on
PATH). With the wheels the smoke test passes and the probe and the cached and resident service checks run (ref2va's
sha256 equal on both); without them the smoke test names every missing module; a torch outside the supported range is
refused before anything is measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytestmark = pytest.mark.processes  # runs scripts/gpu_check.py

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
SCRIPT = SCRIPTS / "gpu_check.py"
CHECKS = ("gpu-tests", "syncs-per-step", "pinned-bytes", "cached-abab", "swap-in", "quality-audit", "sidecar-kill",
          "resident-abab", "fl2va", "ref2va", "adapters", "multi-device")  # fmt: skip
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the script runs every check (scripts/gpu_check.sh)"
)


def script(name: str) -> ModuleType:
    """A module of scripts/ (not a package), imported from its file."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})  # fmt: skip


def fake_nvidia_smi(bin_dir: Path, stdout: str, code: int = 0) -> dict[str, str]:
    """PATH with only a stand-in `nvidia-smi` (printing `stdout`, exiting `code`) on it."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    quoted = stdout.replace("'", "'\\''")
    tool.write_text(f"#!/bin/sh\nprintf '%s\\n' '{quoted}'\nexit {code}\n")  # shell builtins only: PATH is bin_dir
    tool.chmod(0o755)
    return {"PATH": str(bin_dir)}


@no_cuda
@pytest.mark.parametrize(
    "nvidia_smi",
    [
        None,  # no nvidia-smi at all
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9),
        ("No devices were found", 6),
    ],
)
def test_without_any_gpu_every_check_is_skipped_and_the_exit_is_0(
    tmp_path: Path, nvidia_smi: tuple[str, int] | None
) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", *nvidia_smi) if nvidia_smi else {"PATH": str(tmp_path / "empty")}
    res = run(env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("gpu_check: device cuda;") and "cuda available: False" in lines[0]
    assert [ln.split()[:2] for ln in lines[1:]] == [["SKIP", name] for name in CHECKS]
    assert all("no GPU" in ln for ln in lines[1:])


@no_cuda
def test_a_gpu_torch_cannot_use_is_a_failure_and_the_exit_is_1(tmp_path: Path) -> None:
    listed = "GPU 0: NVIDIA H200 (UUID: GPU-6a0e2c1b-1d7c-4f38-9a3e-4b5c6d7e8f90)"
    res = run(fake_nvidia_smi(tmp_path / "bin", listed), timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[1].split()[:2] == ["FAIL", "cuda"]
    assert f"nvidia-smi lists 1 GPU(s) ({listed})" in lines[1] and "torch.cuda.is_available() is False" in lines[1]
    assert [ln.split()[:2] for ln in lines[2:-1]] == [["SKIP", name] for name in CHECKS]
    assert lines[-1] == "gpu_check: FAIL: cuda"


# ----------------------------------------------------------------------------- the manifest and the lock
def test_the_wheel_manifest_pins_exactly_what_requirements_lock_pins() -> None:
    wheels = script("gpu_wheels")
    pins = wheels.lock_pins()  # raises WheelError naming every pin the lock does not hold
    names = {p.name for p in pins}
    brief = {"diffusers", "transformers", "tokenizers", "safetensors", "huggingface-hub", "grpcio", "protobuf",
             "grpcio-health-checking", "grpcio-reflection", "grpcio-status", "googleapis-common-protos"}  # fmt: skip
    assert brief <= names, brief - names
    assert not {n for n in names if re.match(r"^(torch|torchvision|triton|nvidia-.*|cuda-.*)$", n)}
    assert all(p.hashes for p in pins)


def test_a_manifest_pin_the_lock_does_not_hold_is_named(tmp_path: Path) -> None:
    wheels = script("gpu_wheels")
    manifest = tmp_path / "gpu-wheels.txt"
    manifest.write_text("diffusers==0.42.0\nprotobuf==7.36.2\nno-such-package==1.0\n")
    with pytest.raises(wheels.WheelError) as e:
        wheels.lock_pins(manifest)
    assert "diffusers==0.42.0: requirements.lock pins 0.42.1" in str(e.value)
    assert "no-such-package==1.0 is not in requirements.lock" in str(e.value)
    assert "protobuf" not in str(e.value)


@pytest.mark.parametrize(
    ("version", "ok"),
    [("2.11.0+cu130", True), ("2.6.0", True), ("2.14.1", True), ("2.5.1", False), ("2.15.0", False), ("3.0", False)],
)
def test_the_supported_torch_range(version: str, ok: bool) -> None:
    assert script("gpu_smoke").torch_supported(version) is ok


# ----------------------------------------------------------------------------- the offline layout, dry-run on CPU
@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The carried wheels for this Python, fetched as a developer fetches them for the device (PyPI; no cache)."""
    dest = tmp_path_factory.mktemp("wheels") / ".whl"
    res = subprocess.run([str(SCRIPTS / "gpu_wheels.sh"), "--python-version", PYTHON_VERSION, "--dest", str(dest)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PIP_NO_CACHE_DIR": "1",
                         "PYTHON": sys.executable})  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    total = re.search(r"gpu_wheels: (\d+) wheels, ([0-9.]+) MiB in all", res.stdout)
    assert total and float(total.group(2)) < 60, res.stdout
    found = sorted(p.name for p in dest.glob("*.whl"))
    assert len(found) == int(total.group(1)) == len(script("gpu_image").read_manifest(SCRIPTS / "gpu-wheels.txt"))
    return dest


@pytest.fixture(scope="module")
def device_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working tree as the device tool sends it: tracked and untracked-not-ignored files (no .venv, no .whl)."""
    out = tmp_path_factory.mktemp("device") / "repo"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / rel)
    return out


def emulated_python(dest: Path, extra_exclude: tuple[str, ...] = ()) -> Path:
    image = script("gpu_image")
    carried = [n for n, _ in image.read_manifest(SCRIPTS / "gpu-wheels.txt")]
    return image.emulate(dest, [*carried, *extra_exclude])


@pytest.fixture(scope="module")
def device_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulated_python(tmp_path_factory.mktemp("devpy") / "venv")


def offline(
    tree: Path, python: Path, wheels: Path, out: Path, timeout: float, **env: str
) -> subprocess.CompletedProcess[str]:
    """`scripts/gpu_check.sh --offline` in `tree` with `python` as the system python and no console scripts on PATH."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DITSERVE_", "PYTHON", "VIRTUAL_ENV"))}
    base |= {"PATH": "/usr/bin:/bin", "DITSERVE_GPU_CHECK_PYTHON": str(python), "DITSERVE_GPU_CHECK_DEVICE": "cpu",
             "OUT": str(out), **env}  # fmt: skip
    return subprocess.run([str(tree / "scripts" / "gpu_check.sh"), "--offline", "--wheels", str(wheels)],
                          cwd=tree, capture_output=True, text=True, timeout=timeout, env=base)  # fmt: skip


def returned_files(out: Path) -> list[Path]:
    """What the device tool would bring back from $OUT: every file, at most 8, at most 2 folders down, plain names."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    for f in files:
        rel = f.relative_to(out)
        assert len(rel.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
    return files


def test_offline_dry_run_on_the_cpu_end_to_end(
    device_tree: Path, device_python: Path, wheels: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # cached and resident (ref2va compares them; the slow test runs every service check), the quality audit, and
    # room for a slow CI machine (the device's budget is 480 s)
    res = offline(device_tree, device_python, wheels, out, timeout=900, DITSERVE_GPU_CHECK_PRESET="tiny",
                  DITSERVE_GPU_CHECK_STEPS="4", DITSERVE_GPU_CHECK_SERVICES="cached,resident,quality",
                  DITSERVE_GPU_CHECK_TOTAL_S="840")  # fmt: skip
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    assert f"installing {len(list(wheels.glob('*.whl')))} wheels" in log
    assert f"gpu_check: python {device_python};" in log and ".venv" not in log.split("gpu_check: python")[1][:200]
    assert "smoke: every module imports" in log and "REFUSED" not in log and "MISSING" not in log
    assert re.search(r"protos/ generated code imports: protobuf 7\.\d+\.\d+ .*grpcio 1\.\d+", log), log
    status = {ln.split()[1]: ln.split()[0] for ln in log.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP")}
    checks = ("cached-abab", "swap-in", "resident-abab", "fl2va", "ref2va", "adapters", "quality-audit")
    assert {status[n] for n in checks} == {"PASS"}, log
    assert status["sidecar-kill"] == status["multi-device"] == "SKIP"
    assert_task_lines(log)
    assert_audit_line(log)
    records = [json.loads(ln) for ln in (out / "probe.jsonl").read_text().splitlines()]
    assert [r["part"] for r in records] == ["slab", "swap", "block", "vae", "rebuild", "disk", "readpath"]
    assert all(r["status"] == "ok" and r["device"] == "cpu" and r["scaled"] is True for r in records), records
    assert records[0]["full_sizes"]["page_numel"] == 4_849_152
    disk, readpath = records[5], records[6]
    # the disk tier's pack of a 50-point schedule read back bitwise; its page cache dropped before the cold read
    assert disk["pages_equal"] is True and disk["plans"] == 49 and disk["pages"] == 97, disk
    assert disk["full_sizes"]["bytes"] == 97 * 4_849_152 * 2 and disk["page_cache"]["fadvise"] is True, disk
    assert disk["cold_read_gbps"] and disk["warm_read_gbps"] and 0 < disk["checksum_share_warm"] < 1, disk
    assert readpath["full_sizes"]["bytes"] == 3 * 96768 * 2689 * 2 and readpath["pass"] is None, readpath
    assert all(readpath[k]["ratio"] > 0 and readpath[k]["plain_gbps"] for k in ("warm", "cold")), readpath
    assert "On an H200 (DITSERVE_GPU_CHECK_DEVICE=cuda) the check measures" in log
    assert "49 x 3 pages of 4,849,152 bf16 (9.25 MiB) = 1.33 GiB over CUDA IPC" in log
    assert "(hidden 5376, 56 heads x 128, ffn 14336) forward at 8192 and 32768 tokens" in log
    assert "one pack of a 50-point schedule's 49 plans (97 pages, 0.94 GB)" in log
    assert "of 3 adaln_proj (1.56 GB) onto the device vs one plain sequential read" in log
    assert re.search(r"probe: a 50-point schedule from disk \S+ s cold, \S+ s warm vs its rebuild pass \S+ s "
                     r"\(modeled\): \S+x, \S+x \(scaled", log), log  # fmt: skip
    names = {f.name for f in returned_files(out)}
    assert {"gpu-check.log", "probe.jsonl"} <= names
    assert (out / "gpu-check.log").read_text().splitlines()[-1] == log.splitlines()[-1]


def assert_task_lines(log: str) -> None:
    """The fl2va and ref2va lines: their images (made without PyAV, which the device lacks), one sha256 cached and
    resident, not t2va A's."""
    for task, images in (
        ("fl2va", "keyframes PNG 64x48, JPEG 48x64:"),
        ("ref2va", "references PNG 80x48, JPEG 48x64:"),
    ):
        found = next(ln for ln in log.splitlines() if ln.split()[1:2] == [task])
        assert images in found, found
        sha = re.search(r"cached sha256 ([0-9a-f]{64}), resident ([0-9a-f]{64}) \(equal\)", found)
        assert sha and sha.group(1) == sha.group(2), found
        assert f"task {task};" in found and "differs from t2va A" in found, found


def assert_audit_line(log: str) -> None:
    """The quality-audit line: `ditserve audit-quality` measured its request on a serve with a levels file, wrote
    its record, and the line carries the audit's numbers and verdict."""
    found = next(ln for ln in log.splitlines() if ln.split()[1:2] == ["quality-audit"])
    assert "level fast (FirstBlockCache 0.5) on 32x32x124, the CPU dry run" in found, found
    assert "1/1 request(s) measured, 1 record(s) written" in found, found
    numbers = re.search(r"latency ratio [0-9.]+ \(denoise [0-9.]+\), skipped fraction (0\.\d+), PSNR \S+ dB, SSIM \S+, "
                        r"audio corr \S+, audio SNR \S+ dB; (passed|failed)", found)  # fmt: skip
    assert numbers and float(numbers.group(1)) > 0, found


def test_offline_without_the_wheels_the_smoke_test_names_every_missing_module(
    device_tree: Path, device_python: Path, tmp_path: Path
) -> None:
    (tmp_path / "no-wheels").mkdir()
    res = offline(device_tree, device_python, tmp_path / "no-wheels", tmp_path / "out", timeout=300)
    log = res.stdout + res.stderr
    assert res.returncode == 1, log
    missing = {ln.split()[1] for ln in log.splitlines() if ln.startswith("MISSING")}
    # each carried distribution the check imports, as the emulated image lacks it; torch lacks typing_extensions
    want = {"diffusers", "transformers", "tokenizers", "safetensors", "grpc", "grpc_health", "grpc_reflection",
            "grpc_status", "google", "prometheus_client", "tqdm", "typing_extensions", "sqlalchemy", "xxhash"}  # fmt: skip
    assert missing == want, log
    assert "FAIL: the import smoke test (exit 1): nothing was measured" in log
    assert not (tmp_path / "out" / "probe.jsonl").exists()


@pytest.mark.parametrize("version", ["2.5.1", "2.15.0"])
def test_offline_a_torch_outside_the_supported_range_is_refused(
    device_tree: Path, tmp_path: Path, version: str
) -> None:
    python = emulated_python(tmp_path / "venv", extra_exclude=("torch",))
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "torch").mkdir()  # a stand-in torch that only reports its version
    (site / "torch" / "__init__.py").write_text(
        f"import types\n__version__ = {version!r}\nversion = types.SimpleNamespace(cuda=None)\n"
    )
    (tmp_path / "no-wheels").mkdir()
    res = offline(device_tree, python, tmp_path / "no-wheels", tmp_path / "out", timeout=300)
    log = res.stdout + res.stderr
    assert res.returncode == 2, log
    assert re.search(rf"REFUSED  torch {re.escape(version)} \(at .*\) is not supported: ditserve runs on torch "
                     r">=2\.6, <2\.15", log), log  # fmt: skip
    assert "nothing was measured" in log and "MISSING" not in log


@pytest.mark.slow
def test_service_checks_pass_on_the_cpu_in_the_offline_layout(
    device_tree: Path, device_python: Path, wheels: Path, tmp_path: Path
) -> None:
    res = offline(device_tree, device_python, wheels, tmp_path / "out", timeout=1800, DITSERVE_GPU_CHECK_PRESET="tiny",
                  DITSERVE_GPU_CHECK_STEPS="8", DITSERVE_GPU_CHECK_BUDGET_S="1200",
                  DITSERVE_GPU_CHECK_TOTAL_S="1700")  # fmt: skip
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    status = {ln.split()[1]: ln.split()[0] for ln in log.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP")}
    checks = ("cached-abab", "swap-in", "sidecar-kill", "resident-abab", "fl2va", "ref2va", "adapters", "quality-audit")
    assert {status[n] for n in checks} == {"PASS"}, log
    assert_task_lines(log)
    kill = next(ln for ln in log.splitlines() if ln.split()[1:2] == ["sidecar-kill"])
    assert "closed the old slab mapping (storage freed): True" in kill, kill
    assert "gpu_check: all checks passed" in log
