"""A GGUF reader: the ``gguf`` package parses the file; hetmoe checks it and hands out raw blocks.

Tensors come back as their stored bytes, ``uint8 [..., row_bytes]`` over the logical shape's
leading dims (GGUF lists dims fastest-first; the logical shape here is torch order, ``[.., N, K]``),
memory-mapped; ``hetmoe.formats`` decodes them. Before the ``gguf`` package sees the file we check
the magic and that the declared counts can fit in the file, so a corrupt or hostile file is an
error naming it rather than a long loop or a numpy exception from deep inside the parser.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError
from .safetensors_file import TensorInfo

GGUF_MAGIC = b"GGUF"
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MIN_KV_BYTES = 8 + 4  # key length, value type


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
