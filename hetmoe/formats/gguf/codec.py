"""``GGUFCodec``: one ggml block type as a hetmoe codec (``gguf:q4_k``, ``gguf:iq2_xxs``, ...).

The stored form is exactly a GGUF tensor's data: one ``uint8`` tensor ``".weight"`` of shape
``[..., N, K / block_elements * block_bytes]``, each row the concatenated ggml blocks of one
output row. The float types F32/F16/BF16 use the same raw-byte container (``K * itemsize``
bytes per row) rather than a float tensor, so every GGUF tensor, quantized or not, round-trips
through one code path and writers can copy the bytes into a GGUF file verbatim.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..base import Codec, FormatError, QuantizedTensor, TensorSpec, check_weight
from .blocks import decode_only_error, dequantize_blocks, nonfinite_scale_block, quantize_blocks
from .types import GGMLType, resolve_type

SUFFIX = ".weight"


class GGUFCodec(Codec):
    """A ggml block type. Build from a name (any case: ``"q4_k"``, ``"Q4_K"``) or a ggml type id.

    ``can_quantize`` is per instance: the K-quants Q2_K/Q3_K and the IQ1/IQ2/IQ3/TQ types are
    decode-only (their quantize raises :class:`~.blocks.DecodeOnlyTypeError`; use llama.cpp's
    ``llama-quantize`` for them).
    """

    method: ClassVar[str] = "gguf"
    convention: ClassVar[str] = "llama.cpp GGUF (ggml blocks)"

    def __init__(self, ggml_type: int | str | GGMLType = "q4_k") -> None:
        self.ggml_type: GGMLType = resolve_type(ggml_type)
        # Shadows the class-level flag: quantizability depends on the type, not the codec class.
        self.can_quantize = self.ggml_type.can_quantize  # type: ignore[misc]

    @property
    def params(self) -> dict[str, Any]:
        return {"type": self.ggml_type.name}

    def label(self) -> str:
        return f"{self.method}:{self.ggml_type.lower}"

    def __repr__(self) -> str:
        return f"GGUFCodec({self.ggml_type.name})"

    def _check_k(self, shape: tuple[int, ...], name: str) -> None:
        t = self.ggml_type
        if len(shape) < 1 or shape[-1] % t.block_elements:
            k = shape[-1] if shape else None
            expected = f"K (last dim) divisible by {t.block_elements} for {t.name} blocks"
            raise FormatError(name, expected, f"K={k} (shape {list(shape)})")

    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        shape = tuple(int(s) for s in shape)
        self._check_k(shape, "weight")
        return [TensorSpec(SUFFIX, torch.uint8, (*shape[:-1], self.ggml_type.row_bytes(shape[-1])))]

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        if not self.can_quantize:
            raise decode_only_error(self.ggml_type, name)
        check_weight(weight, name)
        self._check_k(tuple(weight.shape), name)
        raw = quantize_blocks(weight.detach(), self.ggml_type, name=name)
        return QuantizedTensor(
            method=self.label(),
            shape=tuple(weight.shape),
            tensors={SUFFIX: raw},
            params={"ggml_type": self.ggml_type.name},
        )

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self.validate(q)
        out = dequantize_blocks(q.tensors[SUFFIX], self.ggml_type, shape=tuple(q.shape), name="weight" + SUFFIX)
        return out if dtype == torch.float32 else out.to(dtype)

    def validate(self, q: QuantizedTensor, name: str = "weight") -> None:
        """Shape/K checks, raw byte dtype and row length, the base checks, then every fp16 scale finite."""
        t = self.ggml_type
        shape = tuple(q.shape)
        if len(shape) >= 2:
            self._check_k(shape, name)
        stored = q.params.get("ggml_type")
        if stored is not None and str(stored).upper() != t.name:
            raise FormatError(name, f"ggml_type {t.name} for {self.label()}", f"ggml_type {stored}")
        raw = q.tensors.get(SUFFIX)
        if raw is not None and len(shape) >= 2:
            if raw.dtype != torch.uint8:
                raise FormatError(name + SUFFIX, f"uint8 raw bytes of {t.name} blocks", f"dtype {raw.dtype}")
            want = t.row_bytes(shape[-1])
            if raw.dim() >= 1 and raw.shape[-1] != want:
                raise FormatError(
                    name + SUFFIX,
                    f"{want} bytes per row ({shape[-1]} weights = {shape[-1] // t.block_elements} {t.name} blocks "
                    f"of {t.block_bytes} bytes)",
                    f"{raw.shape[-1]} bytes per row (shape {list(raw.shape)})",
                )
        super().validate(q, name)
        bad = nonfinite_scale_block(q.tensors[SUFFIX], t)
        if bad is not None:
            expected = f"finite {t.name} values" if t.is_float else f"finite fp16 scales in every {t.name} block"
            raise FormatError(name + SUFFIX, expected, self._where(bad, shape))

    def _where(self, flat_block: int, shape: tuple[int, ...]) -> str:
        """Human-readable position of a flat block index: block, row index tuple, block within row."""
        t = self.ggml_type
        per_row = shape[-1] // t.block_elements
        row, col = divmod(flat_block, per_row)
        index = []
        for dim in reversed(shape[:-1]):
            row, r = divmod(row, dim)
            index.append(r)
        what = "a NaN/Inf value" if t.is_float else "a NaN/Inf fp16 scale"
        return f"{what} in block {flat_block} (row {tuple(reversed(index))}, block {col} of {per_row} in the row)"
