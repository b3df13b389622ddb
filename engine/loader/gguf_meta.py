"""A GGUF file's metadata and tensor table, read without the ``gguf`` package's full parse.

``gguf.GGUFReader`` builds numpy views of every metadata item, the tokenizer's ~100K strings
included: ≈ 3 s for SmolLM2 on the build machine, paid by every process that resolves the model
(driver checks, ingress, each instance and rank), and far more on a loaded machine. The model's
config needs only the scalar fields and the tensor table, so this reads the header sequentially and
skips array contents (their lengths are kept). Layout (little-endian, versions 2 and 3)::

    "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count × ( string key | u32 value_type | value )         string = u64 length + UTF-8 bytes
                 value of ARRAY = u32 item_type | u64 count | count × item
    tensor_count × ( string name | u32 n_dims | n_dims × u64 | u32 type | u64 offset )
    padding to ``general.alignment`` (default 32) | tensor data (offsets are relative to its start)
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# value types: struct format of the fixed-size ones (STRING = 8, ARRAY = 9 are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader parses (the full reader then says what is wrong)."""


@dataclass(frozen=True)
class ArrayField:
    """An array-valued metadata item: its length only (the contents are skipped)."""

    item_type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: where its bytes are (absolute file offset) and how to read them."""

    name: str
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    type_id: int  # ggml type (gguf.GGMLQuantizationType)
    offset: int  # absolute byte offset of the tensor's data in the file


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, Any]  # key -> int / float / bool / str, or ArrayField
    tensor_names: frozenset[str]
    tensors: tuple[TensorInfo, ...] = ()  # empty where the full reader parsed the header

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("truncated header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFFormatError("truncated header")
        self.pos += n

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[item]))
            elif item == _STRING:
                for _ in range(count):
                    self.skip(self.unpack("<Q"))
            else:  # arrays of arrays: rare in model files; the full reader handles them
                raise GGUFFormatError(f"array of value type {item}")
            return ArrayField(item, count)
        raise GGUFFormatError(f"unknown value type {vtype}")


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor names of GGUF file ``path``; ``GGUFFormatError`` where this reader
    does not parse it (bad magic, big-endian, unknown version or type, truncated)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:  # magic, version and the two counts
            raise GGUFFormatError("shorter than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse_buffer(mm)


def _parse_buffer(mm: mmap.mmap) -> GGUFHeader:
    buf = memoryview(mm)
    try:
        return _parse(_Cursor(buf))
    finally:
        buf.release()


def _parse(c: _Cursor) -> GGUFHeader:
    if bytes(c.buf[:4]) != b"GGUF":
        raise GGUFFormatError("bad magic")
    c.skip(4)
    version = c.unpack("<I")
    if version not in (2, 3):  # a byte-swapped (big-endian) file reads as a huge version
        raise GGUFFormatError(f"version {version}")
    tensors, kvs = c.unpack("<Q"), c.unpack("<Q")
    fields = {}
    for _ in range(kvs):
        key = c.string()
        fields[key] = c.value(c.unpack("<I"))
    table = []
    for _ in range(tensors):
        name = c.string()
        dims = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
        table.append((name, dims, c.unpack("<I"), c.unpack("<Q")))
    align = fields.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFFormatError(f"general.alignment {align!r} is not a power of two")
    data = -(-c.pos // align) * align
    infos = tuple(TensorInfo(n, d, t, data + off) for n, d, t, off in table)
    return GGUFHeader(fields, frozenset(n for n, *_ in table), infos)
