"""A memory-mapped safetensors reader that validates the header before trusting it.

The format: an 8-byte little-endian header length, a JSON header mapping tensor names to
``{dtype, shape, data_offsets: [begin, end]}`` (offsets relative to the end of the header), then
the data. Every field is checked (known dtype, non-negative shape, offsets inside the file and
consistent with dtype x shape) so a truncated or hostile file gives an error naming the file and the
tensor, never a crash or a tensor read from the wrong bytes. Nothing is read before it is asked
for: tensors are views into a private (copy-on-write) memory map.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's own limit
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; Python names it from 3.12


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype | str  # a torch dtype, or a ggml type name such as "Q4_K" for GGUF blocks
    shape: tuple[int, ...]  # logical shape (for GGUF blocks: of the dequantized tensor)
    nbytes: int
    file: Path


def read_ahead(path: Path, start: int, nbytes: int) -> None:
    """Have the kernel read ``nbytes`` of ``path`` from ``start`` into the page cache
    (POSIX_FADV_WILLNEED). It returns once the reads are issued, without holding the GIL; a no-op
    where the OS has no posix_fadvise."""
    if nbytes <= 0 or not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def drop_mapped_pages(mapping: mmap.mmap | None, start: int, nbytes: int) -> None:
    """Drop the pages of ``mapping`` that ``[start, start + nbytes)`` covers entirely from this
    process's memory (MADV_DONTNEED; a private file mapping's pages re-read from the file if touched
    again, so neighbours sharing a partial page are unaffected). Only for bytes nobody wrote to: a
    copy-on-write page would lose the writes. A no-op where madvise is missing."""
    if mapping is None or not hasattr(mapping, "madvise"):
        return
    page = mmap.PAGESIZE
    first = -(-start // page) * page
    last = (start + nbytes) // page * page
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


class SafetensorsFile:
    """One ``.safetensors`` file: ``keys()``, ``info(name)``, ``get(name)``, ``metadata``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise CheckpointError(self.path, f"cannot open: {exc.strerror}") from None
        if size < 8:
            raise CheckpointError(
                self.path, f"truncated: {size} bytes, a safetensors file starts with an 8-byte length"
            )
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > MAX_HEADER_BYTES or header_len > size - 8:
                raise CheckpointError(
                    self.path,
                    f"corrupt or truncated header: it claims {header_len} bytes, "
                    f"the file has {size - 8} after the length",
                )
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(self.path, f"corrupt header: not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(self.path, f"corrupt header: expected a JSON object, found {type(header).__name__}")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        data_len = size - self._data_start
        self._infos: dict[str, tuple[TensorInfo, int]] = {}
        for name, entry in header.items():
            self._infos[name] = (self._check_entry(name, entry, data_len), self._data_start + entry["data_offsets"][0])
        self._map: mmap.mmap | None = None
        self._map_lock = threading.Lock()

    def _check_entry(self, name: str, entry: Any, data_len: int) -> TensorInfo:
        where = f"tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(self.path, f"corrupt header: {where} lacks dtype/shape/data_offsets")
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(self.path, f"{where}: unknown dtype {entry['dtype']!r}; known: {sorted(DTYPES)}")
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(self.path, f"{where}: shape must be a list of non-negative ints, found {shape!r}")
        offsets = entry["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(self.path, f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offsets[1] - offsets[0] != nbytes:
            raise CheckpointError(
                self.path,
                f"{where}: {entry['dtype']} {shape} needs {nbytes} bytes, data_offsets span {offsets[1] - offsets[0]}",
            )
        if offsets[1] > data_len:
            raise CheckpointError(
                self.path,
                f"truncated: {where} ends at data byte {offsets[1]}, the file holds only {data_len} bytes of data",
            )
        return TensorInfo(name, dtype, tuple(shape), nbytes, self.path)

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name][0]
        except KeyError:
            raise CheckpointError(self.path, f"no tensor named {name!r}") from None

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's memory (they re-read from the file if touched).

        For readers that copied a tensor (stacking per-expert weights) and will not read the mapped
        bytes again: without it the copy and the mapped pages would both count against RAM. Only the
        pages the tensor covers entirely are dropped, so neighbours are unaffected; a view of it that
        was written to (copy-on-write) would lose the writes, so only call it on tensors nobody
        modified.
        """
        entry = self._infos.get(name)
        if entry is not None:
            drop_mapped_pages(self._map, entry[1], entry[0].nbytes)

    def prefetch(self, name: str) -> None:
        """Have the kernel read the tensor's bytes into the page cache (POSIX_FADV_WILLNEED), so the
        reader finds them there. It returns once the reads are issued (for a large tensor that takes
        a while), without holding the GIL: call it from a thread to overlap the disk with work on
        the previous tensors. A no-op where the OS has no posix_fadvise."""
        entry = self._infos.get(name)
        if entry is not None:
            read_ahead(self.path, entry[1], entry[0].nbytes)

    def populate(self, name: str) -> None:
        """Read the tensor's bytes into this process's memory now: its pages mapped, read from the disk
        where the page cache lacks them (MADV_POPULATE_READ), without holding the GIL. For a model
        that keeps views of the file, so that its first forwards do not fault them in from the disk
        one page at a time. Where the kernel lacks it (before Linux 5.14), nothing: the pages then
        come in on first use."""
        entry = self._infos.get(name)
        if entry is None or entry[0].nbytes == 0:
            return
        info, start = entry
        self._mapped()
        if not hasattr(self._map, "madvise"):
            return
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):  # EINVAL: a kernel without it
            self._map.madvise(_MADV_POPULATE_READ, first, start + info.nbytes - first)

    def _mapped(self) -> None:
        with self._map_lock:  # the read-ahead thread and the reader may both be first
            if self._map is None:
                with open(self.path, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as a view of the file (copy-on-write: writing to it never touches the file)."""
        info, start = self._infos.get(name, (None, 0))
        if info is None:
            raise CheckpointError(self.path, f"no tensor named {name!r}")
        assert isinstance(info.dtype, torch.dtype)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        self._mapped()
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes, offset=start)
        return raw.view(info.dtype).reshape(info.shape)
