"""`ditserve quality-levels` and `ditserve audit-quality`: a generator's quality levels (ListQualityLevels), and the
audit that says where a level keeps its quality (docs/quality.md).

`audit-quality --level NAME --requests FILE.jsonl --audit-dir DIR` runs each request of the file (the format of
`ditserve generate --requests`) twice on the server, as output type frames_and_wav (PNG frames and a 16-bit WAV,
both lossless, so the comparison sees the model and not a codec): once lossless, once at the level as an audit run
(`quality_audit`: the level runs where no audit covers it yet). Per request it measures (quality_measures) the
latency ratio, the fraction of block forwards skipped, PSNR and SSIM of the frames and the Pearson correlation and
SNR of the waveform against lossless, judges them against the level's thresholds (`ditcore.quality.verdict`, with
the definition the server serves: its digest goes into the record), and appends an `AuditRecord` to
`DIR/NAME.jsonl` (the server's --quality-audit-dir). A line the level refuses (a rule it breaks: INVALID_ARGUMENT)
is reported and skipped, the others still run; it writes no record. Exit 0 when every request passed, 1 when any
failed or was refused, 2 for a usage error (flags, the requests file, a level the server does not serve).

Client side: nothing of the model, torch or torchmetrics is imported before the server has answered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from ditruntime.auth import ADMIN_TOKEN_ENV, bearer_metadata

from .errors import UsageError
from .remote import (
    add_admin_token_flags,
    add_client_flags,
    admin_token_of,
    check_client_args,
    check_token_transport,
    client_from_args,
)

LOSSLESS = "lossless"


def add_quality_levels_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="generator address HOST:PORT")
    p.add_argument("--json", action="store_true", help="print the ListQualityLevels response as one JSON object")
    p.add_argument("--timeout-s", type=float, default=10.0, help="the call's deadline (default %(default)s)")
    add_client_flags(p)
    p.set_defaults(func=cmd_quality_levels)


def add_audit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="generator address HOST:PORT")
    p.add_argument("--level", required=True, help="the quality level to audit (a level ListQualityLevels lists)")
    p.add_argument(
        "--requests", required=True, metavar="FILE.jsonl",
        help="the requests to audit, one JSON object a line (as `ditserve generate --requests`); each runs lossless "
        "and at the level, as frames_and_wav (a line's quality and output_type are the audit's)",
    )  # fmt: skip
    p.add_argument(
        "--audit-dir", required=True, metavar="DIR",
        help="where the records go: DIR/LEVEL.jsonl, one line each (the server's --quality-audit-dir; created if "
        "missing)",
    )  # fmt: skip
    p.add_argument("--out", default=None, metavar="REPORT.json", help="also write the whole report (JSON) there")
    p.add_argument(
        "--timeout-s", type=float, default=3600.0, help="each generation's deadline (default %(default)s)"
    )  # fmt: skip
    add_admin_token_flags(p)
    add_client_flags(p)
    p.set_defaults(func=cmd_audit_quality)


def _message_dict(resp: Any) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    data: dict[str, Any] = MessageToDict(
        resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return data


def _list_levels(args: argparse.Namespace, command: str) -> Any:
    """The server's ListQualityLevels; None (the failure on stderr) when the call fails."""
    check_client_args(args)
    with client_from_args(args) as client:
        try:
            return client.list_quality_levels(timeout=min(args.timeout_s, 30.0))
        except grpc.RpcError as e:
            print(f"ditserve {command}: failed: {e.code().name}: {e.details()}", file=sys.stderr)
            return None


# ------------------------------------------------------------------------------------------- quality-levels
def cmd_quality_levels(args: argparse.Namespace) -> int:
    """The server's quality levels: a table, or with --json the response as one JSON object (proto field names);
    exit 1 when the call fails."""
    resp = _list_levels(args, "quality-levels")
    if resp is None:
        return 1
    if args.json:
        print(json.dumps(_message_dict(resp), sort_keys=True), flush=True)
    else:
        print(quality_levels_table(resp), flush=True)
    return 0


def _allows(level: Any) -> str:
    """What a level runs with, in one cell."""
    if level.name == LOSSLESS:
        return "any request"
    parts = [f"tasks {','.join(level.tasks)}"]
    if level.steps:
        parts.append(f"steps {','.join(map(str, level.steps))}")
    bounds = [f"{label}<={v}" for label, v in (("h", level.max_height), ("w", level.max_width),
                                                ("frames", level.max_num_frames)) if v]  # fmt: skip
    if bounds:
        parts.append(" ".join(bounds))
    parts.append(f"ranks {','.join(map(str, level.world_sizes))}")
    adapters = ",".join(level.adapter_names) if level.adapters == "listed" else level.adapters
    parts.append(f"adapters {adapters}")
    return "; ".join(parts)


def _audits(level: Any) -> str:
    if level.name == LOSSLESS:
        return "-"
    a = level.audits
    text = f"{a.passed} passed, {a.failed} failed"
    if a.covered:
        shapes = [f"{s.task} {s.num_inference_steps}st {s.height}x{s.width}x{s.num_frames} @{s.world_size}"
                  for s in a.covered]  # fmt: skip
        text += f"; covers {', '.join(shapes)}"
    if a.HasField("last_audit_at"):
        text += f"; last {a.last_audit_at.ToDatetime().strftime('%Y-%m-%dT%H:%M:%SZ')}"
    return text


def quality_levels_table(resp: Any) -> str:
    """A ListQualityLevelsResponse as text: a header and a row per level (its step cache, what it allows, its
    unaudited policy and thresholds), then its audits."""
    header = ("LEVEL", "CACHE", "ALLOWS", "UNAUDITED", "THRESHOLDS", "DIGEST", "AUDITS")
    rows = []
    for lv in resp.levels:
        cache = "none" if not lv.HasField("cache") else f"{lv.cache.kind} {lv.cache.params_json}"
        thresholds = " ".join(f"{k}={v:g}" for k, v in sorted(lv.thresholds.items())) or "-"
        rows.append((lv.name, cache, _allows(lv), lv.unaudited or "-", thresholds, lv.digest[:12] or "-",
                     _audits(lv)))  # fmt: skip
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header) - 1)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]) for r in (header, *rows)]
    lines.append(f"on {resp.world_size} rank(s); audits in {resp.audit_dir or '(no --quality-audit-dir)'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- audit-quality
def _requests(path: str) -> list[Any]:
    """The requests of `path` (requests_io's JSONL format) as frames_and_wav results."""
    from .outputs import output_target
    from .requests_io import add_request_flags, requests_with_unset

    scratch = argparse.ArgumentParser(add_help=False)
    add_request_flags(scratch)
    ns = scratch.parse_args([])
    ns.requests = path
    ns.out, ns.output_type = None, None
    return [r for r, _ in requests_with_unset(ns, output_target(None, "frames_and_wav"))]


def append_record(audit_dir: Path, record: dict[str, Any]) -> Path:
    """`record` as one line of `audit_dir/LEVEL.jsonl`: one write of the whole line on a file opened for appending,
    flushed and fsynced (a reader sees whole lines, or a torn last one that covers nothing)."""
    audit_dir.mkdir(parents=True, exist_ok=True)
    path = audit_dir / f"{record['level']}.jsonl"
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def cmd_audit_quality(args: argparse.Namespace) -> int:
    """One JSON line per request (its measures and verdict, or why the level refused it), then a summary line."""
    if not Path(args.requests).is_file():
        raise UsageError(f"--requests: no such file {args.requests}")
    if args.level == LOSSLESS:
        raise UsageError("--level lossless: lossless is the reference an audit compares against; name a level")
    resp = _list_levels(args, "audit-quality")
    if resp is None:
        return 1
    served = {lv.name: lv for lv in resp.levels}
    if args.level not in served:
        raise UsageError(f"--level: unknown level {args.level!r}; the server serves {', '.join(served)}")
    token = admin_token_of(args) or os.environ.get(ADMIN_TOKEN_ENV, "")  # an audit run needs the admin token
    check_token_transport(args)
    metadata = list(bearer_metadata(token)) if token else []
    requests = _requests(args.requests)
    # the server answered: now the parts that need numpy, PIL, torch and torchmetrics
    from ditcore.quality import AuditRecord, QualityLevel, verdict
    from ditcore.step_cache import StepCache

    from .quality_measures import compare, read_frames_and_wav

    lv = served[args.level]
    level = QualityLevel(args.level, StepCache(lv.cache.kind), audit=tuple(sorted(lv.thresholds.items())))
    audit_dir = Path(args.audit_dir)
    lines: list[dict[str, Any]] = []
    failures = 0
    with client_from_args(args) as client:
        for req in requests:
            at_level = _replace(req, f"{req.request_id}.{args.level}", args.level, True)
            lossless = _replace(req, f"{req.request_id}.lossless", "", False)
            line: dict[str, Any] = {"request_id": req.request_id, "level": args.level,
                                    "shape": list(level.shape(req, resp.world_size))}  # fmt: skip
            try:
                got = client.generate(at_level, timeout=args.timeout_s, metadata=metadata)
                ref = client.generate(lossless, timeout=args.timeout_s)
            except grpc.RpcError as e:
                line.update(passed=False, refused=f"{e.code().name}: {e.details()}")
                failures += 1
                print(json.dumps(line), flush=True)
                lines.append(line)
                continue
            assert got.media is not None and ref.media is not None  # the client checked the output type
            measures = compare(read_frames_and_wav(bytes(ref.media.data)), read_frames_and_wav(bytes(got.media.data)))
            measures.update(_speed(got, ref, resp.transformer_blocks))
            passed, misses = verdict(level, measures)
            record = AuditRecord(args.level, lv.digest, level.shape(req, resp.world_size), measures, passed,
                                 datetime.now(UTC).isoformat(timespec="seconds"))  # fmt: skip
            path = append_record(audit_dir, record.to_dict())
            line.update(passed=passed, misses=misses, measures=measures, record=str(path),
                        quality_warning=got.quality_warning, digest=lv.digest)  # fmt: skip
            failures += 0 if passed else 1
            print(json.dumps(line), flush=True)
            lines.append(line)
    refused = sum(bool(x.get("refused")) for x in lines)
    n_passed = sum(bool(x.get("passed")) for x in lines)
    summary = {"level": args.level, "digest": lv.digest, "requests": len(lines), "passed": n_passed,
               "failed": len(lines) - n_passed - refused, "refused": refused, "world_size": resp.world_size,
               "audit_dir": str(audit_dir)}  # fmt: skip
    print(json.dumps({"summary": summary}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "requests": lines}, indent=2) + "\n")
    return 1 if failures else 0


def _replace(req: Any, request_id: str, quality: str, audit: bool) -> Any:
    import dataclasses

    return dataclasses.replace(req, request_id=request_id[:128], quality=quality, quality_audit=audit,
                               output_type="frames_and_wav")  # fmt: skip


def _speed(got: Any, ref: Any, blocks: int) -> dict[str, float]:
    """Latency ratio (total and denoise ms, level / lossless) and the block forwards skipped."""
    out: dict[str, float] = {}
    for key, name in (("total_ms", "latency_ratio"), ("denoise_ms", "denoise_ratio")):
        base = ref.timings_ms.get(key, 0.0)
        out[name] = round(got.timings_ms.get(key, 0.0) / base, 4) if base > 0 else float("nan")
    skipped = float(sum(got.blocks_skipped))
    steps = len(got.blocks_skipped)
    out["blocks_skipped"] = skipped
    out["blocks_skipped_per_step"] = round(skipped / steps, 4) if steps else 0.0
    if blocks and steps:
        out["skipped_fraction"] = round(skipped / (blocks * steps), 4)
    return out
