"""GetStatus reports every loaded component (transformer, text_encoder, vae, audio_vae): device, placement, dtype,
bytes, device bytes and a note, as the served model holds them; through a real generator, resident and cached."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from servicekit import Pair

from ditcore.repo import TEXT_LAYERS
from generator_service.serving.status import component_placement
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as gen_grpc


@pytest.fixture(scope="module", params=["resident", "cached"])
def pair(request: pytest.FixtureRequest, svc_ckpt: Path) -> Iterator[Pair]:
    with Pair(svc_ckpt, mode=request.param, text_encoder_device="cpu") as p:  # cpu: this machine's --device
        yield p.start()


def test_get_status_lists_each_component(pair: Pair) -> None:
    with pair.channel() as ch:
        st = gen_grpc.GeneratorStub(ch).GetStatus(gen_pb.GetStatusRequest(), timeout=10)
    model = pair.generator.backend.loaded()
    assert list(st.components) == [component_placement(c) for c in model.components()]  # what the model holds
    comps = {c.name: c for c in st.components}
    assert list(comps) == ["transformer", "transformer_ref", "text_encoder", "vae", "audio_vae"]
    for c in comps.values():
        assert (c.device, c.placement, c.device_bytes) == ("cpu", "device", 0) and c.bytes > 0, c
    assert comps["transformer"].bytes + comps["transformer_ref"].bytes == st.memory.transformer_bytes
    assert (comps["transformer"].dtype, comps["text_encoder"].dtype) == ("bfloat16", "bfloat16")  # released mixed
    assert comps["text_encoder"].note.startswith(
        f"text layers 0..{TEXT_LAYERS - 1} of {TEXT_LAYERS} kept, lm_head dropped"
    )
    cached = pair.mode == "cached"
    assert ("not loaded" in comps["transformer"].note) is cached
    resident_plan_bytes = st.memory.plan_tensor_bytes if not cached else 0
    assert st.memory.held_plan_bytes == resident_plan_bytes
