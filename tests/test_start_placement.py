"""The placement chosen at start (generator_service.backends.placement): `--text-encoder-device auto` and
`--partitions auto` resolved at the first load from the memory model and the device's free memory (injected here),
GetStatus' start_placement, and a layout that fits nothing refused at start naming the flags, never at a request."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from servicekit import Pair

from ditcore import validate_checkpoint
from ditcore.model import RunOptions
from ditcore.parallel import ParallelSpec
from ditcore.placement import PlacementError, rank_needs
from ditcore.request import RequestLimits
from ditcore.text_encoder import TextEncoderPlacement
from ditruntime import memory as memory_mod
from ditruntime.memory import MemoryBudget
from generator_service.backends import placement as placement_mod
from generator_service.backends.cached import CachedWeights
from generator_service.backends.placement import StartPlacement, largest_canvas

GIB = 1024**3


def _placer(monkeypatch: pytest.MonkeyPatch, device: str, free: int, mode: str = "resident") -> StartPlacement:
    monkeypatch.setattr(memory_mod, "device_name", lambda d: "NVIDIA H200" if d.type == "cuda" else "cpu")
    placer = StartPlacement(torch.device(device), ParallelSpec(), largest_canvas(RequestLimits()), mode)
    monkeypatch.setattr(placer, "free", lambda: MemoryBudget(free, "test budget"))
    return placer


def test_the_largest_canvas_of_the_default_limits_is_the_released_maximum() -> None:
    c = largest_canvas(RequestLimits())
    assert (c.height, c.width, c.num_frames) == (768, 1344, 345)
    c = largest_canvas(RequestLimits(max_num_frames=124))
    assert (c.height, c.width, c.num_frames) == (768, 1344, 124)


def test_auto_resolves_to_the_first_placement_that_fits(svc_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = validate_checkpoint(svc_ckpt, require_adaln=True)
    fp = _placer(monkeypatch, "cuda", GIB).footprint(info, RunOptions())
    names = tuple(info.partitions)
    need = {t: rank_needs(fp, t, len(names), ParallelSpec())[0].total for t in ("device", "offload", "cpu")}
    assert need["device"] > need["offload"] > need["cpu"]
    for free, text in ((need["device"], "device"), (need["device"] - 1, "offload"), (need["offload"] - 1, "cpu")):
        placer = _placer(monkeypatch, "cuda", free)
        options = placer.resolve(info, RunOptions())
        assert options.text_encoder == TextEncoderPlacement("cpu" if text == "cpu" else "auto", text == "offload"), text
        assert options.partitions == "auto"  # every partition kept: an update's repository decides its own
        status = placer.to_status()
        assert status is not None and (status["text_encoder"], status["decided"]) == (text, True)
        assert status["need_bytes"] == need[text] and status["free_bytes"] == free
        assert placer.resolve(info, RunOptions(partitions="base")) is options  # decided once: updates keep it


def test_nothing_fits_is_refused_at_start_naming_the_flags(svc_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = validate_checkpoint(svc_ckpt, require_adaln=True)
    placer = _placer(monkeypatch, "cuda", 1024)
    with pytest.raises(PlacementError, match=r"the model does not fit: text encoder cpu .* but 0\.00 GiB is free"):
        placer.resolve(info, RunOptions())  # tried in order, the CPU last
    fp = placer.footprint(info, RunOptions())
    on_device = rank_needs(fp, "device", len(info.partitions), ParallelSpec())[0].total
    named = RunOptions(text_encoder=TextEncoderPlacement("cuda"), partitions="base,ref")
    with pytest.raises(PlacementError) as ei:  # named: held to the model, never to fail at the first request
        _placer(monkeypatch, "cuda", on_device - 1).resolve(info, named)
    for fix in ("--text-encoder-device cpu", "--text-encoder-offload", "--partitions base"):
        assert fix in str(ei.value), fix


def test_on_the_host_a_placement_over_free_memory_is_kept(svc_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = validate_checkpoint(svc_ckpt, require_adaln=True)
    placer = _placer(monkeypatch, "cpu", 1024)
    options = placer.resolve(info, RunOptions())  # host memory moves: admission refuses what does not fit
    assert options.text_encoder == TextEncoderPlacement() and options.partitions == "auto"
    status = placer.to_status()
    assert status is not None and status["decided"] is False and status["left_bytes"] < 0


@pytest.mark.parametrize("mode", ["resident", "cached"])
def test_get_status_shows_the_start_placement(
    svc_ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    monkeypatch.setattr(StartPlacement, "free", lambda self: MemoryBudget(1000 * GIB, "test budget"))
    caplog.set_level(logging.INFO, logger=placement_mod.__name__)
    with Pair(svc_ckpt, mode=mode) as pair:
        pair.start()
        st = pair.status().start_placement
        assert (st.text_encoder, list(st.partitions), st.decided) == ("device", ["base", "ref"], True)
        assert (st.free_bytes, st.free_source, st.canvas) == (1000 * GIB, "test budget", "768 x 1344 x 345")
        assert st.need_bytes + st.left_bytes == st.free_bytes and len(st.ranks) == 1
        assert st.ranks[0].ranks == "0" and st.ranks[0].bytes == st.need_bytes
        assert set(st.ranks[0].items) >= {"transformer", "text_encoder", "vae", "activations"}
        assert st.ranks[0].items["sidecar"] == 0  # cached: the slab is allocated before, out of the free bytes
    logged = [r.getMessage() for r in caplog.records if r.name == placement_mod.__name__]
    assert any("text encoder device, partitions base,ref, 1 rank(s)" in m and "FITS" in m for m in logged), logged
    assert any(m.startswith("start placement: rank 0: ") for m in logged), logged


def test_cached_mode_refuses_at_the_first_attach(svc_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cached mode learns its repository from the sidecar: nothing fitting is found at the first attach, and the
    generator is told (app.refuse_start exits 2) before any request is served."""
    info = validate_checkpoint(svc_ckpt, require_adaln=False)
    refused: list[PlacementError] = []
    weights = CachedWeights(
        torch.device("cuda"), RunOptions(), None, _placer(monkeypatch, "cuda", 1024, "cached"), refused.append
    )
    with pytest.raises(PlacementError):
        weights._attach_here(SimpleNamespace(weights_path=str(svc_ckpt), fingerprint=info.fingerprint))  # type: ignore[arg-type]
    assert len(refused) == 1 and "the model does not fit" in str(refused[0]) and weights.model is None


def test_a_replica_whose_ranks_chose_other_partitions_does_not_serve() -> None:
    """Each rank places its model by its own free memory: unequal devices could choose other partitions under
    --partitions auto, and a ref2va request would then run on mixed models. Rank 0's describe refuses that."""
    from generator_service.errors import GeneratorError
    from generator_service.replica.link import check_same_partitions
    from protos.ditserve.replica.v1 import replica_pb2 as rpb

    def report(rank: int, *names: str) -> rpb.RankReport:
        parts = [rpb.Component(name=n, device="cpu", placement="device") for n in names]
        return rpb.RankReport(rank=rank, device="cpu", components=[*parts, rpb.Component(name="vae")])

    check_same_partitions([report(0, "transformer", "transformer_ref"), report(1, "transformer", "transformer_ref")])
    check_same_partitions([report(0, "transformer"), report(1)])  # a rank that holds nothing yet
    with pytest.raises(GeneratorError, match="rank 1 holds the transformer partitions transformer but rank 0"):
        check_same_partitions([report(0, "transformer", "transformer_ref"), report(1, "transformer")])
