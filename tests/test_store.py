"""The expert store on its own: the streaming writer, reading a store back, and refusing broken ones.

A store is what ``hetmoe convert`` writes (tests/test_convert.py covers the conversion); here one
small store is made once and then read the ways the runtime and users read it: ``ExpertStore``,
``open_source`` + ``moe_layout`` + ``read_layer_experts``, ``hetmoe inspect``. Damaged stores
(interrupted, a layer file gone or altered, a bad manifest) must be errors naming what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hetmoe.checkpoint import CheckpointError, open_source
from hetmoe.checkpoint import convert as convert_module
from hetmoe.checkpoint.atomic import SequentialWriter
from hetmoe.checkpoint.config import read_config
from hetmoe.checkpoint.convert import convert
from hetmoe.checkpoint.experts import PROJECTIONS, codec_of, read_layer_experts
from hetmoe.checkpoint.layout import moe_layout
from hetmoe.checkpoint.safetensors_file import SafetensorsFile
from hetmoe.checkpoint.store import (
    JOURNAL,
    MANIFEST,
    ExpertStore,
    PlannedTensor,
    layer_file_name,
    write_safetensors,
)
from hetmoe.cli.inspect_cmd import inspect_path
from hetmoe.formats import FormatError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def store(tiny_cache, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Kimi-K2-style int4 tiny checkpoint converted to int8 (MoE layers 1 and 2)."""
    dst = tmp_path_factory.mktemp("store") / "int8"
    convert(tiny_cache.int4(), dst, "int8", progress=False)
    return dst


def _copy(store: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(store, tmp_path / "copy"))


# --- the streaming writer -------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "b.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "a.scale": torch.rand(5, 1, generator=g),
        "c.codes": torch.randint(-127, 127, (3, 9), generator=g, dtype=torch.int8),
        "d.fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "e.shape": torch.tensor([[5, 7]], dtype=torch.int64),
        "f.scalar": torch.tensor(2.5, dtype=torch.float16),
        "g.empty": torch.zeros(0, 3),
    }


def test_writer_output_is_read_by_the_reference_library(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = _sample_tensors()
    path = tmp_path / "x.safetensors"
    written = write_safetensors(path, [PlannedTensor.of(k, v) for k, v in tensors.items()], {"k": "v"})
    data = path.read_bytes()
    assert written.bytes == len(data) and written.sha256 == hashlib.sha256(data).hexdigest()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(_bytes(loaded[name]), _bytes(t)), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"k": "v"}
    ours = SafetensorsFile(path)
    (header_len,) = struct.unpack("<Q", data[:8])
    assert header_len % 8 == 0
    for name in tensors:  # every tensor starts at a multiple of its element size
        begin = json.loads(data[8 : 8 + header_len])[name]["data_offsets"][0]
        assert begin % tensors[name].element_size() == 0, name
        assert torch.equal(_bytes(ours.get(name)), _bytes(tensors[name]))


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct_if_allowed", "page_cache"])
def test_sequential_writer_writes_every_byte_in_order(tmp_path: Path, monkeypatch, direct: bool) -> None:
    """Pieces of every size around the 4 KiB block and the (here 8 KiB) buffer, bytes and tensors,
    through O_DIRECT where this filesystem allows it and through the page cache without it: the file
    is their concatenation, and its size is what close() returns."""
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    g = torch.Generator().manual_seed(5)
    sizes = [1, 0, 4095, 4096, 4097, 8192, 3, 20000, 8191, 12288, 7]
    pieces = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    path = tmp_path / "seq.bin"
    with SequentialWriter(path, buffer_bytes=8192) as w:
        assert w.direct is False or direct
        for i, piece in enumerate(pieces):
            w.write(piece if i % 2 else bytes(piece.numpy()))
        w.write(torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16))  # a 2-D tensor's bytes as laid out
        size = w.close()
    expected = b"".join(bytes(p.numpy()) for p in pieces) + bytes(
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16).view(torch.uint8).numpy()
    )
    assert path.read_bytes() == expected and size == len(expected)


def test_sequential_writer_falls_back_when_direct_writes_are_refused(tmp_path: Path, monkeypatch) -> None:
    """A device that wants more alignment than 4 KiB refuses O_DIRECT writes (EINVAL) after the open
    succeeded: the writer goes on through the page cache and the file is still every byte."""
    import errno

    real_write, refused = os.write, []

    def write(fd: int, data) -> int:
        if not refused and writer.direct:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    payload = bytes(range(256)) * 100
    writer = SequentialWriter(tmp_path / "x", buffer_bytes=8192)
    monkeypatch.setattr(os, "write", write)
    writer.direct = True  # as if the open had taken O_DIRECT, whatever this filesystem does
    writer.write(payload)
    size = writer.close()
    assert refused and not writer.direct
    assert (tmp_path / "x").read_bytes() == payload and size == len(payload)


def test_sequential_writer_refuses_a_buffer_that_is_not_whole_blocks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="buffer_bytes: expected a positive multiple of 4096, found 5000"):
        SequentialWriter(tmp_path / "x", buffer_bytes=5000)


def test_writer_is_deterministic_whatever_the_input_order(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    forward = [PlannedTensor.of(k, v) for k, v in tensors.items()]
    a = write_safetensors(tmp_path / "a.safetensors", forward, {"x": "1", "y": "2"})
    b = write_safetensors(tmp_path / "b.safetensors", forward[::-1], {"y": "2", "x": "1"})
    assert a == b and (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_writer_refuses_a_tensor_that_is_not_what_was_planned(tmp_path: Path) -> None:
    planned = PlannedTensor("w", torch.float32, (2, 2), lambda: torch.zeros(2, 3))
    with pytest.raises(
        FormatError, match=r"w: expected torch.float32 \[2, 2\] as planned, found torch.float32 \[2, 3\]"
    ):
        write_safetensors(tmp_path / "x.safetensors", [planned], {})


# --- reading a store back ---------------------------------------------------------------------------


def test_open_source_reads_a_store_like_a_checkpoint(store: Path, tiny_cache) -> None:
    source = open_source(store)
    assert isinstance(source, ExpertStore)
    layout = moe_layout(read_config(store), source)
    assert layout.style == "store" and layout.moe_layers == (1, 2) and layout.method == "int8"
    src = open_source(tiny_cache.int4())
    src_layout = moe_layout(read_config(tiny_cache.int4()), src)
    for layer in layout.moe_layers:
        experts = read_layer_experts(source, layout, layer)
        same = source.layer(layer)
        reference = read_layer_experts(src, src_layout, layer)
        for proj in PROJECTIONS:
            q = experts.projections[proj]
            assert q.method == "int8" and q.shape == reference.projections[proj].shape
            assert all(torch.equal(t, same.projections[proj].tensors[s]) for s, t in q.tensors.items())
            # The stored codes are exactly int8 quantization of the source's dequantized experts.
            expected = codec_of(q).quantize(
                codec_of(reference.projections[proj]).dequantize(reference.projections[proj])
            )
            assert all(torch.equal(t, expected.tensors[s]) for s, t in q.tensors.items()), (layer, proj)
        assert layout.key(layer, layout.gate, ".weight_scale") in source.keys()
        converted = read_layer_experts(source, layout, layer, "int4", group_size=32)
        assert converted.up.method == "int4" and converted.up.params["group_size"] == 32


def test_non_expert_tensors_keep_their_names_and_bytes(store: Path, tiny_cache) -> None:
    src, dst = open_source(tiny_cache.int4()), open_source(store)
    rest = [k for k in dst.keys() if ".experts." not in k]
    src_rest = [k for k in src.keys() if ".mlp.experts." not in k]
    assert sorted(rest) == sorted(src_rest) and rest
    for name in rest:
        assert src.info(name).dtype == dst.info(name).dtype and src.info(name).shape == dst.info(name).shape
        assert torch.equal(_bytes(src.get(name)), _bytes(dst.get(name))), name


def _resident_bytes(path: Path) -> int:
    """This process's resident bytes of its mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_populate_maps_what_the_engine_reads(store: Path, tmp_path: Path) -> None:
    """Populating a layer's tensors makes the layer file's pages resident in this process, and the
    tensors the engine gets are the same bytes of that one mapping, not a second open of the file
    (whose pages populate would not have touched)."""
    copy = _copy(store, tmp_path)
    source = open_source(copy)
    assert isinstance(source, ExpertStore)
    layer = source.moe_layers[0]
    experts = source.layer(layer)
    path = (copy / layer_file_name(layer)).resolve()
    names = source.layer_keys(layer)
    for name in names:
        source.populate(name)
    data = sum(source.info(n).nbytes for n in names)
    assert _resident_bytes(path) >= data  # whole pages: at least the tensors' bytes
    codes = experts.projections["gate"].tensors[".weight"]
    (name,) = [n for n in names if n.endswith("gate.weight")]
    assert codes.data_ptr() == source.get(name).data_ptr()  # the same bytes of one mapping, not a second open


@pytest.mark.parametrize("keeps_views", [True, False])
def test_the_loader_has_each_layer_in_memory_before_it_takes_the_next(keeps_views: bool) -> None:
    """Where the engine keeps views of the file, the loader's wait for a layer returns once that
    layer was asked of the disk whole and then mapped in, one layer read ahead of it; where the
    reader copies the bytes, nothing is mapped in ahead of it and nothing waits."""
    import threading
    import time

    from hetmoe.models.loader import _ReadAhead

    calls: list[tuple[str, str]] = []
    lock = threading.Lock()

    class Source:
        def prefetch(self, name: str) -> None:
            time.sleep(0.02)  # the disk: slower than the loader
            with lock:
                calls.append(("prefetch", name))

        def populate(self, name: str) -> None:
            with lock:
                calls.append(("populate", name))

    layers = [[f"L{i}.a", f"L{i}.b"] for i in range(4)]
    reader = _ReadAhead(Source(), layers, keeps_views)  # type: ignore[arg-type]
    reader.start(0)
    for index, keys in enumerate(layers):
        reader.start(index + 1)
        reader.wait(index)
        with lock:
            done = list(calls)
        if keeps_views:
            for name in keys:  # asked of the disk whole, then mapped in, before the loader goes on
                assert done.index(("prefetch", keys[-1])) < done.index(("populate", name))
        else:
            assert not any(kind == "populate" for kind, _ in done)
    reader.close()


def test_layer_files_describe_themselves(store: Path) -> None:
    f = SafetensorsFile(store / layer_file_name(1))
    assert f.metadata["method"] == "int8" and f.metadata["layer"] == "1" and f.metadata["format"] == "hetmoe-experts"
    assert sorted(f.keys()) == sorted(
        f"model.layers.1.experts.{p}{s}" for p in PROJECTIONS for s in (".weight", ".weight_scale")
    )
    assert f.info("model.layers.1.experts.down.weight").shape == (8, 64, 32)


def test_inspect_lists_a_store(store: Path) -> None:
    report = inspect_path(str(store))
    methods = {r["weight"]: r["method"] for r in report["tensors"]}
    assert methods["model.layers.2.experts.up"] == "int8"
    assert report["bytes_by_method"]["int8"] > 0


# --- incomplete and damaged stores --------------------------------------------------------------------


def test_interrupted_store_names_the_missing_layers(tiny_cache, tmp_path: Path, monkeypatch) -> None:
    real = convert_module._convert_layer
    finished: list[int] = []

    def interrupted(plan, dst, layer, *rest):  # type: ignore[no-untyped-def]
        if finished:
            raise KeyboardInterrupt
        finished.append(layer)
        return real(plan, dst, layer, *rest)

    monkeypatch.setattr(convert_module, "_convert_layer", interrupted)
    dst = tmp_path / "st"
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_cache.fp8(), dst, "int4", progress=False)
    assert (dst / layer_file_name(1)).exists() and (dst / JOURNAL).exists() and not (dst / MANIFEST).exists()
    pattern = r"incomplete hetmoe expert store.*1 of 2 MoE layers finished, missing layers \[2\].*--resume"
    with pytest.raises(CheckpointError, match=pattern):
        open_source(dst)
    with pytest.raises(CheckpointError, match=pattern) as exc:
        ExpertStore(dst)
    assert f"hetmoe convert {tiny_cache.fp8()} {dst} --method int4 --group-size 32 --resume" in str(exc.value)


def test_stray_layer_files_are_not_taken_for_a_checkpoint(store: Path, tmp_path: Path) -> None:
    d = tmp_path / "stray"
    d.mkdir()
    shutil.copy(store / layer_file_name(1), d)
    with pytest.raises(CheckpointError, match=r"incomplete hetmoe expert store: no hetmoe.json.*layers \[1\]"):
        open_source(d)


def test_missing_or_truncated_layer_files_are_named(store: Path, tmp_path: Path) -> None:
    d = _copy(store, tmp_path)
    (d / layer_file_name(2)).unlink()
    with pytest.raises(CheckpointError, match=r"damaged hetmoe expert store: layers \[2\] \(1\) missing.*--resume"):
        ExpertStore(d)
    shutil.copy(store / layer_file_name(2), d)
    with open(d / layer_file_name(1), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"layers \[1\] \(1\) truncated or altered"):
        open_source(d)
    shutil.copy(store / layer_file_name(1), d)
    (d / "model-rest.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"\['model-rest.safetensors'\] missing"):
        open_source(d)


def test_altered_layer_data_is_caught_when_the_layer_is_read(store: Path, tmp_path: Path) -> None:
    d = _copy(store, tmp_path)
    path = d / layer_file_name(2)
    f = SafetensorsFile(path)
    name = "model.layers.2.experts.gate.weight_scale"
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    begin = json.loads(path.read_bytes()[8 : 8 + header_len])[name]["data_offsets"][0]
    del f
    with open(path, "r+b") as out:  # same size, one scale turned into NaN
        out.seek(8 + header_len + begin)
        out.write(struct.pack("<f", float("nan")))
    st = ExpertStore(d)
    st.layer(1)
    with pytest.raises(CheckpointError, match=rf"{layer_file_name(2)}.*{name}: expected finite values"):
        st.layer(2)


def test_manifest_that_disagrees_with_a_layer_file_is_an_error(store: Path, tmp_path: Path) -> None:
    d = _copy(store, tmp_path)
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["method"], manifest["params"] = "fp8-channel", {}
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"layer file metadata 'method': expected 'fp8-channel', found 'int8'"):
        ExpertStore(d).layer(1)
    with pytest.raises(CheckpointError, match=r"layer 7 is not an MoE layer of this store"):
        ExpertStore(d).layer(7)


def test_manifest_cannot_point_outside_the_store(store: Path, tmp_path: Path) -> None:
    d = _copy(store, tmp_path)
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["layers"][0]["file"] = "../../outside.safetensors"
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"malformed store manifest.*expected file 'experts-L001.safetensors'"):
        open_source(d)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "cannot read the store manifest"),
        ('{"format": "hetmoe-expert-store", "version": 99}', "store version 99 is not supported"),
        ('{"format": "something-else"}', "not a hetmoe expert store manifest"),
        ('{"format": "hetmoe-expert-store", "version": 1, "method": "int8"}', "malformed store manifest"),
        ("[1, 2]", "must hold a JSON object"),
    ],
)
def test_bad_manifest_is_a_clear_error(store: Path, tmp_path: Path, text: str, message: str) -> None:
    d = _copy(store, tmp_path)
    (d / MANIFEST).write_text(text)
    with pytest.raises(CheckpointError, match=message):
        open_source(d)


def test_atomic_writes_get_the_usual_file_mode(tmp_path: Path) -> None:
    """Not mkstemp's 0600: a checkpoint written by hetmoe is readable like any file the user makes."""
    import os

    from hetmoe.checkpoint.atomic import write_text_atomic

    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


def test_atomic_dir_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    from hetmoe.checkpoint.atomic import atomic_dir

    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "new.txt").write_text("half")
        raise RuntimeError("killed mid-write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no leftovers
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"]
    with atomic_dir(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
