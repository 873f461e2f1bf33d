"""ditcore.quality's rules, without a model: what a level allows (tasks, steps, canvas, world sizes, adapters),
fail closed, each refusal naming `quality` and the rule; audit coverage by definition digest, shape and world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ditcore.adapter_contract import AdapterUse
from ditcore.quality import AUDIT_RUN, AuditRecord, QualityLevels, QualityNotAuditedError
from ditcore.request import GenerationRequest, RequestError

LEVELS = """
[levels.few]
cache = { kind = "taylorseer", cache_interval = 3 }
tasks = ["t2va", "fl2va"]
world_sizes = [1, 4]
adapters = "trunk"
unaudited = "warn"

[levels.named]
cache = { kind = "first_block", threshold = 0.05 }
adapters = ["style"]
"""


@pytest.fixture
def levels(tmp_path: Path) -> QualityLevels:
    (tmp_path / "levels.toml").write_text(LEVELS)
    (tmp_path / "audits").mkdir()
    return QualityLevels.load(tmp_path / "levels.toml", tmp_path / "audits")


def request(**fields: object) -> GenerationRequest:
    return GenerationRequest(**{"prompt": "a fox", "quality": "few", **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "world", "trunk_only", "message"),
    [
        ({"task": "ref2va"}, 1, (), "level few runs with tasks t2va, fl2va, not ref2va"),
        ({}, 2, (), "level few runs on 1 or 4 rank(s), not on this server's 2"),
        ({"adapters": (AdapterUse("mod"),)}, 1, (False,), "trunk-only adapters; mod changes the modulation"),
        ({"quality": "named", "adapters": (AdapterUse("other"),)}, 1, (True,), "adapters style only, not other"),
        ({"quality": "nope"}, 1, (), "unknown level 'nope'; this server serves lossless, few, named"),
    ],
)
def test_a_rule_the_request_breaks_is_refused_naming_it(levels: QualityLevels, fields: dict[str, object], world: int,
                                                         trunk_only: tuple[bool, ...], message: str) -> None:  # fmt: skip
    with pytest.raises(RequestError) as err:
        levels.check(request(**fields), world, trunk_only)
    assert err.value.field == "quality" and message in str(err.value)


def test_what_a_level_allows_runs_and_coverage_follows_the_definition(levels: QualityLevels) -> None:
    level, warning = levels.check(request(adapters=(AdapterUse("style"),)), 4, (True,))  # trunk-only, 4 ranks
    assert level is not None and level.name == "few" and "no passing audit covers" in warning  # policy warn
    assert levels.check(request(quality="lossless"), 2) == (None, "") == levels.check(request(quality=""), 2)
    named = levels.levels["named"]
    req = request(quality="named")
    with pytest.raises(QualityNotAuditedError):  # policy refuse (the default)
        levels.check(req, 1)
    assert levels.check(GenerationRequest(**{**vars(req), "quality_audit": True}), 1)[1].startswith(AUDIT_RUN)
    assert levels.audit_dir is not None
    for record in (AuditRecord("named", named.digest, named.shape(req, 4), passed=True),  # another world size
                   AuditRecord("named", named.digest, named.shape(req, 1), passed=False)):  # fmt: skip
        with (levels.audit_dir / "named.jsonl").open("a") as f:
            f.write(json.dumps(record.to_dict()) + "\n")
    with pytest.raises(QualityNotAuditedError):  # neither covers 1 rank with a pass
        levels.check(req, 1)
    with (levels.audit_dir / "named.jsonl").open("a") as f:
        f.write(json.dumps(AuditRecord("named", named.digest, named.shape(req, 1), passed=True).to_dict()) + "\n")
    assert levels.check(req, 1) == (named, "")
    other = request(quality="named", num_inference_steps=30)  # another shape: not covered
    with pytest.raises(QualityNotAuditedError):
        levels.check(other, 1)
