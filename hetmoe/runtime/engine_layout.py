"""How each stored method is handed to the compiled engine: which tensors, strides, kernel.

Most methods run from their stored bytes as they are (memory-mapped checkpoints included):
bf16, int8, int4 (both layouts: compressed-tensors' int32 words are the same bytes as two codes a
byte, low nibble first), int4-asym with byte zero points, mxfp4 (gpt-oss blocks are rows of
nibbles), fp8 block and fp8 per channel. Two need a one-time repack at load, done here per
projection (bounded by one projection of one layer) and reported in ``repacked_bytes``:

- gptq stores codes along K in int32 columns (``qweight [K/8, N]``); the engine streams rows, so the
  codes are transposed to ``[N, K/2]`` bytes, scales to ``[N, K/g]``, zero points unpacked;
- compressed-tensors int4-asym packs zero points along N; they are unpacked to ``[N, K/g]`` bytes.

GGUF projections go through gguf_transcode.py: exact repacks for Q8_0 and Q4_0, measured
transcoding for the other block types.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import FormatError, QuantizedTensor, get_codec
from ..formats.packing import pack_nibbles, unpack_int32
from ..kernels.dispatch import engine_method_id
from .gguf_transcode import transcode

# Scale kinds: csrc/kernels.h ScaleKind. (Method ids come from the engine's traits table:
# kernels.dispatch.engine_method_id.)
SCALE_F32, SCALE_BF16, SCALE_F16, SCALE_E8M0 = 0, 1, 2, 3
ENGINE_METHODS = ("bf16", "int8", "int4", "int4-asym", "gptq", "mxfp4", "fp8", "fp8-channel", "gguf:*")

# Methods whose 512-bit GEMV in the AVX-512 unit (kernels_common.inc) beats the dequantize-and-GEMM
# path at every token count: the 4-bit nibble formats (gptq is repacked to int4 rows), int8 and
# every GGUF type with a native kernel. (Q6_K joined once its GEMV took activation digits: a
# Qwen3-30B-A3B layer on a Zen 5, 2 threads, 128 tokens 85 -> 45 ms, 512 tokens 196 -> 174 ms.)
WIDE_GEMV_METHODS = (
    "int4", "int4-asym", "gptq", "mxfp4",
    "int8", "gguf:q4_0", "gguf:q8_0", "gguf:q4_k", "gguf:q5_k", "gguf:q6_k", "gguf:iq4_xs", "gguf:iq4_nl",
)  # fmt: skip
GEMV_ALL_TOKENS = 1 << 30  # a gemv_max_tokens no forward reaches


def gemv_is_wide(projections: list[QuantizedTensor]) -> bool:
    """Whether every projection runs a 512-bit GEMV (AMD by default, K at least one group of 256: the
    blocks past the last whole group go through the 256-bit loop, kernels_common.inc) that beats
    dequantizing panels for the fp32 GEMM at (nearly) every token count: measured on a
    Zen 5 (2 threads), linears at 512 tokens 2048 -> 5120: int4 38 -> 31 ms, int8 44 -> 32 ms, Q4_0
    43 -> 38 ms; a Qwen3-30B-A3B layer's experts at 512 tokens: int4 128 -> 121 ms, int8 153 -> 136
    ms, Q4_0 and Q4_K within 3% either way."""
    from ..kernels.dispatch import engine_module, int_vector_bits

    if engine_module().selected_isa() == "avx2":
        return False
    return all(
        q.method in WIDE_GEMV_METHODS
        and q.shape[-1] >= 256
        and int_vector_bits(gemv_width_family(q.method), "prompt") == 512
        for q in projections
    )


# Codecs stored in another codec's engine layout (engine_projection below).
_LAYOUT_OF = {"int4-asym": "int4", "gptq": "int4", "fp8-channel": "fp8"}


def gemv_width_family(method: str) -> str:
    """The GEMV family (kernels.dispatch.WIDTH_FAMILIES, PREFETCH_FAMILIES) of ``method``'s layout from
    its traits row: "int4" (4- to 6-bit digits), "int8" (int16 codes), or "bf16" (float arithmetic:
    bf16, fp8); "int4" for a method without a row of its own (GGUF types the engine transcodes: never
    wide)."""
    from ..kernels.dispatch import gemv_width_family as layout_family

    try:
        return layout_family(_LAYOUT_OF.get(method, method))
    except KeyError:
        return "int4"


# The weight-prefetch family (kernels.dispatch.PREFETCH_FAMILIES) of a method's GEMV: the engine's
# prefetch families are its width families (csrc/kernels.h).
prefetch_family = gemv_width_family


@dataclass
class EngineProjection:
    """One projection ``[E, N, K]`` as the engine reads it."""

    codes: torch.Tensor  # [E, N, row bytes]
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    group: int
    scale_row_div: int
    method_id: int
    scale_kind: int
    repacked_bytes: int = 0
    note: str = ""  # what a GGUF projection was transcoded to, and at what SNR

    def descriptor(self, n: int, k: int) -> tuple[int, ...]:
        def stride_bytes(t: torch.Tensor | None, dim: int) -> int:
            return t.stride(dim) * t.element_size() if t is not None else 0

        s, z = self.scales, self.zeros
        return (
            self.codes.data_ptr(),
            s.data_ptr() if s is not None else 0,
            z.data_ptr() if z is not None else 0,
            stride_bytes(self.codes, 0),
            stride_bytes(self.codes, 1),
            stride_bytes(s, 0),
            stride_bytes(s, 1),
            stride_bytes(z, 0),
            stride_bytes(z, 1),
            n,
            k,
            self.group,
            self.scale_row_div,
            self.method_id,
            self.scale_kind,
        )


def _rows_contiguous(t: torch.Tensor, name: str) -> torch.Tensor:
    """The engine needs each row dense; stacked experts may be strided (views of fused tensors)."""
    if t.stride(-1) != 1:
        raise FormatError(name, "rows contiguous in memory (last stride 1)", f"strides {list(t.stride())}")
    return t


def _check_group(group: int, k: int, name: str) -> None:
    if group < 32 or group % 32 or (group // 32) & (group // 32 - 1) or k % group:
        raise FormatError(name, "a group size of 32, 64, 128 or 256 dividing K for the CPU engine", f"{group}")


def engine_projection(q: QuantizedTensor, name: str) -> EngineProjection:
    """Validate ``q`` (stacked ``[E, N, K]``) and describe it for the engine, repacking if needed."""
    if q.method not in ENGINE_METHODS and not q.method.startswith("gguf:"):
        raise FormatError(name, f"a method the CPU engine runs: {list(ENGINE_METHODS)}", f"method {q.method!r}")
    codec = get_codec(q.method, **q.params)
    if not q.validated:  # the checkpoint reader already checked what it returns
        codec.validate(q, name)
    if len(q.shape) != 3:
        raise FormatError(name, "stacked experts [E, N, K]", f"shape {list(q.shape)}")
    e, n, k = q.shape
    if k % 32:
        raise FormatError(name, "K (input features) a multiple of 32 for the CPU engine", f"K={k}")
    t = q.tensors
    if q.method.startswith("gguf:"):
        tc = transcode(q)
        native = tc.target.endswith("native")
        note = "" if native else f"{q.params['ggml_type']} -> {tc.target}"
        if tc.snr_db != float("inf"):
            note += f", SNR {tc.snr_db:.1f} dB vs stored"
        elif not native:
            note += " (exact)"
        repacked = 0 if native else tc.codes.numel() * tc.codes.element_size()
        return EngineProjection(
            tc.codes, tc.scales, None, tc.group, 1, tc.method_id, tc.scale_kind, repacked_bytes=repacked, note=note
        )
    if q.method == "bf16":
        return EngineProjection(
            _rows_contiguous(t[".weight"], name), None, None, k, 1, engine_method_id("bf16"), SCALE_F32
        )
    if q.method == "int8":
        s = t[".weight_scale"].float().contiguous()
        return EngineProjection(
            _rows_contiguous(t[".weight"], name), s, None, k, 1, engine_method_id("int8"), SCALE_F32
        )
    if q.method in ("int4", "int4-asym"):
        group = int(q.params.get("group_size", 32))
        _check_group(group, k, name)
        ct = q.params.get("layout", "bytes") == "compressed-tensors"
        codes = t[".weight_packed"].view(torch.uint8) if ct else t[".weight"]
        zeros, repacked = None, 0
        if q.method == "int4-asym":
            zeros = codec.zero_points(q).to(torch.uint8).contiguous() if ct else t[".weight_zero_point"]
            repacked = zeros.numel() if ct else 0
        scales = _rows_contiguous(t[".weight_scale"], name)
        return EngineProjection(
            _rows_contiguous(codes, name),
            scales,
            zeros,
            group,
            1,
            engine_method_id("int4"),
            SCALE_BF16,
            repacked_bytes=repacked,
        )
    if q.method == "gptq":
        group = int(q.params.get("group_size", 128))
        group = k if group == -1 else group
        _check_group(group, k, name)
        codes = pack_nibbles(unpack_int32(t[".qweight"].transpose(-1, -2).contiguous()))  # [E, N, K/2]
        scales = t[".scales"].transpose(-1, -2).contiguous()  # [E, N, K/g] fp16
        zeros = None
        if not q.params.get("sym", True):
            zeros = codec.zero_points(q).transpose(-1, -2).to(torch.uint8).contiguous()
        repacked = codes.numel() + scales.numel() * 2 + (zeros.numel() if zeros is not None else 0)
        return EngineProjection(
            codes, scales, zeros, group, 1, engine_method_id("int4"), SCALE_F16, repacked_bytes=repacked
        )
    if q.method == "mxfp4":
        blocks = t["_blocks"]
        codes = blocks.reshape(e, n, k // 2) if blocks.is_contiguous() else blocks.contiguous().reshape(e, n, k // 2)
        return EngineProjection(
            codes, _rows_contiguous(t["_scales"], name), None, 32, 1, engine_method_id("mxfp4"), SCALE_E8M0
        )
    if q.method == "fp8":
        bn, bk = (int(b) for b in q.params.get("block_size", (128, 128)))
        if bk % 16:
            raise FormatError(name, "an fp8 column block that is a multiple of 16", f"{bk}")
        codes = _rows_contiguous(t[".weight"], name).view(torch.uint8)
        scales = t[".weight_scale_inv"].float().contiguous()
        return EngineProjection(codes, scales, None, bk, bn, engine_method_id("fp8"), SCALE_F32)
    # fp8-channel
    qc = codec.canonical(q, name)
    codes = _rows_contiguous(qc.tensors[".weight"], name).view(torch.uint8)
    return EngineProjection(
        codes, qc.tensors[".weight_scale"].contiguous(), None, k, 1, engine_method_id("fp8"), SCALE_F32
    )
