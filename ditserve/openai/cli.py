"""`ditserve openai-api`: its flags and the command (the app itself, and its FastAPI import, is
ditserve.openai.app's, loaded only when the command runs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ditruntime.auth import read_token_file

from ..errors import UsageError
from ..jobs_client import JobsClient
from ..remote import add_client_flags, credentials_from_args

API_KEY_ENV = "DITSERVE_OPENAI_API_KEY"


def add_openai_api_parser(sub: Any) -> None:
    p = sub.add_parser("openai-api", help="serve an OpenAI-compatible /v1/videos HTTP API over a generator's jobs")
    p.add_argument("--target", required=True, help="generator address HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s)")
    p.add_argument("--api-key-file", default=None, help=f"bearer key clients must send (default: ${API_KEY_ENV}; "
                   "none: no key asked)")  # fmt: skip
    add_client_flags(p)
    p.set_defaults(func=cmd_openai_api)


def api_key_of(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        try:
            return read_token_file(Path(args.api_key_file), "--api-key-file")
        except ValueError as e:
            raise UsageError(str(e)) from e
    return os.environ.get(API_KEY_ENV) or None


def cmd_openai_api(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    key = api_key_of(args)
    with JobsClient(args.target, credentials=credentials_from_args(args)) as jobs:
        print(f"openai-api on http://{args.host}:{args.port}/v1/videos -> {args.target} "
              f"({'bearer key required' if key else 'no key'})", flush=True)  # fmt: skip
        uvicorn.run(create_app(jobs, key), host=args.host, port=args.port, log_level="warning")
    return 0
