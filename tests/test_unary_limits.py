"""A unary Generate whose latents alone cannot fit one message is refused before any work, naming the limit and
GenerateStream; a canvas that breaks a rule is refused for its field first (never for its size)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from jobskit import jobs_server
from servicekit import error_info

from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

MIB = 2**20


@pytest.fixture(scope="module")
def target(svc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A generator whose messages are at most 4 MiB: a 768 x 1344 canvas' latents (12.4 MB at the tiny preset's
    channels; 158 MB at the released model's 768 x 1344 x 345) cannot fit."""
    with jobs_server(svc_ckpt, tmp_path_factory.mktemp("unary"), max_message_bytes=4 * MIB) as srv:
        yield f"127.0.0.1:{srv.port}"


def _refusal(target: str, **fields: object) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.GeneratorStub(channel).Generate(pb.GenerateRequest(prompt="a fox", **fields), timeout=30)
    return err.value


def test_latents_over_the_message_limit_are_refused_for_unary_before_work(target: str) -> None:
    err = _refusal(target, height=768, width=1344, num_frames=124, num_inference_steps=2)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(err)
    assert info is not None and info.reason == "RESULT_TOO_LARGE" and int(info.metadata["result_bytes"]) > 4 * MIB
    assert "GenerateStream" in (err.details() or "")


def test_an_invalid_huge_canvas_is_refused_for_its_field(target: str) -> None:
    err = _refusal(target, height=768, width=1344, num_frames=346)  # not 17n + 5
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_frames" in (err.details() or "")
    err = _refusal(target, height=4096, width=4096, num_frames=345)  # over the operator's side limit
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-height" in (err.details() or "")
