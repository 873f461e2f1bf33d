"""`ditserve openai-api`: its parser (the flags are `FacadeConfig`'s, ditserve.openai.config, beside the target, the
key and TLS) and the command (the app itself, and its FastAPI import, is ditserve.openai.app's, loaded only when the
command runs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ditruntime.auth import read_token_file
from ditruntime.flags import add_flags, from_args

from ..errors import UsageError
from ..jobs_client import JobsClient
from ..remote import add_client_flags, credentials_from_args
from .config import FacadeConfig

API_KEY_ENV = "DITSERVE_OPENAI_API_KEY"


def add_openai_api_flags(p: argparse.ArgumentParser) -> None:
    """`ditserve openai-api`'s flags."""
    p.add_argument("--target", required=True, help="generator address HOST:PORT")
    add_flags(p, FacadeConfig)
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

    try:
        config = from_args(FacadeConfig, args, api_key=api_key_of(args))
    except ValueError as e:
        raise UsageError(str(e)) from e
    with JobsClient(args.target, credentials=credentials_from_args(args)) as jobs:
        print(f"openai-api on http://{config.host}:{config.port}/v1/videos -> {args.target} "
              f"({'bearer key required' if config.api_key else 'no key'}; Host: "
              f"{','.join(config.host_patterns())})", flush=True)  # fmt: skip
        uvicorn.run(create_app(jobs, config), host=config.host, port=config.port, log_level="warning")
    return 0
