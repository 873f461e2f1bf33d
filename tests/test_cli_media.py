"""Media out and keyframes in through the command line: `generate-local` and `generate` with `--out FILE.mp4|.zip`,
`--output-type`, `--first-frame` / `--last-frame` (fl2va inferred), JSONL keyframe paths, the progress bar, the JSON
line's file fields, the refusals, and the Python client's reassembly checks.

What is checked of a file is what a user would check: PyAV opens the MP4 with one H.264 video stream at 24 fps of
the requested frame count and size and one stereo audio stream lasting num_frames / 24 s (within AAC's priming and
padding); the ZIP holds num_frames PNGs of the requested size and a stereo 16-bit audio.wav of that duration. The
latents' sha256 on the JSON line equals ditcore's in-process result for the same request (decoding does not touch
the latents), and the line's media_sha256 is the file's.
"""

from __future__ import annotations

import hashlib
import io
import json
import wave
import zipfile
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import pytest
from clikit import CliResult, run_cli_inprocess
from PIL import Image
from safetensors.torch import load_file
from servicekit import Pair

from ditcore import GenerationRequest, H3Model, generate, latents_sha256, load_model
from ditserve.client import GeneratorClient
from ditserve.client_requests import request_to_proto
from ditserve.client_results import ClientResult, IntegrityError
from protos.ditserve.generator.v1 import generator_pb2 as pb

FPS = 24
FRAMES, HEIGHT, WIDTH, STEPS = 124, 32, 32, 4
SMALL = ["--num-inference-steps", str(STEPS), "--height", str(HEIGHT), "--width", str(WIDTH)]
SMALL += ["--num-frames", str(FRAMES)]
SECONDS = FRAMES / FPS
AUDIO_TOLERANCE_S = 0.1  # AAC priming and padding (1024-2048 samples at the audio VAE's rate)


# ----------------------------------------------------------------------------- helpers
def _png(path: Path, size: tuple[int, int] = (48, 32), seed: int = 0) -> Path:
    """A small RGB gradient (not the canvas size: the pipeline resizes keyframes)."""
    w, h = size
    img = Image.new("RGB", size)
    img.putdata(
        [((x * 5 + seed * 40) % 256, (y * 7) % 256, (x + y + seed * 9) % 256) for y in range(h) for x in range(w)]
    )
    img.save(path, format="PNG" if path.suffix == ".png" else "JPEG")
    return path


def _request(**overrides: Any) -> GenerationRequest:
    base = GenerationRequest(
        request_id="ref", prompt="a red fox", num_inference_steps=STEPS, height=HEIGHT, width=WIDTH, num_frames=FRAMES
    )
    return GenerationRequest.from_dict(overrides, base)


def _one_line(res: CliResult) -> dict[str, Any]:
    assert res.code == 0, res.err
    lines = [line for line in res.out.splitlines() if line.strip()]
    assert len(lines) == 1, res.out  # stdout: exactly one JSON line per request, nothing else
    line: dict[str, Any] = json.loads(lines[0])
    return line


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_mp4(path: Path, frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH) -> None:
    """One video stream at 24 fps with `frames` frames of width x height; one stereo audio stream of frames / 24 s."""
    with av.open(str(path)) as container:
        videos = [s for s in container.streams if s.type == "video"]
        audios = [s for s in container.streams if s.type == "audio"]
        assert (len(videos), len(audios), len(container.streams)) == (1, 1, 2)
        video, audio = videos[0], audios[0]
        assert video.codec_context.name == "h264"
        assert video.average_rate == Fraction(FPS, 1)
        assert (video.codec_context.width, video.codec_context.height) == (width, height)
        assert audio.codec_context.name == "aac" and audio.layout.nb_channels == 2
        decoded_frames, samples, rate = 0, 0, audio.rate
        for frame in container.decode(video=0, audio=0):
            if isinstance(frame, av.VideoFrame):
                decoded_frames += 1
                assert (frame.width, frame.height) == (width, height)
            else:
                samples += frame.samples
        assert decoded_frames == frames
        assert audio.duration is not None and audio.time_base is not None
        assert abs(float(audio.duration * audio.time_base) - frames / FPS) < AUDIO_TOLERANCE_S
        assert abs(samples / rate - frames / FPS) < AUDIO_TOLERANCE_S


def check_zip(data: bytes, frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH) -> None:
    """frames/000000.png ... (width x height RGB) and a 16-bit stereo audio.wav of frames / 24 s, nothing else."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        assert names == [f"frames/{i:06d}.png" for i in range(frames)] + ["audio.wav"]
        for name in (names[0], names[frames - 1]):
            with Image.open(io.BytesIO(archive.read(name))) as img:
                assert (img.format, img.mode, img.size) == ("PNG", "RGB", (width, height))
        with wave.open(io.BytesIO(archive.read("audio.wav"))) as wav:
            assert (wav.getnchannels(), wav.getsampwidth()) == (2, 2)
            assert abs(wav.getnframes() / wav.getframerate() - frames / FPS) < AUDIO_TOLERANCE_S


# ----------------------------------------------------------------------------- shared state
@pytest.fixture(scope="module")
def model(tiny_ckpt: Path) -> H3Model:
    """The in-process reference (resident; latents only, no decode)."""
    return load_model(tiny_ckpt, "resident")


@pytest.fixture(scope="module")
def keyframes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keyframes")
    return {
        "png": _png(root / "start.png"),
        "jpeg": _png(root / "end.jpg", size=(32, 40), seed=3),
        "text": _text(root / "notes.png"),  # a name that lies: the bytes are text
    }


def _text(path: Path) -> Path:
    path.write_text("not an image, whatever the name says\n")
    return path


@pytest.fixture(scope="module")
def reference(model: H3Model, keyframes: dict[str, Path]) -> dict[str, str]:
    """Latents sha256 of ditcore in process: t2va, fl2va with the PNG first frame, fl2va with both keyframes."""
    first, last = keyframes["png"].read_bytes(), keyframes["jpeg"].read_bytes()
    return {
        "t2va": generate(model, _request()).sha256,
        "fl2va-first": generate(model, _request(task="fl2va", first_frame=first)).sha256,
        "fl2va-both": generate(model, _request(task="fl2va", first_frame=first, last_frame=last)).sha256,
    }


# ----------------------------------------------------------------------------- generate-local
def test_generate_local_writes_an_mp4_with_24_fps_video_and_stereo_audio(
    tiny_ckpt: Path, tmp_path: Path, reference: dict[str, str]
) -> None:
    res = run_cli_inprocess(
        ["generate-local", "--checkpoint", tiny_ckpt, *SMALL, "--prompt", "a red fox", "--out", "fox.mp4"],
        cwd=tmp_path,
    )
    line = _one_line(res)
    path = tmp_path / "fox.mp4"
    check_mp4(path)
    assert line["out"] == str(path.resolve())
    assert (line["output_type"], line["content_type"], line["task"]) == ("mp4", "video/mp4", "t2va")
    assert line["bytes"] == path.stat().st_size and line["media_sha256"] == _sha(path)
    assert line["sha256"] == reference["t2va"]  # the latents, as ditcore computes them, before decoding
    assert {"decode", "mux"} <= set(line["timings_ms"])
    assert "video_shape" not in line  # shapes are for latents results
    assert [p.name for p in tmp_path.iterdir()] == ["fox.mp4"]  # no temporary file left behind
    # --progress auto with stderr not a terminal: no bar of ours
    assert "req-0 decode" not in res.err and "req-0 mux" not in res.err


def test_generate_local_first_frame_is_fl2va_and_the_zip_holds_frames_and_wav(
    tiny_ckpt: Path, tmp_path: Path, keyframes: dict[str, Path], reference: dict[str, str]
) -> None:
    out = tmp_path / "clip.zip"
    argv = ["generate-local", "--checkpoint", tiny_ckpt, *SMALL, "--prompt", "a red fox"]
    res = run_cli_inprocess([*argv, "--first-frame", keyframes["png"], "--out", out, "--progress", "on"])
    line = _one_line(res)
    assert line["task"] == "fl2va"  # inferred from the keyframe
    assert line["sha256"] == reference["fl2va-first"] != reference["t2va"]
    check_zip(out.read_bytes())
    assert (line["out"], line["output_type"]) == (str(out.resolve()), "frames_and_wav")
    assert line["content_type"] == "application/zip"
    assert line["media_sha256"] == _sha(out) and line["bytes"] == out.stat().st_size
    # the bar went to stderr: the steps, then decode, then mux
    err = res.err.replace("\r", "\n")
    assert "req-0 decode" in err and "req-0 mux" in err
    assert err.index("req-0 decode") < err.index("req-0 mux")


def test_generate_local_jsonl_keyframe_paths_and_output_types_into_a_directory(
    tiny_ckpt: Path, tmp_path: Path, keyframes: dict[str, Path], reference: dict[str, str]
) -> None:
    """JSONL keyframes are paths relative to the file; each line's output type picks its file's suffix."""
    jsonl_dir = tmp_path / "job"
    (jsonl_dir / "frames").mkdir(parents=True)
    (jsonl_dir / "frames" / "a.png").write_bytes(keyframes["png"].read_bytes())
    jsonl = jsonl_dir / "reqs.jsonl"
    lines = [
        {"request_id": "kf", "first_frame": "frames/a.png", "last_frame": str(keyframes["jpeg"]), "output_type": "mp4"},
        {"request_id": "plain"},  # t2va, latents
    ]
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "results"
    res = run_cli_inprocess(
        [
            "generate-local",
            "--checkpoint",
            tiny_ckpt,
            *SMALL,
            "--prompt",
            "a red fox",
            "--requests",
            jsonl,
            "--out",
            out,
        ]
    )
    assert res.code == 0, res.err
    kf, plain = res.json_lines()
    assert sorted(p.name for p in out.iterdir()) == ["kf.mp4", "plain.safetensors"]
    assert (kf["task"], kf["output_type"], kf["out"]) == ("fl2va", "mp4", str(out / "kf.mp4"))
    assert kf["sha256"] == reference["fl2va-both"] and kf["media_sha256"] == _sha(out / "kf.mp4")
    check_mp4(out / "kf.mp4")
    assert (plain["task"], plain["output_type"], plain["out"]) == ("t2va", "latents", str(out / "plain.safetensors"))
    assert plain["sha256"] == reference["t2va"] and "media_sha256" not in plain and plain["video_shape"]


# ----------------------------------------------------------------------------- refusals (before any model or call)
LOCAL = ["generate-local", "--checkpoint", "CKPT"]
REMOTE = ["generate", "--target", "127.0.0.1:1"]  # nothing listens: each case must fail on its own value
REFUSALS: list[tuple[str, list[str], list[str]]] = [
    ("unknown-suffix", ["--out", "OUT/fox.mov"], ["--out", "fox.mov", "unknown suffix '.mov'", "--output-type"]),
    (
        "type-conflicts-with-suffix",
        ["--out", "OUT/fox.mp4", "--output-type", "frames_and_wav"],
        ["--output-type frames_and_wav", "--out", "fox.mp4", "means mp4"],
    ),
    ("first-frame-missing", ["--first-frame", "OUT/none.png"], ["--first-frame", "none.png", "cannot read"]),
    ("last-frame-a-directory", ["--last-frame", "OUT"], ["--last-frame", "cannot read", "not a regular file"]),
    ("media-without-out", ["--output-type", "mp4"], ["output type mp4", "--out"]),
    ("bad-output-type", ["--output-type", "gif"], ["--output-type", "invalid choice", "'gif'"]),
]


@pytest.mark.parametrize("command", ["generate-local", "generate"])
@pytest.mark.parametrize(("extra", "expect"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_output_and_keyframe_flags_are_refused_naming_the_flag(
    tiny_ckpt: Path, tmp_path: Path, command: str, extra: list[str], expect: list[str]
) -> None:
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    base = [str(tiny_ckpt) if a == "CKPT" else a for a in (LOCAL if command == "generate-local" else REMOTE)]
    argv = [*base, *SMALL, "--prompt", "a red fox", *[a.replace("OUT", str(out_dir)) for a in extra]]
    res = run_cli_inprocess(argv)
    assert res.code == 2, (res.out, res.err)
    msg = [x for x in res.err.splitlines() if x.strip()][-1]
    assert "error" in msg
    for s in expect:
        assert s in msg, f"{s!r} not in {msg!r}"
    assert res.out == "" and list(out_dir.iterdir()) == []


def test_a_non_image_first_frame_is_refused_naming_first_frame(tiny_ckpt: Path, keyframes: dict[str, Path]) -> None:
    res = run_cli_inprocess(
        ["generate-local", "--checkpoint", tiny_ckpt, *SMALL, "--prompt", "a fox", "--first-frame", keyframes["text"]]
    )
    assert res.code == 2 and res.out == ""
    assert "ditserve generate-local: error: first_frame: is not a PNG or JPEG image" in res.err


@pytest.mark.parametrize(
    ("lines", "extra", "expect"),
    [
        ([{"first_frame": "missing.png"}], [], ["first_frame", "reqs.jsonl:1", "missing.png", "cannot read"]),
        ([{"first_frame": 7}], [], ["first_frame", "reqs.jsonl:1", "file path"]),
        ([{}, {"output_type": "mp4"}], ["--out", "OUT/x.zip"], ["output_type", "reqs.jsonl:2", "--out", "x.zip"]),
        ([{}, {}], ["--out", "OUT/x.mp4"], ["--out", "names one file", "2 requests"]),
        ([{"output_type": "frames_and_wav"}], [], ["output type frames_and_wav", "--out"]),
    ],
    ids=["missing-file", "not-a-path", "type-conflict", "one-file-two-requests", "media-without-out"],
)
def test_jsonl_keyframes_and_output_types_are_refused(
    tiny_ckpt: Path, tmp_path: Path, lines: list[dict[str, Any]], extra: list[str], expect: list[str]
) -> None:
    jsonl = tmp_path / "reqs.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    argv = ["generate-local", "--checkpoint", tiny_ckpt, *SMALL, "--prompt", "a fox", "--requests", jsonl]
    res = run_cli_inprocess([*argv, *[a.replace("OUT", str(out_dir)) for a in extra]])
    assert res.code == 2, (res.out, res.err)
    msg = [x for x in res.err.splitlines() if x.strip()][-1]
    for s in expect:
        assert s in msg, f"{s!r} not in {msg!r}"
    assert res.out == "" and list(out_dir.iterdir()) == []


# ----------------------------------------------------------------------------- the Python client's checks
class _Stub:
    """A Generator stub whose GenerateStream replays `events`."""

    def __init__(self, events: list[pb.GenerateStreamResponse]) -> None:
        self.events = events
        self.sent: list[pb.GenerateStreamRequest] = []

    def GenerateStream(self, msg: pb.GenerateStreamRequest, **_: Any) -> Iterator[pb.GenerateStreamResponse]:
        self.sent.append(msg)
        return iter(self.events)


MEDIA = b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 3


def _media_stream(data: bytes = MEDIA, *, chunk: int = 100, **header: Any) -> list[pb.GenerateStreamResponse]:
    media = pb.Media(
        content_type="video/mp4", size_bytes=len(MEDIA), sha256=hashlib.sha256(MEDIA).hexdigest(), filename="x.mp4"
    )
    fields: dict[str, Any] = {
        "request_id": "x", "sha256": "ab" * 32, "media": media, "output_type": pb.OUTPUT_TYPE_MP4,
        "total_bytes": len(MEDIA), **header,
    }  # fmt: skip
    events = [
        pb.GenerateStreamResponse(step=pb.StepProgress(step=1, total=1)),
        pb.GenerateStreamResponse(decoding=pb.Decoding(output_type=pb.OUTPUT_TYPE_MP4)),
        pb.GenerateStreamResponse(result=pb.GenerateResponse(**fields)),
    ]
    for off in range(0, len(data), chunk):
        piece = pb.ResultChunk(name="media", offset=off, data=data[off : off + chunk])
        events.append(pb.GenerateStreamResponse(chunk=piece))
    return events


def _client_run(events: list[pb.GenerateStreamResponse], **request: Any) -> tuple[ClientResult, _Stub]:
    client = GeneratorClient("127.0.0.1:1")
    stub = _Stub(events)
    client.stub = stub  # type: ignore[assignment]
    try:
        seen: list[tuple[str, Any]] = []
        res = client.generate(
            {"prompt": "a fox", "output_type": "mp4", **request}, progress=lambda k, p: seen.append((k, p))
        )
    finally:
        client.close()
    assert ("decoding", "mp4") in seen and seen[-1] == ("receiving", (len(MEDIA), len(MEDIA)))
    return res, stub


def test_the_client_reassembles_media_chunks_and_sends_keyframes_and_the_output_type() -> None:
    res, stub = _client_run(_media_stream(), first_frame=b"png-bytes")
    assert res.media is not None and res.media.data == MEDIA and res.output_type == "mp4"
    assert (res.media.content_type, res.media.sha256, res.media.size) == (
        "video/mp4",
        hashlib.sha256(MEDIA).hexdigest(),
        len(MEDIA),
    )
    assert res.video is None and res.audio is None and ("decoding", "mp4") in res.events
    [sent] = stub.sent
    # a mapping without a task and with a keyframe is fl2va; the output type and the keyframe travel
    assert (sent.request.task, sent.request.output_type) == (pb.TASK_FL2VA, pb.OUTPUT_TYPE_MP4)
    assert sent.request.first_frame == b"png-bytes" and sent.request.last_frame == b""


def _reorder(events: list[pb.GenerateStreamResponse]) -> list[pb.GenerateStreamResponse]:
    return [*events[:-2], events[-1], events[-2]]


@pytest.mark.parametrize(
    ("events", "expect"),
    [
        (_reorder(_media_stream()), "at offset"),
        (_media_stream(MEDIA[:-1]), "header said"),
        (_media_stream(MEDIA[:-1] + b"!"), "hashes to"),
        (_media_stream(total_bytes=len(MEDIA) + 5), "header said"),
        (_media_stream(total_bytes=10), "more than the header"),
        ([*_media_stream()[:-1], pb.GenerateStreamResponse(chunk=pb.ResultChunk(name="video", data=b"x"))], "video"),
        (_media_stream()[:2], "without a result"),
        (
            [pb.GenerateStreamResponse(result=pb.GenerateResponse(request_id="x", output_type=pb.OUTPUT_TYPE_LATENTS))],
            "asked for output type mp4",
        ),
    ],
    ids=["offsets", "short", "sha256", "total-long", "total-short", "unknown-name", "no-result", "wrong-type"],
)
def test_the_client_refuses_media_that_does_not_check_out(events: list[pb.GenerateStreamResponse], expect: str) -> None:
    with pytest.raises(IntegrityError, match=expect):
        _client_run(events)


def test_request_to_proto_maps_output_types_and_tasks() -> None:
    msg = request_to_proto({"prompt": "p", "last_frame": b"j", "output_type": "frames_and_wav"})
    assert (msg.task, msg.output_type, msg.last_frame) == (pb.TASK_FL2VA, pb.OUTPUT_TYPE_FRAMES_AND_WAV, b"j")
    assert request_to_proto({"prompt": "p"}).task == pb.TASK_T2VA
    assert request_to_proto(GenerationRequest(prompt="p")).output_type == pb.OUTPUT_TYPE_LATENTS


# ----------------------------------------------------------------------------- through a started pair
@pytest.fixture(scope="module")
def pair(tiny_ckpt: Path) -> Iterator[Pair]:
    """A cached sidecar + generator on the tiny repository; plans 3 wide (fl2va's)."""
    with Pair(tiny_ckpt, plan_width=3, gpu_plans=64, chunk_bytes=64 * 1024) as p:
        yield p.start()


def test_generate_through_the_service_writes_the_mp4(pair: Pair, tmp_path: Path, reference: dict[str, str]) -> None:
    """The issue's acceptance test: `ditserve generate --target ... --prompt "a red fox" --out fox.mp4`."""
    res = run_cli_inprocess(
        ["generate", "--target", pair.target, "--prompt", "a red fox", *SMALL, "--out", "fox.mp4", "--progress", "on"],
        cwd=tmp_path,
    )
    line = _one_line(res)
    path = tmp_path / "fox.mp4"
    check_mp4(path)
    assert (line["out"], line["output_type"], line["content_type"]) == (str(path), "mp4", "video/mp4")
    assert line["media_sha256"] == _sha(path) and line["bytes"] == path.stat().st_size
    assert line["sha256"] == reference["t2va"] and line["generation"] == 1
    err = res.err.replace("\r", "\n")
    assert "req-0 decode+mux" in err and "req-0 receive" in err


def test_generate_through_the_service_writes_the_latents(pair: Pair, tmp_path: Path, reference: dict[str, str]) -> None:
    """A latents result the client received, written as safetensors: its tensors hash to the line's sha256."""
    out = tmp_path / "fox.safetensors"
    res = run_cli_inprocess(["generate", "--target", pair.target, "--prompt", "a red fox", *SMALL, "--out", out])
    line = _one_line(res)
    saved = load_file(out)
    assert (line["output_type"], line["sha256"]) == ("latents", reference["t2va"])
    assert latents_sha256(saved["video"], saved["audio"]) == line["sha256"]


def test_generate_through_the_service_with_keyframes_writes_the_zip(
    pair: Pair, tmp_path: Path, keyframes: dict[str, Path], reference: dict[str, str]
) -> None:
    out = tmp_path / "clip.zip"
    argv = ["generate", "--target", pair.target, "--prompt", "a red fox", *SMALL, "--out", out]
    res = run_cli_inprocess([*argv, "--first-frame", keyframes["png"], "--last-frame", keyframes["jpeg"]])
    line = _one_line(res)
    assert (line["task"], line["sha256"]) == ("fl2va", reference["fl2va-both"])
    check_zip(out.read_bytes())
    assert line["media_sha256"] == _sha(out)


def test_generate_through_the_service_refuses_a_non_image_keyframe(pair: Pair, keyframes: dict[str, Path]) -> None:
    argv = ["generate", "--target", pair.target, "--prompt", "a fox", *SMALL, "--first-frame", keyframes["text"]]
    res = run_cli_inprocess(argv)
    assert res.code == 2 and res.out == ""
    assert "INVALID_ARGUMENT" in res.err and "first_frame" in res.err


def test_the_python_client_gets_the_mp4(pair: Pair, tmp_path: Path, reference: dict[str, str]) -> None:
    request = {"prompt": "a red fox", "num_inference_steps": STEPS, "height": HEIGHT, "width": WIDTH}
    with GeneratorClient(pair.target) as client:
        res = client.generate({**request, "num_frames": FRAMES, "output_type": "mp4"}, timeout=300)
    assert res.media is not None and res.media.content_type == "video/mp4"
    assert res.media.sha256 == hashlib.sha256(res.media.data).hexdigest()
    assert res.sha256 == reference["t2va"] and ("decoding", "mp4") in res.events
    check_mp4(res.media.write(tmp_path / "api.mp4"))
