"""Deployment files (docker/): the linters (scripts/validate_deploy.sh), the structure the
services depend on (shared namespaces, /dev/shm, one socket path, native sidecar, headless
Service), the network defaults (TLS and the admin token from Secrets, metrics where Prometheus
scrapes, nothing plaintext published beyond loopback), docker/healthcheck.py against a real sidecar
and a real TLS server, and the installs (lock files with hashes, exact dev-tool pins, one
hash-locked torch stack everywhere, the CUDA image's allocator guard)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from packaging.requirements import Requirement

from ditcore.parallel import Ranks
from ditruntime.auth import ADMIN_TOKEN_ENV
from generator_service import cli as generator_cli
from plancache_service.app import build_server
from plancache_service.cli import build_parser, config_from_args

pytestmark = pytest.mark.processes  # the entrypoint, the healthcheck script, openssl, validate_deploy.sh

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
HEALTHCHECK = DOCKER / "healthcheck.py"
CUDA_ENTRYPOINT = DOCKER / "cuda-entrypoint.sh"
SIDECAR_SERVICE = "ditserve.plancache.v1.PlanCache"
GENERATOR_SERVICE = "ditserve.generator.v1.Generator"


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _flag(args: list[str], name: str) -> str:
    """The value of `--name=value` (or `--name value`) in a container's argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return args[i + 1]
    raise AssertionError(f"{name} not in {args}")


@pytest.fixture(scope="module")
def pod() -> dict[str, Any]:
    return _load(K8S / "deployment.yaml")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load(DOCKER / "compose.yaml")


# ----------------------------------------------------------------------------- the linters
def test_validate_deploy_script_passes() -> None:
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "validate_deploy.sh")], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, f"validate_deploy.sh failed:\n{res.stdout}\n{res.stderr}"
    assert "all checks passed" in res.stdout


# ----------------------------------------------------------------------------- Kubernetes
def test_k8s_sidecar_is_native_and_probed_over_its_socket(pod: dict[str, Any]) -> None:
    [sidecar] = pod["initContainers"]
    [generator] = pod["containers"]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: starts first, lives with the pod
    assert sidecar["args"][0] == "plancache" and generator["args"][0] == "generator"
    socket = _flag(sidecar["args"], "--socket")
    assert _flag(generator["args"], "--sidecar") == f"unix:{socket}"
    assert Path(socket).parent != Path("/run/ditserve")  # a subdir the sidecar owns, not the volume root
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = sidecar[probe]["exec"]["command"]
        assert cmd[:4] == ["python", "/opt/ditserve/healthcheck.py", f"unix:{socket}", SIDECAR_SERVICE], probe
    assert "--alive" in sidecar["livenessProbe"]["exec"]["command"]


def test_k8s_generator_probes_are_grpc_health_checks_over_tls(pod: dict[str, Any]) -> None:
    """Exec probes (the kubelet's own grpc probe speaks plaintext only) through healthcheck.py, which the
    container's environment points at the served certificate; liveness takes NOT_SERVING as alive."""
    [generator] = pod["containers"]
    probe = ["python", "/opt/ditserve/healthcheck.py", "127.0.0.1:50051"]
    assert generator["readinessProbe"]["exec"]["command"] == [*probe, GENERATOR_SERVICE]
    for name in ("startupProbe", "livenessProbe"):
        # NOT_SERVING while the sidecar is away or weights update must not restart it; silence must
        assert generator[name]["exec"]["command"] == [*probe, "--alive"], name
    env = {e["name"]: e for e in generator["env"]}
    assert env["DITSERVE_HEALTH_TLS_CA"]["value"] == _flag(generator["args"], "--tls-cert")
    assert env["DITSERVE_HEALTH_TLS_SERVER_NAME"]["value"] == "ditserve.$(POD_NAMESPACE).svc"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_k8s_pod_shares_shm_socket_dir_and_pids(pod: dict[str, Any]) -> None:
    volumes = {v["name"]: v for v in pod["volumes"]}
    containers = pod["initContainers"] + pod["containers"]
    mounts = [{m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in containers]
    shm = {m["/dev/shm"] for m in mounts}
    run = {m["/run/ditserve"] for m in mounts}
    assert len(shm) == 1 and len(run) == 1  # one volume each, mounted in both containers
    assert volumes[shm.pop()]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[run.pop()]
    assert pod["shareProcessNamespace"] is True  # CUDA IPC needs the PID namespace shared
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "ditserve-models", "readOnly": True}
    assert all(m["readOnly"] for c in containers for m in c["volumeMounts"] if m["name"] == "models")


def test_k8s_one_gpu(pod: dict[str, Any]) -> None:
    [sidecar] = pod["initContainers"]
    [generator] = pod["containers"]
    assert generator["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in sidecar["resources"].get("limits", {})  # a second request = a second GPU


def _mounted_secret(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str, int]:
    """(Secret name, key, file mode) of the Secret file a container sees at `path`."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    secret = volumes[mount["name"]]["secret"]
    key = path.removeprefix(mount["mountPath"] + "/")
    for item in secret.get("items", []):
        if item["path"] == key:
            key = item["key"]
    return secret["secretName"], key, secret["defaultMode"]


def test_k8s_public_port_is_tls_and_the_admin_token_a_secret_file(pod: dict[str, Any]) -> None:
    [sidecar] = pod["initContainers"]
    [generator] = pod["containers"]
    args = generator["args"]
    assert _flag(args, "--listen") == "0.0.0.0:50051"
    assert _mounted_secret(pod, generator, _flag(args, "--tls-cert"))[:2] == ("ditserve-tls", "tls.crt")
    assert _mounted_secret(pod, generator, _flag(args, "--tls-key"))[:2] == ("ditserve-tls", "tls.key")
    name, key, mode = _mounted_secret(pod, generator, _flag(args, "--admin-token-file"))
    assert (name, key) == ("ditserve-admin", "token")
    assert mode == 0o440  # with fsGroup: owner and group 10001 only; the generator refuses o+r
    # the token never as a flag value or an environment variable, in either container
    for c in (sidecar, generator):
        assert not any(a.startswith("--admin-token=") or a == "--admin-token" for a in c["args"])
        assert ADMIN_TOKEN_ENV not in {e["name"] for e in c.get("env", [])}
    assert "--allow-plaintext-admin" not in args


def test_k8s_generator_args_are_a_valid_generator_command_line(pod: dict[str, Any], tmp_path: Path) -> None:
    """The manifest's flags parse into a GeneratorConfig (the Secret file replaced by a local one); /metrics
    listens where Prometheus scrapes the pod IP, in both containers."""
    [sidecar] = pod["initContainers"]
    [generator] = pod["containers"]
    token = tmp_path / "token"
    token.write_text("k8s-manifest-test-token\n")
    token.chmod(0o440)
    args = [a.replace("/etc/ditserve/admin/token", str(token)) for a in generator["args"][1:]]
    cfg = generator_cli.config_from_args(generator_cli.build_parser().parse_args(args))
    assert cfg.tls_cert == Path("/etc/ditserve/tls/tls.crt") and cfg.admin_secret == "k8s-manifest-test-token"
    assert cfg.metrics_bind_host == "0.0.0.0" and cfg.metrics_port == 9400
    assert _flag(sidecar["args"], "--metrics-host") == "0.0.0.0"  # a unix-socket sidecar defaults to 127.0.0.1
    assert _flag(sidecar["args"], "--metrics-port") == "9401"


def test_k8s_service_is_headless_and_selects_the_pods() -> None:
    service = _load(K8S / "service.yaml")
    deployment = _load(K8S / "deployment.yaml")
    assert service["spec"]["clusterIP"] == "None"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50051
    assert ports["grpc"].get("appProtocol") != "kubernetes.io/h2c"  # the port is TLS, not cleartext HTTP/2


def test_kustomization_lists_every_resource_file() -> None:
    listed = set(_load(K8S / "kustomization.yaml")["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_k8s_replica_overlay_is_one_rank_per_gpu_with_a_slab_each(tmp_path: Path) -> None:
    """docker/k8s-replica: torchrun starts as many generator ranks as the pod has GPUs, rank r on cuda:r, and the
    sidecar's --devices lists the same devices in the same order (its slab r is rank r's)."""
    overlay = DOCKER / "k8s-replica"
    assert _load(overlay / "kustomization.yaml")["resources"] == ["../k8s"]
    pod = _load(overlay / "replica-4gpu.yaml")["spec"]["template"]["spec"]
    [sidecar], [generator] = pod["initContainers"], pod["containers"]
    command = generator["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"] and command[-2:] == ["-m", "generator_service"]
    nproc = int(_flag(command, "--nproc-per-node"))
    token = tmp_path / "token"
    token.write_text("k8s-manifest-test-token\n")
    token.chmod(0o440)
    args = [a.replace("/etc/ditserve/admin/token", str(token)) for a in generator["args"]]
    cfg = generator_cli.config_from_args(generator_cli.build_parser().parse_args(args))
    devices = [cfg.rank_device(r) for r in range(nproc)]
    assert devices == [f"cuda:{r}" for r in range(nproc)]
    one_node = Ranks(rank=0, world_size=nproc, local_rank=0)
    cfg.parallel_spec(one_node, torch.device("cuda")).check(nproc, 56, "nccl")  # the released transformer's 56 heads
    side = config_from_args(build_parser().parse_args(sidecar["args"][1:]))
    assert list(side.cache.slab_devices) == devices
    assert generator["resources"]["limits"]["nvidia.com/gpu"] == nproc


def test_every_deployed_sidecar_keeps_its_built_plans_on_its_state_volume(compose: dict[str, Any]) -> None:
    """The disk tier (--plan-dir) is on wherever a sidecar is deployed: a directory on the state volume (which the
    sidecar writes: created 0700 there), bounded by --plan-dir-max-gb."""
    sidecars = [compose["services"]["plancache"]["command"]]
    for path in (K8S / "deployment.yaml", DOCKER / "k8s-replica" / "replica-4gpu.yaml",
                 DOCKER / "k8s-replica-nodes" / "statefulset.yaml"):  # fmt: skip
        [sidecar] = _load(path)["spec"]["template"]["spec"]["initContainers"]
        sidecars.append(sidecar["args"])
    for args in sidecars:
        state, plans = _flag(args, "--state-dir"), _flag(args, "--plan-dir")
        assert plans.startswith(state + "/") and "--plan-dir-read-only" not in args
        assert float(_flag(args, "--plan-dir-max-gb")) > 0
        cache = build_parser().parse_args([a for a in args if a.startswith("--plan-dir")] + ["--checkpoint=/m"])
        assert cache.plan_dir == plans


# ----------------------------------------------------------------------------- compose
def test_compose_shares_ipc_and_pid_and_waits_for_a_healthy_sidecar(compose: dict[str, Any]) -> None:
    side, gen = compose["services"]["plancache"], compose["services"]["generator"]
    assert side["ipc"] == "shareable" and "shm_size" in side
    assert gen["ipc"] == "service:plancache" and gen["pid"] == "service:plancache"
    assert gen["depends_on"]["plancache"]["condition"] == "service_healthy"
    socket = _flag(side["command"], "--socket")
    assert _flag(gen["command"], "--sidecar") == f"unix:{socket}"
    assert side["healthcheck"]["test"][-2:] == [f"unix:{socket}", SIDECAR_SERVICE]
    assert gen["healthcheck"]["test"][-2:] == ["127.0.0.1:50051", GENERATOR_SERVICE]
    for svc in (side, gen):
        assert any(str(v).endswith(":/models:ro") for v in svc["volumes"])
        assert any(str(v).endswith(":/run/ditserve") for v in svc["volumes"])


def test_compose_demo_checkpoint_writes_a_tiny_released_precision_repository(compose: dict[str, Any]) -> None:
    """The one-shot demo service is a valid `ditserve make-checkpoint` call, on a writable H3 preset."""
    from ditserve.cli import _parser
    from ditserve.commands import WRITABLE_PRESETS, cmd_make_checkpoint

    demo = compose["services"]["demo-checkpoint"]
    argv = [a.replace("${DITSERVE_CHECKPOINT:-demo}", "demo") for a in demo["command"]]
    args = _parser().parse_args(argv)
    assert args.func is cmd_make_checkpoint
    assert (args.preset, args.dtype, args.out) == ("tiny", "mixed", "/models/demo")
    assert args.preset in WRITABLE_PRESETS
    # the services' default checkpoint is what the demo service writes
    side, gen = compose["services"]["plancache"], compose["services"]["generator"]
    assert _flag(side["command"], "--checkpoint") == "/models/${DITSERVE_CHECKPOINT:-demo}"
    assert _flag(gen["command"], "--weights-root") == "/models"


def test_compose_publishes_plaintext_only_on_loopback_and_tls_is_opt_in(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    side, gen = compose["services"]["plancache"], compose["services"]["generator"]
    assert gen["ports"][0] == "${DITSERVE_PUBLISH:-127.0.0.1}:50051:50051"
    assert all(p.startswith("127.0.0.1:") for p in side["ports"] + gen["ports"][1:])  # /metrics
    assert _flag(side["command"], "--metrics-host") == "0.0.0.0"  # inside the container, for the published port
    assert gen["environment"]["DITSERVE_HEALTH_TLS_CA"] == "${DITSERVE_TLS_CERT:-}"
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    for env, tls in (("", None), ("/etc/ditserve/tls/tls.crt", Path("/etc/ditserve/tls/tls.crt"))):
        argv = [a.replace("${DITSERVE_TLS_CERT:-}", env).replace("${DITSERVE_TLS_KEY:-}", env) for a in gen["command"]]
        argv = [a.replace("${DITSERVE_DEVICE:-cpu}", "cpu") for a in argv[1:]]
        cfg = generator_cli.config_from_args(generator_cli.build_parser().parse_args(argv))
        assert cfg.tls_cert == tls  # an empty --tls-cert= is plaintext, not a path
        assert cfg.metrics_bind_host == "0.0.0.0"


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_never_reach_for_the_hub(dockerfile: str) -> None:
    text = (DOCKER / dockerfile).read_text()
    assert re.search(r"^\s+HF_HUB_OFFLINE=1$", text, re.M), "the runtime ENV sets HF_HUB_OFFLINE=1"


# ----------------------------------------------------------------------------- installs
def _lock_module() -> Any:
    spec = importlib.util.spec_from_file_location("ditserve_lock", REPO / "scripts" / "lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pip_installs(dockerfile: str) -> list[str]:
    """Each `pip install ...` command of a Dockerfile's RUN instructions (continuations joined)."""
    text = (DOCKER / dockerfile).read_text().replace("\\\n", " ")
    return [m.group(0) for m in re.finditer(r"pip install[^&\n]*", text)]


def test_lock_files_are_current() -> None:
    lock = _lock_module()
    assert lock.check() == []


def test_lock_check_fails_when_pyproject_moves_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What CI runs (scripts/test.sh: lock.py --check) refuses a lock compiled from other dependencies."""
    lock = _lock_module()
    edited = tmp_path / "pyproject.toml"
    edited.write_text((REPO / "pyproject.toml").read_text().replace('"tqdm>=4.66"', '"tqdm>=4.66", "rich>=13"'))
    monkeypatch.setattr(lock, "PYPROJECT", edited)
    problems = lock.check()
    assert problems and all("stale" in p for p in problems), problems
    # a hand-edited pin that no longer satisfies pyproject.toml is named too, even under a matching digest
    bad = tmp_path / "requirements.lock"
    bad.write_text(
        re.sub(r"^diffusers==\S+", "diffusers==0.41.0", (REPO / "requirements.lock").read_text(), flags=re.M)
    )
    monkeypatch.setattr(lock, "PYPROJECT", REPO / "pyproject.toml")
    monkeypatch.setattr(lock, "RUNTIME_LOCK", bad)
    monkeypatch.setattr(lock, "LOCKS", (bad, lock.DEV_LOCK, lock.CUDA_LOCK))
    assert any("diffusers==0.41.0" in p for p in lock.check())


def test_locks_pin_everything_with_hashes_and_the_torch_stack_apart() -> None:
    lock = _lock_module()
    for path in lock.LOCKS:
        entries = lock.blocks(path.read_text())
        assert entries, path.name
        for name, lines in entries.items():
            assert "==" in lines[0] and any("--hash=sha256:" in ln for ln in lines), f"{path.name}: {name}"
        stack = {n for n in entries if lock.TORCH_STACK.match(n)}
        assert stack == (set(entries) if path == lock.CUDA_LOCK else set()), path.name
    # torch and torchvision: exact pins (torchvision names the torch it was built against), locked as pinned
    pinned = {Requirement(r).name: Requirement(r) for r in lock.torch_requirements()}
    assert set(pinned) == {"torch", "torchvision", "torchaudio"}
    cuda = lock.pins(lock.CUDA_LOCK.read_text())
    for name, req in pinned.items():
        [spec] = req.specifier
        assert spec.operator == "==", req
        assert cuda[name] == [(spec.version, "")], name


def test_dev_tools_are_pinned_exactly() -> None:
    import tomllib

    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    for text in dev:
        [spec] = Requirement(text).specifier
        assert spec.operator == "==", text


def test_bootstrap_installs_the_locks_with_hashes() -> None:
    script = (REPO / "scripts" / "bootstrap.sh").read_text()
    # the torch stack too: nothing installed without a hash, nothing resolved
    assert (
        "--require-hashes --no-deps -r requirements.lock -r requirements-dev.lock -r requirements-cuda.lock" in script
    )
    assert "requirements-torch.txt" not in script  # the pins are lock.py's input, not an install
    assert "--no-deps --no-build-isolation -e ." in script
    assert "pip check" in script


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_install_only_from_hashed_locks(dockerfile: str) -> None:
    installs = _pip_installs(dockerfile)
    assert all("--no-deps" in cmd for cmd in installs), installs  # nothing resolved at build time
    hashed = [cmd for cmd in installs if "--require-hashes" in cmd]
    # the torch stack (its own layer), then the rest; the same in both images
    assert [re.search(r"-r (\S+)", cmd).group(1) for cmd in hashed] == ["requirements-cuda.lock", "requirements.lock"]  # type: ignore[union-attr]
    others = [cmd for cmd in installs if "--require-hashes" not in cmd]
    assert len(others) == 1 and "--no-build-isolation ." in others[0]  # ditserve itself


def test_cuda_image_base_matches_the_cuda_of_the_locked_torch() -> None:
    lock = _lock_module()
    m = re.search(
        r"^ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.\d+-base-\S+$", (DOCKER / "Dockerfile.cuda").read_text(), re.M
    )
    assert m, "CUDA_IMAGE is an nvidia/cuda base image"
    [runtime] = {version for version, _ in lock.pins(lock.CUDA_LOCK.read_text())["nvidia-cuda-runtime"]}
    assert runtime.split(".")[:2] == [m.group(1), m.group(2)], f"torch's CUDA runtime {runtime} vs {m.group(0)}"


def test_cuda_image_starts_through_the_allocator_guard() -> None:
    text = (DOCKER / "Dockerfile.cuda").read_text()
    assert "COPY --chmod=0755 docker/cuda-entrypoint.sh /opt/ditserve/entrypoint.sh" in text
    assert re.search(r'^ENTRYPOINT \["/opt/ditserve/entrypoint.sh"\]$', text, re.M)


@pytest.mark.parametrize(
    ("var", "value", "refused"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", True),
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments : true", True),
        ("PYTORCH_ALLOC_CONF", "expandable_segments:True", True),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False", False),
        ("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6,max_split_size_mb:64", False),
        ("PYTORCH_CUDA_ALLOC_CONF", "", False),
    ],
)
def test_cuda_entrypoint_refuses_expandable_segments(var: str, value: str, refused: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update({var: value, "DITSERVE_BIN": "echo"})  # `echo` stands in for ditserve
    res = subprocess.run(
        ["sh", str(CUDA_ENTRYPOINT), "serve", "--device", "cuda"], env=env, capture_output=True, text=True
    )
    if refused:
        assert res.returncode == 2 and res.stdout == ""
        assert f"{var}=" in res.stderr and "expandable_segments:True" in res.stderr and "CUDA IPC" in res.stderr
    else:
        assert res.returncode == 0 and res.stdout == "serve --device cuda\n", res.stderr


# ----------------------------------------------------------------------------- healthcheck.py
@pytest.fixture
def sidecar(tiny_ckpt: Path) -> Iterator[tuple[Any, str]]:
    """A real sidecar on a unix socket (short dir: AF_UNIX paths are limited to 107 bytes)."""
    run_dir = Path(tempfile.mkdtemp(prefix="dhc-"))
    socket = run_dir / "s" / "plancache.sock"
    args = ["--checkpoint", str(tiny_ckpt), "--socket", str(socket), "--host-cache-gb", "0", "--gpu-plans", "4"]
    server = build_server(config_from_args(build_parser().parse_args(args)))
    server.start()
    try:
        yield server, f"unix:{socket}"
    finally:
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=60)


def test_healthcheck_exit_codes_against_a_real_sidecar(sidecar: tuple[Any, str]) -> None:
    server, target = sidecar
    ok = _healthcheck(target, SIDECAR_SERVICE)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    assert _healthcheck(target.removeprefix("unix:")).returncode == 0  # bare socket path, whole server
    unknown = _healthcheck(target, "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    server.set_serving(False)
    assert _healthcheck(target, SIDECAR_SERVICE).returncode == 1
    assert _healthcheck(target, SIDECAR_SERVICE, "--alive").returncode == 0


def test_healthcheck_fails_when_nothing_listens_and_on_bad_usage(tmp_path: Path) -> None:
    down = _healthcheck(f"unix:{tmp_path / 'none.sock'}", "--timeout-s", "2")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    assert _healthcheck("127.0.0.1:1", "--timeout-s", "0").returncode == 2
    assert _healthcheck("127.0.0.1:1", "--tls-server-name", "x").returncode == 2  # TLS flags need --tls-ca
    unreadable = _healthcheck("127.0.0.1:1", "--tls-ca", str(tmp_path / "none.pem"))
    assert unreadable.returncode == 2 and "--tls-ca" in unreadable.stderr


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_health(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A real grpc.health.v1 server over TLS, its certificate signed by a CA and naming ditserve.test.svc only;
    (port, the server's certificate)."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    d = tmp_path_factory.mktemp("tlshc")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)  # fmt: skip
    (d / "ext").write_text("subjectAltName=DNS:ditserve.test.svc\nextendedKeyUsage=serverAuth\n")
    _openssl("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=ditserve", cwd=d)
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "tls.crt", "-days", "2", "-extfile", "ext", cwd=d)  # fmt: skip
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    creds = grpc.ssl_server_credentials([((d / "tls.key").read_bytes(), (d / "tls.crt").read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        yield port, d / "tls.crt"
    finally:
        server.stop(None)


def test_healthcheck_speaks_tls_trusting_the_served_certificate(
    tls_health: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the Kubernetes probes run: --tls-ca is the server's own tls.crt (no CA file in the pod), the name
    is the one in the certificate; plaintext against the TLS port, or another name, fails."""
    port, cert = tls_health
    target = f"127.0.0.1:{port}"
    ok = _healthcheck(target, "--tls-ca", str(cert), "--tls-server-name", "ditserve.test.svc", "--alive")
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    assert _healthcheck(target, "--timeout-s", "2").returncode == 1  # plaintext to a TLS port
    wrong = _healthcheck(target, "--tls-ca", str(cert), "--tls-server-name", "other.name", "--timeout-s", "2")
    assert wrong.returncode == 1
    # the probes' form: the flags come from the container's environment
    monkeypatch.setenv("DITSERVE_HEALTH_TLS_CA", str(cert))
    monkeypatch.setenv("DITSERVE_HEALTH_TLS_SERVER_NAME", "ditserve.test.svc")
    assert _healthcheck(target, "--alive").returncode == 0
    monkeypatch.setenv("DITSERVE_HEALTH_TLS_CA", "")  # compose's ${DITSERVE_TLS_CERT:-} unset: plaintext
    monkeypatch.setenv("DITSERVE_HEALTH_TLS_SERVER_NAME", "")
    assert _healthcheck(target, "--timeout-s", "2").returncode == 1


# ----------------------------------------------------------------------------- Kubernetes: a replica across nodes
K8S_NODES = DOCKER / "k8s-replica-nodes"
NODES, GPUS_PER_NODE = 2, 8
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@pytest.fixture(scope="module")
def nodes_sts() -> dict[str, Any]:
    return _load(K8S_NODES / "statefulset.yaml")


def _expand(values: list[str], container: dict[str, Any], samples: dict[str, str]) -> list[str]:
    """`values` with the kubelet's $(VAR) references replaced by sample values; every reference must name a variable of
    the container's env (the kubelet leaves an unknown one as literal text)."""
    defined = {e["name"] for e in container.get("env", [])}
    refs = {m for v in values for m in ENV_REF.findall(v)}
    assert refs <= defined, f"undefined env references {refs - defined}"
    return [ENV_REF.sub(lambda m: samples[m.group(1)], v) for v in values]


def test_k8s_replica_nodes_manifests_pass_kubernetes_validate() -> None:
    """What validate_deploy.sh runs on docker/k8s, on docker/k8s-replica-nodes: every resource against the API schema,
    --strict (no unknown field); the kustomization lists every resource file."""
    files = sorted(p for p in K8S_NODES.glob("*.yaml") if p.name != "kustomization.yaml")
    assert set(_load(K8S_NODES / "kustomization.yaml")["resources"]) == {p.name for p in files}
    venv_tool = Path(sys.executable).parent / "kubernetes-validate"
    tool = str(venv_tool) if venv_tool.exists() else shutil.which("kubernetes-validate")
    assert tool, "kubernetes-validate not found (install the dev extras: pip install -e '.[dev]')"
    res = subprocess.run([tool, "--strict", "--quiet", *map(str, files)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"kubernetes-validate failed:\n{res.stdout}\n{res.stderr}"


def test_k8s_replica_nodes_is_a_parallel_statefulset_of_two_pods_with_dns(nodes_sts: dict[str, Any]) -> None:
    spec = nodes_sts["spec"]
    assert nodes_sts["kind"] == "StatefulSet"
    assert spec["replicas"] == NODES
    assert spec["podManagementPolicy"] == "Parallel"  # pod 0 is not ready before pod 1 has joined
    pods = _load(K8S_NODES / "service-nodes.yaml")
    assert spec["serviceName"] == pods["metadata"]["name"]
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["publishNotReadyAddresses"] is True  # the rendezvous resolves pod 0 before it is ready
    assert pods["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert {p["port"] for p in pods["spec"]["ports"]} >= {29400, 50052}
    # per-pod state, CUDA IPC within a pod, 8 GPUs each
    assert [t["metadata"]["name"] for t in spec["volumeClaimTemplates"]] == ["state"]
    pod = spec["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    [sidecar], [generator] = pod["initContainers"], pod["containers"]
    assert sidecar["restartPolicy"] == "Always"
    volumes = {v["name"]: v for v in pod["volumes"]}
    for c in (sidecar, generator):
        [shm] = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert generator["resources"]["limits"]["nvidia.com/gpu"] == GPUS_PER_NODE
    assert "nvidia.com/gpu" not in sidecar["resources"].get("limits", {})


def test_k8s_replica_nodes_generator_runs_torchrun_with_the_pod_index_as_node_rank(nodes_sts: dict[str, Any]) -> None:
    pod = nodes_sts["spec"]["template"]["spec"]
    [generator] = pod["containers"]
    command = generator["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"] and command[-2:] == ["-m", "generator_service"]
    assert _flag(command, "--nnodes") == str(NODES)
    assert _flag(command, "--node-rank") == "$(NODE_RANK)"
    assert _flag(command, "--rdzv-backend") == "static"
    pod0 = f"{nodes_sts['metadata']['name']}-0.{nodes_sts['spec']['serviceName']}.$(POD_NAMESPACE).svc"
    assert _flag(command, "--rdzv-endpoint") == f"{pod0}:29400"  # pod 0's DNS name: node rank 0 hosts the store
    assert _flag(command, "--nproc-per-node") == str(GPUS_PER_NODE)
    assert int(_flag(command, "--max-restarts")) >= 1
    env = {e["name"]: e for e in generator["env"]}
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    _expand(command, generator, {"NODE_RANK": "1", "POD_NAMESPACE": "ns"})  # every reference is defined
    # torchrun's own parser takes the command line (the kubelet's substitution done)
    from torch.distributed.run import get_args_parser

    targs = get_args_parser().parse_args(_expand(command[3:], generator, {"NODE_RANK": "1", "POD_NAMESPACE": "ns"}))
    assert (targs.nnodes, targs.node_rank, targs.nproc_per_node) == (str(NODES), 1, str(GPUS_PER_NODE))
    assert targs.module and targs.training_script == "generator_service"


def test_k8s_replica_nodes_probe_grpc_on_pod_0_only(nodes_sts: dict[str, Any]) -> None:
    """One template for both pods: each generator probe runs pod 0's gRPC health check (TLS, as docker/k8s) when
    NODE_RANK is 0, and only a check that torchrun's agent lives elsewhere (no gRPC port there)."""
    [generator] = nodes_sts["spec"]["template"]["spec"]["containers"]
    check = "python /opt/ditserve/healthcheck.py 127.0.0.1:50051"
    expected = {"startupProbe": "--alive", "livenessProbe": "--alive", "readinessProbe": GENERATOR_SERVICE}
    for name, last in expected.items():
        shell, dash_c, script = generator[name]["exec"]["command"]
        assert (shell, dash_c) == ("sh", "-c"), name
        pod0, _, others = script.partition("else")
        assert pod0.startswith('if [ "$NODE_RANK" = 0 ]; then') and f"{check} {last};" in pod0, name
        assert "healthcheck.py" not in others and "torch[.]distributed[.]run" in others, name
    env = {e["name"]: e for e in generator["env"]}
    assert env["DITSERVE_HEALTH_TLS_CA"]["value"] == _flag(generator["args"], "--tls-cert")
    assert env["DITSERVE_HEALTH_TLS_SERVER_NAME"]["value"] == "ditserve.$(POD_NAMESPACE).svc"


def test_k8s_replica_nodes_generator_and_sidecar_args_are_valid(nodes_sts: dict[str, Any], tmp_path: Path) -> None:
    """Each pod's generator flags parse into a GeneratorConfig naming its own sidecar over TCP (mutual TLS) at the
    pod's DNS name, one rank per local GPU, Ulysses 8 x ring 2 by default on 2 x 8 ranks; the sidecar's parse into a
    SidecarConfig listening on TCP with mutual TLS, one slab per rank on the same GPUs."""
    import torch

    pod = nodes_sts["spec"]["template"]["spec"]
    [sidecar], [generator] = pod["initContainers"], pod["containers"]
    token = tmp_path / "token"
    token.write_text("k8s-manifest-test-token\n")
    token.chmod(0o440)
    samples = {"POD_NAME": "ditserve-1", "POD_NAMESPACE": "ns", "NODE_RANK": "1"}

    args = _expand(generator["args"], generator, samples)
    args = [a.replace("/etc/ditserve/admin/token", str(token)) for a in args]
    cfg = generator_cli.config_from_args(generator_cli.build_parser().parse_args(args))
    assert cfg.sidecar_tcp and cfg.sidecar == "ditserve-1.ditserve-nodes.ns.svc:50052"
    devices = [cfg.rank_device(r) for r in range(GPUS_PER_NODE)]
    assert devices == [f"cuda:{r}" for r in range(GPUS_PER_NODE)]
    assert _flag(generator["command"], "--nproc-per-node") == str(len(devices))
    ranks = Ranks(rank=0, world_size=NODES * GPUS_PER_NODE, local_rank=0, node_rank=0, local_world_size=GPUS_PER_NODE)
    spec = cfg.parallel_spec(ranks, torch.device("cuda"))
    assert (spec.ulysses_degree, spec.ring_degree) == (GPUS_PER_NODE, NODES)  # Ulysses in a node, ring across
    spec.check(NODES * GPUS_PER_NODE, 56, "nccl")  # the released transformer's 56 heads

    side_args = [a.replace("/etc/ditserve/admin/token", str(token)) for a in sidecar["args"][1:]]
    side = config_from_args(build_parser().parse_args(_expand(side_args, sidecar, samples)))
    assert side.tcp and side.address == "0.0.0.0:50052"
    assert cfg.sidecar.rsplit(":", 1)[1] == side.address.rsplit(":", 1)[1]
    assert None not in (side.tls_cert, side.tls_key, side.tls_client_ca)
    assert list(side.cache.slab_devices) == devices
    assert side.admin_secret == cfg.admin_secret  # rank 0 presents its token to every TCP sidecar

    # the TLS files are the mounted Secrets: the public one as in docker/k8s, the sidecars' own for both ends
    assert _mounted_secret(pod, generator, str(cfg.tls_cert))[:2] == ("ditserve-tls", "tls.crt")
    assert _mounted_secret(pod, generator, str(cfg.tls_key))[:2] == ("ditserve-tls", "tls.key")
    for c, path in ((generator, cfg.sidecar_tls_cert), (sidecar, side.tls_cert)):
        assert _mounted_secret(pod, c, str(path))[:2] == ("ditserve-sidecar-tls", "tls.crt")
    for c, path in ((generator, cfg.sidecar_tls_ca), (sidecar, side.tls_client_ca)):
        assert _mounted_secret(pod, c, str(path))[:2] == ("ditserve-sidecar-tls", "ca.crt")
    for c in (sidecar, generator):
        assert _mounted_secret(pod, c, "/etc/ditserve/admin/token") == ("ditserve-admin", "token", 0o440)
    # the sidecar's probes: mutual TLS to its TCP port, expecting the pod's name the generator dials
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    assert _expand([env["DITSERVE_HEALTH_TLS_SERVER_NAME"]], sidecar, samples) == [cfg.sidecar.rsplit(":", 1)[0]]
    assert env["DITSERVE_HEALTH_TLS_CERT"] == str(side.tls_cert)
    assert env["DITSERVE_HEALTH_TLS_CA"] == str(side.tls_client_ca)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["exec"]["command"][2:4] == ["127.0.0.1:50052", SIDECAR_SERVICE], probe


def test_k8s_replica_nodes_public_service_selects_pod_0_only(nodes_sts: dict[str, Any]) -> None:
    service = _load(K8S_NODES / "service.yaml")
    selector = service["spec"]["selector"]
    assert selector["apps.kubernetes.io/pod-index"] == "0"  # a string: label values are
    labels = nodes_sts["spec"]["template"]["metadata"]["labels"]
    assert {k: v for k, v in selector.items() if k != "apps.kubernetes.io/pod-index"}.items() <= labels.items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc"} and ports["grpc"]["port"] == 50051
    assert ports["grpc"].get("appProtocol") != "kubernetes.io/h2c"
