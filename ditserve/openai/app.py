"""`ditserve openai-api --target HOST:PORT`: an OpenAI-compatible `/v1/videos` HTTP facade over the Jobs API.

    ditserve openai-api --target 127.0.0.1:50051 --port 8000      # key: DITSERVE_OPENAI_API_KEY or --api-key-file

| method, path | does | codes |
| --- | --- | --- |
| `POST /v1/videos` | create (JSON or multipart; `input_reference`: the first frame) | 200, 400, 401, 409, 413, 415, 429, 503, 504 |
| `GET /v1/videos/{id}` | the video (job) | 200, 401, 404, 504 |
| `GET /v1/videos` | list: `after`, `limit` 1-100, `order` asc/desc | 200, 400, 401, 404 (`after`), 504 |
| `GET /v1/videos/{id}/content` | the MP4 (`variant=thumbnail`: its first frame as PNG) | 200, 400, 401, 404, 409, 504 |
| `DELETE /v1/videos/{id}` | cancel and delete | 200, 401, 404, 504 |

Stateless: every call is a Jobs RPC (ditserve.openai.mapping maps both ways), so the facade may restart, or run as
several copies, without losing anything. Before a route runs, the guards (ditserve.openai.guards) check the Host,
the key and the body's size; each Jobs call then carries the client's Authorization header as gRPC metadata and the
--backend-timeout-s deadline, and a download's call is cancelled when its HTTP client goes away. Every error, FastAPI's
and Starlette's own included, has OpenAI's body shape with a non-null `code`.
"""

from __future__ import annotations

import io
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import anyio
import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Receive, Scope, Send

from ..client_results import IntegrityError
from ..jobs_client import ContentChunks, JobsClient
from .config import FacadeConfig
from .guards import BodyLimit, HostGuard, KeyGuard
from .mapping import (
    CREATE_FIELDS,
    FILE_PARTS,
    LORA_FORM_ENTRIES,
    ApiError,
    create_body,
    form_lora,
    from_rpc_error,
    parse_json_object,
    reference_image,
    video_object,
)

MAX_LIST = 100
log = logging.getLogger(__name__)


def create_app(jobs: JobsClient, config: FacadeConfig | None = None) -> FastAPI:
    config = config or FacadeConfig()
    app = FastAPI(title="ditserve /v1/videos", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    _handle_errors(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)  # added first: innermost
    app.add_middleware(KeyGuard, api_key=config.api_key)
    if config.origins():  # outside the key guard: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.origins()), allow_methods=["GET", "POST",
                           "DELETE"], allow_headers=["*"], expose_headers=["Retry-After"])  # fmt: skip
    app.add_middleware(HostGuard, allowed_hosts=config.host_patterns())  # outermost

    def backend(request: Request) -> JobsClient:
        """The Jobs client for this request: the deadline, and the client's Authorization header forwarded."""
        given = request.headers.get("authorization")
        if given is not None and not all(" " <= c <= "~" for c in given):
            raise ApiError(401, "the Authorization header must be printable ASCII", None, "invalid_api_key")
        metadata = (("authorization", given),) if given else ()
        return jobs.with_call_options(config.backend_timeout_s, metadata)

    @app.post("/v1/videos")
    async def create(request: Request) -> dict[str, Any]:
        fields, first, last = await _create_fields(request, config.max_body_bytes)
        body = create_body(fields, first, last)
        key = request.headers.get("idempotency-key", "") or body.idempotency_key
        job, _ = await run_in_threadpool(backend(request).create, body.request, key)  # a blocking RPC: off the loop
        return video_object(job, body.model, body.seconds)

    @app.get("/v1/videos/{video_id}")
    def retrieve(video_id: str, request: Request) -> dict[str, Any]:
        return video_object(backend(request).get(video_id))

    @app.get("/v1/videos")
    def list_videos(request: Request, after: str | None = None, limit: int = 20, order: str = "desc") -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIST:
            raise ApiError(400, f"limit must be in [1, {MAX_LIST}], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", "order")
        found = backend(request).iter_all(oldest_first=order == "asc")
        if after:
            found = itertools.dropwhile(lambda j: j.job_id != after, found)
            if next(found, None) is None:
                raise ApiError(404, f"after: no video {after!r}", "after")
        page = list(itertools.islice(found, limit + 1))
        data = [video_object(j) for j in page[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(page) > limit}  # fmt: skip

    @app.get("/v1/videos/{video_id}/content")
    def content(video_id: str, request: Request, variant: str = "video") -> Response:
        if variant not in ("video", "thumbnail"):
            raise ApiError(400, f"variant must be video or thumbnail, got {variant!r}", "variant")
        header, chunks = backend(request).content_iter(
            video_id, timeout=config.download_timeout_s, idle_timeout_s=config.backend_timeout_s
        )
        if header.content.content_type != "video/mp4":
            chunks.cancel()
            raise ApiError(409, f"video {video_id} holds {header.content.content_type}, not an MP4", None)
        if variant == "thumbnail":
            return Response(_first_frame_png(b"".join(chunks)), media_type="image/png")
        headers = {"Content-Length": str(header.content.total_bytes),
                   "Content-Disposition": f'attachment; filename="{header.content.filename}"'}  # fmt: skip
        return ContentResponse(chunks, headers)

    @app.delete("/v1/videos/{video_id}")
    def delete(video_id: str, request: Request) -> dict[str, Any]:
        backend(request).delete(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return app


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _handle_errors(app: FastAPI) -> None:
    """Every error as OpenAI's body: ours, the generator's (gRPC status), FastAPI's and Starlette's own (no such
    route or method, a malformed multipart body, a query value of the wrong type), and anything unexpected (500,
    its details only in the log)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(grpc.RpcError)
    async def rpc_error(request: Request, e: grpc.RpcError) -> JSONResponse:
        return _error(from_rpc_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(ApiError(e.status_code, str(e.detail), headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def invalid_parameter(request: Request, e: RequestValidationError) -> JSONResponse:  # e.g. limit=abc
        [first, *_] = e.errors()
        param = str(first["loc"][-1]) if first.get("loc") else None
        return _error(ApiError(400, f"{param}: {first.get('msg', 'invalid value')}", param))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:  # the traceback goes to the log only
        return _error(ApiError(500, "the facade failed on this request (its log has the details)"))


async def _create_fields(request: Request, max_bytes: int) -> tuple[dict[str, Any], bytes, bytes]:
    """The create body's fields and its keyframes: multipart (files `input_reference` = the first frame,
    `last_frame`; or either as text) or JSON, by the exact Content-Type (anything else: 415, so a cross-site
    form or text/plain post is never parsed). As text a keyframe is base64, a data URL, or OpenAI's
    `{"image_url": <data URL>}` (multipart: the field `input_reference[image_url]`); `first_frame` is
    `input_reference`'s other name."""
    kind = request.headers.get("content-type", "")
    media = kind.partition(";")[0].strip().lower()
    if media == "multipart/form-data":
        fields, files = await _form_fields(request, max_bytes)
    elif media == "application/json":
        fields, files = parse_json_object(await request.body()), {}
    else:
        raise ApiError(415, f"Content-Type must be application/json or multipart/form-data, got {kind[:100]!r}")
    first = "input_reference" if "input_reference" in fields or "input_reference" in files else "first_frame"
    if first == "input_reference" and ("first_frame" in fields or "first_frame" in files):
        raise ApiError(400, "give input_reference or first_frame (the same keyframe), not both", "first_frame")
    frames = []
    for name in (first, "last_frame"):
        text = fields.pop(name, None)
        frames.append(reference_image(text, name) if text not in (None, "") else files.get(name, b""))
    return fields, frames[0], frames[1]


async def _form_fields(request: Request, max_bytes: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A multipart body's text fields and its file parts (only the keyframes; each name once)."""
    fields_limit = len(CREATE_FIELDS) + 2 * LORA_FORM_ENTRIES  # `lora` as bracket parts: a name and a scale each
    form = await request.form(max_files=len(FILE_PARTS), max_fields=fields_limit, max_part_size=max_bytes)
    fields: dict[str, Any] = {}
    files: dict[str, bytes] = {}
    lora_parts: list[tuple[str, str]] = []
    for name, value in form.multi_items():
        base, _, sub = name.partition("[")
        if base == "lora" and sub and isinstance(value, str) and "lora" not in fields:
            lora_parts.append((sub, value))  # the openai client's form of a nested `lora`: lora[name], lora[][scale]
            continue
        if base in fields or base in files or (base == "lora" and lora_parts):
            raise ApiError(400, f"the part {base!r} is given more than once", base)
        if isinstance(value, str):
            fields[base] = {sub.rstrip("]"): value} if sub else value
        elif sub or base not in FILE_PARTS:
            raise ApiError(400, f"unknown file part {name!r}; file parts allowed: {', '.join(FILE_PARTS)}", name,
                           "unknown_parameter")  # fmt: skip
        else:
            files[base] = await value.read()
    if lora_parts:
        fields["lora"] = form_lora(lora_parts)
    return fields, files


class ContentResponse(StreamingResponse):
    """The MP4 as its chunks arrive. A task watches for the HTTP client going away and cancels the gRPC call at
    once (the thread waiting for the next chunk returns); the call is cancelled whenever the response ends."""

    def __init__(self, chunks: ContentChunks, headers: dict[str, str]) -> None:
        super().__init__(_guarded(chunks), media_type="video/mp4", headers=headers)
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tasks:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.chunks.cancel()
                tasks.cancel_scope.cancel()

            tasks.start_soon(watch)
            try:
                await self.stream_response(send)
            except OSError:  # the client went away mid-send
                pass
            finally:
                self.chunks.cancel()  # a no-op once the stream has ended
                tasks.cancel_scope.cancel()


def _guarded(chunks: ContentChunks) -> Iterator[bytes]:
    """The content's chunks; a failure mid-stream ends the response (its Content-Length then tells the client)."""
    try:
        yield from chunks
    except (grpc.RpcError, IntegrityError) as e:
        log.warning("a /content stream of %s ended early: %s", chunks.job_id, e)


def _first_frame_png(mp4: bytes) -> bytes:
    import av
    from PIL import Image

    with av.open(io.BytesIO(mp4), mode="r") as container:
        frame = next(container.decode(video=0))
        image = Image.fromarray(frame.to_ndarray(format="rgb24"))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
