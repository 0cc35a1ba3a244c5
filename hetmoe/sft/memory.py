"""What a training model holds, counted in bytes of distinct storages.

``held_bytes(model)`` sums every distinct storage reachable from the model's parameters and
buffers plus the CPU experts' stored tensors (and the engine's repacked copies) of every SFTMoE.
A storage shared by several tensors (views, the engine reading the stored tensors in place) counts
once, so comparing it with the same model before ``prepare_model`` says whether any expert is held
twice. Memory-mapped checkpoint views count at the size of the mapping they view.
"""

from __future__ import annotations

import torch
from torch import nn


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    from .block import SFTMoE

    out = [p for p in model.parameters()] + [b for b in model.buffers()]
    for m in model.modules():
        if isinstance(m, SFTMoE):
            out += m.base.tensors()
    return out


def held_bytes(model: nn.Module) -> int:
    seen: dict[int, int] = {}
    for t in _tensors(model):
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())
