"""gpt-oss: a biased router (top-k of the logits, then softmax over the k), experts with biases and
a clamped SwiGLU, and a block whose forward returns ``(hidden, router_scores)``.

The CPU engine runs this activation as ``"swiglu-oai"`` with the biases; an engine built without
it leaves gpt-oss experts to the torch fallback (``runtime.torch_experts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...checkpoint import CheckpointError
from ..gguf_names import GLM_NORMS, GGUFConfig
from .base import Activation, MoEAdapter
from .routing import BlockRouting, router_logits, topk_softmax

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssAdapter(MoEAdapter):
    model_types = ("gpt_oss",)
    block_classes = ("GptOssMLP",)
    router_attr = "router"
    returns_router_scores = True
    decode_layer = "GptOssDecoderLayer"
    decode_causal_lm = ("GptOssForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "none"
    decode_rotary_tables = "half"
    decode_sinks = True
    rms_norms = (("GptOssRMSNorm", "scale_then_cast", "variance_epsilon"),)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.router.weight, block.router.bias))

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_softmax(logits, self.top_k())

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        # the softmax of the k largest logits is the renormalised top k of the softmax, in the dtype
        return BlockRouting(softmax=(self.top_k(), True, True))

    @property
    def activation(self) -> Activation:
        alpha, limit = float(self.config.swiglu_alpha), float(self.config.swiglu_limit)
        return lambda gate, up: clamped_swiglu(gate, up, alpha, limit)

    def engine_activation(self) -> dict[str, Any] | None:
        return {
            "activation": "swiglu-oai",
            "alpha": float(self.config.swiglu_alpha),
            "limit": float(self.config.swiglu_limit),
        }


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "gpt-oss"

# biases everywhere in its attention and router, a sink logit per head, GLM's norm names
GPT_OSS = (
    GLM_NORMS
    | {f"attn_{x}.{p}": f"self_attn.{x}_proj.{p}" for x in ("q", "k", "v") for p in ("weight", "bias")}
    | {"attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias"}
    | {"attn_sinks.weight": "self_attn.sinks"}
    | {"ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias"}
)


def sliding_layers(g: GGUFModel, layers: int) -> list[str]:
    """llama.cpp's ``load_swa_pattern``: a per-layer array, or every n-th layer full (the others
    sliding), n from the metadata or 2."""
    pattern = g.meta.get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) < layers or not all(isinstance(v, (bool, int)) for v in pattern[:layers]):
            raise CheckpointError(
                g.meta.path,
                f"{g.arch}.attention.sliding_window_pattern: expected {layers} flags, found {pattern!r}",
            )
        sliding = [bool(v) for v in pattern[:layers]]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        sliding = [pattern == 0 or layer % pattern < pattern - 1 for layer in range(layers)]
    else:
        raise CheckpointError(
            g.meta.path,
            f"{g.arch}.attention.sliding_window_pattern must be a count or per-layer flags, found {pattern!r}",
        )
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    """gpt-oss as llama.cpp's openai-moe graph runs it: softmax over the top-k router logits, the
    clamped SwiGLU with alpha 1.702 and limit 7 (fixed in its graph, and transformers' defaults),
    sliding-window layers by ``attention.sliding_window_pattern`` (default 2: even layers slide),
    YaRN as ggml computes it (correction dims floored and ceiled: transformers' ``truncate``)."""
    m = g.meta
    fields = g.gqa_fields(layout)
    g.no_expert_scale()
    g.all_moe(layout)
    base, swa_base = fields["rope_parameters"]["rope_theta"], m.get("rope.freq_base_swa")
    if swa_base is not None and swa_base != base:
        raise CheckpointError(
            m.path,
            f"gpt-oss.rope.freq_base_swa={swa_base} differs from rope.freq_base={base}: transformers' "
            "gpt-oss has one rope base for all layers",
        )
    fields |= {
        "model_type": "gpt_oss",
        "num_local_experts": layout.num_experts,
        "intermediate_size": layout.intermediate_size,
        "sliding_window": m.count("attention.sliding_window", "sliding_window"),
        "layer_types": sliding_layers(g, layout.num_layers),
        "attention_bias": True,
        "swiglu_limit": 7.0,
    }
    fields.pop("moe_intermediate_size")
    fields.pop("hidden_act")
    return fields, lambda layer: GPT_OSS
