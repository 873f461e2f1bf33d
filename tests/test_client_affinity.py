"""`ditserve.client_requests.schedule_affinity_key`, the `x-ditserve-schedule` header: equal keys exactly when two
requests' plan keys are equal on one checkpoint (ditcore.schedule.ScheduleKeys is the judge), ref2va's audio
references included; unreadable references get the plain key (the server refuses them, naming the field)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from refmedia import image_bytes, video_bytes, wav_bytes

from ditcore.references import Reference
from ditcore.schedule import ScheduleKeys
from ditserve.client_requests import as_request, schedule_affinity_key

BASE: dict[str, Any] = {"prompt": "a red fox", "num_inference_steps": 4, "height": 32, "width": 32}
REQUESTS: dict[str, dict[str, Any]] = {
    "t2va": BASE,
    "t2va_other_seed": {**BASE, "seed": 9, "prompt": "rain"},
    "t2va_shift": {**BASE, "flow_shift": 5.0},
    "ref2va_image": {**BASE, "references": (Reference(image_bytes(64, 48, seed=1)),)},
    "ref2va_two_images": {**BASE, "references": (Reference(image_bytes(40, 60, seed=2)), Reference(image_bytes()))},
    "ref2va_wav": {**BASE, "references": (Reference(image_bytes()), Reference(wav_bytes(1.5)))},
    "ref2va_video_sound": {**BASE, "references": (Reference(video_bytes(frames=30, fps=30, audio_rate=32000)),)},
}


def test_the_key_is_the_schedule(tiny_ckpt: Path) -> None:
    schedule = ScheduleKeys(tiny_ckpt)
    keys = {n: schedule_affinity_key(r) for n, r in REQUESTS.items()}  # mappings, as users pass them: task inferred
    reqs = {n: as_request(r).validate() for n, r in REQUESTS.items()}
    assert keys["t2va"] == "t2va/4/12/3" and keys["t2va_shift"] == "t2va/4/5/3"
    assert keys["ref2va_image"] == "ref2va/4/12/3" and keys["ref2va_wav"] == "ref2va+audio/4/12/3"
    plans = {n: tuple(schedule.keys(r)) for n, r in reqs.items()}
    for a in reqs:
        for b in reqs:
            assert (keys[a] == keys[b]) == (plans[a] == plans[b]), (a, b, keys[a], keys[b])


@pytest.mark.parametrize("data", [b"", b"not media", image_bytes()[:40]])
def test_unreadable_references_get_the_plain_key(data: bytes) -> None:
    assert schedule_affinity_key({**BASE, "references": [data]}) == "ref2va/4/12/3"
