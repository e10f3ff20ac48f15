"""The resource usage of each function in a cubin, read from the cubin itself: no GPU, no CUDA tools.

A cubin is a little-endian ELF64 file. Besides the code (`.text.<function>`) it carries the attributes
that the driver needs to launch each kernel, as the records that `cuobjdump -elf` shows under the names
EIATTR_*. They sit in two kinds of sections:

- `.nv.info`, one per cubin: per-function records whose value names the function by its index in
  `.symtab`, then a u32: EIATTR_REGCOUNT (registers per thread), EIATTR_FRAME_SIZE (bytes of stack frame
  per thread: where ptxas puts spilled registers and arrays it cannot keep in registers),
  EIATTR_MIN_STACK_SIZE (the frame plus those of the functions it calls, when ptxas can bound them) and,
  in relocatable code, EIATTR_MAX_STACK_SIZE.
- `.nv.info.<kernel>`, one per kernel: records about that kernel alone, such as EIATTR_MAXREG_COUNT (the
  register cap it was compiled under), EIATTR_NUM_BARRIERS, EIATTR_CRS_STACK_SIZE, its parameters.

Every record starts with a format byte and an attribute byte; what follows depends on the format:

| format | name | value | record size |
|---|---|---|---|
| 0x01 | EIFMT_NVAL | none | 4 bytes: the header and two bytes of padding |
| 0x02 | EIFMT_BVAL | u8 | 4 bytes: the header, the value and one byte of padding |
| 0x03 | EIFMT_HVAL | u16, little-endian | 4 bytes |
| 0x04 | EIFMT_SVAL | a u16 size, then that many bytes | 4 + size bytes |

Checked against `cuobjdump -elf` and `--dump-resource-usage` (CUDA 13) and ptxas's `-v` report on cubins
from NVRTC 12.9 (ELF ABI 7) and nvcc 13.0 (ELF ABI 8): tests/kernels/test_resources.py.

Other per-kernel sizes come from the sizes of sections named after the kernel: `.nv.shared.<kernel>`
(static shared memory; an sm_90 cubin counts the 1 KiB the system reserves, as cuobjdump's SHARED column
does and ptxas's "bytes smem" does not), `.nv.local.<kernel>` and `.nv.constant0.<kernel>` (the parameter
bank). The number of named barriers is EIATTR_NUM_BARRIERS where the cubin has it (ABI 8) and bits 20-26
of the `.text.<kernel>` section's flags otherwise (ABI 7).

A function whose frame size is 0 keeps everything in registers: a spill needs a stack frame to go to. One
exception: a recursive device function's stack cannot be bounded, so its spills go to the stack the driver
sizes at run time (cudaLimitStackSize) and its frame size says 0 (nvcc 13.0: a recursive `fib` with 20
bytes of spill stores). The frame sizes of functions that are not recursive count their spills.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

ELF_MAGIC = b"\x7fELF"
_SHT_SYMTAB = 2
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10  # st_other of a kernel's symbol: an entry point, not a device function
_SHF_BARRIERS_SHIFT, _SHF_BARRIERS_MASK = 20, 0x7F  # ABI 7: a kernel's barriers, in its .text's flags


class Format(enum.IntEnum):
    NVAL = 0x01
    BVAL = 0x02
    HVAL = 0x03
    SVAL = 0x04


class Attr(enum.IntEnum):
    """The EIATTR codes this module reads or names (as `cuobjdump -elf` spells them, less EIATTR_)."""

    MAX_THREADS = 0x05
    PARAM_CBANK = 0x0A
    FRAME_SIZE = 0x11
    MIN_STACK_SIZE = 0x12
    KPARAM_INFO = 0x17
    CBANK_PARAM_SIZE = 0x19
    MAXREG_COUNT = 0x1B
    EXIT_INSTR_OFFSETS = 0x1C
    CRS_STACK_SIZE = 0x1E
    MAX_STACK_SIZE = 0x23
    COOP_GROUP_INSTR_OFFSETS = 0x28
    COOP_GROUP_MASK_REGIDS = 0x29
    REGCOUNT = 0x2F
    SW_WAR = 0x36
    CUDA_API_VERSION = 0x37
    NUM_BARRIERS = 0x4C
    SPARSE_MMA_MASK = 0x50
    ANNOTATIONS = 0x55


class CubinError(ValueError):
    """The bytes are not a cubin this module can read."""


@dataclass(frozen=True)
class Record:
    """One EIATTR record: its attribute code, its format, and its value (an int, bytes for SVAL, None)."""

    attr: int
    fmt: int
    value: int | bytes | None

    @property
    def name(self) -> str:
        return Attr(self.attr).name if self.attr in Attr._value2member_map_ else f"0x{self.attr:02x}"


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int
    info: int


@dataclass
class FunctionResources:
    """What one function of a cubin uses, per thread unless said otherwise. None: the cubin does not say."""

    name: str
    kernel: bool  # an entry point (__global__); False for a device function called by kernels
    registers: int | None = None  # EIATTR_REGCOUNT
    frame_size: int | None = None  # EIATTR_FRAME_SIZE, bytes: spills and arrays not kept in registers
    min_stack_size: int | None = None  # EIATTR_MIN_STACK_SIZE, bytes: the frame and its callees'
    max_stack_size: int | None = None  # EIATTR_MAX_STACK_SIZE, bytes (relocatable code)
    crs_stack_size: int | None = None  # EIATTR_CRS_STACK_SIZE, bytes
    max_registers: int | None = None  # EIATTR_MAXREG_COUNT: the cap ptxas compiled the kernel under
    barriers: int = 0  # named barriers (bar.sync ids) the kernel uses
    shared_bytes: int = 0  # static shared memory per block: the size of .nv.shared.<name>
    local_bytes: int = 0  # the size of .nv.local.<name>
    constant0_bytes: int = 0  # the parameter bank: the size of .nv.constant0.<name>
    records: list[Record] = field(default_factory=list)  # the kernel's own .nv.info.<name>, in order


def parse_records(data: bytes) -> list[Record]:
    """The EIATTR records of one .nv.info section's bytes. Raises CubinError on a format it does not know
    or a record that runs past the end."""
    records: list[Record] = []
    at = 0
    while at < len(data):
        if at + 4 > len(data):
            raise CubinError(f"a truncated attribute record at byte {at} of {len(data)}")
        fmt, attr = data[at], data[at + 1]
        value: int | bytes | None
        if fmt == Format.NVAL:
            value, size = None, 4
        elif fmt == Format.BVAL:
            value, size = data[at + 2], 4
        elif fmt == Format.HVAL:
            (value,) = struct.unpack_from("<H", data, at + 2)
            size = 4
        elif fmt == Format.SVAL:
            (length,) = struct.unpack_from("<H", data, at + 2)
            if at + 4 + length > len(data):
                raise CubinError(f"attribute 0x{attr:02x} at byte {at} runs past the section's end")
            value, size = bytes(data[at + 4 : at + 4 + length]), 4 + length
        else:
            raise CubinError(f"unknown attribute format 0x{fmt:02x} (attribute 0x{attr:02x}) at byte {at}")
        records.append(Record(attr, fmt, value))
        at += size
    return records


def read_sections(cubin: bytes) -> list[Section]:
    """The section headers of an ELF64 little-endian file, with their names."""
    if cubin[:4] != ELF_MAGIC:
        raise CubinError("not an ELF file")
    if cubin[4] != 2 or cubin[5] != 1:
        raise CubinError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    if shoff + shnum * shentsize > len(cubin) or shstrndx >= shnum:
        raise CubinError("the section header table runs past the file's end")
    raw = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = raw[shstrndx][4]
    return [
        Section(_string(cubin, names_at + name), kind, flags, offset, size, link, info)
        for name, kind, flags, _addr, offset, size, link, info, _align, _entsize in raw
    ]


def read_resources(cubin: bytes) -> dict[str, FunctionResources]:
    """Each function's resource usage, by symbol name: every kernel, and every device function that
    .nv.info has a record for (ptxas's internal subroutines such as `$__internal_0_$__cuda_sm20_div_s64`
    included)."""
    sections = read_sections(cubin)
    by_name = {section.name: section for section in sections}
    symbols = _symbols(cubin, sections)
    functions: dict[str, FunctionResources] = {
        name: FunctionResources(name, kernel=True) for name, kernel in symbols if kernel
    }

    def entry(index: int) -> FunctionResources:
        if index >= len(symbols):
            raise CubinError(f".nv.info names symbol {index}, but .symtab has {len(symbols)}")
        name, kernel = symbols[index]
        return functions.setdefault(name, FunctionResources(name, kernel=kernel))

    if ".nv.info" in by_name:
        per_function = {
            Attr.REGCOUNT: "registers",
            Attr.FRAME_SIZE: "frame_size",
            Attr.MIN_STACK_SIZE: "min_stack_size",
            Attr.MAX_STACK_SIZE: "max_stack_size",
        }
        for record in parse_records(_contents(cubin, by_name[".nv.info"])):
            if record.attr in per_function and isinstance(record.value, bytes) and len(record.value) == 8:
                symbol, number = struct.unpack("<II", record.value)
                setattr(entry(symbol), per_function[Attr(record.attr)], number)

    for function in functions.values():
        name = function.name
        if (info := by_name.get(f".nv.info.{name}")) is not None:
            function.records = parse_records(_contents(cubin, info))
            for record in function.records:
                if record.attr == Attr.MAXREG_COUNT and isinstance(record.value, int):
                    function.max_registers = record.value
                elif record.attr == Attr.NUM_BARRIERS and isinstance(record.value, int):
                    function.barriers = record.value
                elif record.attr == Attr.CRS_STACK_SIZE and isinstance(record.value, bytes):
                    (function.crs_stack_size,) = struct.unpack_from("<I", record.value)
        has_num_barriers = any(record.attr == Attr.NUM_BARRIERS for record in function.records)
        if not has_num_barriers and (text := by_name.get(f".text.{name}")) is not None:
            function.barriers = (text.flags >> _SHF_BARRIERS_SHIFT) & _SHF_BARRIERS_MASK
        function.shared_bytes = _size(by_name, f".nv.shared.{name}")
        function.local_bytes = _size(by_name, f".nv.local.{name}")
        function.constant0_bytes = _size(by_name, f".nv.constant0.{name}")
    return functions


def kernels(cubin: bytes) -> dict[str, FunctionResources]:
    """The entry points' resource usage only."""
    return {name: usage for name, usage in read_resources(cubin).items() if usage.kernel}


def _symbols(cubin: bytes, sections: list[Section]) -> list[tuple[str, bool]]:
    """Every symbol of .symtab, by index: its name and whether it is a kernel."""
    symtab = next((s for s in sections if s.type == _SHT_SYMTAB), None)
    if symtab is None:
        raise CubinError("no .symtab")
    if symtab.link >= len(sections) or symtab.offset + symtab.size > len(cubin):
        raise CubinError(".symtab runs past the file's end")
    strings = sections[symtab.link].offset
    symbols: list[tuple[str, bool]] = []
    for index in range(symtab.size // 24):
        name_at, info, other, _shndx, _value, _size = struct.unpack_from(
            "<IBBHQQ", cubin, symtab.offset + index * 24
        )
        kernel = info & 0xF == _STT_FUNC and bool(other & _STO_CUDA_ENTRY)
        symbols.append((_string(cubin, strings + name_at), kernel))
    return symbols


def _contents(cubin: bytes, section: Section) -> bytes:
    if section.offset + section.size > len(cubin):
        raise CubinError(f"{section.name} runs past the file's end")
    return cubin[section.offset : section.offset + section.size]


def _size(by_name: dict[str, Section], name: str) -> int:
    section = by_name.get(name)
    return section.size if section is not None else 0


def _string(cubin: bytes, at: int) -> str:
    end = cubin.find(b"\0", at)
    if end < 0:
        raise CubinError(f"a string at byte {at} has no end")
    return cubin[at:end].decode(errors="replace")
