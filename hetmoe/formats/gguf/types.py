"""The ggml block types hetmoe reads (and for some, writes): ids, block geometry, scale fields.

Every ggml tensor row is a run of fixed-size blocks; a block holds ``block_elements`` weights in
``block_bytes`` bytes. The ids are ggml's ``enum ggml_type`` values as written in GGUF files;
``tests/test_gguf_codecs.py`` checks ids and geometry against ``gguf.GGML_QUANT_SIZES`` so a
typo here cannot go unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256  # super-block size of the K-quants, I-quants and ternary types


class UnknownGGMLTypeError(ValueError):
    """A ggml type name or id that hetmoe does not know (or does not support)."""


@dataclass(frozen=True)
class GGMLType:
    """One ggml block type.

    ``f16_scale_offsets`` are the byte offsets, inside a block, of the fp16 super-scales (``d``,
    ``dmin``, ``m``): validation decodes exactly these to catch NaN/Inf before a decode silently
    spreads them over a whole block. IQ1_M scatters its fp16 scale over four nibbles and MXFP4 uses
    an e8m0 exponent byte, so both list none and are handled separately.
    """

    name: str
    type_id: int
    block_elements: int
    block_bytes: int
    f16_scale_offsets: tuple[int, ...] = ()
    can_quantize: bool = False

    @property
    def is_float(self) -> bool:
        """Plain float storage (one element per "block"): F32, F16, BF16."""
        return self.block_elements == 1

    @property
    def lower(self) -> str:
        return self.name.lower()

    def row_bytes(self, k: int) -> int:
        """Bytes of a row of ``k`` weights (``k`` must be a multiple of the block size)."""
        return k // self.block_elements * self.block_bytes


_TYPES: tuple[GGMLType, ...] = (
    GGMLType("F32", 0, 1, 4, can_quantize=True),
    GGMLType("F16", 1, 1, 2, can_quantize=True),
    GGMLType("BF16", 30, 1, 2, can_quantize=True),
    GGMLType("Q4_0", 2, 32, 18, (0,), can_quantize=True),
    GGMLType("Q4_1", 3, 32, 20, (0, 2), can_quantize=True),
    GGMLType("Q5_0", 6, 32, 22, (0,), can_quantize=True),
    GGMLType("Q5_1", 7, 32, 24, (0, 2), can_quantize=True),
    GGMLType("Q8_0", 8, 32, 34, (0,), can_quantize=True),
    GGMLType("Q2_K", 10, QK_K, 84, (80, 82)),
    GGMLType("Q3_K", 11, QK_K, 110, (108,)),
    GGMLType("Q4_K", 12, QK_K, 144, (0, 2), can_quantize=True),
    GGMLType("Q5_K", 13, QK_K, 176, (0, 2), can_quantize=True),
    GGMLType("Q6_K", 14, QK_K, 210, (208,), can_quantize=True),
    GGMLType("IQ2_XXS", 16, QK_K, 66, (0,)),
    GGMLType("IQ2_XS", 17, QK_K, 74, (0,)),
    GGMLType("IQ3_XXS", 18, QK_K, 98, (0,)),
    GGMLType("IQ1_S", 19, QK_K, 50, (0,)),
    GGMLType("IQ4_NL", 20, 32, 18, (0,), can_quantize=True),
    GGMLType("IQ3_S", 21, QK_K, 110, (0,)),
    GGMLType("IQ2_S", 22, QK_K, 82, (0,)),
    GGMLType("IQ4_XS", 23, QK_K, 136, (0,), can_quantize=True),
    GGMLType("IQ1_M", 29, QK_K, 56),
    GGMLType("TQ1_0", 34, QK_K, 54, (52,)),
    GGMLType("TQ2_0", 35, QK_K, 66, (64,)),
    GGMLType("MXFP4", 39, 32, 17, can_quantize=True),
)

GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in _TYPES}
"""Supported types by upper-case ggml name."""

GGML_TYPES_BY_ID: dict[int, GGMLType] = {t.type_id: t for t in _TYPES}


def resolve_type(ggml_type: int | str | GGMLType) -> GGMLType:
    """The table entry for a name (any case, ``"q4_k"``), a ggml id (``12``) or an entry."""
    if isinstance(ggml_type, GGMLType):
        return ggml_type
    # IntEnum members (gguf.GGMLQuantizationType) are ints; bool is excluded on purpose.
    if isinstance(ggml_type, int) and not isinstance(ggml_type, bool):
        found = GGML_TYPES_BY_ID.get(int(ggml_type))
    elif isinstance(ggml_type, str):
        found = GGML_TYPES.get(ggml_type.strip().upper())
    else:
        found = None
    if found is None:
        known = ", ".join(t.lower for t in _TYPES)
        raise UnknownGGMLTypeError(f"unsupported ggml type {ggml_type!r}; supported: {known}")
    return found
