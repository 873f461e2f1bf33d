"""The sidecar's persisted state: (generation, weights_path, per-file digests).

Written atomically (temp file, fsync, rename, fsync the directory) so the generation never
goes backwards across restarts and a crash leaves either the old or the new state.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ditcore.checkpoint import combine_digests

STATE_FILE = "plancache-state.json"


class StateFileError(Exception):
    grpc_code = "INTERNAL"
    reason = "STATE_FILE_ERROR"


@dataclass(frozen=True)
class PersistedState:
    generation: int
    weights_path: str
    digests: dict[str, str]

    @property
    def fingerprint(self) -> str:
        return combine_digests(self.digests)


def load_state(state_dir: Path) -> PersistedState | None:
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        state = PersistedState(int(d["generation"]), str(d["weights_path"]), dict(d["digests"]))
    except (ValueError, KeyError, TypeError) as e:
        raise StateFileError(f"{path}: corrupt state file ({e}); fix or remove it") from e
    if state.generation < 1:
        raise StateFileError(f"{path}: generation must be >= 1, got {state.generation}")
    return state


def save_state(state_dir: Path, state: PersistedState) -> None:
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = {
        "generation": state.generation,
        "weights_path": state.weights_path,
        "fingerprint": state.fingerprint,
        "digests": state.digests,
    }
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=state_dir)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, state_dir / STATE_FILE)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
