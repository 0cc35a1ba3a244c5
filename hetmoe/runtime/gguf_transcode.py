"""GGUF experts for the engine: native kernels for the common block formats, transcoding (with its
measured SNR) for the rest.

- Q4_0, Q8_0, IQ4_NL (blocks of 32) and Q4_K, Q5_K, Q6_K, IQ4_XS (superblocks of 256) run natively
  from their stored bytes: no copy, and Q4_K_M's mixed Q4_K/Q6_K layers run as they are.
- F16/BF16/F32 become bf16 (exact for BF16).
- MXFP4 (gpt-oss's experts as llama.cpp's converter writes them) becomes the engine's mxfp4: the same
  codes and exponents, its nibbles reordered (exact, no arithmetic).
- Every other type is dequantized with hetmoe's GGUF decoders and re-quantized, one projection of
  one layer at a time: to int8 with fp16 scales per 32 when the source has 4 bits or more (its
  error against the stored values is far below the source's own quantization error), to int4 g32
  below 4 bits (IQ1/IQ2/IQ3, Q2_K, Q3_K, TQ). The SNR against the stored values is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import QuantizedTensor, get_codec, snr_db
from ..formats.gguf import dequantize_blocks
from ..kernels.dispatch import engine_method_id
from ..kernels.quantize import engine_quantize

SCALE_F16 = 2


def native_id(ggml: str) -> int | None:
    """The engine's method id of a GGUF block type it runs from its own bytes (its traits table has a
    ``gguf:`` row for it), else None."""
    try:
        return engine_method_id(f"gguf:{ggml.lower()}")
    except KeyError:
        return None


@dataclass
class Transcoded:
    codes: torch.Tensor
    scales: torch.Tensor | None
    method_id: int  # engine Method
    scale_kind: int
    group: int
    target: str  # what it runs as, e.g. "int8 g32 (fp16 scales)"
    snr_db: float  # against the stored values (inf when exact)


def _int8_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> int8 codes and fp16 scales per 32 (amax / 127, scale rounded first)."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / 127.0).to(torch.float16).float()
    codes = (groups / torch.where(scale > 0, scale, torch.ones_like(scale))).round().clamp(-127, 127)
    return codes.to(torch.int8).reshape(w.shape), scale.squeeze(-1).to(torch.float16)


def mxfp4_from_ggml(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 blocks ``[..., B, 17]`` (``e | qs[16]``: element j in the low nibble of ``qs[j]``, element
    j + 16 in its high nibble; value ``kvalues_mxfp4[code] * 2^(e - 128)`` with the table doubled) ->
    the mxfp4 codec's codes ``[..., B * 16]`` (element 2i low, 2i + 1 high: formats/mxfp4.py) and e8m0
    exponents ``[..., B]``. The code values agree (ggml's table is E2M1's doubled against a halved
    scale), so only the nibbles move."""
    qs = blocks[..., 1:]
    elements = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [..., B, 32] in element order
    codes = elements[..., 0::2] | (elements[..., 1::2] << 4)
    return codes.reshape(*blocks.shape[:-2], -1).contiguous(), blocks[..., 0].contiguous()


def transcode(q: QuantizedTensor) -> Transcoded:
    """``q``: a stacked ``gguf:*`` projection ``[E, N, K]`` -> what the engine runs."""
    from .engine_layout import SCALE_BF16, SCALE_F32

    ggml = str(q.params["ggml_type"]).upper()
    raw = q.tensors[".weight"]
    e, n, k = q.shape
    native = native_id(ggml)
    if native is not None:
        if raw.stride(-1) != 1:
            raw = raw.contiguous()
        return Transcoded(raw, None, native, SCALE_F32, 32, f"{ggml} native", float("inf"))
    if ggml == "MXFP4":
        from .engine_layout import SCALE_E8M0

        codes, exponents = mxfp4_from_ggml(raw.reshape(e, n, k // 32, 17))
        if not bool((exponents == 255).any()):  # e8m0's NaN, which ggml reads as 2^127: transcoded below
            return Transcoded(codes, exponents, engine_method_id("mxfp4"), SCALE_E8M0, 32, "mxfp4", float("inf"))
    stored = dequantize_blocks(raw, ggml).reshape(e, n, k)
    if ggml in ("F16", "BF16", "F32"):
        codes = stored.to(torch.bfloat16)
        return Transcoded(codes, None, engine_method_id("bf16"), SCALE_F32, k, "bf16", snr_db(stored, codes.float()))
    bits = get_codec(f"gguf:{ggml.lower()}").bits_per_weight((n, k))
    if bits >= 4.0:
        codes, scales = _int8_groups(stored)
        back = codes.float().reshape(e, n, -1, 32) * scales.float().unsqueeze(-1)
        snr = snr_db(stored, back.reshape(e, n, k))
        return Transcoded(codes, scales, engine_method_id("int8"), SCALE_F16, 32, "int8 g32", snr)
    codec = get_codec("int4", group_size=32)
    q4 = engine_quantize(codec, stored) or codec.quantize(stored)  # the engine's bytes equal the codec's
    return Transcoded(
        q4.tensors[".weight"],
        q4.tensors[".weight_scale"],
        engine_method_id("int4"),
        SCALE_BF16,
        32,
        "int4 g32",
        snr_db(stored, codec.dequantize(q4)),
    )
