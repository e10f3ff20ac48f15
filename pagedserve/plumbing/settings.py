"""One source for every setting: a config dataclass's field says once what its flag, type, default, help and
checks are, and the command-line parsers are built from the fields.

A field made with `setting()` carries its help, its flag (`--kv-memory` for `kv_memory` unless told
otherwise), how its command-line text becomes a value (`convert`, e.g. parse_bytes; else the field's type),
an environment variable that holds the value when the flag is absent, and a check. Choices come from a
`Literal` type. A field made with `nested()` holds another config dataclass whose settings are flags of the
same parser. Each config's `__post_init__` calls `check_settings`, so a config built in code obeys the same
rules as one built from flags. `add_arguments` declares the flags with no defaults of their own: `from_args`
takes the dataclass's default for every flag not given, and `given_flags` turns the given ones back into
arguments, which is how `pagedserve up` passes its children's settings on without declaring them again.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Setting:
    help: str
    flag: str | None = None
    convert: Callable[[str], Any] | None = None  # command-line text to value; the field's type if None
    env: str | None = None  # an environment variable holding the value itself, when the flag is absent
    check: Callable[[Any], str | None] | None = None  # what is wrong with a value, or None
    metavar: str | None = None
    shown_default: str | None = None  # the default as --help shows it


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    convert: Callable[[str], Any] | None = None,
    env: str | None = None,
    check: Callable[[Any], str | None] | None = None,
    metavar: str | None = None,
    shown_default: str | None = None,
    secret: bool = False,
) -> Any:
    """A config field with its command-line flag; `secret` keeps the value out of repr."""
    meta = Setting(help, flag, convert, env, check, metavar, shown_default)
    return dataclasses.field(default=default, repr=not secret, metadata={"setting": meta})


def nested(config: type) -> Any:
    """A field holding another config dataclass, whose settings join the same command line."""
    return dataclasses.field(default_factory=config, metadata={"nested": config})


# Checks: each returns what is wrong with a value, or None ----------------------------------------------


def positive(value: float) -> str | None:
    return None if value > 0 else f"must be positive, got {value}"


def not_negative(value: float) -> str | None:
    return None if value >= 0 else f"must not be negative, got {value}"


def between(low: float, high: float) -> Callable[[float], str | None]:
    """A check that a value lies in [low, high]."""

    def check(value: float) -> str | None:
        return None if low <= value <= high else f"must be between {low} and {high}, got {value}"

    return check


def tcp_port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else f"must be a TCP port (0 to 65535), got {value}"


_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def device(value: str) -> str | None:
    match = _DEVICE.match(value)
    if match is None or (match.group(1) == "cpu" and match.group(2)):
        return f"must be cpu, cuda or cuda:N, got {value!r}"
    return None


def cuda_index(value: str) -> int:
    """The N of cuda:N (0 for cuda); call only on a checked device."""
    match = _DEVICE.match(value)
    assert match is not None, value
    return int(match.group(2) or 0)


# Walking a config class --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SettingField:
    name: str
    flag: str
    dest: str
    kind: Any  # the field's type, Optional unwrapped
    default: Any
    meta: Setting


def _fields(config: type) -> Iterator[SettingField | tuple[str, type]]:
    """Every setting of a config class, and (name, class) for each nested config."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if "nested" in f.metadata:
            yield f.name, f.metadata["nested"]
        elif "setting" in f.metadata:
            meta: Setting = f.metadata["setting"]
            flag = meta.flag or "--" + f.name.replace("_", "-")
            kind = _unwrap_optional(hints[f.name])
            yield SettingField(f.name, flag, flag[2:].replace("-", "_"), kind, f.default, meta)


def settings_of(config: type) -> Iterator[SettingField]:
    """Every setting of a config class, nested ones included."""
    for item in _fields(config):
        if isinstance(item, SettingField):
            yield item
        else:
            yield from settings_of(item[1])


def _unwrap_optional(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return kind


def choices(kind: Any) -> tuple[Any, ...] | None:
    """The values a Literal type, or a union of Literals, allows; None for any other type."""
    if typing.get_origin(kind) is Literal:
        return typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        parts = [choices(arg) for arg in typing.get_args(kind)]
        if all(part is not None for part in parts):
            return tuple(value for part in parts for value in part)  # type: ignore[union-attr]
    return None


def check_settings(config: object) -> None:
    """Check every setting of a config against its choices and check; raise ValueError naming the flag."""
    for field in _fields(type(config)):
        if not isinstance(field, SettingField):
            continue
        value = getattr(config, field.name)
        allowed = choices(field.kind)
        if value is None:
            continue
        if allowed is not None and value not in allowed:
            raise ValueError(f"{field.flag} must be one of {', '.join(map(str, allowed))}, got {value!r}")
        problem = field.meta.check(value) if field.meta.check else None
        if problem:
            raise ValueError(f"{field.flag} {problem}")


# The command line --------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, config: type, skip: frozenset[str] = frozenset()) -> None:
    """A flag for every setting of config, except the flags in skip; a flag already declared (a setting
    that several configs share) is left as it is."""
    declared = {option for action in parser._actions for option in action.option_strings}
    for field in settings_of(config):
        if field.flag in skip or field.flag in declared:
            continue
        parser.add_argument(field.flag, dest=field.dest, default=argparse.SUPPRESS, **_argument(field))


def _argument(field: SettingField) -> dict[str, Any]:
    meta = field.meta
    help_text = meta.help
    shown = meta.shown_default
    if shown is None and field.default not in (None, ()):
        shown = ("on" if field.default else "off") if field.kind is bool else str(field.default)
    if shown is not None:
        help_text += f" (default: {shown})"
    if meta.env:
        help_text += f"; ${meta.env} when not given"
    kwargs: dict[str, Any] = {"help": help_text}
    if meta.metavar:
        kwargs["metavar"] = meta.metavar
    allowed = choices(field.kind)
    if field.kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(field.kind) is tuple:
        kwargs["action"] = "append"
    elif meta.convert is not None:
        pass  # text, converted by from_args
    elif allowed is not None:
        kwargs["choices"], kwargs["type"] = allowed, type(allowed[0])
    else:
        kwargs["type"] = field.kind
    return kwargs


def from_args(config: type[T], args: argparse.Namespace) -> T:
    """The config that the parsed flags describe, with its defaults for the flags not given.

    Raises ValueError (or OSError, from reading a file) with a message fit for a usage error.
    """
    values: dict[str, Any] = {}
    for item in _fields(config):
        if not isinstance(item, SettingField):
            values[item[0]] = from_args(item[1], args)
            continue
        if hasattr(args, item.dest):
            raw = getattr(args, item.dest)
            if item.meta.convert is not None:
                try:
                    raw = item.meta.convert(raw)
                except (ValueError, OSError) as error:
                    raise ValueError(f"{item.flag}: {error}") from None
            values[item.name] = tuple(raw) if typing.get_origin(item.kind) is tuple else raw
        elif item.meta.env and os.environ.get(item.meta.env):
            values[item.name] = os.environ[item.meta.env]
    return config(**values)


def given_flags(config: type, args: argparse.Namespace, skip: frozenset[str] = frozenset()) -> list[str]:
    """The flags of config's settings (but those in skip) given on this command line, as arguments for
    another process."""
    out: list[str] = []
    for field in settings_of(config):
        if field.flag in skip or not hasattr(args, field.dest):
            continue
        value = getattr(args, field.dest)
        if field.kind is bool:
            out.append(field.flag if value else "--no-" + field.flag[2:])
        elif isinstance(value, list):
            out += [arg for item in value for arg in (field.flag, str(item))]
        else:
            out += [field.flag, str(value)]
    return out


def configure(parser: argparse.ArgumentParser, config: type[T], args: argparse.Namespace) -> T:
    """from_args, with a bad value told as the parser's usage error (exit status 2), not a traceback."""
    try:
        return from_args(config, args)
    except (ValueError, OSError) as error:  # a value out of range, an unreadable secret file
        parser.error(str(error))
