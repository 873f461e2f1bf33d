"""Oracle (a): every page the sidecar serves is diffusers' own adaln_proj / norm_out.linear output, bit for bit.

A real sidecar (plancache_service.app.build_server, over gRPC on a unix socket) serves real MiniMax-H3 t2va
schedules; its pages are read the way a generator reads them (the slab and slot table mapped read-only from the
Attach descriptor) and compared with `torch.equal` against the rows diffusers computes: the repository's transformer
loaded by `MiniMaxH3Transformer3DModel.from_pretrained`, its forward run on each plan's timesteps with every block's
`adaln_proj.linear` and `norm_out.linear` hooked (plancache_helpers.DiffusersPages). Covered: a cold build, slot
hits, a host-tier swap-in, and the host tier's own copies; in the released mixed precision (bfloat16 projections,
float32 time embedder) and in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from ditcore.checkpoint import validate_checkpoint
from ditcore.plans import DTYPES, PlanKey
from ditruntime.slab import COL_LENGTH, COL_STATE, READY, ROW_WORDS, descriptor_from_proto, map_slab
from plancache_service.server import SidecarServer
from protos.ditserve.plancache.v1 import plancache_pb2 as pb
from protos.ditserve.plancache.v1 import plancache_pb2_grpc as pb_grpc

from plancache_helpers import DiffusersPages, Sched, pages_needed, running_sidecar, sched  # isort: skip

A, B = sched(6, 5.0, 3.0), sched(6, 7.0, 3.0)  # 6 plans each; they share only the first (t = 0, width 1)


@pytest.fixture(scope="module", params=["mixed", "float32"])
def repo(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue("tiny_ckpt" if request.param == "mixed" else "tiny_ckpt_f32")
    return path


@pytest.fixture(scope="module")
def oracle(repo: Path) -> DiffusersPages:
    return DiffusersPages(repo)


@pytest.fixture
def sidecar(repo: Path) -> Iterator[SidecarServer]:
    """A started sidecar on `repo`: 6 slots (one schedule), a host tier holding both schedules."""
    both = set(A.plan_keys()) | set(B.plan_keys())
    with running_sidecar(repo, "pco-", pages_needed(both), gpu_plans=6, plan_width=2) as server:
        yield server


class Client:
    """The generator's side of the protocol: one Attach session, the slab mapped read-only, leases by RPC."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.PlanCacheStub(self.channel)
        self.stream = self.stub.Attach(pb.AttachRequest(client_name="oracle"), timeout=60)
        session = next(self.stream).session
        self.session_id, self.generation = session.session_id, session.generation
        self.descriptor = descriptor_from_proto(session.slab)
        shm_dir = Path(self.descriptor.table_path).parent  # running_sidecar's run dir (not /dev/shm)
        self.slab, self.table, self._maps = map_slab(self.descriptor, shm_dirs=[shm_dir])

    def prepare(self, keys: list[PlanKey]) -> pb.PreparePlansResponse:
        req = pb.PreparePlansRequest(
            session_id=self.session_id,
            generation=self.generation,
            plan_keys=[pb.PlanKey(timestep_bits=list(k.bits)) for k in keys],
            request_id="oracle",
        )
        resp: pb.PreparePlansResponse = self.stub.PreparePlans(req, timeout=60)
        return resp

    def release(self, lease_id: int) -> None:
        self.stub.ReleasePlans(pb.ReleasePlansRequest(session_id=self.session_id, lease_id=lease_id), timeout=10)

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


def served_pages_equal_diffusers(client: Client, oracle: DiffusersPages, spec: Sched) -> tuple[int, int, int]:
    """Lease `spec`'s plans, check every step's slot against diffusers, release; returns (built, slot, host) hits."""
    keys = spec.plan_keys()
    resp = client.prepare(keys)
    try:
        assert len(resp.slots) == len(keys)
        for step, (key, slot) in enumerate(zip(keys, resp.slots, strict=True)):
            row = client.table[slot]
            assert int(row[COL_STATE]) == READY and int(row[COL_LENGTH]) == key.width
            assert tuple(int(b) for b in row[ROW_WORDS : ROW_WORDS + key.width]) == key.bits
            got = client.slab[slot, : key.width]
            want = oracle.pages(key)
            assert got.dtype == want.dtype and got.shape == want.shape, (step, got.dtype, want.dtype)
            assert torch.equal(got, want), f"step {step} {key}: slot {slot} differs from diffusers' rows"
    finally:
        client.release(resp.lease_id)
    r = resp.report
    return r.built_plans, r.gpu_hit_plans, r.host_hit_plans


def test_oracle_is_diffusers_and_not_degenerate(repo: Path, oracle: DiffusersPages) -> None:
    info = validate_checkpoint(repo)
    keys = A.plan_keys()
    assert keys[0].width == 1 and all(k.width == 2 for k in keys[1:])
    pages = [oracle.pages(k) for k in keys[:3]]
    assert all(p.dtype == info.projection_dtype and p.shape[1] == info.layout.page_numel for p in pages)
    assert all(bool(torch.isfinite(p.float()).all()) for p in pages)
    assert not torch.equal(pages[1], pages[2]) and not torch.equal(pages[1][0], pages[1][1])
    # the hooked modules are diffusers' own, at the repository's precision
    linear = oracle.model.transformer_blocks[0].adaln_proj.linear
    assert type(oracle.model).__module__.startswith("diffusers.") and linear.weight.dtype == info.projection_dtype
    assert oracle.model.time_embedder.linear_1.weight.dtype == torch.float32  # _keep_in_fp32_modules


def test_sidecar_pages_equal_diffusers_cold_slot_hit_and_host_swap_in(
    repo: Path, oracle: DiffusersPages, sidecar: SidecarServer
) -> None:
    info = validate_checkpoint(repo)
    client = Client(sidecar.address)
    try:
        desc = client.descriptor
        assert DTYPES[desc.dtype] == info.projection_dtype == client.slab.dtype
        assert desc.page_numel == info.layout.page_numel and desc.width == 2
        reports = [served_pages_equal_diffusers(client, oracle, spec) for spec in (A, A, B, A)]
        assert reports == [
            (6, 0, 0),  # cold build: one streamed pass, one GEMM per plan
            (0, 6, 0),  # slot hits
            (5, 1, 0),  # B evicts A's plans from the 6 slots (t = 0 is shared)
            (0, 1, 5),  # A comes back from the host tier
        ]
        cache = sidecar.sidecar.cache
        held = cache.host.plan_keys()
        assert held == set(A.plan_keys()) | set(B.plan_keys())
        for key in held:  # the host tier's own copies
            assert torch.equal(torch.stack(cache.host.page_rows(key)), oracle.pages(key)), key
        stats = client.stub.GetState(pb.GetStateRequest(), timeout=10).stats
        assert stats.page_bytes == info.layout.page_bytes(info.projection_dtype)
        assert (stats.built_plans, stats.host_hit_plans, stats.rebuild_passes) == (11, 5, 2)
    finally:
        client.close()
