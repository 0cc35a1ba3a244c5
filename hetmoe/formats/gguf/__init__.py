"""GGUF / ggml block formats.

Vectorised torch decoders for every common ggml type (bit-exact with ggml), encoders for those a
round-to-nearest quantizer handles, and the ``gguf:<type>`` codec family (``gguf:q4_k``, ...).
Importing this package registers the family with :mod:`hetmoe.formats.registry`.
"""

from __future__ import annotations

from typing import Any

from ..registry import UnknownMethodError, register_family
from .blocks import DecodeOnlyTypeError, dequantize_blocks, quantize_blocks
from .codec import GGUFCodec
from .types import GGML_TYPES, GGML_TYPES_BY_ID, GGMLType, UnknownGGMLTypeError, resolve_type

__all__ = [
    "GGML_TYPES",
    "GGML_TYPES_BY_ID",
    "DecodeOnlyTypeError",
    "GGMLType",
    "GGUFCodec",
    "UnknownGGMLTypeError",
    "dequantize_blocks",
    "members",
    "quantize_blocks",
    "resolve_type",
]


def _factory(member: str, **params: Any) -> GGUFCodec:
    """``gguf:<member>``; a ``type``/``ggml_type`` parameter (as in saved params) must agree."""
    try:
        t = resolve_type(member)
        for key, value in params.items():
            if key not in ("type", "ggml_type"):
                raise UnknownMethodError(f"method 'gguf:{member}' takes no parameter {key!r}")
            if resolve_type(value) is not t:
                raise UnknownMethodError(f"method 'gguf:{member}' given conflicting {key}={value!r}")
    except UnknownGGMLTypeError as exc:
        raise UnknownMethodError(str(exc)) from None
    return GGUFCodec(t)


def members() -> list[str]:
    """Lower-case names of every supported ggml type (the ``gguf:`` family members)."""
    return [t.lower for t in GGML_TYPES.values()]


register_family("gguf", _factory, members)
