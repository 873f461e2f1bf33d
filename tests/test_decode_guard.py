"""In-process gRPC servers on the real generator proto, with the interceptors both services run: `DecodeGuard`
(invalid UTF-8 in a request string is INVALID_ARGUMENT naming the field, with no traceback logged) and
`RpcMetrics` (a client-cancelled RPC is counted CANCELLED, a deadline-exceeded one DEADLINE_EXCEEDED)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client import CollectorRegistry
from servicekit import wait_for

from ditruntime.decode_guard import DecodeGuard, invalid_utf8_field
from ditruntime.obs import RpcMetrics
from protos.ditserve.generator.v1 import generator_pb2 as pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as pb_grpc

PREFIX = "ditserve_test"
GENERATE = "/ditserve.generator.v1.Generator/Generate"
STREAM = "/ditserve.generator.v1.Generator/GenerateStream"


class Servicer(pb_grpc.GeneratorServicer):
    """Generate echoes the request id after `delay_s`; GenerateStream sends one message, then waits for `release`."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.release = threading.Event()
        self.calls = 0

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        self.calls += 1
        time.sleep(self.delay_s)
        return pb.GenerateResponse(request_id=request.request_id)

    def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        self.calls += 1
        yield pb.GenerateStreamResponse(queued=pb.Queued(request_id=request.request.request_id, position=0))
        while not self.release.wait(0.02):  # until the test lets go, or the RPC ends
            if not context.is_active():
                break
        yield pb.GenerateStreamResponse(step=pb.StepProgress(step=1, total=1))


@pytest.fixture
def served() -> Iterator[tuple[grpc.Channel, Servicer, CollectorRegistry]]:
    registry = CollectorRegistry()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[RpcMetrics(registry, PREFIX), DecodeGuard()]
    )
    servicer = Servicer()
    pb_grpc.add_GeneratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, servicer, registry
    finally:
        servicer.release.set()
        channel.close()
        server.stop(None)


def _key(message: Any, field: str) -> bytes:
    """The tag of a length-delimited `field` of `message` (field numbers < 16: one byte)."""
    number = message.DESCRIPTOR.fields_by_name[field].number
    assert number < 16
    return bytes([number << 3 | 2])


def _string(message: Any, field: str, value: bytes) -> bytes:
    """`field` set to raw `value` bytes (shorter than 128), on the wire."""
    return _key(message, field) + bytes([len(value)]) + value


BAD_PROMPT = _string(pb.GenerateRequest(), "request_id", b"r-1") + _string(pb.GenerateRequest(), "prompt", b"\xff")


def _raw(channel: grpc.Channel, method: str, response: Any) -> Any:
    """A stub that sends request bytes as given."""
    if method == STREAM:
        return channel.unary_stream(method, request_serializer=lambda b: b, response_deserializer=response.FromString)
    return channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=response.FromString)


def _details(err: grpc.RpcError) -> tuple[str, list[str]]:
    """(ErrorInfo reason, BadRequest field paths) of a ditserve status."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc status details"
    reason, fields = "", []
    for d in status.details:
        info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
        if d.Unpack(info):
            reason = info.reason
        elif d.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return reason, fields


def _count(registry: CollectorRegistry, method: str, code: str) -> float:
    return registry.get_sample_value(f"{PREFIX}_rpc_requests_total", {"method": method, "code": code}) or 0.0


# ----------------------------------------------------------------------------- invalid UTF-8
def test_invalid_utf8_prompt_is_invalid_argument_naming_the_field_without_a_traceback(
    served: tuple[grpc.Channel, Servicer, CollectorRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    channel, servicer, registry = served
    caplog.set_level(logging.DEBUG)
    for _ in range(2):  # every call, not only the first
        with pytest.raises(grpc.RpcError) as e:
            _raw(channel, GENERATE, pb.GenerateResponse)(BAD_PROMPT, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "prompt" in e.value.details() and "UTF-8" in e.value.details()
        assert _details(e.value) == ("MALFORMED_REQUEST", ["prompt"])
    assert servicer.calls == 0  # the handler never ran
    assert not [r for r in caplog.records if r.exc_info or "Exception deserializing" in r.getMessage()]
    assert _count(registry, "Generate", "INVALID_ARGUMENT") == 2
    # a valid request still goes through
    ok = _raw(channel, GENERATE, pb.GenerateResponse)(pb.GenerateRequest(request_id="r-2").SerializeToString())
    assert ok.request_id == "r-2"


def test_invalid_utf8_in_a_nested_message_names_its_path(
    served: tuple[grpc.Channel, Servicer, CollectorRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    channel, servicer, _ = served
    caplog.set_level(logging.DEBUG)
    outer = _key(pb.GenerateStreamRequest(), "request") + bytes([len(BAD_PROMPT)]) + BAD_PROMPT
    with pytest.raises(grpc.RpcError) as e:
        list(_raw(channel, STREAM, pb.GenerateStreamResponse)(outer, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request.prompt" in e.value.details()
    assert _details(e.value) == ("MALFORMED_REQUEST", ["request.prompt"])
    assert servicer.calls == 0
    assert not [r for r in caplog.records if r.exc_info]


def test_broken_wire_format_names_the_message_type(served: tuple[grpc.Channel, Servicer, CollectorRegistry]) -> None:
    channel, _, _ = served
    truncated = _key(pb.GenerateRequest(), "prompt") + b"\x05ab"  # says 5 bytes, has 2
    with pytest.raises(grpc.RpcError) as e:
        _raw(channel, GENERATE, pb.GenerateResponse)(truncated, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ditserve.generator.v1.GenerateRequest" in e.value.details()
    assert _details(e.value) == ("MALFORMED_REQUEST", [])


def test_invalid_utf8_field_walks_repeated_and_nested_fields() -> None:
    req = pb.GenerateRequest.DESCRIPTOR
    assert invalid_utf8_field(BAD_PROMPT, req) == "prompt"
    assert invalid_utf8_field(pb.GenerateRequest(prompt="ok é").SerializeToString(), req) is None
    tensors = pb.UpdateWeightsRequest.DESCRIPTOR.fields_by_name["tensors"]
    good = pb.Tensor(name="a").SerializeToString()
    bad = _string(pb.Tensor(), "name", b"\xc3")  # a truncated two-byte sequence
    key = _key(pb.UpdateWeightsRequest(), "tensors")
    data = key + bytes([len(good)]) + good + key + bytes([len(bad)]) + bad
    assert tensors.is_repeated
    assert invalid_utf8_field(data, pb.UpdateWeightsRequest.DESCRIPTOR) == "tensors[1].name"


# ----------------------------------------------------------------------------- RPC metrics codes
def test_a_client_cancelled_stream_is_counted_cancelled(
    served: tuple[grpc.Channel, Servicer, CollectorRegistry],
) -> None:
    channel, _, registry = served
    stub = pb_grpc.GeneratorStub(channel)
    call = stub.GenerateStream(pb.GenerateStreamRequest(request=pb.GenerateRequest(request_id="c-1")), timeout=30)
    assert next(call).HasField("queued")
    call.cancel()
    wait_for(lambda: _count(registry, "GenerateStream", "CANCELLED") == 1, 10, "the cancelled stream to be counted")
    assert _count(registry, "GenerateStream", "UNKNOWN") == 0


def test_deadline_exceeded_rpcs_are_counted_deadline_exceeded(
    served: tuple[grpc.Channel, Servicer, CollectorRegistry],
) -> None:
    channel, servicer, registry = served
    stub = pb_grpc.GeneratorStub(channel)
    servicer.delay_s = 1.0  # returns normally, after the client's deadline
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(request_id="d-1"), timeout=0.2)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = stub.GenerateStream(pb.GenerateStreamRequest(request=pb.GenerateRequest(request_id="d-2")), timeout=0.5)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: _count(registry, "Generate", "DEADLINE_EXCEEDED") == 1, 10, "Generate's DEADLINE_EXCEEDED")
    wait_for(lambda: _count(registry, "GenerateStream", "DEADLINE_EXCEEDED") == 1, 10, "the stream's DEADLINE_EXCEEDED")
    assert _count(registry, "Generate", "OK") == 0 and _count(registry, "GenerateStream", "UNKNOWN") == 0
