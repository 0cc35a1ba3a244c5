"""The adapter contract: what hetmoe needs to know about one transformers MoE architecture.

An adapter says where the sparse MoE block sits in a decoder layer and which class it is, how the
architecture routes a token (the top-k ids and weights, computed exactly as transformers does,
from the block's own router parameters), what runs beside the routed experts (shared experts),
which activation the experts use, and how checkpoint tensor names differ from the module names.
Everything else (reading experts, the CPU engine, placement) is architecture-independent.

Adding an architecture is one small file: subclass :class:`MoEAdapter` (:class:`MLAAdapter` for
latent attention), fill in the class attributes, write ``route`` (and ``shared`` if there are
shared experts), and register it in ``__init__.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .routing import BlockRouting, softmax_topk

# A torch activation on the gate and up projections: h = act(gate, up).
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class MoEAdapter(ABC):
    """One architecture. Instances hold the transformers config of the model being run."""

    # transformers ``model_type`` values served by this adapter (aliases such as kimi_k2 included).
    model_types: ClassVar[tuple[str, ...]] = ()
    # Class names of the sparse MoE block in transformers (checked before a block is replaced).
    block_classes: ClassVar[tuple[str, ...]] = ()
    # Attribute of a decoder layer holding the MoE block.
    block_attr: ClassVar[str] = "mlp"
    # Submodule name of the block's own router.
    router_attr: ClassVar[str] = "gate"
    # True when the block's forward returns ``(hidden, router_scores)`` (gpt-oss).
    returns_router_scores: ClassVar[bool] = False
    # (module-name fragment, checkpoint-name fragment): alternative spellings of a module name in
    # checkpoints, e.g. Mixtral's ``block_sparse_moe`` for transformers 5's ``mlp``.
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # transformers model_type to build the model with when the checkpoint's is an alias.
    transformers_model_type: ClassVar[str | None] = None
    # The one-token decode step (models/fast_decode.py): transformers' decoder layer class, where its
    # forward is the pre-norm shape that step reproduces (input norm; q/k/v, q/k norms, rotary over
    # each head's leading values, KV append, softmax attention, o_proj; residual; post-attention
    # norm; the MLP; residual), and the causal LM class with the output class its forward returns.
    # None: the family's layers keep transformers' forward.
    decode_layer: ClassVar[str | None] = None
    decode_causal_lm: ClassVar[tuple[str, str] | None] = None
    # Where that layer RMS-normalises q and k: "head" (each head's values), "projection" (all the
    # heads' values before they split) or "none".
    decode_qk_norm: str = "none"
    # The rotary tables the model hands its layers: "full" (cos/sin over the rotated width, each
    # frequency twice, as rotate_half reads them) or "half" (each frequency once: gpt-oss, whose
    # layers rotate the two halves of a head by the same tables).
    decode_rotary_tables: ClassVar[str] = "full"
    # The attention has sinks (``self_attn.sinks``: a logit per head in the softmax, gpt-oss).
    decode_sinks: ClassVar[bool] = False
    # q_proj gives each head's query then as many gate values, and the attention's output is
    # multiplied by sigmoid(gate) before o_proj (Qwen3-Next's full-attention layers).
    decode_gated_query: ClassVar[bool] = False
    # Its modeling module's apply_rotary_pos_emb is transformers' standard one (rotate_half over the
    # whole head, cos/sin unsqueezed at dim 1): models/fused_rope.py puts the engine's in its place.
    standard_rotary: ClassVar[bool] = False
    # Its RMSNorm classes as (class name, where it rounds to the model's dtype, its epsilon
    # attribute), the rounding "cast_then_scale" (x cast back, then times the weight),
    # "scale_then_cast" (gpt-oss) or "offset_scale" ((1 + w) * x, Qwen3-Next); models/fused_norms.py
    # rounds the engine's norm the same way.
    rms_norms: ClassVar[tuple[tuple[str, str, str], ...]] = ()

    def __init__(self, config: Any) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return self.model_types[0]

    # --- structure ---------------------------------------------------------------------------

    def is_moe_block(self, module: nn.Module) -> bool:
        return type(module).__name__ in self.block_classes

    def decodes_in_one_call(self) -> bool:
        """Whether this model's decoder layers take the one-token decode step (``decode_layer``)."""
        return self.decode_layer is not None

    def checkpoint_names(self, module_name: str) -> list[str]:
        """Names a module tensor may have in a checkpoint, the module's own name first."""
        names = [module_name]
        for ours, theirs in self.checkpoint_renames:
            if ours in module_name:
                names.append(module_name.replace(ours, theirs))
        return names

    # --- math --------------------------------------------------------------------------------

    @abstractmethod
    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights ``[T, k]`` (in the dtype transformers multiplies with) and ids ``[T, k]``.

        ``block`` is the MoE block (or the HybridMoE standing in for it: it carries the same
        router submodule and buffers), ``x`` the flattened hidden states ``[T, H]``.
        """

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``route`` from the logits, where this architecture's logits are ``router_logits(x,
        router.weight, router.bias)`` of the block's ``router_attr`` module (routing.py: its bias where
        it has one, the router's own dtype) and everything after them is a function of the logits
        alone: the one-token decode path then has the engine compute them. None for every other
        router, and for logits it would not have computed so. By default the softmax top-k
        ``decode_routing`` names, where it names one."""
        routing = self.decode_routing(block)
        if routing is None or routing.softmax is None or routing.fp32:
            return None
        k, normalize, rounded = routing.softmax
        return softmax_topk(logits, k, normalize, logits.dtype if rounded else None)

    def routes_from_logits(self, block: nn.Module) -> bool:
        """Whether ``route_logits`` routes this block (models/fast_decode.py then has the engine
        compute the logits of a one-token step)."""
        if type(self).route_logits is not MoEAdapter.route_logits:
            return True
        routing = self.decode_routing(block)
        return routing is not None and routing.softmax is not None and not routing.fp32

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The output of the shared experts for ``x [T, H]``, or None when there are none."""
        return None

    def decode_routing(self, block: nn.Module) -> BlockRouting | None:
        """How ``route`` and ``shared`` compute, where the engine can compute them the same way
        (routing.py's ``BlockRouting``): the one-call decode layer then routes the block in the
        engine and runs its experts and shared experts there too, the whole layer without a return
        to Python (models/fast_decode.py for softmax top-k and a grouped router on the router's
        logits, models/ffn_half.py for a grouped router on fp32 logits). None otherwise: the layer's
        MoE half then runs in Python."""
        return None

    @property
    def activation(self) -> Activation:
        """The experts' activation for the torch paths (device experts, CPU fallback)."""
        act = getattr(self.config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            from transformers.activations import ACT2FN

            fn = ACT2FN[act]
            return lambda gate, up: fn(gate) * up
        return silu_mul

    def engine_activation(self) -> dict[str, Any] | None:
        """CPUExperts' activation arguments for these experts, or None if the engine has no such
        activation (the experts then run on the torch fallback)."""
        if getattr(self.config, "hidden_act", "silu") in ("silu", "swish"):
            return {}
        return None

    def top_k(self) -> int:
        return int(self.config.num_experts_per_tok)


class MLAAdapter(MoEAdapter):
    """An architecture with multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): its attention runs
    in models/mla_attention.py, which takes the architecture's rotary embedding from here."""

    @abstractmethod
    def mla_rotary(
        self, attn: nn.Module, q_rot: torch.Tensor, k_rot: torch.Tensor, position_embeddings: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding of the query's ``[B, H, T, rope]`` and the shared key's ``[B, 1, T,
        rope]`` rotary parts, exactly as the architecture's attention forward applies it."""

    @abstractmethod
    def mla_rope_mode(self, attn: nn.Module) -> str:
        """The same rotation as the one-call decode step names it (csrc/mla_step.h, MLARope):
        "interleaved" (pairs rotated by cos/sin tables, written de-interleaved), "half" (rotate_half
        over the rope part) or "complex" (pairs times complex factors, ``freqs_cis``)."""
