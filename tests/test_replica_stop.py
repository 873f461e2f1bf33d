"""A replica's stop is quiet on every rank, without processes: rank 0's link, stopping, takes a rank already gone
for no loss (no error, no restart), and a follower signalled with the others ends on the broken group in one line,
exit 0. The whole replica under `ditserve serve`: tests/parallel/test_replica_shutdown.py."""

from __future__ import annotations

import logging
import signal
import threading
import types
from collections.abc import Iterator

import pytest

from ditcore.replica import ReplicaLostError
from generator_service.errors import ReplicaUnavailableError
from generator_service.replica.follower import follow
from generator_service.replica.link import ReplicaLink
from protos.ditserve.replica.v1 import replica_pb2 as rpb


class _GoneRanks:
    """Rank 0 of a replica whose other ranks are gone: every collective fails."""

    leader, world_size = True, 2

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        raise ReplicaLostError("broadcast failed (a rank is gone?)")


def test_a_rank_gone_while_rank_0_stops_is_no_loss(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    lost: list[str] = []
    link = ReplicaLink(_GoneRanks(), lost.append)  # type: ignore[arg-type]
    link.stop()
    assert lost == [] and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with pytest.raises(ReplicaUnavailableError):
        link.call(rpb.RankWork())  # refused after the stop, as after any loss

    serving = ReplicaLink(_GoneRanks(), lost.append)  # type: ignore[arg-type]
    with pytest.raises(ReplicaUnavailableError):
        serving.call(rpb.RankWork())
    assert len(lost) == 1 and any(r.levelno == logging.ERROR for r in caplog.records)  # serving: a loss
    serving.stop()


def _unhandled(signum: int, frame: object) -> None:
    """pytest.fail raises no Exception (follow catches those): the test fails, the run goes on."""
    pytest.fail(f"signal {signum} reached the test: follow() installed no handler")


@pytest.fixture
def _handlers_restored() -> Iterator[None]:
    """The test's own handlers meanwhile (a follower without its own fails the test, not the test run)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in saved:
        signal.signal(sig, _unhandled)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.usefixtures("_handlers_restored")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signalled_follower_ends_quietly_when_rank_0_is_gone(
    caplog: pytest.LogCaptureFixture, sig: signal.Signals
) -> None:
    assert threading.current_thread() is threading.main_thread()  # follow installs its handlers there only
    caplog.set_level(logging.INFO)

    def serve() -> int:
        signal.raise_signal(sig)  # no KeyboardInterrupt: the rank keeps following rank 0
        raise ReplicaLostError("broadcast failed: rank 0 stopped first")

    follower = types.SimpleNamespace(serve=serve, replica=types.SimpleNamespace(rank=1))
    assert follow(follower) == 0  # type: ignore[arg-type]
    assert [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records] == [
        (logging.INFO, "replica rank 1: stopped with rank 0 (ReplicaLostError)", None)
    ]
