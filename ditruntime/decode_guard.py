"""`DecodeGuard`, a server interceptor: a request that protobuf cannot parse (invalid UTF-8 in a string field, at
any depth; a broken wire format) is answered INVALID_ARGUMENT (MALFORMED_REQUEST) naming the field, with one log
line, instead of grpc's INTERNAL "Exception deserializing request!" and a logged traceback on every call.

grpc calls a method's request deserializer before any interceptor sees the request, and logs and aborts when it
raises; so the guard wraps the deserializer itself: a DecodeError becomes a marker value, and the wrapped handler
aborts with the mapped status (ditruntime.rpc_errors) when it receives one. The field is found by parsing the
bytes into an empty message (every field then unknown) and walking those unknown fields against the method's
request descriptor, message fields recursively.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import descriptor_pool, empty_pb2, unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from .errors import ServiceError
from .rpc_errors import abort

log = logging.getLogger(__name__)

_LENGTH_DELIMITED = 2  # wire type of strings, bytes, messages and packed repeated scalars


class MalformedRequestError(ServiceError):
    """The request bytes are not a valid message of the method's request type: a string field holds invalid UTF-8
    (the field is named; protobuf strings must be UTF-8, raw bytes go in a bytes field), or the wire format is
    broken (the message type is named)."""

    reason = "MALFORMED_REQUEST"
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.description = message


class _Undecodable:
    """What the guarded deserializer returns for bytes protobuf refused: the error the handler aborts with."""

    def __init__(self, error: MalformedRequestError) -> None:
        self.error = error


def invalid_utf8_field(data: bytes, desc: Descriptor, prefix: str = "") -> str | None:
    """The path ('request.prompt', 'tags[2]') of the first string field in `data` (a serialized `desc` message)
    that is not valid UTF-8; None if there is none or the bytes do not parse as protobuf wire format at all."""
    holder = empty_pb2.Empty()
    try:
        holder.ParseFromString(data)  # every field lands in the unknown fields, unchecked
    except DecodeError:
        return None
    seen: dict[int, int] = {}
    for f in unknown_fields.UnknownFieldSet(holder):
        fd = desc.fields_by_number.get(f.field_number)
        if fd is None or f.wire_type != _LENGTH_DELIMITED:
            continue
        index = seen[f.field_number] = seen.get(f.field_number, -1) + 1
        path = prefix + fd.name + (f"[{index}]" if fd.is_repeated else "")
        if fd.type == FieldDescriptor.TYPE_STRING:
            try:
                f.data.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            found = invalid_utf8_field(f.data, fd.message_type, path + ".")
            if found is not None:
                return found
    return None


def malformed(data: bytes, desc: Descriptor | None, type_name: str) -> MalformedRequestError:
    """The error for request bytes of type `type_name` that protobuf refused."""
    field = invalid_utf8_field(data, desc) if desc is not None else None
    if field is not None:
        return MalformedRequestError(f"{field}: not valid UTF-8 (protobuf string fields must be UTF-8 text)", field)
    return MalformedRequestError(f"the request is not a valid {type_name} (protobuf could not parse its bytes)")


def _request_descriptor(method: str, deserializer: Callable[[bytes], Any]) -> Descriptor | None:
    """The request message type: the class whose FromString is the deserializer, else the method's input type in
    the default descriptor pool ('/pkg.Service/Method')."""
    desc = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    if isinstance(desc, Descriptor):
        return desc
    try:
        return descriptor_pool.Default().FindMethodByName(method.strip("/").replace("/", ".")).input_type
    except KeyError:
        return None


def _guarded(deserializer: Callable[[bytes], Any], desc: Descriptor | None, method: str) -> Callable[[bytes], Any]:
    type_name = desc.full_name if desc is not None else "request message"

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            try:
                error = malformed(data, desc, type_name)
            except Exception:  # the search for the field must never turn this back into INTERNAL
                error = MalformedRequestError(f"the request is not a valid {type_name}")
            log.info("refused %s: %s", method, error)
            return _Undecodable(error)

    return deserialize


def _checked(request: Any, context: grpc.ServicerContext) -> Any:
    if isinstance(request, _Undecodable):
        abort(context, request.error)
    return request


def _checked_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for request in requests:
        yield _checked(request, context)


class DecodeGuard(grpc.ServerInterceptor):
    """Undecodable requests become INVALID_ARGUMENT (MalformedRequestError) naming the field, for every method
    whose handler has a request deserializer (module docstring). Place it after RpcMetrics, so those calls are
    counted with their code."""

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        desc = _request_descriptor(details.method, handler.request_deserializer)
        guarded = _guarded(handler.request_deserializer, desc, details.method)
        ser = handler.response_serializer
        if handler.unary_unary:
            uu = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(lambda r, c: uu(_checked(r, c), c), guarded, ser)
        if handler.unary_stream:
            us = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(lambda r, c: us(_checked(r, c), c), guarded, ser)
        if handler.stream_unary:
            su = handler.stream_unary
            return grpc.stream_unary_rpc_method_handler(lambda rs, c: su(_checked_stream(rs, c), c), guarded, ser)
        if handler.stream_stream:
            ss = handler.stream_stream
            return grpc.stream_stream_rpc_method_handler(lambda rs, c: ss(_checked_stream(rs, c), c), guarded, ser)
        return handler
