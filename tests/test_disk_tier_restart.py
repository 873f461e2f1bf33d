"""A real sidecar restart with the disk tier (`--plan-dir`): the first request after the restart takes every plan from
the packs the first sidecar wrote (its cache report says so: none built, none in a slot) and its output equals the
resident reference bit for bit (docs/architecture.md, "The disk tier and plan packs")."""

from __future__ import annotations

from pathlib import Path

from servicekit import REQ_FOX, Pair, distinct_plans, ref_sha, wait_for


def test_the_first_request_after_a_sidecar_restart_reads_its_plans_from_disk(svc_ckpt: Path, tmp_path: Path) -> None:
    plan_dir = tmp_path / "plans"
    n = distinct_plans(svc_ckpt, REQ_FOX)
    reference = ref_sha(svc_ckpt, REQ_FOX)
    with Pair(svc_ckpt, plan_dir=plan_dir) as pair:
        pair.start()
        first = pair.generate(REQ_FOX, "before-restart")
        assert (first.cache.built_plans, first.cache.disk_hit_plans, first.cache.disk_stored_plans) == (n, 0, n)
        assert first.sha256 == reference

        pair.sidecar.stop(grace_s=1)  # its pending pack is written before the cache closes
        assert len(list(plan_dir.glob("*.pack"))) == 1
        wait_for(lambda: not pair.generator.state.serving, 30, "the generator to notice the sidecar is gone")
        pair.start_sidecar()  # a new process's worth of state: an empty slab and host tier
        pair.wait_generator()

        after = pair.generate(REQ_FOX, "after-restart")
        c = after.cache
        assert (c.disk_hit_plans, c.built_plans, c.gpu_hit_plans, c.host_hit_plans) == (n, 0, 0, 0)
        assert c.disk_read_s > 0 and c.disk_stored_plans == 0
        assert after.sha256 == reference
        stats = pair.state().stats
        assert (stats.disk_hit_plans, stats.built_plans, stats.rebuild_passes, stats.disk_packs) == (n, 0, 0, 1)
        assert stats.disk_capacity_bytes > 0 and not stats.disk_read_only
