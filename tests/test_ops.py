"""Operations: every metric moves when it should, JSON logs, operator limits, TLS and mTLS."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from servicekit import Pair, request_keys

from ditcore import validate_checkpoint, write_repository
from ditcore.request import MAX_FRAMES
from ditruntime.obs import JsonFormatter
from ditserve.client import GeneratorClient
from generator_service.config import GeneratorConfig
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.metrics import sidecar_registry
from plancache_service.rebuild import RebuildSource
from plancache_service.sidecar import Sidecar
from protos.ditserve.generator.v1 import generator_pb2 as gpb

pytestmark = pytest.mark.processes  # openssl makes the certificates

STEPS = 5
"""Transformer forwards per request: STEPS + 1 grid points, STEPS distinct plans. Every request's first plan is the
same (video and audio both at t = 0), so two requests with other shifts share one plan."""


def req(shift: float, audio: float, **kw: object) -> dict[str, object]:
    return {
        "prompt": "ops",
        "num_inference_steps": STEPS + 1,
        "flow_shift": shift,
        "audio_flow_shift": audio,
        "height": 32,
        "width": 32,
        **kw,
    }


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="dops-") as d:
        r = Path(d)
        write_repository(r / "A", "tiny", seed=0, dtype="mixed", shards=2)
        write_repository(r / "B", "tiny", seed=1, dtype="mixed", shards=2)
        yield r


@contextlib.contextmanager
def pair(root: Path, gpu_plans: int, **gen_kw: Any) -> Iterator[tuple[Any, Any]]:
    """A started in-process pair on checkpoint A with metrics on both sides; (sidecar, generator) servers."""
    options: dict[str, Any] = {"admin_token": "tok-0123456789abcdef", "weights_root": root, "metrics_port": 0, **gen_kw}
    with Pair(root / "A", gpu_plans=gpu_plans, host_cache_bytes=10**8, heartbeat_s=0.2, sidecar_metrics_port=0,
              **options) as p:  # fmt: skip
        p.start()
        yield p.sidecar, p.generator


def test_metrics_move_when_they_should(root: Path) -> None:
    with pair(root, gpu_plans=STEPS) as (side, gen):
        sp, gp = side.metrics.port, gen.metrics_server.port
        s0, g0 = scrape(sp), scrape(gp)
        assert val(s0, "ditserve_plancache_generation") == 1
        assert val(g0, "ditserve_generator_queue_depth") == 0
        assert val(g0, "ditserve_generator_sidecar_connected") == 1
        with GeneratorClient(f"127.0.0.1:{gen.port}") as c:
            c.generate(req(5.0, 3.0))  # built
            s1 = scrape(sp)
            assert val(s1, "ditserve_plancache_plans_total", tier="built") == STEPS
            assert val(s1, "ditserve_plancache_rebuild_passes_total") == 1
            assert val(s1, "ditserve_plancache_rebuild_seconds_total") > 0
            c.generate(req(5.0, 3.0))  # slot hits
            s2 = scrape(sp)
            assert val(s2, "ditserve_plancache_plans_total", tier="slot_hit") == STEPS
            c.generate(req(4.0, 2.0))  # evicts A's plans (all but the shared first one) from the 5-slot slab
            c.generate(req(5.0, 3.0))  # swaps A back in from the host tier
            s3 = scrape(sp)
            assert val(s3, "ditserve_plancache_plans_total", tier="host_hit") > 0
            assert val(s3, "ditserve_plancache_swap_in_bytes_total") > 0
            assert val(s3, "ditserve_plancache_swap_in_seconds_total") > 0
            assert val(s3, "ditserve_plancache_evictions_total", tier="slot") > 0
            assert val(s3, "ditserve_plancache_host_groups") == 2
            assert val(s3, "ditserve_plancache_host_bytes", kind="used") > 0
            assert val(s3, "ditserve_plancache_slots", state="ready") == STEPS
            assert val(s3, "ditserve_plancache_rpc_requests_total", method="PreparePlans", code="OK") == 4
            with pytest.raises(grpc.RpcError):
                c.generate_unary({"prompt": "ops", "num_inference_steps": 0})
            c.generate_unary(req(5.0, 3.0))
        g1 = scrape(gp)
        assert val(g1, "ditserve_generator_rpc_requests_total", method="GenerateStream", code="OK") == 4
        assert val(g1, "ditserve_generator_rpc_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
        assert val(g1, "ditserve_generator_rpc_requests_total", method="Generate", code="OK") == 1
        assert val(g1, "ditserve_generator_request_stage_seconds_count", stage="denoise") == 5
        assert val(g1, "ditserve_generator_request_stage_seconds_count", stage="queue") == 5
        assert val(g1, "ditserve_generator_plans_total", tier="built") >= STEPS
        assert val(g1, "ditserve_generator_plans_total", tier="host_hit") > 0
        assert val(g1, "ditserve_generator_requests_total", outcome="ok") == 5
        # a weight update moves the generation and the update counters on both sides
        stub = gen.backend  # noqa: F841 - keep the server referenced
        with grpc.insecure_channel(f"127.0.0.1:{gen.port}") as ch:
            from protos.ditserve.generator.v1 import generator_pb2_grpc as ggrpc

            up = ggrpc.GeneratorStub(ch).UpdateWeights
            up(
                gpb.UpdateWeightsRequest(weights_path="B"),
                metadata=[("authorization", "Bearer tok-0123456789abcdef")],
                timeout=60,
            )
            with pytest.raises(grpc.RpcError):
                up(gpb.UpdateWeightsRequest(weights_path="B"), metadata=[("authorization", "Bearer bad")], timeout=60)
        g2, s4 = scrape(gp), scrape(sp)
        assert val(g2, "ditserve_generator_generation") == 2
        assert val(g2, "ditserve_generator_weight_updates_total", outcome="committed") == 1
        assert val(g2, "ditserve_generator_weight_updates_total", outcome="BAD_TOKEN") == 1
        assert val(s4, "ditserve_plancache_generation") == 2
        assert val(s4, "ditserve_plancache_weight_updates_total", outcome="committed") == 1


def test_lease_and_pressure_gauges_move(root: Path) -> None:
    info = validate_checkpoint(root / "A")
    page = info.layout.page_bytes(info.projection_dtype)
    cache = PlanCache(CacheConfig(gpu_plans=STEPS, host_cache_bytes=3 * page), RebuildSource(info, torch.device("cpu")))
    try:
        sidecar = Sidecar(cache)
        reg = sidecar_registry(sidecar)
        keys = request_keys(root / "A", req(5.0, 3.0))  # 9 pages: widths 1, 2, 2, 2, 2
        session = sidecar.attach("test")
        lease = sidecar.prepare(session.session_id, 1 if cache.generation == 1 else cache.generation, keys)
        assert reg.get_sample_value("ditserve_plancache_leases") == 1
        assert reg.get_sample_value("ditserve_plancache_host_pressure_skips_total") == 1  # group > 3 pages
        sidecar.release(session.session_id, lease.lease_id)
        assert reg.get_sample_value("ditserve_plancache_leases") == 0
        assert reg.get_sample_value("ditserve_plancache_session_attached") == 1
        sidecar.detach(session.session_id)
        assert reg.get_sample_value("ditserve_plancache_session_attached") == 0
    finally:
        cache.close()


def test_json_log_lines_carry_request_fields() -> None:
    rec = logging.makeLogRecord({"msg": "request %s done", "args": ("r1",), "levelname": "INFO", "name": "x"})
    rec.request_id, rec.generation, rec.timings_ms = "r1", 3, {"denoise_ms": 1.5}
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["msg"] == "request r1 done"
    assert doc["request_id"] == "r1" and doc["generation"] == 3 and doc["timings_ms"] == {"denoise_ms": 1.5}


def test_operator_limits_refuse_with_the_flag_named(root: Path) -> None:
    """--max-num-frames / --max-height / --max-width / --max-prompt-bytes tighten H3's own rules: a request over one
    is INVALID_ARGUMENT naming the field and the flag; H3's rules still apply under them."""
    limits = {
        "max_num_frames": 141,
        "max_height": 64,
        "max_width": 96,
        "max_prompt_bytes": 3,
        "max_canvas_pixels": 64 * 96,
    }
    with pair(root, gpu_plans=64, **limits) as (_, gen), GeneratorClient(f"127.0.0.1:{gen.port}") as c:
        ok = {"prompt": "ok", "num_inference_steps": 2, "flow_shift": 3.0, "audio_flow_shift": 3.0}
        for field, value, flag in (
            ("num_frames", 158, "--max-num-frames"),  # 17n + 5: valid for H3, over this server's limit
            ("height", 96, "--max-height"),
            ("width", 128, "--max-width"),
            ("prompt", "long", "--max-prompt-bytes"),
            ("height", (96, 96), "--max-height"),  # over its side limit and over the area: the side is named
        ):
            extra = {"height": value[0], "width": value[1]} if isinstance(value, tuple) else {field: value}
            with pytest.raises(grpc.RpcError) as e:
                c.generate_unary({**ok, **extra})
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = e.value.details() or ""
            assert details.startswith(f"{field}: ") and flag in details, details
        with pytest.raises(grpc.RpcError) as e:
            c.generate_unary({**ok, "num_frames": 130})  # under the limit, but not 17n + 5: H3's rule, no flag
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max" not in (e.value.details() or "")
        res = c.generate_unary({**ok, "num_frames": 141, "height": 64, "width": 96})
        assert res.sha256 and res.video.shape[3:] == (4, 6)
    with pytest.raises(ValueError, match="--max-num-frames"):
        GeneratorConfig(sidecar="unix:/s", max_num_frames=MAX_FRAMES + 17)


def _cert(d: Path, name: str, ca: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    key, crt = d / f"{name}.key", d / f"{name}.crt"
    if ca is None:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", crt, "-days", "2",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        return key, crt
    csr = d / f"{name}.csr"
    subprocess.run(
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca[1],
            "-CAkey",
            ca[0],
            "-CAcreateserial",
            "-out",
            crt,
            "-days",
            "2",
        ],
        check=True,
        capture_output=True,
    )
    return key, crt


def test_tls_and_mutual_tls(root: Path, tmp_path: Path) -> None:
    key, crt = _cert(tmp_path, "server")
    ca_key, ca_crt = _cert(tmp_path, "ca")
    ckey, ccrt = _cert(tmp_path, "client", ca=(ca_key, ca_crt))
    with pair(root, gpu_plans=64, tls_cert=crt, tls_key=key) as (_, gen):
        target = f"localhost:{gen.port}"
        creds = grpc.ssl_channel_credentials(crt.read_bytes())
        with GeneratorClient(target, credentials=creds) as c:
            assert c.status().serving
        with GeneratorClient(target) as c, pytest.raises(grpc.RpcError) as e:
            c.status(timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pair(root, gpu_plans=64, tls_cert=crt, tls_key=key, tls_client_ca=ca_crt) as (_, gen):
        target = f"localhost:{gen.port}"
        with (
            GeneratorClient(target, credentials=grpc.ssl_channel_credentials(crt.read_bytes())) as c,
            pytest.raises(grpc.RpcError),
        ):
            c.status(timeout=3)  # no client certificate
        mtls = grpc.ssl_channel_credentials(crt.read_bytes(), ckey.read_bytes(), ccrt.read_bytes())
        with GeneratorClient(target, credentials=mtls) as c:
            assert c.status().serving
