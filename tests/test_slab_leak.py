"""No slab mapping outlives a failed request or a dead sidecar (docs/architecture.md, "The slab and the lease
protocol").

A cached request that fails mid-denoise (cancelled by its client, or its sidecar gone or SIGKILLed) leaves no
reference to the mapped slab anywhere in the generator: the traceback of its error (which whoever keeps the error
keeps: the Failed event, a log record) runs through the denoise loop's frames, which held the SlotReads view of the
slab, so ditcore closes those reads after the last kernel that reads them (`SlotReads.close`), the Failed event's
error leaves with its frames' locals cleared, and the executor thread keeps nothing of a finished run. So when the
mapping is closed (on reattach, before the next slab is mapped) the slab's storage is freed: its weak reference has
expired, and the generator never logs "still referenced". `SlabMapping` tracks the shm (cpu) storage as it does the
cuda one, which is what lets these tests see it on cpu. After a sidecar `kill -9` (process pair), the log-level
checks (old mapping closed with its storage freed before the new slab is mapped, never "still referenced") are part
of tests/test_e2e_faults.py::test_sidecar_killed_mid_request_then_restarted.
"""

from __future__ import annotations

import gc
import re
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import grpc
import pytest
import torch
from servicekit import Pair, narrow_request, wait_for
from torch.multiprocessing.reductions import StorageWeakRef

from ditcore import CacheReport, GenerationRequest, PlanKey, generate, load_model
from ditruntime.slab import ROW_WORDS, SlabDescriptor, SlabMapping
from ditserve.client_requests import request_to_proto
from generator_service.backends.sidecar_client import SidecarClient
from generator_service.errors import CancelledError
from generator_service.execution.runs import Failed, Run
from generator_service.metrics import P
from protos.ditserve.generator.v1 import generator_pb2 as gen_pb
from protos.ditserve.generator.v1 import generator_pb2_grpc as gen_grpc

STILL_REFERENCED = "still referenced"
ATTACHED = re.compile(r"attached to sidecar \S+ \(session (\w+),")
# Mid-denoise when the failure lands (it follows step 1 of 60 forwards); every plan 1 wide, each step its own slot.
LONG_REQUEST: dict[str, Any] = narrow_request(60, request_id="leak-long", prompt="leak", height=64, width=64)
CORE_REQUEST = GenerationRequest(request_id="leak-core", prompt="rain on a tin roof", num_inference_steps=5, seed=7,
                                 height=32, width=64, num_frames=141, flow_shift=9.0, audio_flow_shift=2.5)  # fmt: skip


# ----------------------------------------------------------------------------- helpers
def _open_stream(target: str, req: dict[str, Any]) -> tuple[grpc.Channel, Any, Any]:
    ch = grpc.insecure_channel(target)
    msg = gen_pb.GenerateStreamRequest(request=request_to_proto(GenerationRequest.from_dict(dict(req))))
    call = gen_grpc.GeneratorStub(ch).GenerateStream(msg, timeout=120)
    return ch, call, iter(call)


def _read_until_step(it: Any, step: int) -> None:
    for ev in it:
        if ev.WhichOneof("event") == "step" and ev.step.step >= step:
            return
    raise AssertionError(f"the stream ended before step {step}")


def _slab_ref(link: SidecarClient) -> tuple[str, StorageWeakRef]:
    """(session id, a weak reference to the storage of the slab the generator has mapped for it)."""
    att = link.attachment
    assert att is not None
    return att.session_id, StorageWeakRef(att.slab.untyped_storage())


def _outcomes(pair: Pair, outcome: str) -> float:
    return pair.generator.metrics.registry.get_sample_value(f"{P}_requests_total", {"outcome": outcome}) or 0.0


def _closed_freed(link: SidecarClient, session: str, ref: StorageWeakRef) -> None:
    """The mapping of `session` was closed (the generator attached to a new session) and its storage freed."""
    wait_for(lambda: link.last_closed is not None and link.last_closed[0] == session, 30, "the old mapping to close")
    assert link.last_closed == (session, True), link.last_closed
    gc.collect()  # what is left is reachable: a reference cycle alone would not count
    assert ref.expired(), "the closed slab's storage is still referenced"
    att = link.attachment
    assert att is not None and att.session_id != session


@pytest.fixture(scope="module")
def pair(svc_ckpt: Path) -> Iterator[Pair]:
    """An in-process sidecar and generator shared by the in-process tests (each restores what it changed)."""
    with Pair(svc_ckpt, plan_width=1) as p:
        yield p.start()


# ----------------------------------------------------------------------------- in process
def test_a_cancelled_request_leaves_no_slab_reference(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    link = pair.generator.backend.link
    session, ref = _slab_ref(link)
    cancelled = _outcomes(pair, "CANCELLED")
    ch, call, it = _open_stream(pair.target, LONG_REQUEST)
    with ch:
        _read_until_step(it, 1)
        call.cancel()
        wait_for(lambda: _outcomes(pair, "CANCELLED") == cancelled + 1, 30, "the run to fail CANCELLED")
    wait_for(lambda: pair.generator.executor.queue_depth == 0, 10, "the executor to be idle")
    assert not ref.expired()  # the mapping holds it until the session ends
    link.reattach()  # drop the session: the old mapping is closed before the new slab is mapped
    _closed_freed(link, session, ref)
    assert STILL_REFERENCED not in caplog.text
    pair.generate({**LONG_REQUEST, "num_inference_steps": 4}, "after-cancel")  # the new mapping serves


def test_a_failed_jobs_error_keeps_no_frame_locals_and_the_executor_keeps_nothing_of_it(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executor's part, whatever the frames held: the Failed event's error keeps its traceback (the logs print it)
    but none of its finished frames' locals, and the idle executor thread holds neither the run nor its event."""
    failed: list[tuple[Run, Failed]] = []
    emit = Run.emit

    def recording_emit(run: Run, event: Any) -> None:
        emit(run, event)
        if isinstance(event, Failed):
            failed.append((run, event))

    monkeypatch.setattr(Run, "emit", recording_emit)
    ch, call, it = _open_stream(pair.target, {**LONG_REQUEST, "request_id": "leak-frames"})
    with ch:
        _read_until_step(it, 1)
        call.cancel()
        wait_for(lambda: failed, 30, "the run to fail")
    run, event = failed[0]
    assert isinstance(event.error, CancelledError) and str(event.error) == "request leak-frames was cancelled"
    frames = [tb.tb_frame for tb in _walk(event.error.__traceback__)]
    names = [f.f_code.co_name for f in frames]
    assert {"_run", "generate", "generate_latents", "_check_live"} <= set(names), names
    assert all(not f.f_locals for f in frames), [(f.f_code.co_name, list(f.f_locals)) for f in frames if f.f_locals]
    assert "generate_latents" in "".join(traceback.format_exception(event.error))
    executor = pair.generator.executor
    wait_for(lambda: executor.queue_depth == 0, 10, "the executor to be idle")
    stack = sys._current_frames()[executor.threads[0].ident]
    held = [
        (f.f_code.co_name, name)
        for f in _callers(stack)
        for name, value in f.f_locals.items()
        if value is run or value is event
    ]
    assert not held, held


def _callers(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _walk(tb: TracebackType | None) -> Iterator[TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


def test_a_request_failed_by_a_stopped_sidecar_leaves_no_slab_reference(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    link = pair.generator.backend.link
    session, ref = _slab_ref(link)
    ch, _call, it = _open_stream(pair.target, LONG_REQUEST)
    with ch:
        _read_until_step(it, 1)
        pair.sidecar.stop(grace_s=0)  # the session ends mid-denoise: the request fails UNAVAILABLE
        with pytest.raises(grpc.RpcError) as ei:
            list(it)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
    pair.start_sidecar()
    _closed_freed(link, session, ref)
    assert STILL_REFERENCED not in caplog.text
    pair.wait_generator()


# ----------------------------------------------------------------------------- units
class _Stop(Exception):
    """What the step callback raises: the request fails mid-denoise."""


class _SlabLease:
    """A ditcore SlabPlanLease over an in-process slab; released, it drops the slab (as a closed mapping does)."""

    def __init__(self, slab: torch.Tensor, slots: list[int]) -> None:
        self.slab: torch.Tensor | None = slab
        self.slots = slots

    @property
    def report(self) -> CacheReport:
        return CacheReport(built_plans=len(set(self.slots)))

    def pages(self, step: int) -> torch.Tensor:
        raise AssertionError("a slab lease is read through SlotReads")

    def slab_slots(self) -> tuple[torch.Tensor, list[int]]:
        assert self.slab is not None
        return self.slab, self.slots

    def release(self) -> None:
        self.slab = None


class _SlabProvider:
    """One slot per distinct plan (zero pages: the request fails after its first step anyway)."""

    def __init__(self, page_numel: int, dtype: torch.dtype) -> None:
        self.page_numel, self.dtype = page_numel, dtype
        self.ref: StorageWeakRef | None = None

    def acquire(self, keys: Sequence[PlanKey]) -> _SlabLease:
        distinct = list(dict.fromkeys(keys))
        slab = torch.zeros(len(distinct), max(k.width for k in keys), self.page_numel, dtype=self.dtype)
        self.ref = StorageWeakRef(slab.untyped_storage())
        return _SlabLease(slab, [distinct.index(k) for k in keys])


def test_a_failed_generate_leaves_no_slab_view_in_its_traceback(tiny_ckpt: Path) -> None:
    """Whoever keeps a failed request's error (a log record, an event, a future) keeps its traceback's frames, the
    denoise loop's among them: none of them may still reach the slab once the lease is released."""
    model = load_model(tiny_ckpt, "cached")
    provider = _SlabProvider(model.info.layout.page_numel, model.info.projection_dtype)

    def fail_after_first_step(done: int, total: int) -> None:
        if done == 1:
            raise _Stop(f"stopped at step {done} of {total}")

    with pytest.raises(_Stop) as failure:
        generate(model, CORE_REQUEST, provider, on_step=fail_after_first_step)
    assert provider.ref is not None
    gc.collect()
    assert provider.ref.expired(), "a frame of the failed request's traceback still holds the slab"
    assert failure.value.__traceback__ is not None  # the traceback itself is kept (the logs print it)


def _shm_mapping(shm_dir: Path) -> SlabMapping:
    """A mapping of a 4-slot x 2-page x 16 float32 slab in `shm_dir`, as the generator maps the sidecar's."""
    desc = SlabDescriptor(
        transport="shm", slab_path=str(shm_dir / "ditserve-slab-leak"), table_path=str(shm_dir / "ditserve-table-leak"),
        slab_bytes=4 * 2 * 16 * 4, table_bytes=4 * (ROW_WORDS + 2) * 8, dtype="float32", num_slots=4, width=2,
        page_numel=16, device="cpu",
    )  # fmt: skip
    Path(desc.slab_path).write_bytes(bytes(desc.slab_bytes))
    Path(desc.table_path).write_bytes(bytes(desc.table_bytes))
    return SlabMapping.open(desc, shm_dirs=[shm_dir])


def test_closing_a_cpu_mapping_tells_whether_a_view_still_holds_the_slab(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mapping = _shm_mapping(tmp_path)
    ref = StorageWeakRef(mapping.slab.untyped_storage())
    view = mapping.slab.view(8, 16)[3:5]  # what a request's SlotReads keeps of the slab
    assert mapping.close(timeout_s=0.2) is False and mapping.closed
    assert STILL_REFERENCED in caplog.text and not ref.expired()
    cycle: list[Any] = [view]
    cycle.append(cycle)  # held only by a reference cycle: close() collects it
    del view, cycle
    assert mapping.close() is True and ref.expired()
    assert mapping.close() is True  # idempotent


def test_closing_an_unread_cpu_mapping_frees_its_storage_and_unmaps_the_file(tmp_path: Path) -> None:
    mapping = _shm_mapping(tmp_path)
    ref = StorageWeakRef(mapping.slab.untyped_storage())
    path = mapping.descriptor.slab_path
    assert path in _mapped_files()
    assert mapping.close(timeout_s=0.2) is True and ref.expired()
    assert path not in _mapped_files()


def _mapped_files() -> str:
    with open("/proc/self/maps") as f:
        return f.read()
