"""SiLU and sigmoid in the CPU engine, for the MLPs whose linears run there (dense layers, shared
experts) and the sigmoid gate on Qwen2-MoE's and Qwen3-Next's shared experts.

A one-call decode layer (csrc/decode_step.h: DecodeMLP, run by models/mla_decode.py's step) computes
a dense MLP's ``down(silu(gate(h)) * up(h))`` in C++ with the engine's vectorised silu. The same MLP
run module by module (a prompt, or a step the one-call layer does not take) must give the same
values, so its transformers activation is swapped for ``EngineSiLU``, which calls that same function
on CPU bf16/fp32 inputs without autograd (torch's silu and the engine's are each within an ulp or
two of exact, not equal). Elsewhere (a device, autograd) torch's silu.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.dispatch import EngineUnavailableError, engine_module

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # csrc: kF32, kBF16Data


def _in_engine(x: torch.Tensor, function: str, fallback: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The engine's elementwise ``function`` (csrc/decode_step.h) of x, rounded to x's dtype, where it
    runs x (CPU bf16/fp32 without autograd); elsewhere ``fallback``, torch's."""
    code = _DTYPES.get(x.dtype)
    if code is None or x.device.type != "cpu" or not x.numel() or (torch.is_grad_enabled() and x.requires_grad):
        return fallback(x)
    try:
        engine = engine_module()
    except EngineUnavailableError:
        return fallback(x)
    src = x.contiguous()
    out = torch.empty_like(src)
    getattr(engine, function)(src.data_ptr(), code, src.numel(), out.data_ptr())
    return out


class EngineSiLU(nn.Module):
    """``silu(x)`` rounded to x's dtype by the engine (csrc/decode_step.h: silu_rounded) where it
    runs x, else torch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _in_engine(x, "silu_rounded", F.silu)


def engine_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` in fp32 rounded to x's dtype by the engine (csrc/decode_step.h:
    sigmoid_rounded), as the one-call decode layer takes it, where it runs x; elsewhere torch's."""
    return _in_engine(x, "sigmoid_rounded", torch.sigmoid)


def _engine_linear(mod: nn.Module | None) -> bool:
    from .cpu_linear import CPULinear
    from .fused_linears import FusedSlice

    return isinstance(mod, CPULinear | FusedSlice)


def install_engine_activations(model: nn.Module) -> int:
    """Give every SwiGLU MLP whose gate, up and down projections run in the engine (CPULinear or a
    fused slice of one) and whose activation is transformers' SiLU an ``EngineSiLU``; returns how many."""
    count = 0
    for mod in model.modules():
        act = getattr(mod, "act_fn", None)
        if type(act).__name__ not in ("SiLUActivation", "SiLU") or not isinstance(act, nn.Module):
            continue
        if all(_engine_linear(getattr(mod, n, None)) for n in ("gate_proj", "up_proj", "down_proj")):
            mod.act_fn = EngineSiLU()
            count += 1
    return count
