"""Dataclass <-> proto message conversion by field name, failing loudly on a field with no
counterpart (so a renamed field can never be dropped silently)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any, TypeVar

from google.protobuf.message import Message

M = TypeVar("M", bound=Message)
D = TypeVar("D")


class FieldMismatchError(TypeError):
    """A dataclass field has no proto counterpart (or the reverse)."""


def check_fields(cls: type[Any], msg_cls: type[Message], elsewhere: Collection[str] = ()) -> list[str]:
    """The dataclass fields carried by `msg_cls`; raises if one is missing and not in `elsewhere`."""
    names = [f.name for f in dataclasses.fields(cls)]
    proto = set(msg_cls.DESCRIPTOR.fields_by_name)
    missing = [n for n in names if n not in proto and n not in elsewhere]
    if missing:
        raise FieldMismatchError(
            f"{cls.__name__} fields {missing} have no counterpart in {msg_cls.DESCRIPTOR.full_name}"
        )
    return [n for n in names if n in proto]


def to_proto(obj: Any, msg_cls: type[M], elsewhere: Collection[str] = ()) -> M:
    """`msg_cls` filled from the dataclass `obj`; fields in `elsewhere` travel in another message."""
    names = check_fields(type(obj), msg_cls, elsewhere)
    return msg_cls(**{n: getattr(obj, n) for n in names})


def from_proto(msg: Message, cls: type[D]) -> D:
    """The dataclass `cls` read off `msg`; every field of `cls` must exist on the message."""
    names = check_fields(cls, type(msg))
    return cls(**{n: getattr(msg, n) for n in names})
