"""Reading safetensors (single and sharded) and GGUF, detecting methods, and refusing bad files."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hetmoe.checkpoint import CheckpointError, group_weights, open_source
from hetmoe.formats import get_codec

GEN = torch.Generator().manual_seed(7)


def _mixed_state() -> dict[str, torch.Tensor]:
    w = torch.randn(256, 256, generator=GEN)
    state = {"model.embed_tokens.weight": w.to(torch.bfloat16), "model.norm.weight": torch.ones(256)}
    specs = {
        "l.fp8": ("fp8", {}),
        "l.fp8c": ("fp8-channel", {}),
        "l.i8": ("int8", {}),
        "l.i4": ("int4", {"group_size": 32}),
        "l.i4ct": ("int4", {"group_size": 64, "layout": "compressed-tensors"}),
        "l.i4a": ("int4-asym", {"group_size": 32}),
        "l.gptq": ("gptq", {"group_size": 128}),
        "l.experts.gate_up_proj": ("mxfp4", {}),
    }
    for prefix, (method, params) in specs.items():
        state.update(get_codec(method, **params).quantize(w).state_dict(prefix))
    return state


def test_detects_every_method_in_a_single_file(tmp_path: Path) -> None:
    save_file(_mixed_state(), tmp_path / "model.safetensors")
    entries = {e.prefix: e for e in group_weights(open_source(tmp_path))}
    expected = {
        "model.embed_tokens": ("bf16", {}),
        "l.fp8": ("fp8", {"block_size": [128, 128]}),
        "l.fp8c": ("fp8-channel", {}),
        "l.i8": ("int8", {}),
        "l.i4": ("int4", {"group_size": 32, "layout": "bytes"}),
        "l.i4ct": ("int4", {"group_size": 64, "layout": "compressed-tensors"}),
        "l.i4a": ("int4-asym", {"group_size": 32, "layout": "bytes"}),
        "l.gptq": ("gptq", {"group_size": 128}),
        "l.experts.gate_up_proj": ("mxfp4", {}),
    }
    for prefix, (method, params) in expected.items():
        assert entries[prefix].method == method, prefix
        assert entries[prefix].params == params, prefix
        assert entries[prefix].shape == (256, 256), prefix
    assert entries["model.norm"].method == "fp32"


def test_reads_tensors_memory_mapped_and_equal(tmp_path: Path) -> None:
    state = _mixed_state()
    save_file(state, tmp_path / "model.safetensors")
    src = open_source(tmp_path / "model.safetensors")
    for key, value in state.items():
        got = src.get(key)
        assert got.dtype == value.dtype and torch.equal(got.view(torch.uint8), value.contiguous().view(torch.uint8))
    # Copy-on-write: scribbling on a tensor never changes the file.
    before = (tmp_path / "model.safetensors").read_bytes()
    src.get("l.i8.weight").fill_(0)
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_sharded_directory(tmp_path: Path) -> None:
    state = _mixed_state()
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for shard, names in shards.items():
        save_file({k: state[k] for k in names}, tmp_path / shard)
        weight_map.update(dict.fromkeys(names, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    src = open_source(tmp_path)
    assert sorted(src.keys()) == keys
    assert torch.equal(src.get(keys[-1]).view(torch.uint8), state[keys[-1]].view(torch.uint8))
    assert src.info(keys[0]).file.name == "model-00001-of-00002.safetensors"
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shards listed in the index are missing"):
        open_source(tmp_path)


def _gguf(path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch="test")
    data = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    w.add_tensor(
        "blk.0.ffn_gate_exps.weight",
        gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_source_and_detection(tmp_path: Path) -> None:
    _gguf(tmp_path / "m.gguf")
    src = open_source(tmp_path / "m.gguf")
    info = src.info("blk.0.ffn_gate_exps.weight")
    assert info.shape == (64, 256) and info.dtype == "Q8_0" and info.nbytes == 64 * 8 * 34
    assert tuple(src.get("blk.0.ffn_gate_exps.weight").shape) == (64, 8 * 34)
    methods = {e.prefix: e.method for e in group_weights(src)}
    assert methods == {"blk.0.ffn_gate_exps.weight": "gguf:q8_0", "output_norm.weight": "gguf:f32"}


# ---- malformed files: each gives a CheckpointError naming the file and the problem ----


def _st_bytes(header: object, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


GOOD = {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
BAD_FILES = [
    ("empty file", b"", "truncated: 0 bytes"),
    ("short length", b"\x01\x02", "truncated: 2 bytes"),
    ("header longer than file", struct.pack("<Q", 1000) + b"{}", "claims 1000 bytes"),
    ("absurd header length", struct.pack("<Q", 2**62) + b"{}", "corrupt or truncated header"),
    ("header not json", _st_bytes(None, raw_header=b"{not json"), "not valid JSON"),
    ("header a list", _st_bytes([1, 2]), "expected a JSON object"),
    (
        "unknown dtype",
        _st_bytes({"t": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
        "unknown dtype 'F7'",
    ),
    (
        "negative shape",
        _st_bytes({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
        "non-negative",
    ),
    (
        "offsets reversed",
        _st_bytes({"t": {"dtype": "U8", "shape": [1], "data_offsets": [4, 3]}}, b"\0" * 4),
        "0 <= begin <= end",
    ),
    (
        "size mismatch",
        _st_bytes({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, b"\0" * 12),
        "needs 16 bytes",
    ),
    ("truncated data", _st_bytes(GOOD, b"\0" * 10), "truncated: tensor 't' ends at data byte 16"),
    ("entry lacks fields", _st_bytes({"t": {"dtype": "F32"}}), "lacks dtype/shape/data_offsets"),
]


@pytest.mark.parametrize(("content", "message"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_malformed_safetensors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        open_source(path).keys()
    assert str(path) in str(info.value) and message in str(info.value)


def test_malformed_gguf(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    _gguf(good)
    raw = good.read_bytes()
    cases = {
        "bad magic": (b"GGUX" + raw[4:], "bad magic"),
        "tiny": (raw[:10], "truncated"),
        "absurd counts": (raw[:8] + struct.pack("<QQ", 2**40, 2**40) + raw[24:], "cannot fit"),
        "bad version": (raw[:4] + struct.pack("<I", 9) + raw[8:], "unsupported GGUF version 9"),
        "truncated data": (raw[: len(raw) - 100], "truncated"),
    }
    for case, (content, message) in cases.items():
        path = tmp_path / f"{case.replace(' ', '_')}.gguf"
        path.write_bytes(content)
        with pytest.raises(CheckpointError) as info:
            open_source(path)
        assert str(path) in str(info.value) and message in str(info.value), case


def test_missing_and_empty_paths(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        open_source(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        open_source(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="weight_map"):
        open_source(tmp_path)
