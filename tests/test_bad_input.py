"""Bad input to the codecs: each case raises a ValueError subclass naming tensor, expected, found."""

from collections.abc import Callable

import pytest
import torch

from hetmoe.formats import FormatError, QuantizedTensor, get_codec
from hetmoe.formats.registry import UnknownMethodError

W = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))


def _q(method: str, **params: object) -> QuantizedTensor:
    return get_codec(method, **params).quantize(W, "blk.w")


def _with(q: QuantizedTensor, suffix: str, value: torch.Tensor) -> QuantizedTensor:
    return QuantizedTensor(q.method, q.shape, {**q.tensors, suffix: value}, q.params)


def _nan_at(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def _validate(method: str, q: QuantizedTensor, **params: object) -> Callable[[], None]:
    return lambda: get_codec(method, **params).validate(q, "blk.w")


q_fp8, q_int4, q_ct = _q("fp8"), _q("int4", group_size=32), _q("int4", group_size=32, layout="compressed-tensors")
q_gptq, q_mx, q_int8 = _q("gptq", group_size=64), _q("mxfp4"), _q("int8")

# (case id, call, words the message must contain: the tensor, the expectation, the finding)
CASES: list[tuple[str, Callable[[], object], list[str]]] = [
    (
        "quantize integer weight",
        lambda: get_codec("int4").quantize(torch.ones(4, 64, dtype=torch.int32), "x.w"),
        ["x.w", "floating-point", "int32"],
    ),
    ("quantize 1-d weight", lambda: get_codec("int8").quantize(torch.ones(64), "x.w"), ["x.w", "[..., N, K]", "[64]"]),
    ("quantize NaN weight", lambda: get_codec("fp8").quantize(_nan_at(W), "x.w"), ["x.w", "finite", "1 NaN"]),
    (
        "quantize Inf weight",
        lambda: get_codec("int4").quantize(W.clone().index_fill_(1, torch.tensor([0]), float("inf")), "x.w"),
        ["x.w", "finite", "64 NaN/Inf"],
    ),
    (
        "int4 K not divisible by group",
        lambda: get_codec("int4", group_size=128).quantize(torch.randn(4, 96), "x.w"),
        ["x.w", "divisible by 128", "K=96"],
    ),
    (
        "int4-asym K not divisible",
        lambda: get_codec("int4-asym", group_size=64).quantize(torch.randn(4, 80), "x.w"),
        ["x.w", "divisible by 64", "K=80"],
    ),
    (
        "gptq N not divisible by 8",
        lambda: get_codec("gptq", group_size=32).quantize(torch.randn(12, 64), "x.w"),
        ["x.w", "N (out_features) divisible by 8", "=12"],
    ),
    (
        "gptq K not divisible by group",
        lambda: get_codec("gptq", group_size=128).quantize(torch.randn(8, 192), "x.w"),
        ["x.w", "divisible by 128", "=192"],
    ),
    (
        "mxfp4 K not divisible by 32",
        lambda: get_codec("mxfp4").quantize(torch.randn(4, 48), "x.w"),
        ["x.w", "divisible by 32", "K=48"],
    ),
    ("bad group size", lambda: get_codec("int4", group_size=33), ["group_size", "multiple of 8", "33"]),
    ("bad layout", lambda: get_codec("int4", layout="awq"), ["layout", "compressed-tensors", "'awq'"]),
    (
        "fp8 weight wrong dtype",
        _validate("fp8", _with(q_fp8, ".weight", W.to(torch.bfloat16))),
        ["blk.w.weight", "float8_e4m3fn", "bfloat16"],
    ),
    (
        "fp8 scale wrong shape",
        _validate("fp8", _with(q_fp8, ".weight_scale_inv", torch.ones(1, 1))),
        ["blk.w.weight_scale_inv", "[1, 2]", "[1, 1]"],
    ),
    (
        "fp8 NaN scale",
        _validate("fp8", _with(q_fp8, ".weight_scale_inv", torch.tensor([[1.0, float("nan")]]))),
        ["blk.w.weight_scale_inv", "finite", "1 NaN"],
    ),
    (
        "fp8 NaN weight byte",
        _validate(
            "fp8", _with(q_fp8, ".weight", torch.full((64, 256), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn))
        ),
        ["blk.w.weight", "finite", "NaN"],
    ),
    (
        "fp8 missing scale",
        _validate("fp8", QuantizedTensor("fp8", (64, 256), {".weight": q_fp8.tensors[".weight"]})),
        ["blk.w", "weight_scale_inv", "missing"],
    ),
    (
        "int4 zero point on symmetric",
        _validate("int4", _with(q_int4, ".weight_zero_point", torch.zeros(64, 8, dtype=torch.uint8)), group_size=32),
        ["blk.w.weight_zero_point", "only the tensors", "unexpected", "zero point"],
    ),
    (
        "int4 scale Inf",
        _validate(
            "int4",
            _with(q_int4, ".weight_scale", torch.full((64, 8), float("inf"), dtype=torch.bfloat16)),
            group_size=32,
        ),
        ["blk.w.weight_scale", "finite", "512 NaN/Inf"],
    ),
    (
        "int4 packed wrong dtype",
        _validate("int4", _with(q_int4, ".weight", q_int4.tensors[".weight"].view(torch.int8)), group_size=32),
        ["blk.w.weight", "torch.uint8", "torch.int8"],
    ),
    (
        "compressed-tensors weight_shape lies",
        _validate(
            "int4", _with(q_ct, ".weight_shape", torch.tensor([64, 512])), group_size=32, layout="compressed-tensors"
        ),
        ["blk.w.weight_shape", "[64, 256]", "[64, 512]"],
    ),
    (
        "compressed-tensors scale group mismatch",
        _validate("int4", q_ct, group_size=64, layout="compressed-tensors"),
        ["blk.w.weight_scale", "[64, 4]", "[64, 8]"],
    ),
    (
        "gptq desc_act g_idx",
        _validate(
            "gptq",
            _with(
                q_gptq, ".g_idx", torch.randperm(256, generator=torch.Generator().manual_seed(0)).to(torch.int32) // 64
            ),
            group_size=64,
        ),
        ["blk.w.g_idx", "desc_act=False", "permuted", "desc_act=True"],
    ),
    (
        "gptq scales wrong dtype",
        _validate("gptq", _with(q_gptq, ".scales", q_gptq.tensors[".scales"].float()), group_size=64),
        ["blk.w.scales", "float16", "float32"],
    ),
    (
        "gptq qweight wrong shape",
        _validate("gptq", _with(q_gptq, ".qweight", q_gptq.tensors[".qweight"].T.contiguous()), group_size=64),
        ["blk.w.qweight", "[32, 64]", "[64, 32]"],
    ),
    (
        "mxfp4 NaN exponent",
        _validate("mxfp4", _with(q_mx, "_scales", torch.full((64, 8), 255, dtype=torch.uint8))),
        ["blk.w_scales", "below 255", "512 NaN"],
    ),
    (
        "int8 zero point handed in",
        _validate("int8", _with(q_int8, ".weight_zero_point", torch.zeros(64, 1))),
        ["blk.w.weight_zero_point", "only the tensors", "unexpected"],
    ),
]


@pytest.mark.parametrize(("call", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_value_error(call: Callable[[], object], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert isinstance(info.value, FormatError), type(info.value)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_unknown_method_lists_the_known_ones() -> None:
    with pytest.raises(UnknownMethodError, match=r"known: .*int4"):
        get_codec("int3")
