"""SFTMoE: the training stand-in for one sparse MoE block, routed experts in the CPU engine.

Like the inference HybridMoE it adopts everything of the block but the routed experts (router,
shared experts, buffers) under the same names, so the model's parameter names do not change and
the router's own parameters stay ordinary trainable parameters. A forward:

1. routes with the architecture adapter's exact routing on the block's router (on the device,
   differentiable through the top-k weights: the ids are discrete, the weights are not);
2. runs the routed experts in ``function.routed_experts`` on the CPU (the engine or the per-expert
   torch path, with the LoRA that PEFT put on the expert hosts), gradient to x, weights and LoRA;
3. adds the shared experts, computed on the device by ordinary torch autograd.

Everything on the device trains as usual; only the routed experts' base is frozen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.adapters.base import MoEAdapter
from ..runtime.hybrid import adopt_block_members
from .frozen import FrozenExperts
from .function import dropout_masks, routed_experts
from .hosts import RoutedExperts, collect_lora


class SFTMoE(nn.Module):
    def __init__(
        self,
        block: nn.Module,
        adapter: MoEAdapter,
        layer: int,
        base: FrozenExperts,
        experts: RoutedExperts,
        *,
        recompute: bool = False,
        use_engine: bool = True,
    ) -> None:
        super().__init__()
        adopt_block_members(self, block)
        self.experts = experts
        self.adapter = adapter
        self.layer = layer
        self.base = base
        self.recompute = recompute
        self.use_engine = use_engine
        self.block_class = getattr(block, "block_class", type(block).__name__)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = self.adapter.route(self, x)
        lora = collect_lora(self.experts, f"layer {self.layer} experts")
        ids_cpu = ids.to(device="cpu", dtype=torch.int64).contiguous()
        masks = dropout_masks(lora, ids_cpu.numel(), self.base, self.training)
        y = routed_experts(
            x.to("cpu"),
            ids_cpu,
            weights.to(device="cpu", dtype=torch.float32),
            self.base,
            lora,
            recompute=self.recompute,
            use_engine=self.use_engine,
            masks=masks,
        )
        out = y.to(device=x.device, dtype=x.dtype)
        shared = self.adapter.shared(self, x)
        if shared is not None:
            out = out + shared
        out = out.reshape(shape)
        return (out, weights) if self.adapter.returns_router_scores else out

    def extra_repr(self) -> str:
        b = self.base
        return (
            f"layer={self.layer}, replaces={self.block_class}, experts={b.num_experts}, method={b.method}, "
            f"engine={'yes' if b.engine is not None else 'no'}, recompute={self.recompute}"
        )
