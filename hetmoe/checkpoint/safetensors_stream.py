"""Write safetensors shards one tensor at a time, memory bounded by the largest single tensor.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once. A quantizing
writer knows each output tensor's name, dtype and shape before it computes the data (the codec's
``tensor_specs``), so the layout of every shard can be fixed up front: the header is written
first, then each tensor lands at its offset as it is produced and is dropped. Within a file the
tensors are laid out widest element first, so every tensor starts at an offset aligned to its
element size (memory maps of the file can be viewed without copies) while the data stays
contiguous, as the format requires. Shards are cut in production order at ``max_bytes``, named
as transformers names them, and each file is written atomically (temporary name, fsync, rename).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .atomic import atomic_path, write_text_atomic
from .safetensors_file import DTYPE_NAMES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default "5GB"


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def plan_shards(tensors: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Split ``tensors`` (in production order) into shards of at most ``max_bytes`` (a bigger tensor alone)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards if shards[0] else []


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class ShardWriter:
    """One safetensors file being filled: ``write(name, tensor)`` for every planned tensor, any order."""

    def __init__(self, f: BinaryIO, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
        self._f = f
        self._planned = {t.name: t for t in tensors}
        if len(self._planned) != len(tensors):
            raise ValueError("duplicate tensor names in one shard")
        # Widest elements first: each tensor then starts aligned to its own element size.
        layout = sorted(tensors, key=lambda t: -t.itemsize)
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._offsets: dict[str, int] = {}
        for t in layout:
            end = offset + t.nbytes
            header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
            self._offsets[t.name] = offset
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors itself pads
        self._data_start = 8 + len(raw)
        self.data_bytes = offset
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(self._data_start + offset)
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        planned = self._planned.get(name)
        if planned is None:
            raise ValueError(f"{name}: not planned for this shard")
        if tensor.dtype != planned.dtype or tuple(tensor.shape) != planned.shape:
            raise ValueError(
                f"{name}: planned {planned.dtype} {list(planned.shape)}, produced {tensor.dtype} {list(tensor.shape)}"
            )
        if name in self._written:
            raise ValueError(f"{name}: written twice")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.seek(self._data_start + self._offsets[name])
        self._f.write(memoryview(data))
        self._written.add(name)

    def missing(self) -> list[str]:
        return [n for n in self._planned if n not in self._written]


@contextmanager
def open_shard(
    path: Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None
) -> Iterator[ShardWriter]:
    """A ``ShardWriter`` on a temporary file that becomes ``path`` only when every tensor was written."""
    with atomic_path(path) as tmp, open(tmp, "r+b") as f:
        writer = ShardWriter(f, tensors, metadata)
        yield writer
        missing = writer.missing()
        if missing:
            raise ValueError(f"{path.name}: {len(missing)} planned tensors were never written, first {missing[0]}")
        f.flush()


def write_index(directory: Path, shards: list[list[PlannedTensor]], names: list[str]) -> None:
    """``model.safetensors.index.json`` for a sharded checkpoint (nothing for a single file)."""
    if len(shards) < 2:
        return
    weight_map = {t.name: file for shard, file in zip(shards, names, strict=True) for t in shard}
    total = sum(t.nbytes for shard in shards for t in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomic(directory / INDEX_FILE, json.dumps(index, indent=2) + "\n")
