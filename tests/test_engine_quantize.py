"""The engine's weight quantizers (csrc/quantize.h via hetmoe/kernels/quantize.py) against the Python
codecs, which are the reference: the stored tensors must be equal bit for bit, for every method and
group size the engine takes, on ragged shapes, every source dtype, awkward values (ties, zeros,
subnormals, one huge outlier), and from the layouts the loader hands it (a list of experts, a
strided half of a fused tensor). Also: the loader's direct per-expert path equals the stacked
torch path, and a NaN/Inf names the expert."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetmoe.checkpoint.config import read_config
from hetmoe.checkpoint.errors import CheckpointError
from hetmoe.checkpoint.experts import read_layer_experts
from hetmoe.checkpoint.layout import moe_layout
from hetmoe.checkpoint.source import open_source
from hetmoe.formats import FormatError, QuantizedTensor, get_codec
from hetmoe.kernels.quantize import engine_quantize, engine_quantizes

GEN = torch.Generator().manual_seed(7)

# (method, codec params, the K granularity the shapes below must respect)
CASES = [
    *(("int4", {"group_size": g}, g) for g in (8, 16, 24, 32, 64, 128)),
    *(("int4-asym", {"group_size": g}, g) for g in (8, 32, 128)),
    ("int4", {"group_size": 32, "layout": "compressed-tensors"}, 32),
    ("int4-asym", {"group_size": 64, "layout": "compressed-tensors"}, 64),
    ("gptq", {"group_size": 32, "sym": True}, 32),
    ("gptq", {"group_size": 128, "sym": False}, 128),
    ("gptq", {"group_size": 64, "sym": False, "checkpoint_format": "gptq_v2"}, 64),
    ("gptq", {"group_size": -1, "sym": True}, 8),
    ("int8", {}, 1),
    ("fp8-channel", {}, 1),
    ("mxfp4", {}, 32),
    ("gguf:q4_0", {}, 32),
    ("gguf:q8_0", {}, 32),
    ("gguf:q4_k", {}, 256),
    ("gguf:q5_k", {}, 256),
    ("gguf:q6_k", {}, 256),
    ("gguf:iq4_nl", {}, 32),
    ("gguf:iq4_xs", {}, 256),
]
IDS = [f"{m}-{'-'.join(f'{v}' for v in p.values())}" for m, p, _ in CASES]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(ref: QuantizedTensor, got: QuantizedTensor | None) -> None:
    assert got is not None
    assert (got.method, got.shape, got.params) == (ref.method, ref.shape, ref.params)
    assert got.tensors.keys() == ref.tensors.keys()
    for key, t in ref.tensors.items():
        g = got.tensors[key]
        assert g.dtype == t.dtype and g.shape == t.shape, key
        diff = int((_bits(g) != _bits(t)).sum())
        assert diff == 0, f"{key}: {diff} of {t.numel()} elements differ"


def awkward(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Gaussian weights with every hard case planted: an all-zero row, a row of one repeated value (ties
    among candidate scales), exact half-steps of a 4-bit grid, a negative-only row, subnormal-sized
    values and one outlier 1e4 times the rest."""
    w = torch.randn(shape, generator=GEN) * 0.02
    w[..., 0, :] = 0.0
    if shape[-2] > 4:
        w[..., 1, :] = 0.0125
        w[..., 2, :] = (torch.arange(shape[-1]) % 16 - 7.5) * 0.001  # halfway between codes
        w[..., 3, :] = -w[..., 3, :].abs()
        w[..., 4, :] *= 1e-36
        w[..., 5, 3] = 200.0
    return w.to(dtype)


@pytest.mark.parametrize(("method", "params", "unit"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_engine_equals_codec(method: str, params: dict, unit: int, dtype: torch.dtype) -> None:
    codec = get_codec(method, **params)
    assert engine_quantizes(codec)
    k = 3 * max(unit, 32) if method != "gptq" or params["group_size"] != -1 else 200
    n = 40 if method == "gptq" else 37  # ragged: not a multiple of the kernels' row chunk (gptq: of 8)
    w = awkward((3, n, k), dtype)
    if dtype == torch.float16:
        w[..., 4, :] = 0.0  # 1e-38 is not an fp16 value
        w = w.clamp(-6e4, 6e4)
    assert_same(codec.quantize(w), engine_quantize(codec, w))


@pytest.mark.parametrize(("method", "params", "unit"), CASES[:: len(CASES) // 6 + 1], ids=IDS[:: len(CASES) // 6 + 1])
def test_parts_and_2d(method: str, params: dict, unit: int) -> None:
    """A list of expert tensors (as per-expert files give them), a strided half of a fused [E, 2N, K]
    tensor and a single 2-D weight all give the codec's bytes."""
    codec = get_codec(method, **params)
    k = 2 * max(unit, 64)
    fused = awkward((4, 64, k), torch.bfloat16)
    half = fused[:, 32:]  # rows unit-stride, experts 2N rows apart
    ref = codec.quantize(half.contiguous())
    assert_same(ref, engine_quantize(codec, half))
    assert_same(ref, engine_quantize(codec, [half[e] for e in range(4)]))
    assert_same(codec.quantize(half[1].contiguous()), engine_quantize(codec, half[1]))


def test_unsupported_sources_fall_back() -> None:
    codec = get_codec("int4")
    w = torch.randn(8, 64, generator=GEN)
    assert engine_quantize(codec, w.double()) is None  # float64: not a source the engine reads
    assert engine_quantize(codec, w.t()) is None  # columns strided
    assert engine_quantize(codec, [w, w[:4]]) is None  # parts that differ
    assert engine_quantize(get_codec("gguf:q2_k"), w.repeat(1, 4)) is None  # a type it has no quantizer for
    assert not engine_quantizes(get_codec("fp8"))  # a target it does not write (fp8 sources it reads)


def test_shape_errors_match_the_codec() -> None:
    w = torch.randn(4, 48, generator=GEN)
    for method, params in (("int4", {"group_size": 32}), ("gguf:q4_0", {}), ("mxfp4", {})):
        codec = get_codec(method, **params)
        with pytest.raises(FormatError) as ref:
            codec.quantize(w, "blk.0.w")
        with pytest.raises(FormatError) as got:
            engine_quantize(codec, w, "blk.0.w")
        assert str(got.value) == str(ref.value)


def test_the_engines_gguf_table_is_what_python_offers_and_checks_k() -> None:
    """The GGUF kinds engine_quantizes admits are the C++ table's, each CASES row is one of them, and
    the binding refuses a K that is no whole number of the kind's blocks (its own check, past Python's)."""
    from hetmoe.kernels.dispatch import engine_module

    engine = engine_module()
    kinds = set(engine.quantize_gguf_kinds())
    assert kinds == {m.removeprefix("gguf:") for m, _, _ in CASES if m.startswith("gguf:")}
    assert all(engine_quantizes(get_codec(f"gguf:{k}")) for k in kinds)
    assert not engine_quantizes(get_codec("gguf:q2_k"))
    w = torch.zeros(2, 32, dtype=torch.float32)
    out = torch.zeros(2 * 144, dtype=torch.uint8)
    for kind, block in (("q4_k", 256), ("iq4_xs", 256)):
        with pytest.raises(ValueError, match=f"K must be a multiple of {block}"):
            engine.quantize_weights(kind, [w.data_ptr()], 2, 32, 32, 0, out0=out.data_ptr())
    with pytest.raises(ValueError, match="unknown kind q2_k"):
        engine.quantize_weights("q2_k", [w.data_ptr()], 2, 32, 32, 0, out0=out.data_ptr())


def test_nonfinite_names_the_expert() -> None:
    w = torch.randn(5, 16, 64, generator=GEN).to(torch.bfloat16)
    w[3, 7, 9] = float("nan")
    w[4, 0, 0] = float("inf")
    with pytest.raises(FormatError) as exc:
        engine_quantize(get_codec("int4"), list(w), "layer 0 gate")
    assert str(exc.value) == "layer 0 gate: expected finite values, found 2 NaN/Inf entries, the first in expert 3"
    with pytest.raises(FormatError, match="expected finite values, found 1 NaN/Inf"):
        engine_quantize(get_codec("int8"), w[3])


def test_fp8_rounding_every_e4m3_neighbourhood() -> None:
    """fp8-channel's e4m3 conversion on every code's value, the midpoints between neighbours (ties go
    to even) and one ulp either side of them, against torch's own cast."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (codes[1:] + codes[:-1]) / 2
    ulp = torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.nextafter(mids, torch.zeros_like(mids))
    values = torch.cat([codes, mids, *ulp])
    values = torch.cat([values, -values])
    row = torch.cat([values, torch.tensor([448.0])])  # amax 448: the scale is exactly 1
    row = torch.nn.functional.pad(row, (0, -row.numel() % 8)).reshape(1, -1)
    codec = get_codec("fp8-channel")
    assert_same(codec.quantize(row), engine_quantize(codec, row))


# --- fp8 sources: codes and scales read in place ---------------------------------------------------


def fp8_weight(shape: tuple[int, ...], method: str, block: tuple[int, int] = (128, 128)) -> QuantizedTensor:
    """An fp8 weight as checkpoints ship it, with every e4m3fn code in it (subnormals, +-448, both
    zeros) and scales of both signs and several magnitudes; ``fp8``: one scale per ``block`` (partial
    blocks at the edges), ``fp8-channel``: one per row."""
    codes = torch.randint(0, 256, shape, generator=GEN, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0x01  # NaN codes: tested on their own
    flat = codes.view(-1)
    every = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    flat[: every.numel()] = every
    n, k = shape[-2:]
    if method == "fp8":
        grid = (*shape[:-2], -(-n // block[0]), -(-k // block[1]))
        scales = {".weight_scale_inv": torch.randn(grid, generator=GEN) * 3e-3}
        params = {"block_size": list(block)}
    else:
        scales, params = {".weight_scale": torch.randn(*shape[:-1], 1, generator=GEN) * 3e-3}, {}
    return QuantizedTensor(method, shape, {".weight": codes.view(torch.float8_e4m3fn), **scales}, params)


FP8_SOURCES = [("fp8", (128, 128)), ("fp8", (16, 32)), ("fp8", (7, 40)), ("fp8-channel", None)]
FP8_IDS = ["block128", "block16x32", "block7x40", "channel"]


@pytest.mark.parametrize(("source", "block"), FP8_SOURCES, ids=FP8_IDS)
@pytest.mark.parametrize(("method", "params", "unit"), CASES[::2], ids=IDS[::2])
def test_fp8_source_equals_the_codec_on_its_dequantized_values(source, block, method, params, unit) -> None:
    """From an fp8 weight the engine gives ``codec.quantize(fp8 codec.dequantize(q))`` bit for bit:
    the e4m3 decode, the block scale each value takes (blocks cut by the edges included) and the
    product are the fp8 codec's."""
    codec = get_codec(method, **params)
    k = 3 * max(unit, 32) if method != "gptq" or params["group_size"] != -1 else 200
    q = fp8_weight((3, 40 if method == "gptq" else 37, k), source, block or (1, 1))
    reference = codec.quantize(get_codec(source, **q.params).dequantize(q))
    assert_same(reference, engine_quantize(codec, q))
    assert_same(codec.quantize(get_codec(source, **q.params).dequantize(q)[1]), engine_quantize(codec, _expert(q, 1)))


def _expert(q: QuantizedTensor, e: int) -> QuantizedTensor:
    return QuantizedTensor(q.method, q.shape[1:], {k: t[e] for k, t in q.tensors.items()}, q.params)


def test_fp8_source_nan_names_the_expert_and_odd_scales_fall_back() -> None:
    q = fp8_weight((4, 32, 256), "fp8")
    q.tensors[".weight"].view(torch.uint8)[2, 5, 7] = 0x7F  # e4m3fn NaN
    with pytest.raises(FormatError, match="found 1 NaN/Inf entries, the first in expert 2"):
        engine_quantize(get_codec("int4"), q, "layer 3 up")
    wrong = QuantizedTensor("fp8", q.shape, {**q.tensors, ".weight_scale_inv": torch.ones(4, 1, 1)}, q.params)
    assert engine_quantize(get_codec("int4"), wrong) is None  # the codec names the scale shape
    assert engine_quantize(get_codec("int4"), QuantizedTensor("int8", q.shape, {}, {})) is None


def test_fp8_checkpoint_converts_in_place(tiny_cache) -> None:
    """DeepSeek-V3's fp8 experts converted while loading go through the engine's fp8 reader and
    give what the torch path gives."""
    path = tiny_cache.fp8()
    source = open_source(path)
    layout = moe_layout(read_config(path), source)
    layer = layout.moe_layers[0]
    calls: list[str] = []

    def spy(codec, parts, name="weight"):  # type: ignore[no-untyped-def]
        calls.append(type(parts).__name__)
        return engine_quantize(codec, parts, name)

    ref = read_layer_experts(source, layout, layer, "int4", group_size=32)
    got = read_layer_experts(open_source(path), layout, layer, "int4", quantize=spy, group_size=32)
    assert calls and set(calls) == {"QuantizedTensor"}
    for proj in ("gate", "up", "down"):
        assert_same(ref.projections[proj], got.projections[proj])


def _per_expert_dir(tmp_path: Path, experts: int = 4, hidden: int = 64, inter: int = 96) -> Path:
    from safetensors.torch import save_file

    d = tmp_path / "model"
    d.mkdir()
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "intermediate_size": 2 * inter,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    (d / "config.json").write_text(json.dumps(config))
    tensors = {}
    for e in range(experts):
        p = f"model.layers.0.mlp.experts.{e}."
        tensors[p + "gate_proj.weight"] = awkward((inter, hidden), torch.bfloat16)
        tensors[p + "up_proj.weight"] = awkward((inter, hidden), torch.bfloat16)
        tensors[p + "down_proj.weight"] = awkward((hidden, inter), torch.bfloat16)
    save_file(tensors, d / "model.safetensors")
    return d


@pytest.mark.parametrize("method", ["int4", "int4-asym", "int8", "gguf:q4_0"])
def test_loader_direct_path_equals_the_torch_path(tmp_path: Path, method: str) -> None:
    d = _per_expert_dir(tmp_path)
    source = open_source(d)
    layout = moe_layout(read_config(d), source)
    params = {"group_size": 32} if method.startswith("int4") else {}
    ref = read_layer_experts(source, layout, 0, method, **params)
    got = read_layer_experts(open_source(d), layout, 0, method, quantize=engine_quantize, **params)
    for proj in ("gate", "up", "down"):
        assert_same(ref.projections[proj], got.projections[proj])


def test_loader_direct_path_names_the_file_and_expert(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = _per_expert_dir(tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.experts.2.up_proj.weight"][5, 5] = float("nan")
    save_file(tensors, d / "model.safetensors")
    source = open_source(d)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*NaN/Inf entries, the first in expert 2"):
        read_layer_experts(source, moe_layout(read_config(d), source), 0, "int4", quantize=engine_quantize)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_convert_with_the_engine_writes_the_same_store(tmp_path: Path, method: str) -> None:
    from hetmoe.checkpoint.convert import convert

    d = _per_expert_dir(tmp_path)
    convert(d, tmp_path / "torch", method, progress=False)
    convert(d, tmp_path / "engine", method, progress=False, quantize=engine_quantize)
    layers = sorted(p.name for p in (tmp_path / "torch").glob("experts-*.safetensors"))
    assert layers
    for name in layers:
        assert (tmp_path / "torch" / name).read_bytes() == (tmp_path / "engine" / name).read_bytes(), name


def test_load_shows_progress_and_reads_ahead(tiny_cache, capsys, monkeypatch) -> None:
    """load_model(progress=True) draws a bar over the experts' bytes with the layer count, and every
    MoE layer's expert tensors are prefetched once (the first before the non-expert weights)."""
    from hetmoe import load_model
    from hetmoe.checkpoint import safetensors_file

    fetched: list[str] = []
    real = safetensors_file.SafetensorsFile.prefetch

    def record(self, name: str) -> None:  # type: ignore[no-untyped-def]
        fetched.append(name)
        real(self, name)

    monkeypatch.setattr(safetensors_file.SafetensorsFile, "prefetch", record)
    path = tiny_cache.model("qwen3_moe")
    model = load_model(path, method="int4", progress=True)
    err = capsys.readouterr().err
    layers = sum(type(m).__name__ == "HybridMoE" for m in model.modules())
    assert "loading experts" in err and f"layers {layers}/{layers}" in err
    experts = [k for k in open_source(path).keys() if ".mlp.experts." in k]
    assert sorted(fetched) == sorted(experts)


def test_store_load_reads_ahead(tmp_path: Path, monkeypatch) -> None:
    """A store made by convert prefetches each layer's expert files too (ExpertStore.prefetch)."""
    from hetmoe.checkpoint import safetensors_file
    from hetmoe.checkpoint.convert import convert
    from hetmoe.checkpoint.store import ExpertStore

    d = _per_expert_dir(tmp_path)
    convert(d, tmp_path / "st", "int4", progress=False, quantize=engine_quantize)
    store = ExpertStore(tmp_path / "st")
    fetched: list[str] = []
    monkeypatch.setattr(safetensors_file.SafetensorsFile, "prefetch", lambda self, name: fetched.append(name))
    for key in store.keys():
        store.prefetch(key)
    assert sorted(fetched) == sorted(store.keys())
