"""LoadAdapter and UnloadAdapter's work (no grpc here): an adapter of --adapter-dir loaded into the served model now,
or deleted from it, between requests. Both hold the backend's `model_lock`, which the executor holds while a request
denoises (its adapters active, ditcore.adapters.ModelAdapters.active), so neither ever runs beside a request.

The fence is the adapter's identity (sha256 of its bytes and contract): LoadAdapter with an `identity` is refused
unless the file reads that identity now, and once more after the load (a file that changed while it was loaded is
deleted from the model again). Identities of the same name loaded before whose file has changed since are deleted
when the new one is loaded; they were never served for the name again anyway (a request resolves the name to the
identity its file has now).

On a replica this runs on rank 0 only: the other ranks load an adapter at its first use and check rank 0's identity
for it before the first step (generator_service.replica.follower), and each bounds its own loaded set
(--max-loaded-adapters), so what they hold never changes what is served (docs/adapters.md)."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ditcore import H3Model, RequestError
from ditcore.adapter_contract import AdapterNotFoundError
from ditcore.adapters import AdapterInfo, AdapterRegistry
from ditcore.request import ADAPTER_NAME

from ..backends.base import Backend
from ..errors import AdapterIdentityError, DeadlineExceededError

log = logging.getLogger(__name__)

IDENTITY = re.compile(r"[0-9a-f]{64}")
NAME_RULE = "1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit (an adapter file's stem, no path)"


@dataclass(frozen=True)
class Loaded:
    """What LoadAdapter did."""

    info: AdapterInfo
    loaded_bytes: int
    already_loaded: bool
    replaced: tuple[str, ...]
    """Identities of the same name (its file changed since) deleted from the model."""


def check_name(name: str) -> str:
    if not ADAPTER_NAME.fullmatch(name):
        raise RequestError("name", f"must be {NAME_RULE}, got {name[:160]!r}")
    return name


def check_identity(identity: str) -> str:
    if identity and not IDENTITY.fullmatch(identity):
        raise RequestError(
            "identity", f"must be 64 lowercase hex digits (sha256, as ListAdapters shows it), got {identity[:80]!r}"
        )
    return identity


class AdapterAdmin:
    """LoadAdapter / UnloadAdapter on `backend`'s served model, reading `registry` (--adapter-dir; None: none)."""

    def __init__(self, backend: Backend, registry: AdapterRegistry | None) -> None:
        self.backend = backend
        self.registry = registry

    def _registry(self, name: str) -> AdapterRegistry:
        if self.registry is None:
            raise AdapterNotFoundError(f"adapter {name}: this server serves no adapters (no --adapter-dir)")
        return self.registry

    @contextlib.contextmanager
    def _between_requests(self, what: str, timeout_s: float | None) -> Iterator[H3Model]:
        """The served model, held (`model_lock`) until the block ends: no request runs meanwhile. Waits for the running
        request up to `timeout_s` (the call's deadline; None: as long as it takes), then DeadlineExceededError."""
        lock = self.backend.model_lock
        bounded = timeout_s is not None and timeout_s < threading.TIMEOUT_MAX  # a call without a deadline: huge
        if not lock.acquire(timeout=max(0.0, timeout_s) if bounded and timeout_s is not None else -1):
            raise DeadlineExceededError(f"{what}: the running request still held the model at the call's deadline; "
                                        "nothing changed")  # fmt: skip
        try:
            yield self.backend.model()
        finally:
            lock.release()

    def load(self, name: str, identity: str = "", timeout_s: float | None = None) -> Loaded:
        """Load adapter `name` into the served model (AdapterNotFoundError, AdapterError as a request's admission
        refuses it; AdapterIdentityError when `identity` is set and its file reads another)."""
        check_name(name)
        check_identity(identity)
        registry = self._registry(name)
        registry.get(name)  # read (hashed) before the model is held: under it, a stat unless the file changes again
        with self._between_requests(f"LoadAdapter {name}", timeout_s) as model:
            info = registry.get(name)
            self._fence(info, identity)
            adapters = model.adapter_set
            held = [i for i in adapters.loaded() if i.name == name]
            replaced = tuple(i.identity for i in held if i.identity != info.identity)
            already = any(i.identity == info.identity for i in held)
            if replaced:  # unload deletes by name: every identity of it goes, then this one is loaded again
                while adapters.unload(name) is not None:
                    pass
                already = False
            adapters.load(info)
            now = registry.get(name)
            if now.identity != info.identity:  # the file changed while it was being loaded: never served as `info`
                while adapters.unload(name) is not None:
                    pass
                raise AdapterIdentityError(
                    f"adapter {name}: its file changed while it was loaded ({info.identity} -> {now.identity}); "
                    "nothing of it stays loaded: load it again",
                    {"name": name, "expected_identity": info.identity, "identity": now.identity},
                )
            loaded_bytes = adapters.loaded_bytes().get(info.identity, 0)
        log.info("LoadAdapter %s: identity %s %s%s", name, info.identity[:16],
                 "already loaded" if already else "loaded",
                 f" (replaced {', '.join(r[:16] for r in replaced)})" if replaced else "")  # fmt: skip
        return Loaded(info, loaded_bytes, already, replaced)

    @staticmethod
    def _fence(info: AdapterInfo, identity: str) -> None:
        if identity and info.identity != identity:
            raise AdapterIdentityError(
                f"adapter {info.name}: the file reads identity {info.identity} now, not the expected {identity} "
                "(it changed since it was listed); nothing was loaded",
                {"name": info.name, "expected_identity": identity, "identity": info.identity},
            )

    def unload(self, name: str, timeout_s: float | None = None) -> list[AdapterInfo]:
        """Delete every loaded identity of adapter `name` from the served model (its file stays): what was deleted,
        empty when none was loaded. A later request naming it loads it again at its first use."""
        check_name(name)
        deleted = []
        with self._between_requests(f"UnloadAdapter {name}", timeout_s) as model:
            while (info := model.adapter_set.unload(name)) is not None:
                deleted.append(info)
        if deleted:
            log.info("UnloadAdapter %s: deleted %s", name, ", ".join(i.identity[:16] for i in deleted))
        return deleted
