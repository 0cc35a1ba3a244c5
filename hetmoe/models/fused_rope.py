"""Rotary embedding in one engine call on the CPU, rounded exactly as transformers' eager ops round.

transformers' ``apply_rotary_pos_emb`` is ~14 eager ops per attention layer (unsqueeze, slices,
neg, cat, four products, two sums); in a CPU decode step that is ~0.3 ms of dispatch for a 4-layer
model. For the families whose modeling file uses the standard function (``FAMILIES``, from the
adapters' ``standard_rotary``: rotate_half over the whole head, cos/sin unsqueezed at dim 1),
``fuse_rotary(model)`` replaces that function in the model's own modeling module with one that
calls the engine's ``rope`` for CPU bf16/fp32 inputs without autograd and the original otherwise.
The engine rounds after each of the three operations in bf16 as torch does, so results are
bit-identical (a test holds it to that), which is why replacing the module-level function, which
other models of the same family in the process also use, changes no one's numbers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..kernels.dispatch import engine_module
from .adapters import ADAPTERS

# modeling modules whose apply_rotary_pos_emb is the standard full-head rotate_half one: the
# architectures whose adapter says so (MoEAdapter.standard_rotary)
FAMILIES = tuple(
    f"transformers.models.{a.model_types[0]}.modeling_{a.model_types[0]}" for a in ADAPTERS if a.standard_rotary
)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The engine's rotary embedding of ``x [B, H, T, D]`` with contiguous ``cos``/``sin [B or 1, T, D]``
    of x's dtype (checked by the caller)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    b, h, t, d = x.shape
    engine_module().rope(
        x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), _DTYPES[x.dtype], b, h, t, d, cos.shape[0] == b
    )
    return out


def _fused(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = (q, k, cos, sin)
        if (
            unsqueeze_dim != 1
            or any(t.device.type != "cpu" or t.dtype != q.dtype for t in tensors)
            or q.dtype not in _DTYPES
            or q.dim() != 4
            or k.dim() != 4
            or cos.dim() != 3
            or sin.shape != cos.shape
            or q.shape[-1] % 2
            or cos.shape[-1] != q.shape[-1]
            or k.shape[-1] != q.shape[-1]
            or cos.shape[1] != q.shape[2]
            or k.shape[2] != q.shape[2]
            or cos.shape[0] not in (1, q.shape[0])
            or k.shape[0] != q.shape[0]
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        ):
            return original(q, k, cos, sin, unsqueeze_dim)
        cos, sin = cos.contiguous(), sin.contiguous()
        return rope(q, cos, sin), rope(k, cos, sin)

    apply_rotary_pos_emb.hetmoe_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def fuse_rotary(model: nn.Module) -> bool:
    """Give the model's modeling module the fused apply_rotary_pos_emb; False if its family is not one
    of ``FAMILIES`` (nothing changes then)."""
    name = type(model).__module__
    module = sys.modules.get(name)
    if name not in FAMILIES or module is None:
        return False
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is None:
        return False
    if not hasattr(current, "hetmoe_original"):
        module.apply_rotary_pos_emb = _fused(current)
    return True
