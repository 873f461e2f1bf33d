"""Test-only fault hook: crash (or stall) this process at a named point.

Enabled only by the environment variable DITSERVE_FAULT, a comma-separated list of
`POINT` (SIGKILL this process there) or `POINT=sleep:SECONDS` (stall there, so a test can
kill the *other* process at that phase). Points: update:after_prepare, update:during_drain,
update:after_swap, update:before_commit, update:after_commit (generator);
sidecar:during_rebuild, sidecar:before_commit, sidecar:after_persist (sidecar). Unset: a no-op.
"""

from __future__ import annotations

import logging
import os
import signal
import time

ENV = "DITSERVE_FAULT"
log = logging.getLogger(__name__)


def crash_point(name: str) -> None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    for item in spec.split(","):
        point, _, action = item.strip().partition("=")
        if point != name:
            continue
        if action.startswith("sleep:"):
            log.critical("fault hook: stalling %s s at %s", action[6:], name)
            time.sleep(float(action[6:]))
            return
        log.critical("fault hook: killing this process at %s", name)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
