"""The sidecar's persisted state: (generation, weights_path, per-file digests) in `<state-dir>/plancache-state.json`.

Written atomically (temp file, fsync, rename, fsync the directory) so the generation never goes backwards across
restarts and a crash leaves either the old or the new state. A write that would change nothing is skipped, so a
sidecar that starts on an unchanged state writes nothing (a full state disk does not stop it); a real change that
cannot be written raises StateFileError and changes nothing.

Schema, read strictly (every failure is a StateFileError naming the key and the rule):

    generation    a JSON integer (not a boolean, no fraction or exponent), 1 <= g <= 2**63 - 1 (the slot table's int64)
    weights_path  a non-empty string without NUL
    digests       optional: an object of file path -> 64 lowercase hex digits ("corrupt:" + 64 hex digits is what
                  ditcore.digests.file_digests writes for an unreadable shard); left out (a hand-written recovery
                  file), the sidecar digests the files at start and writes them back
    fingerprint   optional (the sidecar writes it): must equal combine_digests(digests)

Any other key is refused (the sidecar rewrites the file at every commit and would silently drop it), and so is a key
given twice. Recovery never resets the generation: the advice names N, the smallest generation known to be safe
("set generation to at least N"): the file's own generation when that key is valid; else one above the generation of
`plancache-state.json.prev`, the state the last replace superseded (written atomically just before each replace, and
at start, best effort, when it is missing or lags the loaded state by more than one, e.g. after a hand edit); else
unknown (the sidecar's log names every committed generation). `.prev` is never served from; it only bounds N.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditcore.digests import combine_digests

from .errors import StateFileError as StateFileError  # re-exported: the CLI and the adapter import it from here

log = logging.getLogger(__name__)

STATE_FILE = "plancache-state.json"
PREV_FILE = STATE_FILE + ".prev"
MAX_GENERATION = 2**63 - 1
"""The largest generation: the slot table stores it in an int64 column."""
MAX_STATE_BYTES = 1 << 20
"""A state file is a few KiB (one digest per checkpoint file); anything larger is not one."""
KEYS = ("generation", "weights_path", "digests", "fingerprint")
_DIGEST = re.compile(r"(corrupt:)?[0-9a-f]{64}")


@dataclass(frozen=True)
class PersistedState:
    generation: int
    weights_path: str
    digests: dict[str, str]  # {} when the file left them out: the sidecar digests the files at start

    @property
    def fingerprint(self) -> str:
        return combine_digests(self.digests)


class _Invalid(Exception):
    """One broken rule of the schema: the key ("" for the file itself), the rule, and the file's own generation
    when that key was valid."""

    def __init__(self, key: str, rule: str, generation: int | None = None) -> None:
        super().__init__(rule)
        self.key, self.rule, self.generation = key, rule, generation


@dataclass(frozen=True)
class _Fraction:
    """A JSON number with a fraction or an exponent, kept as written (`1e400`, `2.9`): never an integer here."""

    text: str


def _refuse_constant(name: str) -> Any:
    raise _Invalid("", f"is not valid JSON ({name} is not a JSON number)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Invalid(k, "is given twice")
        out[k] = v
    return out


def _shown(value: Any) -> str:
    """A JSON value as the file spells it (containers by kind)."""
    if isinstance(value, _Fraction):
        return value.text
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return json.dumps(value)


# ---------------------------------------------------------------------------- reading
def _read_bytes(path: Path) -> bytes:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise _Invalid("", f"is {kind}, not a state file")
        if st.st_size > MAX_STATE_BYTES:
            raise _Invalid("", f"holds {st.st_size} bytes; a state file is at most {MAX_STATE_BYTES}")
        with open(path, "rb") as f:
            return f.read(MAX_STATE_BYTES + 1)
    except OSError as e:
        raise _Invalid("", f"cannot be read ({e.strerror or e})") from e


def _parse(data: bytes) -> dict[str, Any]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Invalid("", f"is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from e
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys, parse_float=_Fraction, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise _Invalid("", f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except (ValueError, RecursionError) as e:  # an integer of more than 4300 digits; arrays nested too deeply
        raise _Invalid("", f"is not valid JSON ({e or 'nested too deeply'})") from e
    if not isinstance(obj, dict):
        raise _Invalid("", f"must hold a JSON object, got {_shown(obj)}")
    return obj


def _generation(obj: dict[str, Any]) -> int:
    if "generation" not in obj:
        raise _Invalid("generation", f"is missing (required: a JSON integer in [1, {MAX_GENERATION}])")
    g = obj["generation"]
    if isinstance(g, bool) or not isinstance(g, int):
        raise _Invalid("generation", f"must be a JSON integer in [1, {MAX_GENERATION}], got {_shown(g)}")
    if not 1 <= g <= MAX_GENERATION:
        raise _Invalid("generation", f"must be in [1, {MAX_GENERATION}], got {g}")
    return g


def _weights_path(obj: dict[str, Any], g: int) -> str:
    p = obj.get("weights_path")
    if p is None and "weights_path" not in obj:
        raise _Invalid("weights_path", "is missing (required: the checkpoint directory served)", g)
    if not isinstance(p, str):
        raise _Invalid("weights_path", f"must be a string, got {_shown(p)}", g)
    if not p or "\0" in p:
        raise _Invalid("weights_path", "must be a non-empty path without NUL bytes", g)
    return p


def _digests(obj: dict[str, Any], g: int) -> dict[str, str]:
    if "digests" not in obj:
        if "fingerprint" in obj:
            raise _Invalid("fingerprint", "is given without digests (leave both out, or give both)", g)
        return {}
    d = obj["digests"]
    if not isinstance(d, dict) or not d:
        raise _Invalid("digests", f"must be a non-empty object of file path -> digest, got {_shown(d)}", g)
    for name, digest in d.items():
        if not name or not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise _Invalid(
                f"digests[{name!r}]", f"must be a file path -> 64 lowercase hex digits, got {_shown(digest)}", g
            )
    digests = dict(d)
    if "fingerprint" in obj:
        fp, want = obj["fingerprint"], combine_digests(digests)
        if fp != want:
            raise _Invalid("fingerprint", f"must equal the digests' fingerprint {want}, got {_shown(fp)}", g)
    return digests


def _validate(obj: dict[str, Any]) -> PersistedState:
    g = _generation(obj)
    state = PersistedState(g, _weights_path(obj, g), _digests(obj, g))
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise _Invalid(unknown[0], f"is not a state file key (the keys: {', '.join(KEYS)})", g)
    return state


def _read(path: Path) -> PersistedState:
    return _validate(_parse(_read_bytes(path)))


def _read_valid(path: Path) -> PersistedState | None:
    """The state at `path` if it is a valid one, else None (never raises)."""
    try:
        return _read(path)
    except _Invalid:
        return None


def min_generation(state_dir: Path, own: int | None = None) -> tuple[int | None, str]:
    """(N, why): the smallest generation known to be safe for a new state file in `state_dir` (module doc)."""
    if own is not None:
        return own, "the file's own generation"
    prev = _read_valid(state_dir / PREV_FILE)
    if prev is not None and prev.generation < MAX_GENERATION:
        return prev.generation + 1, f"one above generation {prev.generation} of {PREV_FILE}, the state it replaced"
    return None, ""


def recovery_advice(state_dir: Path, own: int | None = None) -> tuple[int | None, str]:
    """(N, how to recover without the generation going backwards)."""
    n, why = min_generation(state_dir, own)
    never = "never remove it: the generation would restart at 1 and go backwards"
    keep = '"weights_path" the checkpoint to serve ("digests" and "fingerprint" may be left out: the sidecar then'
    keep += " digests the files at start)"
    if n is None:
        return None, (
            f'to recover, make it a valid state file with {keep} and "generation" above every generation this sidecar '
            f'served (its log\'s "committed generation N" lines; no readable {PREV_FILE} bounds it); {never}'
        )
    return n, f"to recover, make it a valid state file: set generation to at least {n} ({why}) and {keep}; {never}"


def load_state(state_dir: Path) -> PersistedState | None:
    """The persisted state, or None when there is no state file; a bad one raises StateFileError (module doc)."""
    path = state_dir / STATE_FILE
    if not os.path.lexists(path):  # a dangling symlink is a state file that cannot be read, not "none yet"
        return None
    try:
        return _read(path)
    except _Invalid as e:
        n, advice = recovery_advice(state_dir, e.generation)
        raise StateFileError(str(path), e.key, e.rule, n, advice) from e


# ---------------------------------------------------------------------------- writing
def _encode(state: PersistedState) -> bytes:
    data: dict[str, Any] = {"generation": state.generation, "weights_path": state.weights_path}
    if state.digests:
        data.update(fingerprint=state.fingerprint, digests=state.digests)
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def _fsync_dir(state_dir: Path) -> None:
    dfd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_atomic(state_dir: Path, name: str, data: bytes) -> None:
    """Write `state_dir/name` as a whole or not at all (temp file, fsync, rename, fsync the directory)."""
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=state_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, state_dir / name)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(state_dir)


def _check_writable(path: Path, state: PersistedState) -> None:
    """Never write a state that `load_state` would refuse."""
    try:
        _validate(json.loads(_encode(state)))
    except _Invalid as e:
        raise StateFileError(str(path), e.key, f"{e.rule}: cannot be persisted; nothing changed") from e


def _keep_prev(state_dir: Path, current: PersistedState) -> None:
    """Best effort: refresh `.prev` when it is missing or lags `current` by more than one (module doc)."""
    prev = _read_valid(state_dir / PREV_FILE)
    if prev is not None and prev.generation >= current.generation - 1:
        return
    try:
        write_atomic(state_dir, PREV_FILE, _encode(current))
    except OSError as e:
        log.warning("could not refresh %s (%s); the state file itself is unchanged", state_dir / PREV_FILE, e)


def save_state(state_dir: Path, state: PersistedState) -> bool:
    """Persist `state`; returns False when the file already holds exactly it (nothing written, `.prev` refreshed
    best effort). Before a replace, the superseded valid state goes to `.prev`. Raises StateFileError when it cannot
    be written (the file keeps its previous state)."""
    path = state_dir / STATE_FILE
    _check_writable(path, state)
    current = _read_valid(path)
    if current == state:
        assert current is not None
        _keep_prev(state_dir, current)
        return False
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if current is not None:
            write_atomic(state_dir, PREV_FILE, _encode(current))
        write_atomic(state_dir, STATE_FILE, _encode(state))
    except OSError as e:
        kept = f"it still holds generation {current.generation}" if current is not None else "nothing was written"
        raise StateFileError(str(path), "", f"cannot be written ({e.strerror or e}); {kept}") from e
    return True
