"""generator_service.jobs.results: content-addressed result files, written atomically, kept once, kept while read."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from generator_service.jobs.results import (
    CHUNK_BYTES,
    STALE_TEMP_S,
    TEMP_PREFIX,
    ContentMissingError,
    ContentRef,
    ResultStore,
)  # fmt: skip

BIG = bytes(range(256)) * (CHUNK_BYTES // 256 * 3 + 7)  # a bit over 3 MiB: several copy chunks


def files(root: Path) -> list[str]:
    """Every file under root, relative, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_put_bytes_stores_the_content_under_its_sha256(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results")
    sha = hashlib.sha256(b"hello world").hexdigest()
    ref = store.put_bytes([b"hello", b" ", b"world"], "video/mp4", "r1.mp4")
    assert ref == ContentRef(sha, 11, "video/mp4", "r1.mp4")
    assert files(store.root) == [f"{sha[:2]}/{sha}"]
    with store.open(sha) as f:
        assert f.read() == b"hello world"
    assert store.size(sha) == 11 and store.total_bytes() == 11


def test_put_file_streams_a_large_file(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    src = io.BytesIO(b"skipped" + BIG)
    src.seek(7)  # from the current position on
    ref = store.put_file(src, "application/zip", "x.zip")
    assert (ref.sha256, ref.size) == (hashlib.sha256(BIG).hexdigest(), len(BIG))
    assert store.path(ref.sha256).read_bytes() == BIG


def test_the_same_content_is_kept_once(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    a = store.put_bytes(b"same bytes", "video/mp4", "a.mp4")
    b = store.put_bytes([b"same ", b"bytes"], "video/mp4", "b.mp4")
    assert a.sha256 == b.sha256 and b.filename == "b.mp4"
    assert files(tmp_path) == [f"{a.sha256[:2]}/{a.sha256}"]
    assert store.total_bytes() == len(b"same bytes")


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)

    def chunks() -> Iterator[bytes]:
        yield BIG
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        store.put_bytes(chunks(), "video/mp4", "x.mp4")
    assert files(tmp_path) == []  # no half file under a final name, no temp file left
    with pytest.raises(ContentMissingError):
        store.open(hashlib.sha256(BIG).hexdigest())


def test_stale_temp_files_are_removed_on_open(tmp_path: Path) -> None:
    """A writer's own crashed temp files go at open; another writer's (a replica sharing the directory, maybe
    writing now) stay until a day old."""
    kept = ResultStore(tmp_path, writer="r1").put_bytes(b"kept", "video/mp4", "k.mp4")
    (tmp_path / f"{TEMP_PREFIX}r1-crashed").write_bytes(b"half a file")
    (tmp_path / f"{TEMP_PREFIX}r2-writing").write_bytes(b"being written")
    old = tmp_path / f"{TEMP_PREFIX}r3-long-dead"
    old.write_bytes(b"a day old")
    os.utime(old, (time.time() - STALE_TEMP_S - 60,) * 2)
    ResultStore(tmp_path, writer="r1")
    assert files(tmp_path) == [f"{TEMP_PREFIX}r2-writing", f"{kept.sha256[:2]}/{kept.sha256}"]


def test_a_file_being_read_is_not_removed(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    ref = store.put_bytes(b"watched", "video/mp4", "w.mp4")
    with store.reading(ref.sha256), store.reading(ref.sha256):
        assert store.readers(ref.sha256) == 2
        assert store.remove(ref.sha256) is False
        assert store.path(ref.sha256).is_file()
    assert store.readers(ref.sha256) == 0
    assert store.remove(ref.sha256) is True
    assert files(tmp_path) == [] and store.total_bytes() == 0
    assert store.remove(ref.sha256) is True  # already gone


def test_missing_content_is_failed_precondition(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    sha = "0" * 64
    with pytest.raises(ContentMissingError) as e:
        store.open(sha)
    assert (e.value.grpc_code, e.value.reason) == ("FAILED_PRECONDITION", "CONTENT_UNAVAILABLE")
    assert e.value.metadata == {"sha256": sha} and "--results-max-gb" in str(e.value)
    with pytest.raises(ContentMissingError):
        store.size(sha)


@pytest.mark.parametrize("bad", ["../" + "a" * 61, "A" * 64, "a" * 63, "a" * 65, "", "/etc/passwd"])
def test_a_bad_sha256_is_refused(tmp_path: Path, bad: str) -> None:
    store = ResultStore(tmp_path / "results")
    (tmp_path / "outside").write_bytes(b"not the store's")
    for call in (store.open, store.remove, store.size, store.readers, store.path):
        with pytest.raises(ValueError, match="sha256: must be 64 lowercase hex digits"):
            call(bad)
    with pytest.raises(ValueError, match="sha256: must be"), store.reading(bad):
        pass
    assert (tmp_path / "outside").exists()


def test_a_write_holds_its_file_until_recorded_so_a_racing_remove_keeps_it(tmp_path: Path) -> None:
    """The dedupe race: job A's content is there; job B stores the same bytes while A is deleted. B's write holds
    the file until B's record names it, so A's removal leaves it."""
    store = ResultStore(tmp_path)
    first = store.put_bytes(b"same bytes", "video/mp4", "a.mp4")
    with store.stored(b"same bytes", "video/mp4", "b.mp4") as second:
        assert second.sha256 == first.sha256
        assert store.remove(first.sha256) is False  # A deleted meanwhile: held by B's write
    assert store.path(first.sha256).read_bytes() == b"same bytes"
    assert store.remove(first.sha256) is True  # nobody holds it now


def test_orphans_go_after_the_grace_period_and_named_files_stay(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    named = store.put_bytes(b"named", "video/mp4", "n.mp4")
    orphan = store.put_bytes(b"orphan", "video/mp4", "o.mp4")
    young = store.put_bytes(b"young orphan", "video/mp4", "y.mp4")
    for ref in (named, orphan):
        os.utime(store.path(ref.sha256), (time.time() - 7200,) * 2)
    asked: list[list[str]] = []

    def records_name(shas: list[str]) -> set[str]:
        asked.append(sorted(shas))
        return {named.sha256} & set(shas)

    assert store.remove_orphans(records_name, grace_s=3600) == (1, len(b"orphan"))
    assert asked == [sorted([named.sha256, orphan.sha256])]  # the young one is not even asked about
    assert files(tmp_path) == sorted(f"{r.sha256[:2]}/{r.sha256}" for r in (named, young))
    with store.reading(named.sha256):
        os.utime(store.path(named.sha256), (time.time() - 7200,) * 2)
        assert store.remove_orphans(lambda shas: set(), grace_s=3600) == (0, 0)  # held: kept


def test_concurrent_writers_of_the_same_bytes_keep_one_file(tmp_path: Path) -> None:
    store = ResultStore(tmp_path)
    refs: list[ContentRef] = []
    threads = [threading.Thread(target=lambda: refs.append(store.put_bytes(BIG, "x", "x"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.sha256 for r in refs}) == 1 and len(files(tmp_path)) == 1
