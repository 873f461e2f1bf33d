"""docs/errors.md, from the error classes: every `ditruntime.errors.ServiceError` subclass of ditruntime and the two
services, ditcore's errors as `ditruntime.rpc_errors` maps them, and the statuses of the classes that take their code
and reason per call (read from the call sites' literals)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import logging
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc

import ditruntime
import generator_service
import plancache_service
from ditruntime import rpc_errors
from ditruntime.errors import ServiceError

from .markdown import cell, class_doc, code, table

PACKAGES: tuple[ModuleType, ...] = (ditruntime, generator_service, plancache_service)
_WHERE = {
    "ditcore": "both (ditcore)",
    "ditruntime": "both",
    "generator_service": "generator",
    "plancache_service": "sidecar",
}
_CODES = list(grpc.StatusCode.__members__)
HEADER = ("gRPC code", "reason", "service", "class", "meaning")


@dataclasses.dataclass(frozen=True)
class Row:
    code: str
    reason: str
    cls: type[BaseException]
    meaning: str

    def cells(self) -> list[str]:
        where = _WHERE[self.cls.__module__.split(".")[0]]
        name = f"{self.cls.__module__}.{self.cls.__qualname__}"
        number = f" ({grpc.StatusCode[self.code].value[0]})" if self.code in _CODES else ""
        return [
            code(self.code) + number,
            code(self.reason) if self.reason else "—",
            where,
            code(name),
            cell(self.meaning),
        ]

    def key(self) -> tuple[int, str, str]:
        return (_CODES.index(self.code) if self.code in _CODES else len(_CODES), self.reason, self.cls.__qualname__)


def _import_all() -> None:
    """Import every module of the packages, so that every error class is defined."""
    for pkg in PACKAGES:
        for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)


def _subclasses(cls: type[ServiceError]) -> Iterator[type[ServiceError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _sets_status_per_call(cls: type[ServiceError]) -> bool:
    """Whether the class's own `__init__` assigns `self.grpc_code` (its status comes from each call)."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return False
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(init)))
    return any(
        isinstance(t, ast.Attribute) and t.attr == "grpc_code"
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for t in node.targets
    )


def _literal(node: ast.expr) -> str | None:
    """A message argument's text: a constant, or an f-string with each placeholder shown as `…`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)  # type: ignore[misc]
    return None


def _call_sites(cls: type[ServiceError]) -> dict[tuple[str, str], list[str]]:
    """{(code, reason): the distinct messages} of every `Cls("CODE", "REASON", message, ...)` in the packages."""
    found: dict[tuple[str, str], list[str]] = {}
    for pkg in PACKAGES:
        root = Path(pkg.__path__[0])
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and _called(node) == cls.__name__ and len(node.args) >= 2):
                    continue
                status, reason = (_literal(a) for a in node.args[:2])
                if status is None or reason is None:
                    continue
                texts = _messages(node.args[2], node, tree, parents) if len(node.args) > 2 else []
                messages = found.setdefault((status, reason), [])
                where = f"raised in `{path.relative_to(root.parent).as_posix()}`"
                messages += [t for t in texts or [where] if t not in messages]
    return found


def _messages(arg: ast.expr, call: ast.Call, tree: ast.Module, parents: dict[ast.AST, ast.AST]) -> list[str]:
    """The message's text; for a parameter of the enclosing function, the literals its callers in the same module
    pass (the one level `raise Error(code, reason, message)` helpers need)."""
    text = _literal(arg)
    if text is not None or not isinstance(arg, ast.Name):
        return [text] if text is not None else []
    fn: ast.AST | None = parents.get(call)
    while fn is not None and not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        fn = parents.get(fn)
    if fn is None:
        return []
    params = [a.arg for a in fn.args.args]
    params = params[1:] if params[:1] in (["self"], ["cls"]) else params
    if arg.id not in params:
        return []
    i = params.index(arg.id)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n) == fn.name and len(n.args) > i]
    return [t for t in (_literal(c.args[i]) for c in calls) if t is not None]


def _called(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _rows() -> list[Row]:
    _import_all()
    rows = [Row(status.name, reason, cls, class_doc(cls)) for cls, status, reason in rpc_errors._CORE_TABLE]
    classes = {c for c in _subclasses(ServiceError) if c.__module__.split(".")[0] in _WHERE} | {ServiceError}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        doc = class_doc(cls)
        if not doc:
            raise ValueError(f"{cls.__module__}.{cls.__qualname__}: an error class needs a docstring (its meaning)")
        if not _sets_status_per_call(cls):
            rows.append(Row(str(cls.grpc_code), str(cls.reason), cls, doc))
            continue
        sites = _call_sites(cls)
        for (status, reason), messages in sites.items():
            rows.append(Row(status, reason, cls, "; ".join(m.rstrip(".") for m in messages) + "."))
        if not sites:  # a status relayed from elsewhere (the sidecar's, through the generator)
            rows.append(Row("(relayed)", "(relayed)", cls, doc))
    return sorted(rows, key=Row.key)


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _fallback() -> tuple[str, str]:
    """What the one mapping gives an exception no class names (asked of the mapping itself)."""
    with _quiet(rpc_errors.log):
        status, reason, _ = rpc_errors.classify(RuntimeError("docs"))
    return status.name, reason


def render() -> str:
    """The whole of docs/errors.md."""
    fallback_code, fallback_reason = _fallback()
    lines = [
        "# Errors",
        "",
        "Generated by `python scripts/gen_docs.py` from the error classes (`ditruntime/errors.py`, the services'",
        "`errors.py`, ditcore's errors as `ditruntime/rpc_errors.py` maps them); do not edit it by hand: the default",
        "test suite fails when it differs from what the script writes.",
        "",
        "One mapping (`ditruntime/rpc_errors.py`) serves both services. Every error leaves with a",
        "`google.rpc.ErrorInfo` (the stable `reason` below, domain `ditserve`, and metadata) and, for a request",
        "field, a `google.rpc.BadRequest` field violation naming it; messages name the field or flag and the",
        "allowed range. Any other exception is",
        f"`{fallback_code}` with reason `{fallback_reason}` (logged; no stack trace in the status). The generator",
        "relays a sidecar refusal with the sidecar's code and reason. Statuses no class raises (a TLS handshake",
        "refused, a peer of another uid disconnected at accept) and grpcurl's output: [api.md](api.md#errors).",
        "",
    ]
    lines += table(HEADER, (r.cells() for r in _rows()))
    return "\n".join(lines) + "\n"
