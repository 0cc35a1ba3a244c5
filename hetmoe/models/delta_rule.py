"""Qwen3-Next's gated delta rule for one decode token in one engine call (csrc/delta_rule.h).

transformers runs a Qwen3-Next linear-attention layer's decode step through
``torch_recurrent_gated_delta_rule``: ~20 eager ops (repeat_interleave, l2 norms, the decay, two
reductions over the ``[heads, dk, dv]`` fp32 state, the outer-product update), each a pass over the
state on one thread. Measured on a Zen 4 (2 threads) at Qwen3-Next-80B-A3B's shapes, a delta-net
layer's step took 6.5 ms of which ~3 ms was neither its weights nor its projections. The engine does
the same arithmetic per value head, two passes over the state, the heads spread over its pool.

The sums run in another order than torch's reductions, so the results agree to fp32 summation
rounding (tests/test_delta_rule.py states the bound), not bit for bit. That is why the module-level
function is replaced by one that takes the engine only inside the forward of a linear-attention
module ``load_model`` gave the flag to (``install_delta_rule``); any other Qwen3-Next model in the
process (a transformers reference, say) keeps transformers' own arithmetic.
"""

from __future__ import annotations

import contextvars
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..kernels.dispatch import engine_module

_MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"
_LAYER = "Qwen3NextGatedDeltaNet"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# set while a flagged module's forward runs: only then does the replaced function use the engine
_IN_FLAGGED_FORWARD = contextvars.ContextVar("hetmoe_delta_rule", default=False)


def install_delta_rule(model: nn.Module) -> int:
    """Flag every Qwen3-Next linear-attention module of ``model`` for the engine's one-token step and
    put the engine-aware function in place (once per process); returns how many modules."""
    count = 0
    for module in model.modules():
        if type(module).__name__ != _LAYER:
            continue
        modeling = sys.modules[type(module).__module__]
        if type(module).__module__ != _MODULE or not hasattr(modeling, "torch_recurrent_gated_delta_rule"):
            continue
        _replace_function(modeling)
        module.forward = types.MethodType(_flagged(type(module).forward), module)
        count += 1
    return count


def _replace_function(modeling: Any) -> None:
    current = modeling.torch_recurrent_gated_delta_rule
    if getattr(current, "hetmoe_original", None) is None:
        replaced = _engine_rule(current)
        replaced.hetmoe_original = current  # type: ignore[attr-defined]
        modeling.torch_recurrent_gated_delta_rule = replaced


def _flagged(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        token = _IN_FLAGGED_FORWARD.set(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            _IN_FLAGGED_FORWARD.reset(token)

    forward.hetmoe_delta_rule = True  # type: ignore[attr-defined]
    return forward


def _engine_rule(original: Callable[..., Any]) -> Callable[..., Any]:
    def torch_recurrent_gated_delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if _IN_FLAGGED_FORWARD.get() and _applies(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel):
            return _step(query, key, value, g, beta, initial_state, output_final_state)  # type: ignore[arg-type]
        return original(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            **kwargs,
        )

    return torch_recurrent_gated_delta_rule


def _applies(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    l2norm: bool,
) -> bool:
    """One token of one sequence on the CPU without autograd, q/k/v of one engine dtype, an fp32
    contiguous state of the matching shape, and the l2 norms inside the rule (Qwen3-Next's call)."""
    if not l2norm or state is None or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, state))):
        return False
    if q.dim() != 4 or q.shape[:2] != (1, 1) or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != (1, 1):
        return False
    heads_k, dk = q.shape[2], q.shape[3]
    heads_v, dv = v.shape[2], v.shape[3]
    if heads_v % heads_k or g.numel() != heads_v or beta.numel() != heads_v:
        return False
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    tensors = (q, k, v, g, beta, state)
    if any(t.device.type != "cpu" for t in tensors):
        return False
    return state.dtype == torch.float32 and state.shape == (1, heads_v, dk, dv) and state.is_contiguous()


def _step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The engine's step: ``state`` updated in place (the caller stores what is returned in its place),
    the output ``[1, 1, Hv, dv]`` in q's dtype, as transformers returns it."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g32 = g.reshape(-1).float().contiguous()
    beta32 = beta.reshape(-1).float().contiguous()
    out = torch.empty(v.shape, dtype=q.dtype)
    engine_module().gated_delta_step(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        _DTYPES[q.dtype],
        g32.data_ptr(),
        beta32.data_ptr(),
        state.data_ptr(),
        out.data_ptr(),
        q.shape[2],
        v.shape[2],
        q.shape[3],
        v.shape[3],
    )
    return out, state if output_final_state else None


__all__ = ["install_delta_rule"]
