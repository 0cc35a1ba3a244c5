"""``dequantize_blocks`` / ``quantize_blocks``: input checks, dispatch by type, chunking.

Every per-type decoder maps ``uint8 [nblocks, block_bytes]`` to float32 ``[nblocks, block_elements]``
(every encoder the reverse) with whole-tensor torch ops, no Python loop over blocks. Here we only
flatten the leading dimensions (rows, experts) into one block axis and walk it in chunks of about a
million weights, which bounds the temporaries of the encoders' scale searches and keeps a decode's
working set in cache; a 4096 x 4096 matrix is 16 chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..base import FormatError
from . import floats, iquants, kquantize, kquants, legacy, nonlinear, ternary
from .types import GGMLType, resolve_type

Decoder = Callable[[torch.Tensor, torch.Tensor], None]  # (blocks, out) -> fills out
Encoder = Callable[[torch.Tensor], torch.Tensor]  # float32 [n, block_elements] -> uint8 [n, block_bytes]

DECODERS: dict[str, Decoder] = {
    "Q4_0": legacy.decode_q4_0,
    "Q4_1": legacy.decode_q4_1,
    "Q5_0": legacy.decode_q5_0,
    "Q5_1": legacy.decode_q5_1,
    "Q8_0": legacy.decode_q8_0,
    "Q2_K": kquants.decode_q2_k,
    "Q3_K": kquants.decode_q3_k,
    "Q4_K": kquants.decode_q4_k,
    "Q5_K": kquants.decode_q5_k,
    "Q6_K": kquants.decode_q6_k,
    "IQ1_S": iquants.decode_iq1_s,
    "IQ1_M": iquants.decode_iq1_m,
    "IQ2_XXS": iquants.decode_iq2_xxs,
    "IQ2_XS": iquants.decode_iq2_xs,
    "IQ2_S": iquants.decode_iq2_s,
    "IQ3_XXS": iquants.decode_iq3_xxs,
    "IQ3_S": iquants.decode_iq3_s,
    "IQ4_NL": nonlinear.decode_iq4_nl,
    "IQ4_XS": nonlinear.decode_iq4_xs,
    "MXFP4": nonlinear.decode_mxfp4,
    "TQ1_0": ternary.decode_tq1_0,
    "TQ2_0": ternary.decode_tq2_0,
}

ENCODERS: dict[str, Encoder] = {
    "Q4_0": legacy.encode_q4_0,
    "Q4_1": legacy.encode_q4_1,
    "Q5_0": legacy.encode_q5_0,
    "Q5_1": legacy.encode_q5_1,
    "Q8_0": legacy.encode_q8_0,
    "Q4_K": kquantize.encode_q4_k,
    "Q5_K": kquantize.encode_q5_k,
    "Q6_K": kquantize.encode_q6_k,
    "IQ4_NL": nonlinear.encode_iq4_nl,
    "IQ4_XS": nonlinear.encode_iq4_xs,
    "MXFP4": nonlinear.encode_mxfp4,
}

CHUNK_WEIGHTS = 1 << 20


class DecodeOnlyTypeError(FormatError):
    """Quantizing to a type hetmoe can only read (K-quant Q2_K/Q3_K, IQ1/IQ2/IQ3, TQ)."""


def decode_only_error(t: GGMLType, name: str) -> DecodeOnlyTypeError:
    return DecodeOnlyTypeError(
        name,
        "a ggml type hetmoe can quantize (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, "
        "iq4_nl, iq4_xs, mxfp4)",
        f"{t.name}, which hetmoe can only decode",
        "quantize with llama.cpp's llama-quantize, which searches with an importance matrix, then load the GGUF",
    )


def _check_raw(raw: torch.Tensor, t: GGMLType, name: str) -> None:
    if not isinstance(raw, torch.Tensor):
        raise FormatError(name, f"a uint8 torch.Tensor of {t.name} block bytes", type(raw).__name__)
    if raw.dtype != torch.uint8:
        raise FormatError(
            name, f"uint8 raw bytes of {t.name} blocks", f"dtype {raw.dtype}", "pass the GGUF tensor's bytes"
        )
    if raw.dim() < 1:
        raise FormatError(name, "at least one dimension [..., row_bytes]", "a 0-d tensor")
    if raw.shape[-1] % t.block_bytes:
        raise FormatError(
            name,
            f"a row length that is a multiple of {t.block_bytes} bytes ({t.name} block of {t.block_elements})",
            f"{raw.shape[-1]} bytes per row (shape {list(raw.shape)})",
        )


def dequantize_blocks(
    raw: torch.Tensor,
    ggml_type: int | str | GGMLType,
    shape: tuple[int, ...] | None = None,
    *,
    name: str = "raw",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ggml blocks: ``uint8 [..., nblocks * block_bytes]`` -> float32 ``[..., nblocks * block_elements]``.

    Leading dimensions are kept (or the result is reshaped to ``shape``). Bit-exact with ggml's
    ``dequantize_row_*`` and ``gguf.quants.dequantize`` for every supported type. Works on any
    device ``raw`` lives on. ``out`` (a contiguous float32 tensor with the right number of
    elements, on ``raw``'s device) is filled and returned instead of allocating: first-touching a
    fresh output costs about as much as the decode itself on CPU, so streaming loaders should
    reuse one buffer. Raises :class:`FormatError` (naming ``name``) on a wrong dtype, a row length
    that is not whole blocks, or a ``shape``/``out`` with the wrong number of elements.
    """
    t = resolve_type(ggml_type)
    _check_raw(raw, t, name)
    lead = tuple(raw.shape[:-1])
    out_shape = (*lead, raw.shape[-1] // t.block_bytes * t.block_elements)
    numel = math.prod(out_shape)
    if shape is not None and math.prod(shape) != numel:
        raise FormatError(name, f"{math.prod(shape)} weights for shape {list(shape)}", f"{numel} weights in the bytes")
    target = tuple(shape) if shape is not None else out_shape
    if out is not None:
        ok = out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel and out.device == raw.device
        if not ok:
            raise FormatError(
                name,
                f"out: a contiguous float32 tensor of {numel} elements on {raw.device}",
                f"{out.dtype} {list(out.shape)} on {out.device}, contiguous={out.is_contiguous()}",
            )
    if t.is_float:
        decoded = floats.decode_float(raw, t.name).reshape(target)
        return decoded if out is None else out.view(target).copy_(decoded)
    blocks = raw.reshape(-1, t.block_bytes)
    decode = DECODERS[t.name]
    nblocks = blocks.shape[0]
    step = max(1, CHUNK_WEIGHTS // t.block_elements)
    if out is None:
        out = torch.empty((nblocks, t.block_elements), dtype=torch.float32, device=raw.device)
    flat = out.view(nblocks, t.block_elements)
    for start in range(0, nblocks, step):  # chunks of ~1M weights, each decoded whole, in place
        decode(blocks[start : start + step], flat[start : start + step])
    return out.view(target)


def quantize_blocks(w: torch.Tensor, ggml_type: int | str | GGMLType, *, name: str = "weight") -> torch.Tensor:
    """Encode float ``w [..., K]`` to ggml blocks ``uint8 [..., K / block_elements * block_bytes]``.

    Supported for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (ggml's reference quantizers,
    reproduced), MXFP4 (ditto), and Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (hetmoe's round-to-nearest with
    a simple scale choice). Other types raise :class:`DecodeOnlyTypeError`.
    """
    t = resolve_type(ggml_type)
    if not t.can_quantize:
        raise decode_only_error(t, name)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        found = f"dtype {w.dtype}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise FormatError(name, "a floating-point tensor to quantize", found)
    if w.dim() < 1 or w.shape[-1] % t.block_elements:
        k = w.shape[-1] if w.dim() else 0
        raise FormatError(name, f"K (last dim) divisible by {t.block_elements} for {t.name}", f"K={k}")
    if not bool(torch.isfinite(w).all()):
        raise FormatError(name, "finite weights", f"{int((~torch.isfinite(w)).sum())} NaN/Inf entries")
    lead = tuple(w.shape[:-1])
    out_shape = (*lead, t.row_bytes(w.shape[-1]))
    if t.is_float:
        out = floats.encode_float(w, t.name).reshape(out_shape)
    else:
        blocks = w.to(torch.float32).reshape(-1, t.block_elements)
        encode = ENCODERS[t.name]
        nblocks = blocks.shape[0]
        step = max(1, CHUNK_WEIGHTS // t.block_elements)
        out = torch.empty((nblocks, t.block_bytes), dtype=torch.uint8, device=w.device)
        for start in range(0, nblocks, step):
            out[start : start + step] = encode(blocks[start : start + step])
        out = out.reshape(out_shape)
    # Weights beyond fp16 range (F16 itself, or a block scale like max/8 above 65504) would be
    # stored as Inf and poison the decode; refuse rather than write a broken tensor.
    bad = nonfinite_scale_block(out, t)
    if bad is not None:
        raise FormatError(
            name,
            f"weights whose {t.name} encoding fits fp16 (|w| well under 65504 per block)",
            f"an fp16 overflow in block {bad} (max |w| = {float(w.abs().max()):.4g})",
        )
    return out


def nonfinite_scale_block(raw: torch.Tensor, ggml_type: int | str | GGMLType) -> int | None:
    """Flat index of the first block whose fp16 scale (or, for float types, value) is NaN/Inf, else None.

    Only the scale fields are read, so this is cheap next to a decode. MXFP4's e8m0 scale has no
    NaN encoding in ggml (255 decodes to 2**127), so it is never flagged.
    """
    t = resolve_type(ggml_type)
    if t.is_float:
        bad = ~torch.isfinite(floats.float_view(raw, t.name).reshape(-1))
    else:
        blocks = raw.reshape(-1, t.block_bytes)
        if t.name == "IQ1_M":
            fields = [iquants.iq1_m_scale_bytes(blocks)]
        else:
            fields = [blocks[:, o : o + 2] for o in t.f16_scale_offsets]
        if not fields:
            return None
        stacked = torch.stack([f.contiguous().view(torch.float16).reshape(-1) for f in fields], dim=-1)
        bad = ~torch.isfinite(stacked).all(dim=-1)
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0, 0])
