"""GPU-correct stage clocks in ditcore.generation.generate: every stage clock (`plans`, `encode`, `denoise`,
`decode`, `total`, and the first forward's mark between encode and denoise) is read right after
`stage_synchronize(model.device)`, in resident and in cached mode, and none inside the loop after the first forward.
Checked by instrumentation on CPU; on CUDA (marked `gpu`) a sleep kernel queued inside each stage must be contained
in that stage's time, which a clock read before the queue drains would miss (resident mode's denoise did)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import ditcore.generation as generation_mod
from ditcore import GenerationRequest, H3Model, PlanProvider, generate, load_model, validate_checkpoint
from plancache_service.cache import PlanCache
from plancache_service.config import CacheConfig
from plancache_service.embedded import EmbeddedPlanProvider
from plancache_service.rebuild import RebuildSource

LATENTS = GenerationRequest(request_id="t1", prompt="a lighthouse at dusk", num_inference_steps=3, seed=2,
                            height=32, width=32, num_frames=124)  # fmt: skip
MP4 = GenerationRequest(request_id="t2", prompt="a lighthouse at dusk", num_inference_steps=3, seed=2,
                        height=32, width=32, num_frames=124, output_type="mp4")  # fmt: skip
MODES = ("resident", "cached")


@contextmanager
def served(repo: Path, mode: str, device: str = "cpu") -> Iterator[tuple[H3Model, PlanProvider | None]]:
    """The model and, in cached mode, the served plan path in process (a slab built by the sidecar's rebuild code)."""
    model = load_model(repo, mode, device)
    if mode == "resident":
        yield model, None
        return
    info = validate_checkpoint(repo)
    config = CacheConfig(gpu_plans=8, plan_width=2, host_cache_bytes=0, device=device)
    cache = PlanCache(config, RebuildSource(info, torch.device(device)))
    try:
        yield model, EmbeddedPlanProvider(cache)
    finally:
        cache.close()


@contextmanager
def stage_markers(model: H3Model, mark: Callable[[str], None]) -> Iterator[None]:
    """`mark(stage)` after each text-encoder call and each transformer forward, and before each video decode."""
    vae = model.decoder.vae
    decode = vae.decode

    def decoding(*args: Any, **kwargs: Any) -> Any:
        mark("vae_decode")
        return decode(*args, **kwargs)

    handles = [
        model.pipe.text_encoder.model.register_forward_hook(lambda *_: mark("text_encoder")),  # what diffusers calls
        model.transformer.register_forward_hook(lambda *_: mark("forward")),
    ]
    vae.decode = decoding
    try:
        yield
    finally:
        del vae.decode  # the class's method again
        for h in handles:
            h.remove()


def recorded(monkeypatch: pytest.MonkeyPatch, model: H3Model) -> list[str]:
    """Events: "sync" per stage_synchronize(model.device), "clock" per perf_counter read in ditcore.generation."""
    events: list[str] = []
    real_clock = time.perf_counter

    def clock() -> float:
        if sys._getframe(1).f_globals.get("__name__") == generation_mod.__name__:
            events.append("clock")
        return real_clock()

    def sync(device: torch.device) -> None:
        assert device == model.device
        events.append("sync")

    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(generation_mod, "stage_synchronize", sync)
    return events


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("request_", [LATENTS, MP4], ids=["latents", "mp4"])
def test_every_stage_clock_is_read_after_a_device_sync(
    tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch, mode: str, request_: GenerationRequest
) -> None:
    with served(tiny_ckpt, mode) as (model, plans):
        events = recorded(monkeypatch, model)
        with stage_markers(model, events.append):
            result = generate(model, request_, plans)
    clocks = [i for i, e in enumerate(events) if e == "clock"]
    assert clocks and all(events[i - 1] == "sync" for i in clocks)
    assert events.count("sync") == len(clocks)
    forwards = [i for i, e in enumerate(events) if e == "forward"]
    first, last = forwards[0], forwards[-1]
    assert len(forwards) == len(model.plan_keys(request_))
    encoder_done = max(i for i in range(first) if events[i] == "text_encoder")
    assert events[encoder_done + 1 : first] == ["sync", "clock"]  # the end of "encode", at the first forward
    assert "clock" not in events[first:last]  # no stage clock inside the loop after the first forward
    tail = events[last + 1 :]
    if request_.decodes:  # the end of denoise, decode's start; the decode; decode's end, total
        assert tail == ["sync", "clock", "sync", "clock", "vae_decode", "sync", "clock", "sync", "clock"]
        assert set(result.timings_ms) >= {"encode", "denoise", "decode", "total"}
    else:  # the end of denoise, total
        assert tail == ["sync", "clock", "sync", "clock"]
        assert "decode" not in result.timings_ms
    assert result.attention_backend == "native"


def test_stage_synchronize_waits_on_the_devices_stream_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event recorded on the device's current stream, then waited on; nothing on the CPU."""
    calls: list[Any] = []

    class Event:
        def record(self, stream: Any) -> None:
            calls.append(("record", stream))

        def synchronize(self) -> None:
            calls.append("synchronize")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    generation_mod.stage_synchronize(torch.device("cpu"))
    assert calls == []
    generation_mod.stage_synchronize(torch.device("cuda", 1))
    assert calls == [("record", ("stream of", torch.device("cuda", 1))), "synchronize"]


SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of one SM at H200 clocks: far above a tiny model's whole stage


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_each_stage_time_contains_the_gpu_work_queued_in_it(tiny_ckpt: Path, mode: str) -> None:
    """A sleep kernel queued in encode (after the text encoder), in the last denoise step and before the video decode:
    each stage's host time is at least that kernel's GPU time (CUDA events around it)."""
    sleeps: dict[str, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
    forwards = 0

    def queue_sleep(stage: str) -> None:
        if stage == "forward":
            nonlocal forwards
            forwards += 1
            if forwards < len(keys):
                return
        name = {"text_encoder": "encode", "forward": "denoise", "vae_decode": "decode"}[stage]
        if name in sleeps:
            return
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        stop.record()
        sleeps[name] = (start, stop)

    with served(tiny_ckpt, mode, "cuda") as (model, plans):
        keys = model.plan_keys(MP4)
        generate(model, MP4, plans)  # warm-up: kernel loading is no stage's
        with stage_markers(model, queue_sleep):
            result = generate(model, MP4, plans)
    torch.cuda.synchronize()
    assert set(sleeps) == {"encode", "denoise", "decode"}
    for stage, (start, stop) in sleeps.items():
        gpu_ms = start.elapsed_time(stop)
        print(f"{mode} {stage}: stage {result.timings_ms[stage]:.1f} ms, its sleep kernel {gpu_ms:.1f} ms")
        assert result.timings_ms[stage] >= gpu_ms, stage
