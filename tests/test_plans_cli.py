"""`ditserve plans` (ditserve/plans_cli.py): packs built offline are the ones a sidecar looks up — a cached pair
started on them serves a schedule's request, base and with a modulation adapter, with nothing built and the resident
reference's bits; `ls` lists them, `verify` names a damaged one (and `--delete` removes it), `gc` evicts the least
recently used down to a bound; bad input exits 2 naming the flag, the line or the adapter
(docs/operations.md, "Offline plan packs")."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clikit import CliResult, run_cli_inprocess
from servicekit import Pair, distinct_plans, ref_sha, request_keys

from ditcore.plans import distinct_keys
from ditserve import cli

BASE: dict[str, Any] = {"prompt": "a red fox", "num_inference_steps": 3, "seed": 7}
"""Two forwards on the default canvas: the cheapest request with a plan group of two keys."""
MOD = [{"name": "mod", "scale": 0.8}]
FL2VA_SCHEDULE = {"task": "fl2va", "num_inference_steps": 4, "flow_shift": 5.0}


def _flags(p: Any) -> None:
    from ditserve.plans_cli import add_plans_flags

    add_plans_flags(p)


@pytest.fixture(autouse=True)
def _plans_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ditserve plans` in the command table, as ditserve/cli.py registers it."""
    if "plans" not in cli.COMMANDS:  # until ditserve/cli.py registers it
        monkeypatch.setitem(cli.COMMANDS, "plans", cli.Command("plan packs", _flags))


def plans(*argv: Any) -> CliResult:
    return run_cli_inprocess(["plans", *argv])


@pytest.fixture(scope="module")
def adapter_dir(svc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ditcore.adapter_files import write_adapter

    root = tmp_path_factory.mktemp("plans-adapters")
    write_adapter(root / "mod.safetensors", svc_ckpt, "modulation", "diffusers", rank=2, alpha=None, seed=2)
    return root


@pytest.fixture(scope="module")
def schedules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans-schedules") / "schedules.jsonl"
    path.write_text(json.dumps({"num_inference_steps": 3}) + "\n\n" + json.dumps(FL2VA_SCHEDULE) + "\n")
    return path


@pytest.fixture(scope="module")
def built(svc_ckpt: Path, adapter_dir: Path, schedules: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The schedules' packs, base and with mod at 0.8, built by two runs into one directory."""
    out = tmp_path_factory.mktemp("plans-built") / "plans"
    with pytest.MonkeyPatch.context() as mp:  # module scope: before the autouse fixture
        if "plans" not in cli.COMMANDS:
            mp.setitem(cli.COMMANDS, "plans", cli.Command("plan packs", _flags))
        base = plans("build", "--checkpoint", svc_ckpt, "--schedules", schedules, "--out", out, "--progress", "off")
        assert base.code == 0, base.err
        summary = base.json_lines()[-1]
        n = distinct_plans(svc_ckpt, BASE) + distinct_plans(svc_ckpt, FL2VA_SCHEDULE)
        assert (summary["packs"], summary["kept_packs"], summary["plans"], summary["passes"]) == (2, 0, n, 1)
        mod = plans("build", "--checkpoint", svc_ckpt, "--schedules", schedules, "--out", out, "--adapter-dir",
                    adapter_dir, "--adapter", "mod=0.8", "--progress", "off")  # fmt: skip
        assert mod.code == 0, mod.err
        assert (mod.json_lines()[-1]["packs"], mod.json_lines()[-1]["kept_packs"]) == (2, 0)
        again = plans("build", "--checkpoint", svc_ckpt, "--schedules", schedules, "--out", out, "--progress", "off")
        assert again.code == 0 and (again.json_lines()[-1]["packs"], again.json_lines()[-1]["kept_packs"]) == (0, 2)
    return out


@pytest.fixture
def plan_dir(built: Path, tmp_path: Path) -> Iterator[Path]:
    """A private copy of the built directory (the tests below damage and collect it), mtimes kept."""
    import shutil

    copy = tmp_path / "plans"
    shutil.copytree(built, copy)
    yield copy


# ----------------------------------------------------------------------------- build, then serve
def test_a_pair_started_on_built_packs_serves_the_schedule_with_zero_rebuilds(
    svc_ckpt: Path, adapter_dir: Path, built: Path
) -> None:
    n = distinct_plans(svc_ckpt, BASE)
    with Pair(svc_ckpt, mode="resident", adapter_dir=adapter_dir) as resident:
        want_mod = resident.start().generate({**BASE, "adapters": MOD}, "ref-mod").sha256
    with Pair(svc_ckpt, plan_dir=built, adapter_dir=adapter_dir) as pair:
        pair.start()
        base = pair.generate(BASE, "base")
        c = base.cache
        assert (c.built_plans, c.disk_hit_plans, c.gpu_hit_plans, c.host_hit_plans, c.disk_stored_plans) == (
            0, n, 0, 0, 0,
        )  # fmt: skip
        assert base.sha256 == ref_sha(svc_ckpt, BASE)
        mod = pair.generate({**BASE, "adapters": MOD}, "mod")
        assert (mod.cache.built_plans, mod.cache.disk_hit_plans) == (0, n)
        assert mod.sha256 == want_mod != base.sha256
        stats = pair.state().stats
        assert (stats.built_plans, stats.rebuild_passes, stats.disk_hit_plans, stats.disk_packs) == (0, 0, 2 * n, 4)


# ----------------------------------------------------------------------------- ls, verify, gc
def test_ls_lists_each_pack_with_its_identity_and_the_schedule_keys(svc_ckpt: Path, plan_dir: Path) -> None:
    r = plans("ls", "--plan-dir", plan_dir, "--json")
    assert r.code == 0, r.err
    listing = r.json_lines()[0]
    rows = listing["packs"]
    assert len(rows) == 4 and listing["totals"]["packs"] == 4 and listing["totals"]["unusable"] == 0
    assert listing["totals"]["bytes"] == sum(p.stat().st_size for p in plan_dir.glob("*.pack"))
    assert len({r["weights"] for r in rows}) == 1 and {r["partition"] for r in rows} == {"base"}
    digests = {r["adapters"] for r in rows}
    assert len(digests) == 2 and "" in digests
    for request, width in ((BASE, 2), (FL2VA_SCHEDULE, 3)):  # the keys the generator leases for such a request
        group = distinct_keys(request_keys(svc_ckpt, request))
        mine = [r for r in rows if r["plans"] == len(group) and r["width"] == width]
        assert len(mine) == 2, rows
    from ditruntime.plan_packs import read_header

    keys = {read_header(plan_dir / r["file"]).key.keys for r in rows}
    assert tuple(k.bits for k in distinct_keys(request_keys(svc_ckpt, BASE))) in keys
    text = plans("ls", "--plan-dir", plan_dir)
    assert text.code == 0 and "4 pack(s)" in text.out and rows[0]["address"][:16] in text.out


def test_verify_names_a_damaged_pack_and_delete_removes_it(plan_dir: Path) -> None:
    ok = plans("verify", "--plan-dir", plan_dir)
    assert ok.code == 0 and ok.json_lines()[0]["ok"] == 4, ok.err
    victim = sorted(plan_dir.glob("*.pack"))[1]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0x01  # a payload byte: its header is sound, one plan's checksum is not
    victim.write_bytes(bytes(data))
    bad = plans("verify", "--plan-dir", plan_dir)
    assert bad.code == 1 and victim.name in bad.err and "checksum" in bad.err
    assert [b["file"] for b in bad.json_lines()[0]["bad"]] == [victim.name] and victim.exists()
    deleted = plans("verify", "--plan-dir", plan_dir, "--delete")
    assert deleted.code == 0 and deleted.json_lines()[0]["deleted"] == [victim.name] and not victim.exists()
    assert plans("verify", "--plan-dir", plan_dir).code == 0


def test_gc_evicts_the_least_recently_used_down_to_the_bound(plan_dir: Path) -> None:
    packs = sorted(plan_dir.glob("*.pack"))
    for age, p in enumerate(packs):  # packs[0] the newest, packs[-1] the oldest
        os.utime(p, (1_700_000_000 - age * 60, 1_700_000_000 - age * 60))
    keep = packs[0].stat().st_size + packs[1].stat().st_size
    (plan_dir / f".{packs[0].name}.partial-1-0").write_bytes(b"x")  # an interrupted write, two hours old
    os.utime(plan_dir / f".{packs[0].name}.partial-1-0", (1_700_000_000 - 7200, 1_700_000_000 - 7200))
    bound = f"{keep / 1e9:.9f}"
    dry = plans("gc", "--plan-dir", plan_dir, "--plan-dir-max-gb", bound, "--dry-run")
    assert dry.code == 0, dry.err
    assert sorted(dry.json_lines()[0]["evicted"]) == sorted(p.name for p in packs[2:])
    assert len(list(plan_dir.glob("*.pack"))) == 4
    r = plans("gc", "--plan-dir", plan_dir, "--plan-dir-max-gb", bound)
    assert r.code == 0 and r.json_lines()[0]["kept_bytes"] == keep and len(r.json_lines()[0]["removed_partials"]) == 1
    assert sorted(plan_dir.glob("*.pack")) == sorted(packs[:2]) and not list(plan_dir.glob(".*partial*"))


# ----------------------------------------------------------------------------- bad input
def test_bad_input_exits_2_naming_the_flag_line_or_adapter(
    svc_ckpt: Path, adapter_dir: Path, schedules: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    common = ["--out", out, "--progress", "off"]
    r = plans("build", "--checkpoint", tmp_path / "nope", "--schedules", schedules, *common)
    assert r.code == 2 and "--checkpoint" in r.err and "nope" in r.err, r.err

    lines = tmp_path / "bad.jsonl"
    for line, words in (
        ('{"num_inference_steps": 1}', ["bad.jsonl:2", "num_inference_steps"]),
        ('{"steps": 3}', ["bad.jsonl:2", "steps", "not a schedule key"]),
        ("{not json", ["bad.jsonl:2", "not valid JSON"]),
        ('{"task": "t2va", "reference_audio": true}', ["bad.jsonl:2", "reference_audio"]),
        ('{"adapters": [{"name": "mod"}]}', ["bad.jsonl:2", "--adapter-dir"]),
    ):
        lines.write_text('{"num_inference_steps": 3}\n' + line + "\n")
        r = plans("build", "--checkpoint", svc_ckpt, "--schedules", lines, *common)
        assert r.code == 2 and all(w in r.err for w in words), (line, r.err)
    r = plans("build", "--checkpoint", svc_ckpt, "--schedules", tmp_path / "missing.jsonl", *common)
    assert r.code == 2 and "--schedules" in r.err
    r = plans("build", "--checkpoint", svc_ckpt, "--schedules", schedules, "--adapter-dir", adapter_dir,
              "--adapter", "nope=0.5", *common)  # fmt: skip
    assert r.code == 2 and "nope" in r.err and "schedules.jsonl:1" in r.err, r.err
    r = plans("build", "--checkpoint", svc_ckpt, "--schedules", schedules, "--adapter", "a/b", *common)
    assert r.code == 2 and "--adapter" in r.err
    assert not out.exists()  # nothing written
    r = plans("ls", "--plan-dir", tmp_path / "none")
    assert r.code == 2 and "--plan-dir" in r.err


def test_a_ref2va_schedule_with_reference_audio_packs_the_keys_of_such_a_request(
    svc_ckpt: Path, tmp_path: Path
) -> None:
    """ "reference_audio": true stands for a request whose references bring audio rows (each key one wider): the pack
    holds exactly the keys the generator computes for a ref2va request with an image and an audio clip."""
    from refmedia import image_bytes, wav_bytes
    from servicekit import _schedule

    from ditcore import GenerationRequest
    from ditcore.references import Reference
    from ditruntime.plan_packs import list_packs

    lines = tmp_path / "ref.jsonl"
    lines.write_text(json.dumps({"task": "ref2va", "num_inference_steps": 3, "reference_audio": True}) + "\n")
    r = plans("build", "--checkpoint", svc_ckpt, "--schedules", lines, "--out", tmp_path / "p", "--progress", "off")
    assert r.code == 0, r.err
    [pack] = list_packs(tmp_path / "p")
    assert pack.header is not None and pack.header.key.identity.partition == "ref"
    refs = (Reference(image_bytes(), "image"), Reference(wav_bytes(), "audio"))
    request = GenerationRequest(task="ref2va", num_inference_steps=3, references=refs)
    want = distinct_keys(_schedule(str(svc_ckpt)).keys(request))
    assert all(k.partition == "ref" for k in want) and max(k.width for k in want) == 4
    assert pack.header.key.keys == tuple(k.bits for k in want)
