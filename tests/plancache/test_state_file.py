"""The state file (plancache_service/state.py) is read strictly and never tells anyone to let the generation go back
(issue 19, item 6).

Every bad file — a number that is no integer (`1e400`, `2.9`), one out of range (`2**70`, 0, negative), a boolean,
a missing key, invalid JSON or UTF-8, a directory or an unreadable file in its place — is a StateFileError naming the
file, the key and the rule, with advice that keeps the generation: "set generation to at least N", N being the file's
own generation when that key is valid, else one above `plancache-state.json.prev` (the state the last replace
superseded). A start on an unchanged state writes nothing, so a full state disk (ENOSPC from the writer) does not stop
it; a real change on a full disk fails loudly and changes nothing.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import grpc
import pytest

import plancache_service.state as state_module
from ditcore.digests import combine_digests, file_digests
from ditruntime.rpc_errors import classify
from plancache_service import cli
from plancache_service.app import open_source
from plancache_service.config import CacheConfig, SidecarConfig
from plancache_service.errors import StateFileError
from plancache_service.sidecar import Sidecar
from plancache_service.state import MAX_GENERATION, PREV_FILE, STATE_FILE, PersistedState, load_state, save_state

from plancache_helpers import MakeCache  # isort: skip

DIGESTS = {"model_index.json": "a" * 64, "transformer/config.json": "b" * 64}


def good(**over: Any) -> dict[str, Any]:
    """A valid state file's JSON object (generation 7), with keys replaced or (value None) dropped."""
    d: dict[str, Any] = {
        "generation": 7, "weights_path": "/ckpt/a", "digests": DIGESTS, "fingerprint": combine_digests(DIGESTS),
    }  # fmt: skip
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def raw(obj: dict[str, Any], **literal: str) -> bytes:
    """`obj` as JSON with the values of `literal`'s keys spelled exactly as given (numbers json cannot write)."""
    text = json.dumps({**obj, **{k: f"@{k}@" for k in literal}})
    for k, v in literal.items():
        text = text.replace(f'"@{k}@"', v)
    return text.encode()


def refusal(state_dir: Path) -> StateFileError:
    with pytest.raises(StateFileError) as info:
        load_state(state_dir)
    return info.value


# (case, file bytes, the key named, words of the rule, N: the generation the advice keeps; None: unknown)
BAD_FILES: list[tuple[str, bytes, str, list[str], int | None]] = [
    ("1e400", raw(good(), generation="1e400"), "generation", ["JSON integer", "got 1e400"], None),
    ("2**70", raw(good(), generation=str(2**70)), "generation", [f"[1, {MAX_GENERATION}]", str(2**70)], None),
    ("true", raw(good(), generation="true"), "generation", ["JSON integer", "got true"], None),
    ("2.9", raw(good(), generation="2.9"), "generation", ["JSON integer", "got 2.9"], None),
    ("3.0", raw(good(), generation="3.0"), "generation", ["JSON integer", "got 3.0"], None),
    ("negative", raw(good(generation=-3)), "generation", ["must be in [1,", "got -3"], None),
    ("zero", raw(good(generation=0)), "generation", ["must be in [1,", "got 0"], None),
    ("string", raw(good(generation="7")), "generation", ["JSON integer", 'got "7"'], None),
    ("NaN", raw(good(), generation="NaN"), "", ["not valid JSON", "NaN is not a JSON number"], None),
    ("no generation", raw(good(generation=None)), "generation", ["is missing"], None),
    ("no weights_path", raw(good(weights_path=None)), "weights_path", ["is missing"], 7),
    ("empty weights_path", raw(good(weights_path="")), "weights_path", ["non-empty"], 7),
    ("weights_path 3", raw(good(weights_path=3)), "weights_path", ["must be a string", "got 3"], 7),
    ("digests list", raw(good(digests=["x"])), "digests", ["object of file path -> digest", "an array"], 7),
    ("digests empty", raw(good(digests={}, fingerprint=None)), "digests", ["non-empty object"], 7),
    ("digest not hex", raw(good(digests={"a": "XYZ"})), "digests['a']", ["64 lowercase hex", '"XYZ"'], 7),
    ("fingerprint", raw(good(fingerprint="0" * 64)), "fingerprint", ["must equal the digests' fingerprint"], 7),
    ("fingerprint alone", raw(good(digests=None)), "fingerprint", ["without digests"], 7),
    ("unknown key", raw(good(generaton=8)), "generaton", ["is not a state file key"], 7),
    ("key twice", b'{"generation": 7, "generation": 9, "weights_path": "/w"}', "generation", ["given twice"], None),
    ("array", b"[7]", "", ["must hold a JSON object", "an array"], None),
    ("bad JSON", b'{"generation": 7,', "", ["is not valid JSON", "line 1"], None),
    ("empty", b"", "", ["is not valid JSON"], None),
    ("bad UTF-8", b'{"generation": 7, "weights_path": "/ckpt/\xff"}', "", ["is not UTF-8", "0xff"], None),
]


@pytest.mark.parametrize(("case", "data", "key", "words", "n"), BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_a_bad_state_file_is_refused_naming_the_key_and_the_rule(
    tmp_path: Path, case: str, data: bytes, key: str, words: list[str], n: int | None
) -> None:
    (tmp_path / STATE_FILE).write_bytes(data)
    e = refusal(tmp_path)
    msg = str(e)
    assert msg.startswith(f"{tmp_path / STATE_FILE}: {key + ': ' if key else ''}"), msg
    assert e.key == key and e.min_generation == n
    for w in words:
        assert w in e.rule, (w, e.rule)
    assert "never remove it" in msg and "go backwards" in msg  # the advice keeps the generation
    if n is None:
        assert "above every generation this sidecar served" in msg
    else:
        assert f"set generation to at least {n} (the file's own generation)" in msg
    assert classify(e) == (grpc.StatusCode.INTERNAL, "STATE_FILE_ERROR", msg)  # mapped, message kept


def test_without_a_valid_generation_the_advice_keeps_one_above_the_previous_state(tmp_path: Path) -> None:
    """Each replace keeps the state it superseded in `.prev`; when the generation itself is unreadable, N is one above
    it (the file held that state's successor)."""
    for g in (1, 2, 3):
        assert save_state(tmp_path, PersistedState(g, "/ckpt/a", DIGESTS))
    assert json.loads((tmp_path / PREV_FILE).read_text())["generation"] == 2
    (tmp_path / STATE_FILE).write_bytes(raw(good(), generation="1e400"))
    e = refusal(tmp_path)
    assert e.min_generation == 3
    assert f"set generation to at least 3 (one above generation 2 of {PREV_FILE}" in str(e)


def test_a_hand_edit_refreshes_prev_at_start_so_the_advice_stays_ahead(tmp_path: Path) -> None:
    save_state(tmp_path, PersistedState(1, "/ckpt/a", DIGESTS))
    save_state(tmp_path, PersistedState(2, "/ckpt/a", DIGESTS))  # .prev: generation 1
    edited = PersistedState(10, "/ckpt/a", DIGESTS)
    (tmp_path / STATE_FILE).write_bytes(raw(good(generation=10, weights_path="/ckpt/a")))  # the operator's edit
    assert save_state(tmp_path, edited) is False  # a start on it rewrites nothing, but .prev catches up
    assert json.loads((tmp_path / PREV_FILE).read_text())["generation"] == 10
    (tmp_path / STATE_FILE).write_bytes(b"{")
    assert refusal(tmp_path).min_generation == 11


@pytest.mark.parametrize("kind", ["directory", "fifo", "dangling symlink", "unreadable"])
def test_something_else_in_the_state_files_place_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    path = tmp_path / STATE_FILE
    rule = {"directory": "is a directory", "fifo": "not a regular file", "dangling symlink": "cannot be read"}
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # opening it would block: refused by its type first
    elif kind == "dangling symlink":
        path.symlink_to(tmp_path / "gone")  # not "no state file yet": that would restart at generation 1
    else:
        path.write_bytes(raw(good()))

        def denied(*_a: Any, **_k: Any) -> Any:
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(state_module, "open", denied, raising=False)  # as root, chmod 000 would not stop a read
        rule["unreadable"] = "cannot be read (Permission denied)"
    e = refusal(tmp_path)
    assert e.key == "" and rule[kind] in e.rule and "never remove it" in str(e)


def test_a_refused_state_file_stops_the_sidecar_with_exit_2_and_the_advice(
    tiny_ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = logging.getLogger()  # main() points the root logger at this test's captured stderr: put it back after
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    run_dir = Path(tempfile.mkdtemp(prefix="psf-", dir="/tmp"))
    try:
        state_dir = run_dir / "state"
        state_dir.mkdir(mode=0o700)
        (state_dir / STATE_FILE).write_bytes(raw(good(weights_path=str(tiny_ckpt)), generation="true"))
        argv = ["--checkpoint", str(tiny_ckpt), "--state-dir", str(state_dir), "--socket", str(run_dir / "pc.sock")]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"{state_dir / STATE_FILE}: generation: must be a JSON integer" in err and "got true" in err
        assert "never remove it" in err
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# ============================================================================ writing
def test_the_written_file_round_trips_and_an_out_of_range_generation_is_never_written(tmp_path: Path) -> None:
    state = PersistedState(MAX_GENERATION, "/ckpt/a", DIGESTS)
    assert save_state(tmp_path, state) and load_state(tmp_path) == state
    assert set(json.loads((tmp_path / STATE_FILE).read_text())) == {
        "generation",
        "weights_path",
        "digests",
        "fingerprint",
    }
    with pytest.raises(StateFileError, match=r"generation: must be in \[1, 9223372036854775807\].*cannot be persisted"):
        save_state(tmp_path, PersistedState(MAX_GENERATION + 1, "/ckpt/a", DIGESTS))
    assert load_state(tmp_path) == state


def no_space(asked: list[str]) -> Any:
    """A `state.write_atomic` for a full disk: records the name it was asked to write, raises ENOSPC."""

    def write_atomic(_state_dir: Path, name: str, _data: bytes) -> None:
        asked.append(name)
        raise OSError(errno.ENOSPC, "No space left on device")

    return write_atomic


def test_a_start_on_an_unchanged_state_writes_nothing_so_a_full_disk_does_not_stop_it(
    make: MakeCache, tmp_path: Path, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"
    cache = make(gpu_plans=8, generation=3)
    save_state(state_dir, PersistedState(3, str(cache.source.path), cache.source.digests))
    before = (state_dir / STATE_FILE).stat()
    asked: list[str] = []
    monkeypatch.setattr(state_module, "write_atomic", no_space(asked))
    sidecar = Sidecar(cache, state_dir)  # starts: the file already holds generation 3 of this source
    assert sidecar.state().generation == 3
    assert STATE_FILE not in asked  # only the best-effort .prev refresh was tried (and failed, logged)
    after = (state_dir / STATE_FILE).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    # a real change on the full disk fails loudly and changes nothing: a first start (no state file) ...
    with pytest.raises(StateFileError, match=r"cannot be written \(No space left on device\); nothing was written"):
        Sidecar(make(gpu_plans=8, generation=1), tmp_path / "fresh")
    assert not (tmp_path / "fresh" / STATE_FILE).exists()


def test_a_commit_on_a_full_disk_commits_nothing(
    make: MakeCache, tmp_path: Path, tiny_ckpt_b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"
    sidecar = Sidecar(make(gpu_plans=8, generation=1), state_dir)
    sidecar.prepare_update(1, str(tiny_ckpt_b))
    with monkeypatch.context() as m:
        m.setattr(state_module, "write_atomic", no_space([]))
        with pytest.raises(StateFileError, match=r"cannot be written \(No space left on device\); it still holds gen"):
            sidecar.commit_update(1, str(tiny_ckpt_b))
    loaded = load_state(state_dir)
    assert loaded is not None and loaded.generation == 1 and sidecar.cache.generation == 1
    assert sidecar.commit_update(1, str(tiny_ckpt_b))[0] == 2  # once there is room, the same commit succeeds
    loaded = load_state(state_dir)
    assert loaded is not None and (loaded.generation, loaded.weights_path) == (2, str(tiny_ckpt_b))


def test_a_recovery_file_without_digests_is_digested_at_start_and_written_back(
    make: MakeCache, tmp_path: Path, tiny_ckpt: Path
) -> None:
    """The advice's recovery file: generation and weights_path only; the sidecar digests the files and persists them."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / STATE_FILE).write_text(json.dumps({"generation": 12, "weights_path": str(tiny_ckpt)}))
    cfg = SidecarConfig(tiny_ckpt, CacheConfig(), f"unix:{tmp_path / 'pc.sock'}", state_dir=state_dir)
    source, generation = open_source(cfg)
    assert generation == 12 and source.digests == file_digests(tiny_ckpt)
    Sidecar(make(gpu_plans=8, generation=generation, source=source), state_dir)
    loaded = load_state(state_dir)
    assert loaded is not None and (loaded.generation, loaded.digests) == (12, file_digests(tiny_ckpt))
