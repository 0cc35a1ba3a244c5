"""gptq: AutoGPTQ / vLLM 4-bit checkpoints, ``desc_act=False``.

On disk (per linear, K = in_features, N = out_features, g = group size):
``qweight`` int32 ``[K/8, N]`` (8 codes along K, code of k = 8r+i at bits 4i of row r);
``scales`` fp16 ``[K/g, N]``; ``qzeros`` int32 ``[K/g, N/8]`` (8 zero points along N, at bits 4i);
``g_idx`` int32 ``[K]`` = k // g.

Symmetric checkpoints are vLLM's ``uint4b8``: ``w = (q - 8) * s`` and qzeros is ignored (written as
the classic constant, 0x77777777 in v1, 0x88888888 in v2). Asymmetric ones read the zero point from
qzeros: ``checkpoint_format="gptq"`` (v1) stores ``z - 1`` (AutoGPTQ's historical off-by-one),
``"gptq_v2"`` stores ``z``; ``w = (q - z) * s``.
"""

from __future__ import annotations

import torch

from .base import Codec, FormatError, QuantizedTensor, TensorSpec, check_divisible, check_weight
from .int_scales import asymmetric_int4, symmetric_int4
from .packing import pack_int32, pack_nibbles, unpack_int32
from .registry import register

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@register
class GPTQCodec(Codec):
    method = "gptq"
    convention = "AutoGPTQ/vLLM: qweight i32 [K/8,N], scales f16 [K/g,N], qzeros i32 [K/g,N/8], g_idx"

    def __init__(self, group_size: int = 128, sym: bool = True, checkpoint_format: str = "gptq") -> None:
        if not isinstance(group_size, int) or (group_size != -1 and (group_size <= 0 or group_size % 8)):
            raise FormatError("group_size", "-1 or a positive multiple of 8 (32..256 typically)", repr(group_size))
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise FormatError("checkpoint_format", f"one of {CHECKPOINT_FORMATS}", repr(checkpoint_format))
        self.group_size = group_size
        self.sym = bool(sym)
        self.checkpoint_format = checkpoint_format

    @property
    def params(self) -> dict[str, object]:
        return {"group_size": self.group_size, "sym": self.sym, "checkpoint_format": self.checkpoint_format}

    def label(self) -> str:
        kind = "sym" if self.sym else "asym"
        return f"gptq g{self.group_size} {kind} {self.checkpoint_format}"

    def _g(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        *lead, n, k = shape
        groups = k // self._g(k)
        return [
            TensorSpec(".qweight", torch.int32, (*lead, k // 8, n)),
            TensorSpec(".qzeros", torch.int32, (*lead, groups, n // 8)),
            TensorSpec(".scales", torch.float16, (*lead, groups, n)),
            TensorSpec(".g_idx", torch.int32, (*lead, k)),
        ]

    def _check_shape(self, shape: tuple[int, ...], name: str) -> None:
        n, k = shape[-2], shape[-1]
        check_divisible(k, 8, name, "K (in_features)")
        check_divisible(k, self._g(k), name, "K (in_features)")
        check_divisible(n, 8, name, "N (out_features)")

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        check_weight(weight, name)
        shape = tuple(weight.shape)
        self._check_shape(shape, name)
        *lead, n, k = shape
        g = self._g(k)
        groups = weight.reshape(*lead, n, k // g, g)
        if self.sym:
            signed, scale = symmetric_int4(groups, torch.float16)
            codes = (signed + 8).to(torch.uint8)
            zeros = torch.full(scale.shape, 8, dtype=torch.uint8)
        else:
            min_zero = 1 if self.checkpoint_format == "gptq" else 0
            codes, scale, zeros = asymmetric_int4(groups, torch.float16, min_zero=min_zero)
        return self.stored(shape, pack_nibbles(codes.reshape(*lead, n, k)), scale, zeros)

    def stored(
        self, shape: tuple[int, ...], nibbles: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor
    ) -> QuantizedTensor:
        """The checkpoint tensors from codes packed two a byte ``uint8 [..., N, K/2]`` (low nibble = even k),
        scales ``[..., N, K/g]`` and zero points ``uint8 [..., N, K/g]`` (8 when symmetric): what ``quantize``
        and the engine's quantizer (kernels/quantize.py) both produce."""
        *lead, n, k = shape
        stored_zeros = (zeros.to(torch.int16) - 1) & 0xF if self.checkpoint_format == "gptq" else zeros
        qweight = nibbles.reshape(-1).view(torch.int32).reshape(*lead, n, k // 8)
        tensors = {
            ".qweight": qweight.transpose(-1, -2).contiguous(),
            ".qzeros": pack_int32(stored_zeros.transpose(-1, -2).contiguous()),
            ".scales": scale.to(torch.float16).transpose(-1, -2).contiguous(),
            ".g_idx": (torch.arange(k, dtype=torch.int32) // self._g(k)).expand(*lead, k).contiguous(),
        }
        return QuantizedTensor(self.method, tuple(shape), tensors, self.params)

    def group_grid(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The grid ``quantize`` picks for each group ``[..., G, g]``: (scale as stored, float32; zero point 0..15).

        Exposed so a quantizer that chooses codes itself (GPTQ's error compensation) lands on the
        same grid as round-to-nearest: the symmetric zero point is always 8 (``uint4b8``).
        """
        if self.sym:
            _, scale = symmetric_int4(groups, torch.float16)
            return scale, torch.full(scale.shape, 8, dtype=torch.uint8)
        min_zero = 1 if self.checkpoint_format == "gptq" else 0
        _, scale, zero = asymmetric_int4(groups, torch.float16, min_zero=min_zero)
        return scale, zero

    def pack(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> QuantizedTensor:
        """Store codes ``uint8 [..., N, K]``, scales ``[..., N, G]`` and zero points ``[..., N, G]`` (0..15).

        The inverse of ``codes``/``zero_points`` for callers that chose codes themselves; the
        zero points are written by the checkpoint format (v1: ``z - 1``), the classic constant
        when symmetric.
        """
        shape = tuple(codes.shape)
        self._check_shape(shape, "codes")
        *lead, n, k = shape
        g = self._g(k)
        if tuple(scales.shape) != (*lead, n, k // g) or tuple(zeros.shape) != tuple(scales.shape):
            raise FormatError(
                "scales/zeros", f"shape {[*lead, n, k // g]}", f"{list(scales.shape)} / {list(zeros.shape)}"
            )
        if self.sym:
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8)
        z = zeros.to(torch.int16)
        stored_zeros = (z - 1) & 0xF if self.checkpoint_format == "gptq" else z
        tensors = {
            ".qweight": pack_int32(codes.to(torch.uint8)).transpose(-1, -2).contiguous(),
            ".qzeros": pack_int32(stored_zeros.to(torch.uint8).transpose(-1, -2).contiguous()),
            ".scales": scales.to(torch.float16).transpose(-1, -2).contiguous(),
            ".g_idx": (torch.arange(k, dtype=torch.int32) // g).expand(*lead, k).contiguous(),
        }
        return QuantizedTensor(self.method, shape, tensors, self.params)

    def codes(self, q: QuantizedTensor) -> torch.Tensor:
        """Unsigned codes ``uint8 [..., N, K]``."""
        return unpack_int32(q.tensors[".qweight"].transpose(-1, -2).contiguous())

    def zero_points(self, q: QuantizedTensor) -> torch.Tensor:
        """Zero points ``[..., K/g, N]`` as float, by the convention (8 when symmetric)."""
        scales = q.tensors[".scales"]
        if self.sym:
            return torch.full(scales.shape, 8.0)
        z = unpack_int32(q.tensors[".qzeros"]).float()
        return z + 1.0 if self.checkpoint_format == "gptq" else z

    def validate(self, q: QuantizedTensor, name: str = "weight") -> None:
        self._check_shape(tuple(q.shape), name)
        super().validate(q, name)
        k = q.shape[-1]
        want = torch.arange(k, dtype=torch.int32) // self._g(k)
        if not bool((q.tensors[".g_idx"] == want).all()):
            raise FormatError(
                name + ".g_idx",
                f"k // {self._g(k)} for every k (desc_act=False)",
                "a permuted group index",
                "act-order (desc_act=True) checkpoints are not supported: re-quantize with desc_act=False",
            )

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        *lead, n, k = q.shape
        g = self._g(k)
        codes = self.codes(q).float().reshape(*lead, n, k // g, g)
        scale = q.tensors[".scales"].float().transpose(-1, -2).unsqueeze(-1)
        zero = self.zero_points(q).transpose(-1, -2).unsqueeze(-1)
        return ((codes - zero) * scale).reshape(*lead, n, k).to(dtype)
