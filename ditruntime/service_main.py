"""The shared tail of both services' `main`: thread count, build, run until SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Protocol

import torch


class Service(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


def run_service(
    prog: str,
    threads: int | None,
    build: Callable[[], Service],
    errors: tuple[type[BaseException], ...],
    banner: Callable[[Service], str],
) -> int:
    """Exit 2 on a bad flag or a build error (message names it); else serve until signalled."""
    if threads is not None:  # LaunchOptions (ditruntime.flags) already checked it is >= 1
        torch.set_num_threads(threads)
    try:
        server = build()
    except errors as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(banner(server), flush=True)
    stop.wait()
    server.stop()
    return 0
