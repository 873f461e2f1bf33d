"""The adapters the sidecar builds plans with (`AdapterPlans`): its own `--adapter-dir` (ditcore.adapters), each
digest a PreparePlans named with the adapters behind it, and each digest's modulation deltas per page builder
(ditcore.adapter_plans), loaded once. No grpc here.

A PreparePlans whose keys carry an adapters digest names those adapters (name, identity, scale). The sidecar reads
each by name from its own directory and must find the generator's identity (a file that differs between the two is
refused: FAILED_PRECONDITION, nothing built); the digest of what it read must be the keys' (INVALID_ARGUMENT
otherwise). A digest's adapters are then what every later build of its keys uses; plans of different digests are
different keys (the slot table records the digest: PlanKey.adapters_code).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ditcore.adapter_contract import AdapterError
from ditcore.adapter_plans import ModulationDeltas, modulation_digest
from ditcore.adapters import AdapterInfo, AdapterRegistry
from ditcore.plans import PlanKey

from .errors import InvalidPlanRequestError

MAX_DIGESTS = 256
"""Adapter combinations whose adapters (and deltas) the sidecar keeps; the least recently named is forgotten."""


class AdapterPlans:
    """What each adapters digest is built with; `deltas(...)` hands a builder its pass's terms."""

    def __init__(self, registry: AdapterRegistry | None, max_digests: int = MAX_DIGESTS) -> None:
        self.registry = registry
        self.max_digests = max_digests
        self._lock = threading.Lock()
        self._uses: OrderedDict[str, list[tuple[AdapterInfo, float]]] = OrderedDict()
        self._deltas: dict[tuple[str, str, int], ModulationDeltas] = {}

    def register(self, specs: Sequence[Any], keys: Sequence[PlanKey]) -> None:
        """A PreparePlans' adapters (objects with name, identity, scale) for its keys: checked and remembered."""
        digests = {k.adapters for k in keys} - {""}
        if not digests:
            if specs:
                raise InvalidPlanRequestError("adapters", "names adapters but no plan key carries an adapters digest")
            return
        if len(digests) > 1:
            raise InvalidPlanRequestError("plan_keys", "carry different adapters digests; one PreparePlans builds one")
        if self.registry is None:
            raise AdapterError("the plan-cache sidecar serves no adapters (start it with --adapter-dir)")
        uses = []
        for spec in specs:
            info = self.registry.get(spec.name)  # AdapterNotFoundError, AdapterError
            if info.identity != spec.identity:
                raise AdapterError(
                    f"adapter {spec.name} is {info.identity[:16]} in the sidecar's --adapter-dir but "
                    f"{spec.identity[:16]} at the generator: both must read the same file"
                )
            uses.append((info, float(spec.scale)))
        digest = digests.pop()
        if modulation_digest(uses) != digest:
            raise InvalidPlanRequestError("adapters", "are not the adapters of the plan keys' adapters digest")
        with self._lock:
            if digest not in self._uses:
                self._uses[digest] = uses
            self._uses.move_to_end(digest)
            while len(self._uses) > self.max_digests:
                old, _ = self._uses.popitem(last=False)
                self._deltas = {k: v for k, v in self._deltas.items() if k[0] != old}

    def deltas(self, digest: str, partition: str, builder: Any) -> ModulationDeltas | None:
        """The terms a build of `digest`'s keys adds on `builder` (None for the base weights' plans)."""
        if not digest:
            return None
        with self._lock:
            uses = self._uses.get(digest)
            key = (digest, partition, id(builder))
            cached = self._deltas.get(key)
        if uses is None:
            raise AdapterError(f"no adapters are known for plans of adapters digest {digest[:16]}")
        if cached is None:
            cached = ModulationDeltas.load(
                uses, partition, builder.projection_dtype, builder.time_dtype, builder.device
            )
            with self._lock:
                self._deltas[key] = cached
        return cached
