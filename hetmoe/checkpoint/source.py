"""Open what a user points at: a safetensors file, a sharded directory, a GGUF file or split set.

Every source answers ``keys()``, ``info(name)`` and ``get(name)`` and says which file a tensor is
in, so later layers never care how the checkpoint was laid out on disk.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

import torch

from .errors import CheckpointError
from .gguf_file import GGUFFile
from .safetensors_file import SafetensorsFile, TensorInfo

_SPLIT_GGUF = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


class TensorSource(Protocol):
    path: Path

    def keys(self) -> list[str]: ...

    def info(self, name: str) -> TensorInfo: ...

    def get(self, name: str) -> torch.Tensor: ...


class MultiFileSource:
    """Several files seen as one (sharded safetensors, split GGUF); names must not repeat."""

    def __init__(self, path: Path, files: list[SafetensorsFile] | list[GGUFFile]) -> None:
        self.path = path
        self.files = files
        self._where: dict[str, SafetensorsFile | GGUFFile] = {}
        for f in files:
            for name in f.keys():
                if name in self._where:
                    raise CheckpointError(f.path, f"tensor {name!r} also appears in {self._where[name].path.name}")
                self._where[name] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _file(self, name: str) -> SafetensorsFile | GGUFFile:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(self.path, f"no tensor named {name!r}") from None

    def info(self, name: str) -> TensorInfo:
        return self._file(name).info(name)

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get(name)

    def release(self, name: str) -> None:
        file = self._file(name)
        if hasattr(file, "release"):
            file.release(name)

    def prefetch(self, name: str) -> None:
        file = self._file(name)
        if hasattr(file, "prefetch"):
            file.prefetch(name)

    def populate(self, name: str) -> None:
        file = self._file(name)
        if hasattr(file, "populate"):
            file.populate(name)


def open_source(path: str | Path) -> TensorSource:
    """A tensor source for a file or model directory; a clear error for anything else."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(p, "no such file or directory")
    if p.is_dir():
        return _open_directory(p)
    if p.suffix == ".gguf":
        return _open_gguf(p)
    if p.suffix == ".json" and p.name.endswith(".index.json"):
        return _open_index(p)
    return SafetensorsFile(p)


def _open_directory(d: Path) -> TensorSource:
    from .store import is_store_dir, open_store  # lazy: the store module builds on this one

    if is_store_dir(d):  # checked first: an interrupted store's layer files must not pass for shards
        return open_store(d)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return _open_index(index)
    single = d / "model.safetensors"
    if single.exists():
        return SafetensorsFile(single)
    shards = sorted(d.glob("*.safetensors"))
    if shards:
        return MultiFileSource(d, [SafetensorsFile(s) for s in shards])
    ggufs = sorted(d.glob("*.gguf"))
    if len(ggufs) == 1 or (ggufs and all(_SPLIT_GGUF.match(g.name) for g in ggufs)):
        return _open_gguf(ggufs[0])
    raise CheckpointError(
        d, "no model.safetensors, model.safetensors.index.json, *.safetensors or single *.gguf file found"
    )


def _open_index(index: Path) -> TensorSource:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(index, f"not a valid safetensors index (needs a 'weight_map' object): {exc}") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(index, "'weight_map' must map tensor names to shard file names")
    shard_names = sorted(set(weight_map.values()))
    missing = [s for s in shard_names if not (index.parent / s).exists()]
    if missing:
        raise CheckpointError(index, f"shards listed in the index are missing: {missing[:5]} ({len(missing)} in all)")
    source = MultiFileSource(index.parent, [SafetensorsFile(index.parent / s) for s in shard_names])
    absent = [name for name, shard in weight_map.items() if name not in source]
    if absent:
        raise CheckpointError(index, f"{len(absent)} tensors of the index are not in their shards, first: {absent[:5]}")
    return source


def _open_gguf(path: Path) -> TensorSource:
    m = _SPLIT_GGUF.match(path.name)
    if not m:
        return GGUFFile(path)
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise CheckpointError(path, f"split GGUF is incomplete: missing {missing}")
    return MultiFileSource(path, [GGUFFile(p) for p in parts])
