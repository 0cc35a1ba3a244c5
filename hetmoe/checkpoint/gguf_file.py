"""A GGUF reader: the header parsed and checked here; tensors handed out as their raw blocks.

Tensors come back as their stored bytes, ``uint8 [..., row_bytes]`` over the logical shape's
leading dims (GGUF lists dims fastest-first; the logical shape here is torch order, ``[.., N, K]``),
memory-mapped copy-on-write; ``hetmoe.formats`` decodes them. The header (metadata, tensor infos)
is parsed in one pass over the map in which every length and count is checked against the bytes
left, so a corrupt or hostile file is an error naming it, never a long loop or an exception from
deep inside a parser. The ``gguf`` package is the reference this parser is tested against
(tests/test_gguf_file.py); it is not used here because it builds numpy views of every value in
Python: 4.3 s for a DeepSeek-V2-Lite GGUF's 102k-token vocabulary, against ~20 ms here.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError
from .safetensors_file import TensorInfo, drop_mapped_pages, read_ahead

GGUF_MAGIC = b"GGUF"
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MIN_KV_BYTES = 8 + 4  # key length, value type
_DEFAULT_ALIGNMENT = 32  # general.alignment when absent

# GGUF metadata value types (gguf.GGUFValueType): the struct codes of the fixed-size ones
_STRING, _ARRAY = 8, 9
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_FIXED_BYTES = {k: struct.calcsize(v) for k, v in _FIXED.items()}
_MAX_DIMS = 4  # GGML_MAX_DIMS
_SHORT_ARRAY = 16  # arrays up to this long are kept as values (metadata); longer ones (vocabularies) skipped
_SKIPPED = object()  # a value not kept: a long array, or a string that is not UTF-8


@functools.cache
def _ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, weights a block, bytes a block), from the gguf package's table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    type_name: str  # the ggml type's name: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # torch order
    offset: int  # of its first byte in the file
    n_bytes: int


class _Header:
    """One pass over a GGUF header in ``mm``: ``fields`` (key -> value) and ``tensors`` in file order."""

    def __init__(self, path: Path, mm: mmap.mmap, size: int, n_tensors: int, n_kv: int) -> None:
        self.path, self.mm, self.size, self.at = path, mm, size, 24
        self.fields: dict[str, Any] = {}
        for k in range(n_kv):
            key = self.string(f"metadata key {k}")
            if not isinstance(key, str):
                raise self.fail(f"metadata key {k} is not UTF-8 text")
            self.fields[key] = self.value(self.u32(f"the type of {key!r}"), f"metadata {key!r}")
        infos = []
        for t in range(n_tensors):
            name = self.string(f"tensor info {t}'s name")
            if not isinstance(name, str):
                raise self.fail(f"tensor info {t}'s name is not UTF-8 text")
            n_dims = self.u32(f"tensor {name!r}'s dimension count")
            if n_dims > _MAX_DIMS:
                raise self.fail(f"tensor {name!r} has {n_dims} dimensions, GGUF allows at most {_MAX_DIMS}")
            start = self.take(8 * n_dims + 12, f"tensor {name!r}'s dims, type and offset")
            *dims, kind, offset = struct.unpack_from(f"<{n_dims}QIQ", mm, start)
            infos.append((name, dims, kind, offset))
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & 7:
            raise self.fail(f"general.alignment must be a positive multiple of 8, found {alignment!r}")
        data_start = -(-self.at // alignment) * alignment
        types = _ggml_types()
        self.tensors: dict[str, _Tensor] = {}
        for name, dims, kind, offset in infos:
            if kind not in types:
                raise self.fail(f"tensor {name!r} has ggml type {kind}, which is not one this reader knows")
            type_name, block, block_bytes = types[kind]
            if not dims or dims[0] % block:
                raise self.fail(f"tensor {name!r}: {type_name} rows of {dims[:1]} weights, not whole blocks of {block}")
            n_bytes = math.prod(dims) // block * block_bytes
            begin = data_start + offset
            if begin + n_bytes > size:
                raise CheckpointError(
                    path, f"truncated: tensor {name!r} needs bytes {begin}..{begin + n_bytes}, the file has {size}"
                )
            if name in self.tensors:
                raise self.fail(f"tensor {name!r} is listed twice")
            self.tensors[name] = _Tensor(name, type_name, tuple(int(d) for d in reversed(dims)), begin, n_bytes)

    def fail(self, problem: str) -> CheckpointError:
        return CheckpointError(self.path, f"corrupt header: {problem}")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.at + n > self.size:
            raise self.fail(f"{what} needs {n} bytes at offset {self.at}, the file has {self.size}")
        start, self.at = self.at, self.at + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.mm, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.mm, self.take(8, what))[0]

    def string(self, what: str) -> Any:
        n = self.u64(f"the length of {what}")
        start = self.take(n, f"{what} ({n} bytes)")
        try:
            return self.mm[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            return _SKIPPED

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _FIXED:
            return struct.unpack_from("<" + _FIXED[kind], self.mm, self.take(_FIXED_BYTES[kind], what))[0]
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise self.fail(f"{what}: unknown value type {kind}")
        if depth >= 2:
            raise self.fail(f"{what}: arrays nested more than two deep")
        item, count = self.u32(f"{what}'s item type"), self.u64(f"{what}'s length")
        smallest = _FIXED_BYTES.get(item, 8)  # a string or an array takes at least its 8-byte length
        if count * smallest > self.size - self.at:
            raise self.fail(f"{what}: an array of {count} items cannot fit in the {self.size - self.at} bytes left")
        if item in _FIXED:
            start = self.take(count * smallest, what)
            if count > _SHORT_ARRAY:
                return _SKIPPED
            return list(struct.unpack_from(f"<{count}{_FIXED[item]}", self.mm, start))
        if item == _STRING and count > _SHORT_ARRAY:  # a vocabulary: 10^5 strings, walked lean
            pos, size, mm = self.at, self.size, self.mm
            for i in range(count):
                if pos + 8 > size or (pos := pos + 8 + struct.unpack_from("<Q", mm, pos)[0]) > size:
                    raise self.fail(f"{what}[{i}] runs past the end of the file ({size} bytes)")
            self.at = pos
            return _SKIPPED
        items = [self.value(item, f"{what}[{i}]", depth + 1) for i in range(count)]
        return _SKIPPED if count > _SHORT_ARRAY or any(v is _SKIPPED for v in items) else items


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(24)
                # private (copy-on-write) pages: torch wants writable arrays, and nothing reaches the file
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size >= 24 else None
        except OSError as exc:
            raise CheckpointError(self.path, f"cannot open: {exc.strerror}") from None
        if len(head) < 24 or self._map is None:
            raise CheckpointError(self.path, f"truncated: {size} bytes, a GGUF header needs 24")
        if head[:4] != GGUF_MAGIC:
            raise CheckpointError(self.path, f"bad magic: expected {GGUF_MAGIC!r}, found {head[:4]!r}; not a GGUF file")
        version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
        if version not in (2, 3):
            raise CheckpointError(self.path, f"unsupported GGUF version {version} (expected 2 or 3)")
        if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > size:
            raise CheckpointError(
                self.path, f"corrupt header: {n_tensors} tensors and {n_kv} metadata keys cannot fit in {size} bytes"
            )
        header = _Header(self.path, self._map, size, n_tensors, n_kv)
        self._fields = header.fields
        self._tensors = header.tensors
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    @property
    def metadata(self) -> dict[str, object]:
        """Scalar and string metadata fields, and arrays of up to 16 of them (vocabularies are left out)."""
        return {k: v for k, v in self._fields.items() if v is not _SKIPPED}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        t = self._tensor(name)
        return TensorInfo(name, t.type_name, t.shape, t.n_bytes, self.path)

    def get(self, name: str) -> torch.Tensor:
        """Raw stored bytes ``uint8 [*shape[:-1], row_bytes]`` (a view of the file)."""
        t = self._tensor(name)
        raw = self._bytes[t.offset : t.offset + t.n_bytes].reshape(*t.shape[:-1], -1)
        return torch.from_numpy(raw)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's memory, for a reader that copied it (a dense
        weight the engine runs from huge pages) and will not read the mapped bytes again; they re-read
        from the file if touched. Only for tensors nobody wrote to (``drop_mapped_pages``)."""
        t = self._tensors.get(name)
        if t is not None:
            drop_mapped_pages(self._map, t.offset, t.n_bytes)

    def prefetch(self, name: str) -> None:
        """Start reading the tensor's bytes into the page cache (``read_ahead``; call it from a thread
        to overlap the disk with work on the tensors before it)."""
        t = self._tensors.get(name)
        if t is not None:
            read_ahead(self.path, t.offset, t.n_bytes)

    def _tensor(self, name: str) -> _Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(self.path, f"no tensor named {name!r}") from None
