"""What every benchmark scenario runs on: the schedules (labels A-G, each its own width-2 plan keys), the prompt, and
`BenchContext`: the checkpoint and its model (loaded once), a schedule's request and plan keys, and an arm's services
started and run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ditcore import GenerationRequest, H3Model, load_model, validate_checkpoint
from ditcore.plans import PlanKey

from .harness import Arm, Record, Services

SCHEDULES = {  # label -> (flow_shift, audio_flow_shift); distinct shifts give width-2 plans
    "A": (5.0, 3.0),
    "B": (4.0, 2.0),
    "C": (6.0, 2.5),
    "D": (7.0, 3.5),
    "E": (3.0, 1.5),
    "F": (8.0, 4.0),
    "G": (2.5, 1.2),
}
PROMPT = "a red fox runs through a snowy forest at dawn"


@dataclass
class BenchContext:
    checkpoint: Path
    num_inference_steps: int
    device: str
    threads: int
    workdir: Path
    repeats: int
    records: list[Record]
    log: Callable[[str], None]
    _model: H3Model | None = field(default=None, repr=False)

    @property
    def forwards(self) -> int:
        """Transformer forwards (= plan keys, = slots a schedule needs at most) per request."""
        return self.num_inference_steps - 1

    def request(self, label: str) -> dict[str, Any]:
        """GenerationRequest fields of schedule `label` (request_id set per run); the default 32x32, 124 frames."""
        fs, afs = SCHEDULES[label]
        return {
            "task": "t2va", "prompt": PROMPT, "num_inference_steps": self.num_inference_steps,
            "flow_shift": fs, "audio_flow_shift": afs,
        }  # fmt: skip

    def generation_request(self, label: str, request_id: str = "bench-0") -> GenerationRequest:
        return GenerationRequest(request_id=request_id, **self.request(label))

    def model(self) -> H3Model:
        """This process's cached H3Model of the checkpoint (loaded once): plan keys and the embedded runs."""
        if self._model is None:
            torch.set_num_threads(self.threads)
            self._model = load_model(validate_checkpoint(self.checkpoint), "cached", self.device)
        return self._model

    def plan_keys(self, label: str) -> list[PlanKey]:
        return self.model().plan_keys(self.generation_request(label))

    def services(self, arm: Arm) -> Services:
        self.log(f"  starting arm {arm.name}")
        return Services(self.checkpoint, arm, self.device, self.threads, self.workdir)

    def run(self, svc: Services, labels: list[str]) -> list[Record]:
        out = []
        for i, label in enumerate(labels):
            rec = svc.run(label, self.request(label), f"{svc.arm.name}-{i}-{label}")
            self.log(f"    {rec.request_id}: {rec.latency_s:.2f} s, {rec.tier}, {rec.cache}")
            out.append(rec)
        self.records.extend(out)
        return out
