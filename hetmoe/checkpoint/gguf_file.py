"""A GGUF reader: the ``gguf`` package parses the file; hetmoe checks it and hands out raw blocks.

Tensors come back as their stored bytes, ``uint8 [..., row_bytes]`` over the logical shape's
leading dims (GGUF lists dims fastest-first; the logical shape here is torch order, ``[.., N, K]``),
memory-mapped; ``hetmoe.formats`` decodes them. Before the ``gguf`` package sees the file we check
the magic and that the declared counts can fit in the file, so a corrupt or hostile file is an
error naming it rather than a long loop or a numpy exception from deep inside the parser.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError
from .safetensors_file import TensorInfo

GGUF_MAGIC = b"GGUF"
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MIN_KV_BYTES = 8 + 4  # key length, value type


# GGUF metadata value types (gguf.GGUFValueType) and the bytes of the fixed-size ones
_STRING, _ARRAY = 8, 9
_FIXED_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_MAX_DIMS = 4  # GGML_MAX_DIMS


def _walk_header(path: Path, size: int, n_tensors: int, n_kv: int) -> None:
    """Every metadata value and tensor info of the header bounded by the file, before ``gguf`` parses it.

    The ``gguf`` package loops over an array's declared element count in Python, so a flipped byte in
    a count (an array of 2^40 strings in a 4 KB file) would keep it busy for hours; here every length
    and count is checked against the bytes left, and each step consumes at least one byte, so the walk
    ends within the header's size.
    """

    def fail(problem: str) -> CheckpointError:
        return CheckpointError(path, f"corrupt header: {problem}")

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        at = 24

        def take(n: int, what: str) -> int:
            nonlocal at
            if n < 0 or at + n > size:
                raise fail(f"{what} needs {n} bytes at offset {at}, the file has {size}")
            start, at = at, at + n
            return start

        def u64(what: str) -> int:
            return struct.unpack_from("<Q", mm, take(8, what))[0]

        def u32(what: str) -> int:
            return struct.unpack_from("<I", mm, take(4, what))[0]

        def string(what: str) -> bytes:
            n = u64(f"the length of {what}")
            start = take(n, f"{what} ({n} bytes)")
            return mm[start : start + n]

        def value(kind: int, what: str, depth: int = 0) -> None:
            nonlocal at
            if kind in _FIXED_BYTES:
                take(_FIXED_BYTES[kind], what)
            elif kind == _STRING:
                string(what)
            elif kind == _ARRAY:
                if depth >= 2:
                    raise fail(f"{what}: arrays nested more than two deep")
                item, count = u32(f"{what}'s item type"), u64(f"{what}'s length")
                smallest = _FIXED_BYTES.get(item, 8)  # a string or an array takes at least its 8-byte length
                if count * smallest > size - at:
                    raise fail(f"{what}: an array of {count} items cannot fit in the {size - at} bytes left")
                if item in _FIXED_BYTES:
                    take(count * smallest, what)
                elif item == _STRING:  # a vocabulary: 10^5 strings, so the loop is kept lean
                    pos = at
                    for i in range(count):
                        if pos + 8 > size or (pos := pos + 8 + struct.unpack_from("<Q", mm, pos)[0]) > size:
                            raise fail(f"{what}[{i}] runs past the end of the file ({size} bytes)")
                    at = pos
                else:
                    for i in range(count):
                        value(item, f"{what}[{i}]", depth + 1)
            else:
                raise fail(f"{what}: unknown value type {kind}")

        for k in range(n_kv):
            key = string(f"metadata key {k}").decode("utf-8", "replace")
            value(u32(f"the type of {key!r}"), f"metadata {key!r}")
        for t in range(n_tensors):
            name = string(f"tensor info {t}'s name").decode("utf-8", "replace")
            n_dims = u32(f"tensor {name!r}'s dimension count")
            if n_dims > _MAX_DIMS:
                raise fail(f"tensor {name!r} has {n_dims} dimensions, GGUF allows at most {_MAX_DIMS}")
            take(8 * n_dims + 4 + 8, f"tensor {name!r}'s dims, type and offset")


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(24)
        except OSError as exc:
            raise CheckpointError(self.path, f"cannot open: {exc.strerror}") from None
        if len(head) < 24:
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
        _walk_header(self.path, size, n_tensors, n_kv)
        try:
            self._reader = gguf.GGUFReader(self.path, "c")  # copy-on-write: torch wants writable arrays
        except Exception as exc:  # the parser raises ValueError, IndexError, ... on corrupt input
            raise CheckpointError(self.path, f"corrupt or truncated GGUF: {type(exc).__name__}: {exc}") from None
        self._tensors = {}
        for t in self._reader.tensors:
            if t.data.nbytes != t.n_bytes or t.data_offset + t.n_bytes > size:
                raise CheckpointError(
                    self.path,
                    f"truncated: tensor {t.name!r} needs bytes {t.data_offset}..{t.data_offset + t.n_bytes}, "
                    f"the file has {size}",
                )
            self._tensors[t.name] = t

    @property
    def metadata(self) -> dict[str, object]:
        """Scalar and string metadata fields (arrays other than short ones are left out)."""
        out: dict[str, object] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                value = field.contents()
            except Exception:  # an exotic field type the reader cannot render: not needed here
                continue
            if isinstance(value, list) and len(value) > 16:
                continue
            out[key] = value
        return out

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        t = self._tensor(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return TensorInfo(name, t.tensor_type.name, shape, int(t.n_bytes), self.path)

    def get(self, name: str) -> torch.Tensor:
        """Raw stored bytes ``uint8 [*shape[:-1], row_bytes]`` (a view of the file)."""
        t = self._tensor(name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        raw = np.asarray(t.data).view(np.uint8).reshape(*shape[:-1], -1)
        return torch.from_numpy(raw)

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(self.path, f"no tensor named {name!r}") from None
