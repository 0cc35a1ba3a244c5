"""One codec per precision: quantize, dequantize, pack, unpack, the on-disk convention.

``get_codec("int4", group_size=32)`` returns a codec; ``methods()`` lists them all.
"""

from .base import Codec, FormatError, QuantizedTensor, TensorSpec, snr_db
from .registry import UnknownMethodError, get_codec, methods

__all__ = [
    "Codec",
    "FormatError",
    "QuantizedTensor",
    "TensorSpec",
    "UnknownMethodError",
    "get_codec",
    "methods",
    "snr_db",
]
