"""ditcore.placement: the placement `--text-encoder-device auto` and `--partitions auto` choose at start, at the
released size (the h3 preset on meta) and the maximum canvas, against an H200's 139 GiB on one device, 4 x H200
(Ulysses 4) and 2 x 8 H200 (Ulysses 8 x ring 2); a layout that fits nothing is refused naming the flags."""

from __future__ import annotations

import pytest

from ditcore.footprint import Placement, memory_report, meta_components
from ditcore.parallel import ParallelSpec
from ditcore.placement import Footprint, PlacementError, decide, embedding_bytes, rank_needs
from ditcore.repo import TEXT_LAYERS
from ditcore.sizing import Canvas, ModelShapes

GIB = 1024**3
H200 = 139 * GIB
ONE, U4, U8R2 = ParallelSpec(), ParallelSpec(4), ParallelSpec(8, 2)


@pytest.fixture(scope="module")
def released() -> dict[str, Footprint]:
    """The released checkpoint at 768 x 1344 x 345, per mode; the sidecar's slab at its defaults (128 x 4 pages)."""
    c = meta_components(preset="h3")
    shapes = ModelShapes.of_components(c, "mixed", text_layers=TEXT_LAYERS)
    report = memory_report(c, shapes, Canvas(768, 1344, 345), Placement(plan_width=4))
    embed = embedding_bytes(c)
    return {mode: Footprint.of_report(report, shapes, mode, embed) for mode in ("cached", "resident")}


def test_the_defaults_fit_one_h200_with_the_text_encoder_offloaded(released: dict[str, Footprint]) -> None:
    fp = released["cached"]
    on_device = rank_needs(fp, "device", 2, ONE)[0].total  # the old default: 152.12 GiB
    assert round(on_device / GIB, 2) == 152.12
    choice = decide(fp, H200, ONE)
    assert (choice.text_encoder, choice.partitions) == ("offload", ("base", "ref"))
    assert round(choice.need / GIB, 2) == 104.69 and choice.fits
    assert choice.needs[0].items["text_encoder"] == embedding_bytes(meta_components(preset="h3"))  # 1.45 GiB
    assert "FITS, 34.31 GiB left of 139.00 GiB" in choice.table()[0]


@pytest.mark.parametrize(("spec", "rank0_gib", "others_gib"), [(U4, 97.31, 91.51), (U8R2, 97.31, 87.53)])
def test_the_defaults_fit_a_replica_of_h200s(
    released: dict[str, Footprint], spec: ParallelSpec, rank0_gib: float, others_gib: float
) -> None:
    choice = decide(released["cached"], H200, spec)
    assert (choice.text_encoder, choice.partitions) == ("offload", ("base", "ref"))
    rank0, others = choice.needs
    assert (rank0.ranks, others.ranks) == ("0", f"1..{spec.degree - 1}")
    # rank 0 holds the decode's peak (10.12 GiB) above its share of a step; no rank holds the text encoder but 0
    assert (round(rank0.total / GIB, 2), round(others.total / GIB, 2)) == (rank0_gib, others_gib)
    assert others.items["text_encoder"] == 0
    # on the device, the encoder would not fit rank 0 even at 16 ranks: the decode and the weights are not split
    assert rank_needs(released["cached"], "device", 2, spec)[0].total > H200


def test_resident_keeps_the_encoder_and_drops_ref_before_the_cpu(released: dict[str, Footprint]) -> None:
    choice = decide(released["resident"], H200, ONE)  # both resident partitions fit nowhere on one H200
    assert (choice.text_encoder, choice.partitions) == ("device", ("base",))
    named = decide(released["resident"], H200, ONE, partitions_auto=False, text="auto", partitions=("base",))
    assert named.text_encoder == "device"


def test_the_order_tried_on_a_smaller_device(released: dict[str, Footprint]) -> None:
    fp = released["cached"]
    assert decide(fp, 104 * GIB, ONE).text_encoder == "cpu"  # 104.69 offloaded, 103.24 on the CPU
    assert decide(fp, 104 * GIB, ONE, cuda=False).text_encoder == "cpu"  # no offload off CUDA
    small = decide(fp, 100 * GIB, ONE)  # both partitions fit no text placement: base alone (on the device: 114.70)
    assert (small.text_encoder, small.partitions, round(small.need / GIB, 2)) == ("offload", ("base",), 67.25)


def test_a_layout_that_fits_nothing_is_refused_naming_the_flags(released: dict[str, Footprint]) -> None:
    fp = released["cached"]
    with pytest.raises(PlacementError) as ei:
        decide(fp, H200, ONE, text="device", partitions_auto=False)  # the old defaults, named
    message = str(ei.value)
    for part in ("need 152.12 GiB", "139.00 GiB is free", "--text-encoder-device cpu", "--text-encoder-offload",
                 "--partitions base"):  # fmt: skip
        assert part in message, (part, message)
    with pytest.raises(PlacementError) as ei:
        decide(released["resident"], 80 * GIB, ONE, partitions=("base",), partitions_auto=False)
    assert "text encoder cpu and partitions base need 84.98 GiB" in str(ei.value)  # the last tried
    assert "--adaln-mode cached" in str(ei.value) and "--nproc 2" in str(ei.value)
    with pytest.raises(PlacementError, match="ranks") as ei:
        decide(fp, 60 * GIB, ONE, partitions=("base",), partitions_auto=False)  # weights fit, one step does not
    assert "--max-num-frames" in str(ei.value)
