"""The generate commands' progress bar on stderr: one per request, over the denoise steps, then the stages after
them ("decode" and "mux" locally; "decode+mux" and the bytes received from a service). stdout is left alone (one
JSON line per request).

`--progress auto` (the default) shows it when stderr is a terminal; `on` always, `off` never. Disabled, every method
is a no-op, so the commands call it unconditionally.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

PROGRESS_CHOICES = ("auto", "on", "off")


def add_progress_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--progress",
        choices=PROGRESS_CHOICES,
        default="auto",
        help="progress bar on stderr: auto (when stderr is a terminal), on, off (default %(default)s)",
    )


def progress_enabled(choice: str) -> bool:
    if choice == "auto":
        return sys.stderr.isatty()
    return choice == "on"


class Progress:
    """One request's bar. `step(i, n)` after each denoise step; `stage(name)` when a stage after the loop starts;
    `transfer(done, total)` while result bytes arrive. A context manager: closed on exit."""

    def __init__(self, request_id: str, enabled: bool, decodes: bool = False) -> None:
        self.request_id = request_id
        self.decodes = decodes
        self.bar: Any = None
        self._stage = ""
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=None, desc=request_id, unit="step", file=sys.stderr, leave=False, dynamic_ncols=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, i: int, n: int) -> None:
        """Step `i` of `n` done; after the last one a decoding request shows "decode" (the decode starts next)."""
        if self.bar is None:
            return
        self.bar.total = n
        self.bar.update(i - self.bar.n)
        if i >= n and self.decodes:
            self.stage("decode")

    def stage(self, name: str) -> None:
        """A stage after the loop ("decode", "mux", "decode+mux") has started."""
        if self.bar is None or name == self._stage:
            return
        self._stage = name
        self.bar.set_description_str(f"{self.request_id} {name}", refresh=True)

    def transfer(self, done: int, total: int) -> None:
        """Result bytes received so far (`total` 0: unknown)."""
        if self.bar is None:
            return
        if self._stage != "receive":
            self._stage = "receive"
            self.bar.unit, self.bar.unit_scale, self.bar.unit_divisor = "B", True, 1024
            self.bar.set_description_str(f"{self.request_id} receive", refresh=False)
            self.bar.reset(total=total or None)  # redraws the bar
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
