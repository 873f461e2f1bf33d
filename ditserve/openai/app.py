"""`ditserve openai-api --target HOST:PORT`: an OpenAI-compatible `/v1/videos` HTTP facade over the Jobs API.

    ditserve openai-api --target 127.0.0.1:50051 --port 8000      # key: DITSERVE_OPENAI_API_KEY or --api-key-file

| method, path | does | codes |
| --- | --- | --- |
| `POST /v1/videos` | create (JSON or multipart; `input_reference`: the first frame) | 200, 400, 401, 409, 429, 503 |
| `GET /v1/videos/{id}` | the video (job) | 200, 401, 404 |
| `GET /v1/videos` | list: `after`, `limit` 1-100, `order` asc/desc | 200, 400, 401, 404 (`after`) |
| `GET /v1/videos/{id}/content` | the MP4 (`variant=thumbnail`: its first frame as PNG) | 200, 400, 401, 404, 409 |
| `DELETE /v1/videos/{id}` | cancel and delete | 200, 401, 404 |

Stateless: every call is a Jobs RPC (ditserve.openai.mapping maps both ways), so the facade may restart, or run as
several copies, without losing anything. Errors have OpenAI's body shape, FastAPI's own (no such route, a query
value of the wrong type) too; an unknown create field is refused naming it.
"""

from __future__ import annotations

import hmac
import io
import itertools
from collections.abc import Iterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..jobs_client import JobsClient
from .mapping import ApiError, create_body, from_rpc_error, reference_image, video_object

MAX_LIST = 100


def create_app(jobs: JobsClient, api_key: str | None) -> FastAPI:
    app = FastAPI(title="ditserve /v1/videos", version="1", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def auth_and_errors(request: Request, call_next: Any) -> Response:
        if api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(ApiError(401, "invalid or missing API key (Authorization: Bearer ...)", None,
                                       "invalid_api_key", "authentication_error"))  # fmt: skip
        try:
            response: Response = await call_next(request)
            return response
        except ApiError as e:
            return _error(e)
        except grpc.RpcError as e:
            return _error(from_rpc_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # no such route or method
        return _error(ApiError(e.status_code, str(e.detail), None, None, headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def invalid_parameter(request: Request, e: RequestValidationError) -> JSONResponse:  # e.g. limit=abc
        [first, *_] = e.errors()
        param = str(first["loc"][-1]) if first.get("loc") else None
        return _error(ApiError(400, f"{param}: {first.get('msg', 'invalid value')}", param))

    @app.post("/v1/videos")
    async def create(request: Request) -> dict[str, Any]:
        fields, first, last = await _create_fields(request)
        body = create_body(fields, first, last)
        key = request.headers.get("idempotency-key", "") or body.idempotency_key
        job, _ = await run_in_threadpool(jobs.create, body.request, key)  # a blocking RPC: off the event loop
        return video_object(job, body.model)

    @app.get("/v1/videos/{video_id}")
    def retrieve(video_id: str) -> dict[str, Any]:
        return video_object(jobs.get(video_id))

    @app.get("/v1/videos")
    def list_videos(after: str | None = None, limit: int = 20, order: str = "desc") -> dict[str, Any]:
        if not 1 <= limit <= MAX_LIST:
            raise ApiError(400, f"limit must be in [1, {MAX_LIST}], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", "order")
        found = jobs.iter_all(oldest_first=order == "asc")
        if after:
            found = itertools.dropwhile(lambda j: j.job_id != after, found)
            if next(found, None) is None:
                raise ApiError(404, f"after: no video {after!r}", "after")
        page = list(itertools.islice(found, limit + 1))
        data = [video_object(j) for j in page[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(page) > limit}  # fmt: skip

    @app.get("/v1/videos/{video_id}/content")
    def content(video_id: str, variant: str = "video") -> Response:
        if variant not in ("video", "thumbnail"):
            raise ApiError(400, f"variant must be video or thumbnail, got {variant!r}", "variant")
        header, chunks = jobs.content_iter(video_id)
        if header.content.content_type != "video/mp4":
            raise ApiError(409, f"video {video_id} holds {header.content.content_type}, not an MP4", None)
        if variant == "thumbnail":
            return Response(_first_frame_png(b"".join(chunks)), media_type="image/png")
        headers = {"Content-Length": str(header.content.total_bytes),
                   "Content-Disposition": f'attachment; filename="{header.content.filename}"'}  # fmt: skip
        return StreamingResponse(_guarded(chunks), media_type="video/mp4", headers=headers)

    @app.delete("/v1/videos/{video_id}")
    def delete(video_id: str) -> dict[str, Any]:
        jobs.delete(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return app


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _create_fields(request: Request) -> tuple[dict[str, Any], bytes, bytes]:
    """The create body's fields and its keyframes: multipart (files `input_reference` = the first frame,
    `last_frame`; or either as text) or JSON. As text a keyframe is base64, a data URL, or OpenAI's
    `{"image_url": <data URL>}` (multipart: the field `input_reference[image_url]`); `first_frame` is
    `input_reference`'s other name."""
    kind = request.headers.get("content-type", "")
    if kind.startswith("multipart/form-data") or kind.startswith("application/x-www-form-urlencoded"):
        form = await request.form()
        fields: dict[str, Any] = {}
        for name, value in form.multi_items():
            base, _, sub = name.partition("[")
            fields[base] = {sub.rstrip("]"): value} if sub else value
        files = {k: await v.read() for k, v in fields.items() if not isinstance(v, str | dict)}
        fields = {k: v for k, v in fields.items() if k not in files}
    else:
        try:
            fields = await request.json()
        except ValueError:
            raise ApiError(400, "the body must be JSON or multipart/form-data", None) from None
        if not isinstance(fields, dict):
            raise ApiError(400, "the body must be a JSON object", None)
        files = {}
    first = "input_reference" if "input_reference" in fields or "input_reference" in files else "first_frame"
    if first == "input_reference" and ("first_frame" in fields or "first_frame" in files):
        raise ApiError(400, "give input_reference or first_frame (the same keyframe), not both", "first_frame")
    frames = []
    for name in (first, "last_frame"):
        text = fields.pop(name, None)
        frames.append(reference_image(text, name) if text not in (None, "") else files.get(name, b""))
    return fields, frames[0], frames[1]


def _guarded(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The content's chunks; a failure mid-stream ends the response (its Content-Length then tells the client)."""
    try:
        yield from chunks
    except grpc.RpcError:
        return


def _first_frame_png(mp4: bytes) -> bytes:
    import av
    from PIL import Image

    with av.open(io.BytesIO(mp4), mode="r") as container:
        frame = next(container.decode(video=0))
        image = Image.fromarray(frame.to_ndarray(format="rgb24"))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
