"""int4 and int4-asym: 4-bit codes with a scale (and for -asym a zero point) per group of K.

Two on-disk layouts, chosen with ``layout=``:

``"bytes"`` (hetmoe's expert store): ``weight`` uint8 ``[N, K/2]``, low nibble = even k;
``weight_scale`` bf16 ``[N, K/g]``; -asym adds ``weight_zero_point`` uint8 ``[N, K/g]``.

``"compressed-tensors"`` (``pack-quantized``, Kimi-K2): ``weight_packed`` int32 ``[N, K/8]`` with
value i of a word at bits 4i; ``weight_scale`` bf16 ``[N, K/g]``; ``weight_shape`` ``[2]`` = (N, K);
-asym adds ``weight_zero_point`` int32 ``[ceil(N/8), K/g]``, packed along N.

Either way the stored nibble is the code plus 8 (compressed-tensors' offset for signed ints):
symmetric ``w = (code - 8) * s`` with no zero point at all; asymmetric ``w = (code - z) * s``.
"""

from __future__ import annotations

import torch

from .base import Codec, FormatError, QuantizedTensor, TensorSpec, check_divisible, check_weight
from .int_scales import asymmetric_int4, symmetric_int4
from .packing import pack_int32, pack_nibbles, unpack_int32, unpack_nibbles
from .registry import register

LAYOUTS = ("bytes", "compressed-tensors")


class _Int4Base(Codec):
    asymmetric = False

    def __init__(self, group_size: int = 32, layout: str = "bytes") -> None:
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
            raise FormatError("group_size", "a positive multiple of 8 (32, 64 or 128 typically)", repr(group_size))
        if layout not in LAYOUTS:
            raise FormatError("layout", f"one of {LAYOUTS}", repr(layout))
        self.group_size = group_size
        self.layout = layout

    @property
    def params(self) -> dict[str, object]:
        return {"group_size": self.group_size, "layout": self.layout}

    def label(self) -> str:
        suffix = " compressed-tensors" if self.layout != "bytes" else ""
        return f"{self.method} g{self.group_size}{suffix}"

    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        *lead, n, k = shape
        groups = (*lead, n, k // self.group_size)
        if self.layout == "bytes":
            specs = [TensorSpec(".weight", torch.uint8, (*lead, n, k // 2))]
        else:
            specs = [
                TensorSpec(".weight_packed", torch.int32, (*lead, n, k // 8)),
                TensorSpec(".weight_shape", torch.int64, (*lead, 2)),
            ]
        specs.append(TensorSpec(".weight_scale", torch.bfloat16, groups))
        if self.asymmetric:
            if self.layout == "bytes":
                specs.append(TensorSpec(".weight_zero_point", torch.uint8, groups))
            else:
                specs.append(TensorSpec(".weight_zero_point", torch.int32, (*lead, -(-n // 8), k // self.group_size)))
        return specs

    def _groups(self, weight: torch.Tensor, name: str) -> torch.Tensor:
        check_weight(weight, name)
        k = weight.shape[-1]
        check_divisible(k, self.group_size, name, "K")
        return weight.reshape(*weight.shape[:-1], k // self.group_size, self.group_size)

    def stored(
        self, shape: tuple[int, ...], nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
    ) -> QuantizedTensor:
        """The layout's tensors from codes packed two a byte ``uint8 [..., N, K/2]`` (low nibble = even k),
        per-group scales ``[..., N, K/g]`` and, for -asym, zero points ``uint8 [..., N, K/g]``: what
        ``quantize`` and the engine's quantizer (kernels/quantize.py) both produce."""
        if self.layout == "bytes":
            tensors = {".weight": nibbles}
        else:
            tensors = {
                ".weight_packed": nibbles.reshape(-1).view(torch.int32).reshape(*shape[:-1], -1),
                ".weight_shape": torch.tensor(shape[-2:], dtype=torch.int64).expand(*shape[:-2], 2).contiguous(),
            }
        tensors[".weight_scale"] = scale.to(torch.bfloat16).contiguous()
        if self.asymmetric:
            assert zero is not None
            if self.layout == "bytes":
                tensors[".weight_zero_point"] = zero.contiguous()
            else:  # packed along N, padded to a multiple of 8 rows
                padded = torch.nn.functional.pad(zero, (0, 0, 0, -shape[-2] % 8))
                tensors[".weight_zero_point"] = (
                    pack_int32(padded.transpose(-1, -2).contiguous()).transpose(-1, -2).contiguous()
                )
        return QuantizedTensor(self.method, tuple(shape), tensors, self.params)

    def repacked(self, q: QuantizedTensor, target: Codec) -> QuantizedTensor | None:
        """Between the two layouts (Kimi-K2's compressed-tensors and the store's bytes) of one group
        size: the same codes, scales and zero points. An int32 word holding value i at bits 4i is, read
        as little-endian bytes, the bytes layout's two codes a byte, low nibble first."""
        if (same := super().repacked(q, target)) is not None:
            return same
        if type(target) is not type(self) or not isinstance(target, _Int4Base) or target.group_size != self.group_size:
            return None
        nibbles = q.tensors[".weight"] if self.layout == "bytes" else q.tensors[".weight_packed"].view(torch.uint8)
        zero = self.zero_points(q).to(torch.uint8) if self.asymmetric else None
        return target.stored(tuple(q.shape), nibbles, q.tensors[".weight_scale"], zero)

    def codes(self, q: QuantizedTensor) -> torch.Tensor:
        """The unsigned stored codes ``uint8 [..., N, K]`` (value + 8)."""
        if self.layout == "bytes":
            return unpack_nibbles(q.tensors[".weight"])
        return unpack_int32(q.tensors[".weight_packed"])

    def zero_points(self, q: QuantizedTensor) -> torch.Tensor:
        """Per-group zero points ``[..., N, K/g]`` as float (8 for the symmetric format)."""
        scale = q.tensors[".weight_scale"]
        if not self.asymmetric:
            return torch.full(scale.shape, 8.0)
        zp = q.tensors[".weight_zero_point"]
        if self.layout == "bytes":
            return zp.float()
        n = q.shape[-2]
        # Packed along N: unpack the transposed tensor, drop the padding rows.
        unpacked = unpack_int32(zp.transpose(-1, -2).contiguous()).transpose(-1, -2)
        return unpacked[..., :n, :].float()

    def validate(self, q: QuantizedTensor, name: str = "weight") -> None:
        check_divisible(q.shape[-1], self.group_size, name, "K")
        super().validate(q, name)
        if self.layout != "bytes":
            stored = q.tensors[".weight_shape"].reshape(-1, 2)
            want = torch.tensor(q.shape[-2:], dtype=torch.int64)
            if not bool((stored == want).all()):
                raise FormatError(name + ".weight_shape", f"{list(q.shape[-2:])}", f"{stored[0].tolist()}")
        if self.asymmetric and self.layout == "bytes":
            zmax = int(q.tensors[".weight_zero_point"].max()) if q.tensors[".weight_zero_point"].numel() else 0
            if zmax > 15:
                raise FormatError(name + ".weight_zero_point", "zero points in 0..15", f"max {zmax}")

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        *lead, n, k = q.shape
        g = self.group_size
        codes = self.codes(q).float().reshape(*lead, n, k // g, g)
        zero = self.zero_points(q).unsqueeze(-1)
        scale = q.tensors[".weight_scale"].float().unsqueeze(-1)
        return ((codes - zero) * scale).reshape(*lead, n, k).to(dtype)


@register
class Int4Codec(_Int4Base):
    method = "int4"
    convention = (
        "symmetric, stored code - 8, per-group bf16 scale; bytes or compressed-tensors pack-quantized (Kimi-K2)"
    )

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        groups = self._groups(weight, name)
        signed, scale = symmetric_int4(groups, torch.bfloat16)
        codes = (signed + 8).to(torch.uint8).reshape(weight.shape)
        return self.stored(tuple(weight.shape), pack_nibbles(codes), scale)


@register
class Int4AsymCodec(_Int4Base):
    method = "int4-asym"
    convention = "asymmetric (AWQ-like): per-group scale and zero point, w = (q - z) * s"
    asymmetric = True

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        groups = self._groups(weight, name)
        codes, scale, zero = asymmetric_int4(groups, torch.bfloat16)
        return self.stored(tuple(weight.shape), pack_nibbles(codes.reshape(weight.shape)), scale, zero)
