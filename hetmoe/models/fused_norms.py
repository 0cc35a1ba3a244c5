"""RMSNorm in one engine call on the CPU: the norm modules of a CPU-only model, rounded as theirs.

transformers' RMSNorm is ~7 eager ops (cast, pow, mean, add, rsqrt, mul, cast, mul); a decode step
of a 4-layer Qwen3-MoE runs 17 norms, ~0.5 ms of dispatch for a few microseconds of arithmetic.
``fuse_rms_norms`` gives each known norm module a forward that calls the engine's ``rms_norm`` for
CPU bf16/fp32 inputs without autograd, and the module's own forward for anything else. Each family
rounds at its own point (its adapter's ``rms_norms``, gathered in ``NORM_MODES``); the fused op
rounds at the same one, so outputs equal the module's up to the order of the fp32 sum of squares
(tests compare every family's class).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from ..kernels.dispatch import engine_module
from .adapters import ADAPTERS

CAST_THEN_SCALE, SCALE_THEN_CAST, OFFSET_SCALE = 0, 1, 2  # csrc/norms.h NormMode
_MODES = {"cast_then_scale": CAST_THEN_SCALE, "scale_then_cast": SCALE_THEN_CAST, "offset_scale": OFFSET_SCALE}
# class name -> (mode, name of its epsilon attribute), as each architecture's adapter states them
NORM_MODES: dict[str, tuple[int, str]] = {
    name: (_MODES[mode], eps) for a in ADAPTERS for name, mode, eps in a.rms_norms
}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> Any:
    w = self.weight
    x = hidden_states
    if (
        x.device.type != "cpu"
        or x.dtype not in _DTYPES
        or w.dtype != x.dtype
        or w.device.type != "cpu"
        or x.shape[-1] != w.shape[0]
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    ):
        return type(self).forward(self, hidden_states)
    return norm_rows(self, x)


def norm_rows(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The engine's RMSNorm of ``x [..., D]`` with a fused norm module's weight, epsilon and rounding;
    the caller has checked what ``_fused_forward`` checks (CPU, x's dtype is the weight's, no grad)."""
    if not x.is_contiguous():
        x = x.contiguous()
    w = norm.weight
    if not w.is_contiguous():
        w = w.contiguous()
    y = torch.empty_like(x)
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    engine_module().rms_norm(
        x.data_ptr(), w.data_ptr(), y.data_ptr(), _DTYPES[x.dtype], rows, cols, norm._hetmoe_eps, norm._hetmoe_mode
    )
    return y


def norm_spec(norm: nn.Module) -> tuple[int, float, int]:
    """What the engine's one-call decode steps read of a fused norm: its weight's address, epsilon and
    rounding mode (csrc/decode_step.h: NormSpec)."""
    return norm.weight.data_ptr(), norm._hetmoe_eps, norm._hetmoe_mode


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every norm module of a known family the fused CPU forward; returns how many."""
    count = 0
    for mod in model.modules():
        spec = NORM_MODES.get(type(mod).__name__)
        weight = getattr(mod, "weight", None)
        if spec is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        mode, eps_attr = spec
        mod._hetmoe_mode = mode
        mod._hetmoe_eps = float(getattr(mod, eps_attr))
        mod.forward = types.MethodType(_fused_forward, mod)  # the instance's, not the class's
        count += 1
    return count
