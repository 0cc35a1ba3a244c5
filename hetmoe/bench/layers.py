"""Random expert layers at real shapes (formats/random_layout.py builds them in a method's stored
layout), and the one expert a benchmark dequantizes to check against.
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor, get_codec
from ..formats.random_layout import random_projection

__all__ = ["dequantize_expert", "random_projection"]


def dequantize_expert(q: QuantizedTensor, expert: int) -> torch.Tensor:
    """One expert of a stacked projection, dequantized to fp32 ``[N, K]``."""
    one = QuantizedTensor(q.method, tuple(q.shape[1:]), {s: t[expert] for s, t in q.tensors.items()}, q.params)
    return get_codec(q.method, **q.params).dequantize(one)
