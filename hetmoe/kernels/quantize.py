"""Weight quantization in the compiled engine, in a codec's own stored layout.

``engine_quantize(codec, parts, name)`` quantizes full-precision weights (bf16, fp16 or fp32) on
the engine's thread pool (csrc/quantize.h) into exactly the tensors ``codec.quantize`` returns: the
codecs in hetmoe/formats stay the reference and tests/test_engine_quantize.py holds the two bit
for bit equal. ``parts`` is one weight ``[N, K]`` or ``[E, N, K]``, or a list of ``[N, K]`` weights
(the experts of a layer, each where its file put it: nothing is stacked or widened first), or an
fp8 weight (a QuantizedTensor of the ``fp8`` block-scaled or ``fp8-channel`` codec, as DeepSeek-V3
and MiniMax-M2 ship), whose codes and scales the engine reads in place and multiplies as the fp8
codec's ``dequantize`` does: the result is ``codec.quantize(fp8_codec.dequantize(q))`` with no
float copy of the weight. The NaN/Inf check rides along with the pass, so a broken weight costs no
extra read.

For a codec or source the engine has no quantizer for it returns None and the caller uses the
codec: int4 (both layouts), int4-asym, gptq (round to nearest), int8, fp8-channel, mxfp4 and the
GGUF types Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS run here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..formats import Codec, FormatError, QuantizedTensor
from ..formats.base import check_divisible
from ..formats.fp8_channel import FP8ChannelCodec
from ..formats.gguf import GGUFCodec
from ..formats.gptq import GPTQCodec
from ..formats.int4 import _Int4Base
from ..formats.int8 import Int8Codec
from ..formats.mxfp4 import MXFP4Codec
from ..hw import huge_pages
from .dispatch import EngineUnavailableError, engine_module

_SOURCE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FP8_SOURCE = 3  # e4m3fn codes with fp32 block scales (csrc/quantize.h kSrcF8E4M3)


def engine_quantizes(codec: Codec) -> bool:
    """Whether ``engine_quantize`` runs this codec (on this machine)."""
    if not _available():
        return False
    if isinstance(codec, GGUFCodec):
        return codec.ggml_type.name.lower() in _gguf_kinds()
    return isinstance(codec, _Int4Base | GPTQCodec | Int8Codec | FP8ChannelCodec | MXFP4Codec)


@functools.cache
def _gguf_kinds() -> frozenset[str]:
    """The GGUF types the engine quantizes to, from its own table (csrc/quantize.cpp)."""
    return frozenset(engine_module().quantize_gguf_kinds())


def engine_quantize(
    codec: Codec, parts: torch.Tensor | Sequence[torch.Tensor], name: str = "weight"
) -> QuantizedTensor | None:
    """``parts`` in ``codec``'s stored layout (shape ``[N, K]`` for one 2-D weight, else ``[E, N, K]``), or
    None where the engine does not quantize this codec or source (then use ``codec.quantize``)."""
    if not engine_quantizes(codec):
        return None
    src = _fp8_source(parts, name) if isinstance(parts, QuantizedTensor) else _float_source(parts, name)
    if src is None:
        return None
    if isinstance(codec, _Int4Base | GPTQCodec):
        return _int4(codec, src)
    if isinstance(codec, Int8Codec | FP8ChannelCodec):
        return _per_row(codec, src)
    if isinstance(codec, MXFP4Codec):
        return _mxfp4(src)
    assert isinstance(codec, GGUFCodec)
    return _gguf(codec, src)


def _float_source(parts: torch.Tensor | Sequence[torch.Tensor], name: str) -> _Source | None:
    rows = _rows(parts, _SOURCE_DTYPES)
    if rows is None:
        return None
    views, shape = rows
    return _Source(_row_args(views, shape, _SOURCE_DTYPES[views[0].dtype]), shape, name)


def _fp8_source(q: QuantizedTensor, name: str) -> _Source | None:
    """The fp8 codecs' codes and fp32 scales as the engine reads them; None for anything else."""
    if q.method == "fp8":
        scales = q.tensors.get(".weight_scale_inv")
        block_rows, block_cols = (int(b) for b in q.params.get("block_size", (128, 128)))
    elif q.method == "fp8-channel":
        q = FP8ChannelCodec().canonical(q, name)
        scales, block_rows, block_cols = q.tensors.get(".weight_scale"), 1, q.shape[-1]
    else:
        return None
    rows = _rows(q.tensors[".weight"], {torch.float8_e4m3fn: _FP8_SOURCE})
    if rows is None or scales is None:
        return None
    views, shape = rows
    n, k = shape[-2:]
    grid = (-(-n // block_rows), -(-k // block_cols))
    per_part = [s.detach().float().contiguous() for s in (scales.unbind(0) if scales.dim() == 3 else [scales])]
    if len(per_part) != len(views) or any(tuple(s.shape) != grid or s.device.type != "cpu" for s in per_part):
        return None  # the codec's own checks name what is wrong
    args = _row_args(views, shape, _FP8_SOURCE)
    args |= {
        "scale_parts": [s.data_ptr() for s in per_part],
        "scale_block_rows": block_rows,
        "scale_block_cols": block_cols,
        "scale_row_stride": grid[1],
    }
    return _Source(args, shape, name, keep=per_part)


def _row_args(views: list[torch.Tensor], shape: tuple[int, ...], dtype: int) -> dict[str, Any]:
    n = shape[-2]
    return {
        "parts": [v.data_ptr() for v in views],
        "n": n,
        "k": shape[-1],
        "row_stride": views[0].stride(0) if n > 1 else shape[-1],
        "dtype": dtype,
    }


class _Source:
    """One call's source rows (the binding's keyword arguments), logical shape and name; ``keep``
    holds tensors made for the call (fp32 scales) alive while the engine reads them."""

    def __init__(
        self, args: dict[str, Any], shape: tuple[int, ...], name: str, keep: list[torch.Tensor] | None = None
    ) -> None:
        self.args, self.shape, self.name, self.keep = args, shape, name, keep
        self.parts, self.n, self.k = len(args["parts"]), shape[-2], shape[-1]

    def run(self, kind: str, *outputs: torch.Tensor | None, **options: Any) -> None:
        ptrs = {f"out{i}": t.data_ptr() if t is not None else 0 for i, t in enumerate(outputs)}
        bad, first_row = engine_module().quantize_weights(kind, **self.args, **options, **ptrs)
        if bad:  # the codecs' error for such a weight (check_weight's), naming the expert of the first
            where = f", the first in expert {first_row // self.n}" if self.parts > 1 else ""
            exc = FormatError(self.name, "finite values", f"{bad} NaN/Inf entries{where}")
            exc.expert = first_row // self.n if self.parts > 1 else None  # type: ignore[attr-defined]
            raise exc

    def out(self, *tail: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        # the experts a decode step streams: on huge pages, as a model file's are (huge_pages.py)
        return huge_pages.empty((self.parts, self.n, *tail), dtype)

    def logical(self, t: torch.Tensor) -> torch.Tensor:
        """An output ``[parts, N, ...]`` in the weight's own leading dims."""
        return t.reshape(*self.shape[:-1], *t.shape[2:])


def _int4(codec: _Int4Base | GPTQCodec, src: _Source) -> QuantizedTensor:
    gptq = isinstance(codec, GPTQCodec)
    if gptq:
        codec._check_shape(src.shape, src.name)
    group = codec._g(src.k) if gptq else codec.group_size
    check_divisible(src.k, group, src.name, "K")
    asym = not codec.sym if gptq else codec.asymmetric
    nibbles, scales = src.out(src.k // 2), src.out(src.k // group, dtype=torch.int16)
    zeros = src.out(src.k // group) if asym else None
    min_zero = 1 if gptq and asym and codec.checkpoint_format == "gptq" else 0  # GPTQ v1 stores z - 1
    src.run("int4", nibbles, scales, zeros, group=group, asym=asym, min_zero=min_zero, f16_scales=gptq)
    scale = src.logical(scales.view(torch.float16 if gptq else torch.bfloat16))
    zero = src.logical(zeros) if zeros is not None else None
    if gptq:
        symmetric_zero = torch.full(scale.shape, 8, dtype=torch.uint8)  # uint4b8: the zero point is 8
        return codec.stored(src.shape, src.logical(nibbles), scale, zero if zero is not None else symmetric_zero)
    return codec.stored(src.shape, src.logical(nibbles), scale, zero)


def _per_row(codec: Int8Codec | FP8ChannelCodec, src: _Source) -> QuantizedTensor:
    int8 = isinstance(codec, Int8Codec)
    codes, scale = src.out(src.k, dtype=torch.int8 if int8 else torch.uint8), src.out(1, dtype=torch.float32)
    src.run("int8" if int8 else "fp8-channel", codes, scale)
    weight = src.logical(codes if int8 else codes.view(torch.float8_e4m3fn))
    return QuantizedTensor(codec.method, src.shape, {".weight": weight, ".weight_scale": src.logical(scale)})


def _mxfp4(src: _Source) -> QuantizedTensor:
    check_divisible(src.k, 32, src.name, "K")
    blocks, exps = src.out(src.k // 32, 16), src.out(src.k // 32)
    src.run("mxfp4", blocks, exps)
    return QuantizedTensor(MXFP4Codec.method, src.shape, {"_blocks": src.logical(blocks), "_scales": src.logical(exps)})


def _gguf(codec: GGUFCodec, src: _Source) -> QuantizedTensor:
    codec._check_k(src.shape, src.name)
    t = codec.ggml_type
    raw = src.out(t.row_bytes(src.k))
    src.run(t.name.lower(), raw)
    return QuantizedTensor(codec.label(), src.shape, {".weight": src.logical(raw)}, {"ggml_type": codec.ggml_type.name})


@functools.cache
def _available() -> bool:
    try:
        return bool(engine_module().cpu_features().get("avx2"))
    except EngineUnavailableError:
        return False


def _rows(
    parts: torch.Tensor | Sequence[torch.Tensor], dtypes: dict[torch.dtype, int]
) -> tuple[list[torch.Tensor], tuple[int, ...]] | None:
    """The ``[N, K]`` views the engine reads and the logical shape, or None where it cannot read them
    in place (a dtype not in ``dtypes``, another device, strided rows, parts that differ)."""
    if isinstance(parts, torch.Tensor):
        if parts.dim() == 2:
            views, shape = [parts], tuple(parts.shape)
        elif parts.dim() == 3:
            views, shape = list(parts.unbind(0)), tuple(parts.shape)
        else:
            return None
    else:
        views = list(parts)
        if not views or any(not isinstance(v, torch.Tensor) or v.dim() != 2 for v in views):
            return None
        shape = (len(views), *views[0].shape)
    views = [v.detach() for v in views]
    first = views[0]
    if first.dtype not in dtypes or first.numel() == 0:
        return None
    for v in views:
        if v.device.type != "cpu" or v.dtype != first.dtype or v.shape != first.shape:
            return None
        if v.stride(-1) != 1 or (v.shape[0] > 1 and v.stride(0) != first.stride(0)):
            return None
    return views, shape
