"""Byte sizes on the command line: "512MiB", "8GiB", "1.5GB" or a plain number of bytes."""

from __future__ import annotations

import os
import re

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size; write e.g. 4096, 512MiB or 8GiB")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def physical_memory_bytes() -> int:
    """This machine's memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
