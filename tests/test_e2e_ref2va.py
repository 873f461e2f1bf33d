"""End-to-end ref2va: the sidecar and the generator as real processes serving a tiny repository with both transformer
partitions, driven by `ditserve generate --reference ...` and by the real grpcurl (references inline as base64, and
uploaded with UploadReference as a client stream). A request with an image, a short MP4 with sound and a WAV hashes
exactly as diffusers' own ref2va workflow; t2va and fl2va requests on the same replica keep their sha256; a
repository without transformer_ref/ refuses ref2va with FAILED_PRECONDITION naming it; bad references are refused
INVALID_ARGUMENT naming `references[i]` before any work."""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from oracle import diffusers_request_latents, pil_image
from refmedia import image_bytes, video_bytes, wav_bytes
from servicekit import REPO_ROOT, process_group, service_env
from test_e2e_grpcurl import Services, run_grpcurl

from ditcore import latents_sha256, write_repository
from ditcore.request import GenerationRequest

pytestmark = pytest.mark.e2e

PROMPT = "a red fox jumps"
STEPS, SEED = 4, 3


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("refmedia")
    files = {
        "img.png": image_bytes(80, 48, seed=1),
        "clip.mp4": video_bytes(frames=30, fps=30, width=64, height=36, audio_rate=48000, seed=2),
        "voice.wav": wav_bytes(1.5, 44100, channels=1, seed=3),
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    return {name: d / name for name in files}


_ORACLE = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from oracle import diffusers_request_latents, reference_from_bytes
from ditcore import latents_sha256
from ditcore.references import Reference
from ditcore.request import GenerationRequest
refs = tuple(Reference(Path(p).read_bytes()) for p in sys.argv[3:])
req = GenerationRequest(prompt=%r, num_inference_steps=%d, seed=%d, task="ref2va", references=refs)
video, audio = diffusers_request_latents(Path(sys.argv[2]), req, kinds=["image", "video", "audio"])
print(latents_sha256(video, audio))
"""


@pytest.fixture(scope="module")
def oracle_sha(svc_ckpt: Path, media: dict[str, Path]) -> str:
    """diffusers' own ref2va workflow on the same request, in a fresh interpreter (as the services run: torch's
    default threads, nothing another test set in this process)."""
    code = _ORACLE % (PROMPT, STEPS, SEED)
    files = [media[n] for n in ("img.png", "clip.mp4", "voice.wav")]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), str(svc_ckpt), *map(str, files)],
        capture_output=True, text=True, env=service_env(), cwd=REPO_ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()[-1]


@pytest.fixture(scope="module")
def services(request: pytest.FixtureRequest, svc_ckpt: Path) -> Iterator[Services]:
    with process_group(request) as group:
        pair = group.pair(svc_ckpt, gpu_plans=64, plan_width=4, host_cache_bytes=50 * 1000**2).start()
        yield Services(pair.socket_path, pair.target)


def generate(services: Services, data: dict[str, Any], timeout: float = 300) -> Any:
    """grpcurl Generate with the request on stdin (`-d @`: base64 references outgrow an argument list)."""
    args = ["-plaintext", "-emit-defaults", "-max-msg-sz", str(64 * 2**20), "-d", "@", services.target]
    return run_grpcurl([*args, "ditserve.generator.v1.Generator/Generate"], timeout=timeout, input=json.dumps(data))


def ditserve(*args: Any, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ditserve", *[str(a) for a in args]],
        capture_output=True, text=True, env=service_env(), cwd=REPO_ROOT, timeout=timeout,
    )  # fmt: skip


def test_cli_generate_with_three_references_is_diffusers_ref2va(
    services: Services, media: dict[str, Path], oracle_sha: str, tmp_path: Path
) -> None:
    proc = ditserve(
        "generate", "--target", services.target, "--prompt", PROMPT, "--num-inference-steps", STEPS,
        "--seed", SEED, "--reference", media["img.png"], "--reference", media["clip.mp4"],
        "--reference", media["voice.wav"], "--out", tmp_path / "fox.mp4",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.splitlines()[-1])
    assert line["sha256"] == oracle_sha
    assert (tmp_path / "fox.mp4").stat().st_size > 0


def _grpcurl_request(media: dict[str, Path], **extra: Any) -> dict[str, Any]:
    refs = [{"data": base64.b64encode(media[n].read_bytes()).decode()} for n in ("img.png", "clip.mp4", "voice.wav")]
    return {"prompt": PROMPT, "num_inference_steps": STEPS, "seed": SEED, "references": refs, **extra}


def _sha(response: dict[str, Any]) -> str:
    return str(response["sha256"])


def test_grpcurl_generate_with_base64_references(services: Services, media: dict[str, Path], oracle_sha: str) -> None:
    r = generate(services, _grpcurl_request(media, task="TASK_REF2VA"))
    assert r.code == 0, r.text
    assert _sha(r.json()) == oracle_sha


def test_grpcurl_upload_then_generate_by_upload_id(services: Services, media: dict[str, Path], oracle_sha: str) -> None:
    data = media["clip.mp4"].read_bytes()
    half = len(data) // 2
    chunks = [
        {"chunk": base64.b64encode(data[:half]).decode(), "kind": "REFERENCE_KIND_VIDEO"},
        {"chunk": base64.b64encode(data[half:]).decode()},
    ]
    r = run_grpcurl(["-plaintext", "-d", "@", services.target, "ditserve.generator.v1.Generator/UploadReference"],
                    input="\n".join(json.dumps(c) for c in chunks))  # fmt: skip
    assert r.code == 0, r.text
    upload = r.json()
    assert (
        upload["kind"] == "video" and int(upload["size_bytes"]) == len(data) and upload["upload_id"].startswith("upl_")
    )
    req = _grpcurl_request(media)  # task unset: references make it ref2va
    req["references"][1] = {"upload_id": upload["upload_id"], "kind": "REFERENCE_KIND_VIDEO"}
    r = generate(services, req)
    assert r.code == 0, r.text
    assert _sha(r.json()) == oracle_sha
    req["references"][1] = {"upload_id": "upl_" + "0" * 32}
    r = generate(services, req)
    assert r.code == 64 + 3 and "references[1].upload_id: no upload" in r.text, r.text


def test_t2va_and_fl2va_keep_their_sha256_beside_ref2va(services: Services, svc_ckpt: Path) -> None:
    png = image_bytes(32, 32, seed=9)
    for fields in ({}, {"first_frame": png}):
        req = GenerationRequest(prompt=PROMPT, num_inference_steps=STEPS, seed=SEED, **fields).with_task_inferred()
        data = {"prompt": PROMPT, "num_inference_steps": STEPS, "seed": SEED}
        if fields:
            data["first_frame"] = base64.b64encode(png).decode()
        r = services.gen("ditserve.generator.v1.Generator/Generate", data=data, timeout=300)
        assert r.code == 0, r.text
        video, audio = diffusers_request_latents(
            svc_ckpt, dataclasses.asdict(req) | {"first_frame": png if fields else b""}
        )
        assert _sha(r.json()) == latents_sha256(video, audio), fields
    assert pil_image(png).size == (32, 32)


def test_status_reports_both_partitions(services: Services) -> None:
    r = services.gen("ditserve.generator.v1.Generator/GetStatus")
    assert r.code == 0, r.text
    parts = {p["name"]: p for p in r.json()["partitions"]}
    assert set(parts) == {"base", "ref"} and all(p["loaded"] for p in parts.values())
    assert parts["ref"]["folder"] == "transformer_ref" and parts["ref"]["tasks"] == ["ref2va"]
    for p in parts.values():
        memory = p["memory"]
        assert (
            int(memory["held_plan_bytes"]) == 0 and int(memory["saved_bytes"]) == int(memory["plan_tensor_bytes"]) > 0
        )
    names = [c["name"] for c in r.json()["components"]]
    assert names[:2] == ["transformer", "transformer_ref"]
    r = services.side("ditserve.plancache.v1.PlanCache/GetState")
    assert {p["name"] for p in r.json()["partitions"]} == {"base", "ref"}


@pytest.mark.parametrize(
    ("refs", "field", "words"),
    [
        ([{"data": base64.b64encode(b"not media at all").decode()}], "references[0]", "not a readable"),
        ([{"data": base64.b64encode(wav_bytes()).decode()}], "references[0]", "paired with at least one image"),
        ([{"data": base64.b64encode(video_bytes(frames=6)).decode()}], "references[0]", "at least 13 frames"),
    ],
)
def test_bad_references_are_invalid_argument_naming_the_index(
    services: Services, refs: list[dict[str, str]], field: str, words: str
) -> None:
    r = services.gen("ditserve.generator.v1.Generator/Generate", data={"prompt": PROMPT, "references": refs})
    assert r.code == 64 + 3, r.text
    assert f"{field}: " in r.text and words in r.text


def test_a_repository_without_transformer_ref_refuses_ref2va(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, media: dict[str, Path]
) -> None:
    repo = write_repository(tmp_path_factory.mktemp("baseonly") / "r", "tiny", seed=0, dtype="mixed", shards=1,
                            partitions=("base",))  # fmt: skip
    with process_group(request) as group:
        pair = group.pair(repo, plan_width=4).start()
        s = Services(pair.socket_path, pair.target)
        r = generate(s, _grpcurl_request(media))
        assert r.code == 64 + 9, r.text  # FAILED_PRECONDITION
        assert "transformer_ref/" in r.text and "t2va, fl2va" in r.text
        r = s.gen("ditserve.generator.v1.Generator/Generate", data={"prompt": PROMPT, "num_inference_steps": 2})
        assert r.code == 0, r.text
