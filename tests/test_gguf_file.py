"""hetmoe's GGUF header parser against the ``gguf`` package's reader, the independent reference.

Files are written by ``gguf.GGUFWriter`` with every metadata value type, short and long arrays (a
vocabulary), a custom alignment and tensors of several ggml types; the parse must give the metadata
the package gives (its fields' contents, arrays over 16 items left out) and every tensor's type,
torch-order shape, size and bytes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import make_gguf

from hetmoe.checkpoint import CheckpointError
from hetmoe.checkpoint.gguf_file import GGUFFile


def reference(path: Path) -> tuple[dict[str, object], list]:
    r = gguf.GGUFReader(path)
    meta = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) > 16:
            continue
        meta[key] = value
    return meta, r.tensors


def write_every_value_type(path: Path, alignment: int | None) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    if alignment:
        w.add_custom_alignment(alignment)
    GT = gguf.GGUFValueType
    values = {
        "t.u8": (200, GT.UINT8), "t.i8": (-100, GT.INT8), "t.u16": (60000, GT.UINT16), "t.i16": (-30000, GT.INT16),
        "t.u32": (4_000_000_000, GT.UINT32), "t.i32": (-2_000_000_000, GT.INT32), "t.f32": (1e-6, GT.FLOAT32),
        "t.bool": (True, GT.BOOL), "t.u64": (2**63 + 5, GT.UINT64), "t.i64": (-(2**62), GT.INT64),
        "t.f64": (0.1, GT.FLOAT64), "t.str": ("Café 東京", GT.STRING),
    }  # fmt: skip
    for key, (value, kind) in values.items():
        w.add_key_value(key, value, kind)
    w.add_array("t.short_ints", [1, -2, 3])
    w.add_array("t.short_strings", ["a", "bé", ""])
    w.add_array("t.vocab", [f"tok{i}" for i in range(1000)])  # long: left out of metadata, walked past
    w.add_array("t.long_floats", [float(i) for i in range(40)])
    w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((5,)).astype(np.float16))
    q = np.ascontiguousarray(rng.integers(0, 255, (4, 2 * 144), dtype=np.uint8))  # 4 rows of 512 Q4_K weights
    w.add_tensor("q4k", q, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    q8 = np.ascontiguousarray(rng.integers(0, 255, (2, 3, 34), dtype=np.uint8))  # [2, 3] rows of 32 Q8_0
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_parse_equals_the_gguf_package(tmp_path: Path, alignment: int | None) -> None:
    path = write_every_value_type(tmp_path / "all.gguf", alignment)
    meta, tensors = reference(path)
    f = GGUFFile(path)
    assert f.metadata == meta and "t.vocab" not in f.metadata and f.metadata["t.short_strings"] == ["a", "bé", ""]
    assert f.keys() == [t.name for t in tensors]
    for t in tensors:
        info = f.info(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        assert (info.dtype, info.shape, info.nbytes) == (t.tensor_type.name, shape, int(t.n_bytes))
        raw = f.get(t.name)
        assert raw.shape[:-1] == shape[:-1]
        assert np.array_equal(raw.numpy().reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("arch", ["deepseek2", "qwen3moe"])
def test_expert_ggufs_parse_like_the_package(tmp_path: Path, arch: str) -> None:
    path = make_gguf(tmp_path / f"{arch}.gguf", arch=arch, biases=True)
    meta, tensors = reference(path)
    f = GGUFFile(path)
    assert f.metadata == meta
    for t in tensors:
        assert np.array_equal(f.get(t.name).numpy().reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_a_vocabulary_count_past_the_file_is_refused_at_once(tmp_path: Path) -> None:
    path = write_every_value_type(tmp_path / "all.gguf", None)
    data = bytearray(path.read_bytes())
    at = data.index(b"t.vocab") + len(b"t.vocab") + 4 + 4  # the key, its value type, the item type
    data[at : at + 8] = (2**40).to_bytes(8, "little")  # the package would loop over 2^40 items
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"all\.gguf: corrupt header: metadata 't\.vocab': an array of"):
        GGUFFile(path)


def test_prefetch_advises_each_tensors_own_bytes(tmp_path: Path, monkeypatch) -> None:
    """prefetch(name) asks the kernel (POSIX_FADV_WILLNEED) for exactly the byte range the gguf
    package reads the tensor from; an unknown name asks for nothing."""
    import os

    path = write_every_value_type(tmp_path / "all.gguf", 64)
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, n, advice: calls.append((start, n, advice)))
    f = GGUFFile(path)
    _, tensors = reference(path)
    for t in tensors:
        f.prefetch(t.name)
    f.prefetch("no such tensor")
    assert calls == [(int(t.data_offset), int(t.n_bytes), os.POSIX_FADV_WILLNEED) for t in tensors]


def test_release_drops_each_tensors_own_pages(tmp_path: Path, monkeypatch) -> None:
    """release(name) drops exactly the byte range the gguf package reads the tensor from (the pages
    it covers whole: drop_mapped_pages); an unknown name drops nothing."""
    from hetmoe.checkpoint import gguf_file

    path = write_every_value_type(tmp_path / "all.gguf", 64)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(gguf_file, "drop_mapped_pages", lambda mapping, start, n: calls.append((start, n)))
    f = GGUFFile(path)
    _, tensors = reference(path)
    for t in tensors:
        f.release(t.name)
    f.release("no such tensor")
    assert calls == [(int(t.data_offset), int(t.n_bytes)) for t in tensors]


def test_dropped_pages_leave_memory_and_read_back_the_file(tmp_path: Path) -> None:
    """drop_mapped_pages on a private file mapping: the whole pages of the range leave the process's
    resident memory (smaps), the partial ones at its ends stay, and every byte reads back as the file."""
    import mmap
    import os

    from hetmoe.checkpoint.safetensors_file import drop_mapped_pages

    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("Linux smaps only")
    page = mmap.PAGESIZE
    data = np.random.default_rng(0).integers(0, 256, 64 * page, dtype=np.uint8)
    (tmp_path / "f.bin").write_bytes(data.tobytes())
    with open(tmp_path / "f.bin", "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    view = np.frombuffer(m, dtype=np.uint8)
    base = view.ctypes.data

    def resident_pages() -> int:
        inside = False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    inside = int(head.split("-")[0], 16) == base
                elif inside and line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024 // page
        raise AssertionError("the mapping is not in smaps")

    assert int(view.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page touched
    assert resident_pages() == 64
    drop_mapped_pages(m, 3 * page + 1, 40 * page)  # pages 4 .. 42 whole; 3 and 43 partial
    assert resident_pages() == 64 - 39
    assert np.array_equal(view, data)
    del view
    m.close()
