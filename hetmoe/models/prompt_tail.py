"""A prompt's last decoder layer runs its MLP only for the positions whose logits are kept.

With ``logits_to_keep=k`` (what ``generate`` passes for a prompt: 1), only the last k rows of the
final hidden states reach the lm_head. The last layer's attention still runs for every position (it
fills that layer's KV cache), but its MLP (the routed experts: a quarter of a 4-layer model's
prefill, 1/L of an L-layer one's) matters only for those k rows, so it runs on them alone. llama.cpp
does the same (its ``inp_out_ids``, applied after the last layer's attention), so a prefill beside
it compares the same work.

The other rows leave the last layer without the MLP's contribution (its output is zero there);
nothing reads them: the final norm is per row and the lm_head takes the last k. Anything that does
read them turns the skip off for that call: hidden states or router logits asked for, labels (the
loss needs every row), training, a ``logits_to_keep`` that is not a positive integer, or deferred
experts (``set_defer_experts``: a layer's deferred work for every row lands in the next layer).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn


def _last_layer(model: nn.Module) -> nn.Module | None:
    """The last decoder layer a forward runs (models may hold more, e.g. multi-token-prediction ones)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    count = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(count, int) or not 0 < count <= len(layers):
        return None
    return layers[count - 1]


def install_prompt_tail(model: nn.Module) -> bool:
    """Wrap ``model``'s forward and its last decoder layer's MLP; False where that layer has no
    ``mlp`` or the forward takes no ``logits_to_keep``."""
    last = _last_layer(model)
    mlp = getattr(last, "mlp", None)
    forward = model.forward
    if not isinstance(mlp, nn.Module) or "logits_to_keep" not in inspect.signature(forward).parameters:
        return False
    mlp_forward = mlp.forward
    keep = {"rows": 0}  # set for the duration of one eligible model call

    @functools.wraps(mlp_forward)
    def tail_mlp(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        k = keep["rows"]
        if not k or hidden.dim() != 3 or hidden.shape[1] <= k:
            return mlp_forward(hidden, *args, **kwargs)
        out = mlp_forward(hidden[:, -k:], *args, **kwargs)
        rows = out[0] if isinstance(out, tuple) else out  # gpt-oss's MLP returns (output, router scores)
        full = rows.new_zeros(hidden.shape[:2] + rows.shape[2:])
        full[:, -k:] = rows
        return (full, *out[1:]) if isinstance(out, tuple) else full

    @functools.wraps(forward)  # keeps the signature: generate passes logits_to_keep only when it sees it
    def tail_forward(*args: Any, **kwargs: Any) -> Any:
        k = kwargs.get("logits_to_keep", 0)
        if not _skips(model, k, kwargs):
            return forward(*args, **kwargs)
        keep["rows"] = k
        try:
            return forward(*args, **kwargs)
        finally:
            keep["rows"] = 0

    mlp.forward = tail_mlp
    model.forward = tail_forward
    model._hetmoe_prompt_tail = True
    return True


def _skips(model: nn.Module, k: Any, kwargs: dict[str, Any]) -> bool:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or model.training:
        return False
    if kwargs.get("labels") is not None or kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        return False
    config = model.config
    if kwargs.get("output_router_logits") or getattr(config, "output_router_logits", False):
        return False
    if getattr(getattr(model, "hetmoe", None), "deferred", None) is not None:
        return False  # deferred experts carry every row of one MoE layer into the next (runtime/deferred.py)
    return not getattr(config, "output_hidden_states", False)
