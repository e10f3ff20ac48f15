"""Dataclasses to and from protobuf messages whose fields have the same names, for the servicers' edges.

A field is spelled once in its dataclass and once in its .proto; these two functions copy between them by
name, so a conversion never lists the fields again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def to_message(obj: Any, message_type: type[M], **extra: Any) -> M:
    """A message_type made from obj's dataclass fields that the message has; None leaves a field unset."""
    names = message_type.DESCRIPTOR.fields_by_name
    values = {
        f.name: getattr(obj, f.name)
        for f in dataclasses.fields(obj)
        if f.name in names and f.name not in extra and getattr(obj, f.name) is not None
    }
    return message_type(**values, **extra)


def from_message(cls: type[T], message: Message, **overrides: Any) -> T:
    """A cls dataclass made from the message's fields of the same names, with overrides on top.

    A field whose presence the message tracks (proto3 `optional`) and that is unset keeps the dataclass's
    default, as does a field the message lacks; repeated fields become tuples.
    """
    by_name = message.DESCRIPTOR.fields_by_name
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        descriptor = by_name.get(f.name)
        if f.name in overrides or descriptor is None:
            continue
        if descriptor.has_presence and not message.HasField(f.name):
            continue
        value = getattr(message, f.name)
        values[f.name] = tuple(value) if _repeated(descriptor) else value
    return cls(**values, **overrides)


def _repeated(descriptor: Any) -> bool:  # a FieldDescriptor, pure-Python or upb
    if hasattr(descriptor, "is_repeated"):  # protobuf 6.31 and later
        return bool(descriptor.is_repeated)
    return bool(descriptor.label == FieldDescriptor.LABEL_REPEATED)
