"""`ditserve plans`: the sidecar's plan directory (`--plan-dir`, the disk tier) offline.

    ditserve plans build --checkpoint CKPT --schedules schedules.jsonl --out /plans [--adapter-dir A --adapter mod=0.8]
    ditserve plans ls --plan-dir /plans [--json]
    ditserve plans verify --plan-dir /plans [--delete]
    ditserve plans gc --plan-dir /plans --plan-dir-max-gb 32 [--dry-run]

`build` writes, ahead of time (an init container, a CI job), the packs a sidecar would write after serving each
schedule of a JSONL file, so its first requests of those schedules read every plan from disk instead of rebuilding.
It is a thin layer over the sidecar's own code, so what it writes is what the sidecar looks up:

- **keys**: each line's plan keys come from `ditcore.schedule.ScheduleKeys` (`schedule_keys`, the function the
  generator's `H3Model.plan_keys` calls through `keys(request)`: the repository's two schedulers, no model loaded),
  carrying the modulation digest of the line's adapters exactly as the cached backend computes it
  (`ditcore.adapter_plans.modulation_digest` of the modulation-changing adapters, in order, at their scales, after
  their contracts' defaults and checks);
- **pages**: one `plancache_service.rebuild.RebuildSource` on the sidecar's devices and shard split (the sidecar's
  own `--device` / `--devices` / `--rebuild-shard` declarations), its adapters registered through the sidecar's
  `AdapterPlans` (`--adapter-dir`, the same files), built in streamed passes (`build_all`);
- **identity and address**: `plancache_service.disk_tier.identity_of` and `builder_of` (the partition's weight
  fingerprint, adapters digest, dtype, byte order, page layout, shard split, builder = device kind + torch version),
  one `PackKey` per schedule's group (its distinct keys in first-use order, as the disk tier stores a group), written
  with `ditruntime.plan_packs.write_pack` (temp file, fsync, rename).

A **schedule line** is a JSON object with the request fields that decide plan keys — "task" (t2va, fl2va or ref2va;
default t2va), "num_inference_steps", "flow_shift", "audio_flow_shift" (each omitted: the adapters' contract
default, else the request default), "reference_audio" (ref2va only: whether a reference brings audio rows, an audio
clip or a video's soundtrack; default false) and "adapters" (a request's list of {"name", "scale"} objects or names;
omitted: the `--adapter` flags) — and may carry the request fields that do not ("request_id", "prompt", "seed",
"height", "width", "num_frames", "output_type", "quality"), which are ignored; any other key is refused.

`ls`, `verify` and `gc` read pack files with `ditruntime.plan_packs` alone (no checkpoint, no model): docs/operations.md,
"Offline plan packs".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ditcore.request import (
    DEFAULTED,
    MAX_SHIFT,
    MAX_STEPS,
    MIN_STEPS,
    TASKS,
    AdapterUse,
    GenerationRequest,
    RequestError,
    check_uses,
)
from ditruntime.flags import add_flags, from_args
from ditruntime.paths import prepare_dir, require_dir
from ditruntime.plan_packs import (
    PackCorruptError,
    PackError,
    PackKey,
    PackListing,
    PackVersionError,
    gc,
    list_packs,
    read_header,
    write_pack,
)

from .errors import UsageError
from .progress import add_progress_flag, progress_enabled
from .requests_io import parse_adapter

if TYPE_CHECKING:
    from ditcore.adapters import AdapterInfo, AdapterRegistry
    from ditcore.plans import PlanKey
    from plancache_service.rebuild import RebuildSource

GB = 1000**3
PASS_GB = 4.0
"""Pages one `build` pass holds by default (decimal GB): schedules are built in passes of at most this many pages'
bytes (at least one schedule a pass); every pass reads every plan tensor of the checkpoint once."""
SCHEDULE_FIELDS = ("task", "num_inference_steps", "flow_shift", "audio_flow_shift", "reference_audio", "adapters")
"""The keys of a schedule line that decide its plan keys."""
IGNORED_FIELDS = ("request_id", "prompt", "seed", "height", "width", "num_frames", "output_type", "quality")
"""Request fields a schedule line may carry (a requests file read as schedules) that change no plan key."""
BUILD_CACHE_FLAGS = ("device", "devices", "rebuild_shard")
"""The sidecar's CacheConfig flags `build` takes: its devices and shard split are in a pack's identity."""
_DEFAULTS = GenerationRequest()


# ---------------------------------------------------------------------------- flags
def add_plans_flags(p: argparse.ArgumentParser) -> None:
    """`ditserve plans`' verbs and their flags."""
    from plancache_service.config import CacheConfig, SidecarConfig

    verbs = p.add_subparsers(dest="plans_command", required=True, metavar="VERB")
    build = verbs.add_parser(
        "build", help="build the packs of a JSONL file of schedules into a plan directory, ahead of serving"
    )
    add_flags(build, SidecarConfig, only=("checkpoint", "adapter_dir"))
    build.add_argument(
        "--schedules", required=True,
        help="JSONL, one schedule a line: task, num_inference_steps, flow_shift, audio_flow_shift, reference_audio "
        "(ref2va), adapters (docs/operations.md, 'Offline plan packs')",
    )  # fmt: skip
    build.add_argument("--out", required=True, help="the plan directory to write (the sidecar's --plan-dir)")
    build.add_argument(
        "--adapter", action="append", type=parse_adapter, default=[], metavar="NAME[=SCALE]",
        help="build every schedule line without an \"adapters\" key with these adapters of --adapter-dir, in this "
        "order (repeatable; scale 1.0 by default); none: the base weights' plans",
    )  # fmt: skip
    add_flags(build, CacheConfig, only=BUILD_CACHE_FLAGS, group="the sidecar's devices (in a pack's identity)")
    build.add_argument(
        "--pass-gb", type=float, default=PASS_GB,
        help="pages one rebuild pass holds at most, decimal GB; each pass reads every plan tensor once "
        "(default %(default)s)",
    )  # fmt: skip
    add_progress_flag(build)
    build.set_defaults(func=cmd_plans)

    ls = verbs.add_parser("ls", help="list a plan directory's packs, least recently used first, and their totals")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    verify = verbs.add_parser("verify", help="check every pack's header and every plan's checksum (exit 1 if bad)")
    verify.add_argument("--delete", action="store_true", help="delete the damaged packs (exit 0 once they are gone)")
    collect = verbs.add_parser(
        "gc", help="delete damaged packs and interrupted writes, then least recently used packs beyond the bound"
    )
    add_flags(collect, CacheConfig, only=("plan_dir_max_bytes",))
    collect.add_argument("--verify", action="store_true", help="read every plan too (corrupt payloads are removed)")
    collect.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    for verb in (ls, verify, collect):
        add_flags(verb, CacheConfig, only=("plan_dir",))  # the sidecar's declaration; required here
        verb._option_string_actions["--plan-dir"].required = True
        verb.set_defaults(func=cmd_plans)


def cmd_plans(args: argparse.Namespace) -> int:
    verb = args.plans_command
    if verb == "build":
        return cmd_build(args)
    if args.plan_dir is None:
        raise UsageError("--plan-dir is required: the plan directory (the sidecar's --plan-dir)")
    root = require_dir(args.plan_dir, "--plan-dir")
    if verb == "ls":
        return cmd_ls(root, args.json)
    if verb == "verify":
        return cmd_verify(root, args.delete)
    return cmd_gc(root, args)


# ---------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class Schedule:
    """One schedule line: what decides its plan keys."""

    where: str
    """FILE:N, for messages."""
    task: str
    num_inference_steps: int
    flow_shift: float
    audio_flow_shift: float
    reference_audio: bool
    adapters: tuple[AdapterUse, ...]
    unset: frozenset[str]
    """The DEFAULTED fields the line leaves unset (its adapters' contracts may default them)."""

    @property
    def partition(self) -> str:
        return GenerationRequest(task=self.task).partition

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"task": self.task, "num_inference_steps": self.num_inference_steps,
                               "flow_shift": self.flow_shift, "audio_flow_shift": self.audio_flow_shift}  # fmt: skip
        if self.task == "ref2va":
            out["reference_audio"] = self.reference_audio
        if self.adapters:
            out["adapters"] = [{"name": a.name, "scale": a.scale} for a in self.adapters]
        return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def parse_schedule(data: Any, where: str, default_adapters: Sequence[AdapterUse]) -> Schedule:
    """A schedule line, checked (RequestError naming the field; the caller adds where)."""
    if not isinstance(data, dict):
        raise RequestError("schedules", "each line must be a JSON object")
    unknown = sorted(set(data) - set(SCHEDULE_FIELDS) - set(IGNORED_FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"not a schedule key; a schedule line takes {', '.join(SCHEDULE_FIELDS)}")
    task = data.get("task") or "t2va"
    if task not in TASKS:
        raise RequestError("task", f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    steps = data.get("num_inference_steps", _DEFAULTS.num_inference_steps)
    if not (isinstance(steps, int) and not isinstance(steps, bool) and MIN_STEPS <= steps <= MAX_STEPS):
        raise RequestError("num_inference_steps", f"must be an integer in [{MIN_STEPS}, {MAX_STEPS}], got {steps!r}")
    shifts = {}
    for name in ("flow_shift", "audio_flow_shift"):
        value = data.get(name, getattr(_DEFAULTS, name))
        if not (_number(value) and math.isfinite(value) and 0 < value <= MAX_SHIFT):
            raise RequestError(name, f"must be a finite number in (0, {MAX_SHIFT:g}], got {value!r}")
        shifts[name] = float(value)  # the RPC's double
    reference_audio = data.get("reference_audio", False)
    if not isinstance(reference_audio, bool):
        raise RequestError("reference_audio", f"must be true or false, got {reference_audio!r}")
    if reference_audio and task != "ref2va":
        raise RequestError("reference_audio", f"only ref2va has reference audio rows, not {task}")
    if "adapters" in data:
        uses = data["adapters"] if data["adapters"] is not None else []
        if not isinstance(uses, list):
            raise RequestError("adapters", 'must be a list of {"name": ..., "scale": ...} objects or names')
        adapters = GenerationRequest.from_dict({"adapters": uses}).adapters
    else:
        adapters = tuple(default_adapters)
    check_uses(adapters)
    unset = frozenset(f for f, _ in DEFAULTED if f not in data)
    return Schedule(where, task, steps, shifts["flow_shift"], shifts["audio_flow_shift"], reference_audio, adapters,
                    unset)  # fmt: skip


def read_schedules(path: str, default_adapters: Sequence[AdapterUse]) -> list[Schedule]:
    """The schedule lines of `path` (blank lines skipped); UsageError naming --schedules and the line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"--schedules {path}: cannot read it: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise UsageError(f"--schedules {path}: not UTF-8 text ({e.reason})") from e
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"--schedules {where}: not valid JSON ({e.msg})") from e
        try:
            out.append(parse_schedule(data, where, default_adapters))
        except RequestError as e:
            raise UsageError(f"--schedules {where}: {e}") from e
    if not out:
        raise UsageError(f"--schedules {path}: holds no schedules")
    return out


def resolve_adapters(
    schedule: Schedule, registry: AdapterRegistry | None
) -> tuple[Schedule, list[tuple[AdapterInfo, float]]]:
    """The line with its adapters' contract defaults applied and its adapters as read (checked as the generator
    checks a request's: contract, partition), as the generator resolves a request before computing its keys."""
    from dataclasses import replace

    from ditcore.adapter_contract import AdapterError, AdapterNotFoundError, contract_defaults

    if not schedule.adapters:
        return schedule, []
    if registry is None:
        raise UsageError(f"--schedules {schedule.where}: adapters need --adapter-dir (the sidecar's adapter files)")
    infos = []
    try:
        for use in schedule.adapters:
            infos.append(registry.get(use.name))
        schedule = replace(schedule, **contract_defaults([(i.name, i.contract) for i in infos], schedule.unset))
        for info, use in zip(infos, schedule.adapters, strict=True):
            info.contract.check(info.name, float(use.scale), schedule.task, schedule.num_inference_steps,
                                schedule.flow_shift, schedule.audio_flow_shift)  # fmt: skip
            if info.partition != schedule.partition:
                raise RequestError("adapters", f"adapter {info.name} targets the {info.partition} transformer; a "
                                   f"{schedule.task} schedule runs the {schedule.partition} one")  # fmt: skip
    except (AdapterNotFoundError, AdapterError, RequestError) as e:
        raise UsageError(f"--schedules {schedule.where}: {e} (--adapter-dir {registry.root})") from e
    return schedule, [(info, float(use.scale)) for info, use in zip(infos, schedule.adapters, strict=True)]


# ---------------------------------------------------------------------------- build
@dataclass
class _Pack:
    """One pack to write: its key and the plan keys of its group."""

    key: PackKey
    group: list[PlanKey]
    schedule: Schedule

    def nbytes(self, page_bytes: int) -> int:
        return sum(k.width for k in self.group) * page_bytes


@dataclass(frozen=True)
class _Spec:
    """An adapter as a PreparePlans names it (name, identity, scale): what the sidecar's AdapterPlans registers."""

    name: str
    identity: str
    scale: float


def _open_source(args: argparse.Namespace, registry: AdapterRegistry | None) -> RebuildSource:
    """The sidecar's rebuild source on --checkpoint, its devices and shard split (plancache_service.app's)."""
    import torch

    from plancache_service.adapters import AdapterPlans
    from plancache_service.config import CacheConfig
    from plancache_service.rebuild import RebuildSource, open_checkpoint

    try:
        cache = from_args(CacheConfig, args, only=BUILD_CACHE_FLAGS)
    except ValueError as e:
        raise UsageError(str(e)) from e
    try:
        devices = [torch.device(d) for d in cache.slab_devices]
    except RuntimeError as e:
        raise UsageError(f"--device / --devices: {e}") from e
    for d in devices:
        if d.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {d}: torch sees no CUDA device here")
    info = open_checkpoint(require_dir(args.checkpoint, "--checkpoint"))
    return RebuildSource(info, devices, shard_mode=cache.rebuild_shard, adapter_plans=AdapterPlans(registry))


def plan_packs(
    schedules: Sequence[Schedule], source: RebuildSource, registry: AdapterRegistry | None
) -> tuple[list[_Pack], str]:
    """Each schedule's pack (duplicates dropped), keyed as the disk tier keys the group a prepare stores, and the
    builder in their identity."""
    from ditcore.adapter_plans import modulation_digest, modulation_uses
    from ditcore.plans import distinct_keys
    from ditcore.schedule import ScheduleKeys
    from plancache_service.disk_tier import builder_of, identity_of

    schedule_keys = ScheduleKeys(source.path)
    fingerprints, builder = source.partition_fingerprints(), builder_of(source)
    packs: dict[str, _Pack] = {}
    for line in schedules:
        line, uses = resolve_adapters(line, registry)
        if line.partition not in source.partitions:
            raise UsageError(
                f"--schedules {line.where}: {line.task} runs on the {line.partition} partition, which --checkpoint "
                f"{source.path} does not have"
            )
        mods = modulation_uses(uses)
        digest = modulation_digest(mods)
        keys = schedule_keys.schedule_keys(line.task, line.num_inference_steps, line.flow_shift,
                                           line.audio_flow_shift, line.reference_audio)  # fmt: skip
        group = distinct_keys(k.with_adapters(digest) if digest else k for k in keys)
        if digest:  # what the sidecar does with a PreparePlans' adapters: checked, then its digest's build terms
            source.adapter_plans.register([_Spec(i.name, i.identity, s) for i, s in mods], group)
        key = PackKey(identity_of(source, group[0], fingerprints, builder), tuple(k.bits for k in group))
        packs.setdefault(key.address, _Pack(key, group, line))
    return list(packs.values()), builder


def _present(root: Path, key: PackKey) -> bool:
    """A pack of this key is in `root` with a sound header (its plans are checked when read)."""
    try:
        read_header(root / key.file_name)
    except (OSError, PackError):
        return False
    return True


def _batches(packs: Sequence[_Pack], page_bytes: int, limit: int) -> list[list[_Pack]]:
    """Packs in passes of at most `limit` bytes of pages (at least one pack a pass)."""
    out: list[list[_Pack]] = []
    size = 0
    for p in packs:
        n = p.nbytes(page_bytes)
        if out and size + n <= limit:
            out[-1].append(p)
            size += n
        else:
            out.append([p])
            size = n
    return out


def cmd_build(args: argparse.Namespace) -> int:
    """Build the packs of --schedules into --out; one JSON line (packs, plans, bytes, seconds) on stdout."""
    t0 = time.perf_counter()
    if not (math.isfinite(args.pass_gb) and args.pass_gb > 0):
        raise UsageError(f"--pass-gb must be a positive number, got {args.pass_gb}")
    schedules = read_schedules(args.schedules, args.adapter)
    from ditcore.adapters import AdapterRegistry

    registry = AdapterRegistry(require_dir(args.adapter_dir, "--adapter-dir")) if args.adapter_dir else None
    source = _open_source(args, registry)
    packs, builder = plan_packs(schedules, source, registry)
    out = prepare_dir(args.out, "--out")
    todo = [p for p in packs if not _present(out, p.key)]
    page_bytes = source.page_bytes
    plans = written = passes = 0
    bar: Any = None
    if progress_enabled(args.progress) and todo:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(p.group) for p in todo), desc="plans build", unit="plan", file=sys.stderr,
                   leave=False, dynamic_ncols=True)  # fmt: skip
    try:
        for batch in _batches(todo, page_bytes, int(args.pass_gb * GB)):
            passes += 1
            if bar is not None:
                bar.set_description_str(f"plans build: pass {passes}", refresh=True)
            pages = build_pages(source, [k for p in batch for k in p.group])
            for p in batch:
                written += write_pack(out, p.key, page_bytes, [(k.bits, pages[k]) for k in p.group]).file_bytes
                plans += len(p.group)
                if bar is not None:
                    bar.update(len(p.group))
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps({
        "out": str(out), "schedules": len(schedules), "packs": len(todo), "kept_packs": len(packs) - len(todo),
        "plans": plans, "bytes": written, "passes": passes, "builder": builder,
        "seconds": round(time.perf_counter() - t0, 3),
    }))  # fmt: skip
    return 0


def build_pages(source: RebuildSource, keys: Sequence[PlanKey]) -> dict[PlanKey, bytes]:
    """One streamed pass of the sidecar's rebuild over `keys` (each plan its own GEMM of M = its width, so a plan's
    bits do not depend on the pass it is in): each key's pages as the bytes the disk tier copies out of a slab."""
    import torch

    from ditcore.plans import distinct_keys

    keys = distinct_keys(keys)
    numel, dtype = source.page_numel, source.dtype
    outputs = [[torch.empty(k.width, numel, dtype=dtype, device=d) for k in keys] for d in source.devices]
    source.build_all(keys, outputs)
    return {
        k: pages.to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes()
        for k, pages in zip(keys, outputs[0], strict=True)
    }


# ---------------------------------------------------------------------------- ls, verify, gc
def _when(mtime: float) -> str:
    return datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def pack_row(p: PackListing) -> dict[str, Any]:
    """One pack of a listing as `ls --json` prints it (a damaged or foreign one: its path, bytes and error)."""
    row: dict[str, Any] = {"file": p.path.name, "bytes": p.bytes, "last_used": _when(p.mtime)}
    if p.header is None:
        return {**row, "error": str(p.error)}
    ident = p.header.key.identity
    return {
        **row, "address": p.header.address, "partition": ident.partition, "weights": ident.weights,
        "adapters": ident.adapters, "dtype": ident.dtype, "builder": ident.builder, "identity": ident.digest,
        "plans": len(p.header.plans), "width": max((len(e.bits) for e in p.header.plans), default=0),
        "created": _when(p.header.created),
    }  # fmt: skip


def cmd_ls(root: Path, as_json: bool) -> int:
    """Every pack, least recently used first, then the totals."""
    rows = [pack_row(p) for p in list_packs(root)]
    good = [r for r in rows if "error" not in r]
    totals = {"packs": len(good), "plans": sum(r["plans"] for r in good), "bytes": sum(r["bytes"] for r in rows),
              "unusable": len(rows) - len(good)}  # fmt: skip
    if as_json:
        print(json.dumps({"plan_dir": str(root), "packs": rows, "totals": totals}))
        return 0
    head = ("address", "partition", "weights", "adapters", "plans", "width", "bytes", "last used")
    table = [head] + [
        (r["address"][:16], r["partition"], r["weights"][:12], r["adapters"][:12] or "-", str(r["plans"]),
         str(r["width"]), f"{r['bytes']:,}", r["last_used"])
        if "error" not in r else (r["file"][:16], "unusable", "-", "-", "-", "-", f"{r['bytes']:,}", r["last_used"])
        for r in rows
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    print(f"{totals['packs']} pack(s), {totals['plans']} plan(s), {totals['bytes']:,} bytes in {root}"
          + (f"; {totals['unusable']} unusable (ditserve plans verify)" if totals["unusable"] else ""))  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"unusable: {r['error']}", file=sys.stderr)
    return 0


def cmd_verify(root: Path, delete: bool) -> int:
    """Read every pack whole; name each damaged one on stderr (exit 1), or delete them (`delete`: exit 0 once gone).
    A pack of another format version is reported, never deleted: another build's."""
    listing = list_packs(root, verify=True)
    bad = [p for p in listing if isinstance(p.error, PackCorruptError)]
    foreign = [p for p in listing if isinstance(p.error, PackVersionError)]
    deleted = []
    for p in bad:
        print(f"ditserve plans verify: {p.error}", file=sys.stderr)
        if delete:
            with contextlib.suppress(FileNotFoundError):
                p.path.unlink()
            deleted.append(p.path.name)
    print(json.dumps({
        "plan_dir": str(root), "checked": len(listing), "ok": len(listing) - len(bad) - len(foreign),
        "plans": sum(len(p.header.plans) for p in listing if p.header is not None),
        "bad": [{"file": p.path.name, "error": p.error.why if isinstance(p.error, PackError) else ""} for p in bad],
        "other_version": [p.path.name for p in foreign], "deleted": deleted,
    }))  # fmt: skip
    return 1 if len(bad) > len(deleted) else 0


def cmd_gc(root: Path, args: argparse.Namespace) -> int:
    """`ditruntime.plan_packs.gc`: damaged packs, interrupted writes, then the least recently used beyond
    --plan-dir-max-gb (the sidecar's bound and its eviction order: last use = the file's mtime)."""
    from plancache_service.config import CacheConfig

    try:
        max_bytes = from_args(CacheConfig, args, only=("plan_dir_max_bytes",)).plan_dir_max_bytes
    except ValueError as e:
        raise UsageError(str(e)) from e
    result = gc(root, max_bytes, verify=args.verify, dry_run=args.dry_run)
    print(json.dumps({
        "plan_dir": str(root), "max_bytes": max_bytes, "dry_run": args.dry_run,
        "removed_corrupt": [p.name for p in result.removed_corrupt], "evicted": [p.name for p in result.evicted],
        "removed_partials": [p.name for p in result.removed_partials], "kept_bytes": result.kept_bytes,
    }))  # fmt: skip
    return 0
