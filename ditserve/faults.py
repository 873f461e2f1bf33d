"""Test-only fault hook: crash this process at a named point.

Enabled only by the environment variable DITSERVE_FAULT (a comma-separated list of points,
e.g. "update:after_prepare"). At a listed point the process SIGKILLs itself, which is how
the crash tests stop a service at each phase of a weight update. Unset: a no-op.
"""

from __future__ import annotations

import logging
import os
import signal

ENV = "DITSERVE_FAULT"
log = logging.getLogger(__name__)


def crash_point(name: str) -> None:
    points = os.environ.get(ENV, "")
    if points and name in {p.strip() for p in points.split(",")}:
        log.critical("fault hook: killing this process at %s", name)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
