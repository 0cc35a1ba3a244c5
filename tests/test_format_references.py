"""Each codec against an independent reference: the foreign package, or the published rule
written out element by element in the test."""

import math

import numpy as np
import pytest
import torch

from hetmoe.formats import QuantizedTensor, get_codec
from hetmoe.formats.packing import pack_int32, pack_nibbles, unpack_int32, unpack_nibbles

GEN = torch.Generator().manual_seed(1234)


def test_nibble_order_bytes_and_int32() -> None:
    codes = torch.randint(0, 16, (5, 64), generator=GEN, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    for r in range(5):
        for j in range(32):
            assert int(packed[r, j]) == int(codes[r, 2 * j]) | (int(codes[r, 2 * j + 1]) << 4)
    words = pack_int32(codes)
    for r in range(5):
        for w in range(8):
            expected = sum(int(codes[r, 8 * w + i]) << (4 * i) for i in range(8))
            assert int(words[r, w]) & 0xFFFFFFFF == expected
    assert torch.equal(unpack_nibbles(packed), codes)
    assert torch.equal(unpack_int32(words), codes)


def deepseek_weight_dequant(x: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3's weight_dequant rule, block by block: y[block] = float(x[block]) * s[i, j]."""
    m, n = x.shape
    y = torch.empty(m, n)
    for i in range(math.ceil(m / block)):
        for j in range(math.ceil(n / block)):
            rows = slice(i * block, min((i + 1) * block, m))
            cols = slice(j * block, min((j + 1) * block, n))
            y[rows, cols] = x[rows, cols].to(torch.float32) * s[i, j]
    return y


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 1)])
def test_fp8_block_matches_deepseek_rule(shape: tuple[int, int]) -> None:
    w = torch.randn(shape, generator=GEN) * 0.05
    codec = get_codec("fp8")
    q = codec.quantize(w)
    codec.validate(q)
    x, s = q.tensors[".weight"], q.tensors[".weight_scale_inv"]
    assert x.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert torch.equal(codec.dequantize(q), deepseek_weight_dequant(x, s))
    # Each block's largest magnitude maps to the top of the e4m3 range (ragged edge blocks included).
    assert float(x.float().abs().max()) == 448.0


def test_fp8_block_reads_foreign_scales() -> None:
    """A checkpoint's own bytes (not ones hetmoe wrote) decode by the rule."""
    x = (torch.randn(200, 300, generator=GEN) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=GEN) * 1e-3
    q = QuantizedTensor("fp8", (200, 300), {".weight": x, ".weight_scale_inv": s})
    get_codec("fp8").validate(q)
    assert torch.equal(get_codec("fp8").dequantize(q), deepseek_weight_dequant(x, s))


def test_fp8_channel_rule_and_scale_shapes() -> None:
    x = (torch.randn(64, 96, generator=GEN) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(64, 1, generator=GEN)
    expected = x.float() * s
    codec = get_codec("fp8-channel")
    for scale in (s, s.squeeze(1), s.to(torch.bfloat16)):
        q = QuantizedTensor("fp8-channel", (64, 96), {".weight": x, ".weight_scale": scale})
        codec.validate(q)
        assert torch.equal(codec.dequantize(q), x.float() * scale.float().reshape(64, 1))
    assert torch.equal(
        codec.dequantize(QuantizedTensor("fp8-channel", (64, 96), {".weight": x, ".weight_scale": s})), expected
    )


def gptq_reference(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray, sym: bool, v1: bool):
    """AutoGPTQ/vLLM rule written from the convention: returns W [N, K] (float64)."""
    k8, n = qweight.shape
    k = k8 * 8
    w = np.zeros((n, k))
    qw = qweight.astype(np.uint32)
    qz = qzeros.astype(np.uint32)
    for kk in range(k):
        code = (qw[kk // 8, :] >> (4 * (kk % 8))) & 0xF
        g = g_idx[kk]
        if sym:
            zero = np.full(n, 8)
        else:
            zero = np.array([(qz[g, c // 8] >> (4 * (c % 8))) & 0xF for c in range(n)])
            zero = zero + 1 if v1 else zero
        w[:, kk] = (code.astype(np.int64) - zero) * scales[g, :].astype(np.float64)
    return w


@pytest.mark.parametrize(
    ("sym", "fmt", "group"), [(True, "gptq", 32), (False, "gptq", 64), (False, "gptq_v2", 128), (True, "gptq_v2", 128)]
)
def test_gptq_matches_published_rule(sym: bool, fmt: str, group: int) -> None:
    w = torch.randn(48, 256, generator=GEN)
    codec = get_codec("gptq", group_size=group, sym=sym, checkpoint_format=fmt)
    q = codec.quantize(w)
    codec.validate(q)
    t = {k: v.numpy() for k, v in q.tensors.items()}
    assert t[".qweight"].shape == (256 // 8, 48) and t[".qzeros"].shape == (256 // group, 48 // 8)
    assert t[".scales"].dtype == np.float16 and t[".g_idx"].tolist() == [k // group for k in range(256)]
    if sym:
        constant = 0x77777777 if fmt == "gptq" else 0x88888888
        assert (t[".qzeros"].astype(np.uint32) == constant).all()
    ref = gptq_reference(t[".qweight"], t[".qzeros"], t[".scales"], t[".g_idx"], sym, fmt == "gptq")
    np.testing.assert_array_equal(codec.dequantize(q, torch.float64).numpy(), ref)


def test_gptq_single_group_and_single_row_pack() -> None:
    """K equal to the group size leaves size-1 dims in the packed zero points (a stride trap)."""
    for shape in ((64, 32), (8, 32), (2, 8, 32)):
        w = torch.randn(shape, generator=GEN)
        codec = get_codec("gptq", group_size=32, sym=False, checkpoint_format="gptq_v2")
        q = codec.quantize(w)
        codec.validate(q)
        assert codec.dequantize(q).shape == w.shape


def test_gptq_v1_and_v2_zero_points_of_the_same_bytes_differ_by_one() -> None:
    w = torch.randn(16, 64, generator=GEN)
    q = get_codec("gptq", group_size=32, sym=False, checkpoint_format="gptq_v2").quantize(w)
    as_v1 = get_codec("gptq", group_size=32, sym=False, checkpoint_format="gptq")
    z2 = get_codec("gptq", group_size=32, sym=False, checkpoint_format="gptq_v2").zero_points(q)
    assert torch.equal(as_v1.zero_points(q), z2 + 1)


def _ct_scheme(group: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args)


@pytest.mark.parametrize(("method", "group"), [("int4", 32), ("int4", 128), ("int4-asym", 32)])
def test_compressed_tensors_decompression_agrees(method: str, group: int) -> None:
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    del ct
    w = torch.randn(40, 256, generator=GEN)
    codec = get_codec(method, group_size=group, layout="compressed-tensors")
    q = codec.quantize(w)
    codec.validate(q)
    state = {k[1:]: v for k, v in q.tensors.items()}  # ".weight_packed" -> "weight_packed"
    theirs = PackedQuantizationCompressor.decompress(state, _ct_scheme(group, method == "int4"))["weight"]
    assert torch.equal(theirs.float(), codec.dequantize(q, torch.bfloat16).float())


def test_compressed_tensors_packing_agrees_with_their_packer() -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    signed = torch.randint(-8, 8, (12, 64), generator=GEN, dtype=torch.int8)
    ours = pack_int32((signed.to(torch.int16) + 8).to(torch.uint8))
    assert torch.equal(ours, pack_to_int32(signed, 4))
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size([12, 64])), signed)


def test_int4_bytes_rule() -> None:
    w = torch.randn(8, 64, generator=GEN)
    codec = get_codec("int4", group_size=32)
    q = codec.quantize(w)
    packed, scale = q.tensors[".weight"], q.tensors[".weight_scale"]
    assert packed.dtype == torch.uint8 and scale.dtype == torch.bfloat16 and tuple(scale.shape) == (8, 2)
    ref = torch.empty(8, 64)
    for n in range(8):
        for k in range(64):
            byte = int(packed[n, k // 2])
            code = byte & 0xF if k % 2 == 0 else byte >> 4
            ref[n, k] = (code - 8) * float(scale[n, k // 32])
    assert torch.equal(codec.dequantize(q), ref)


@pytest.mark.parametrize("method", ["int4", "int4-asym"])
@pytest.mark.parametrize("rows", [8, 13])  # 13: the asymmetric zero points' int32 packing along N pads rows
def test_int4_layouts_repack_into_each_other_exactly(method: str, rows: int) -> None:
    """Kimi-K2's compressed-tensors layout and the store's bytes hold the same codes: repacking moves
    them (compared here by the published rules' unpacking, not the repacker's own) and round-trips."""
    w = torch.randn(2, rows, 64, generator=GEN)
    ct = get_codec(method, group_size=32, layout="compressed-tensors")
    by = get_codec(method, group_size=32)
    q = ct.quantize(w)
    moved = ct.repacked(q, by)
    assert moved is not None and moved.params == by.params
    by.validate(moved)
    assert torch.equal(unpack_nibbles(moved.tensors[".weight"]), unpack_int32(q.tensors[".weight_packed"]))
    assert torch.equal(moved.tensors[".weight_scale"], q.tensors[".weight_scale"])
    assert torch.equal(by.dequantize(moved), ct.dequantize(q))
    back = by.repacked(moved, ct)
    assert back is not None and back.tensors.keys() == q.tensors.keys()
    for suffix, t in q.tensors.items():
        assert torch.equal(back.tensors[suffix], t), suffix
    assert ct.repacked(q, get_codec(method, group_size=64)) is None  # another grouping is another precision
    assert ct.repacked(q, get_codec("int8")) is None


def test_mxfp4_matches_gpt_oss_rule() -> None:
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    blocks = torch.randint(0, 256, (6, 4, 16), generator=GEN, dtype=torch.uint8)
    scales = torch.randint(110, 140, (6, 4), generator=GEN, dtype=torch.uint8)
    q = QuantizedTensor("mxfp4", (6, 128), {"_blocks": blocks, "_scales": scales})
    codec = get_codec("mxfp4")
    codec.validate(q)
    ref = torch.empty(6, 128)
    for n in range(6):
        for b in range(4):
            for j in range(16):
                byte = int(blocks[n, b, j])
                factor = 2.0 ** (int(scales[n, b]) - 127)
                ref[n, b * 32 + 2 * j] = lut[byte & 0xF] * factor
                ref[n, b * 32 + 2 * j + 1] = lut[byte >> 4] * factor
    assert torch.equal(codec.dequantize(q), ref)


def test_mxfp4_matches_transformers_gpt_oss_dequant() -> None:
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    blocks = torch.randint(0, 256, (2, 8, 4, 16), generator=GEN, dtype=torch.uint8)
    scales = torch.randint(115, 135, (2, 8, 4), generator=GEN, dtype=torch.uint8)
    theirs = mx.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = get_codec("mxfp4").dequantize(QuantizedTensor("mxfp4", (2, 8, 128), {"_blocks": blocks, "_scales": scales}))
    # transformers hands the experts back transposed to its [E, K, N] parameter layout.
    assert torch.equal(theirs, ours.transpose(1, 2))
