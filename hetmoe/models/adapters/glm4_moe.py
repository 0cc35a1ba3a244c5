"""GLM-4.5/4.6/4.7 (GLM-4-MoE): DeepSeek-V3's router (sigmoid, correction bias, groups, scaling)
and ungated shared experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...checkpoint import CheckpointError
from ..gguf_names import DEEPSEEK_SHARED, DENSE_MLP, GLM_NORMS, QK_NORM, QKV, ROUTER, GGUFConfig
from .base import MoEAdapter
from .deepseek_v3 import grouped_sigmoid_route, grouped_sigmoid_routing
from .routing import BlockRouting

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


class Glm4MoeAdapter(MoEAdapter):
    model_types = ("glm4_moe",)
    block_classes = ("Glm4MoeMoE",)
    decode_layer = "Glm4MoeDecoderLayer"
    decode_causal_lm = ("Glm4MoeForCausalLM", "CausalLMOutputWithPast")
    rms_norms = (("Glm4MoeRMSNorm", "cast_then_scale", "variance_epsilon"),)

    @property
    def decode_qk_norm(self) -> str:  # type: ignore[override]
        return "head" if getattr(self.config, "use_qk_norm", False) else "none"

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_sigmoid_route(self, block, x)

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return block.shared_experts(x)

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        return grouped_sigmoid_routing(self, block)


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "glm4moe"

# its router holds the selection bias (e_score_correction_bias)
GLM_ROUTER = ROUTER | {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    m = g.meta
    fields = g.common(layout)
    g.head_dim_and_rotary(fields)
    g.sigmoid_gating()
    sample = layout.moe_layers[0]
    shared_rows = g.shape(f"blk.{sample}.ffn_up_shexp.weight", "the shared experts")[0]
    dense = [layer for layer in range(layout.num_layers) if layer not in layout.moe_layers]
    fields |= {
        "model_type": "glm4_moe",
        "n_routed_experts": layout.num_experts,
        "n_shared_experts": m.count(
            "expert_shared_count", "n_shared_experts", max(1, shared_rows // layout.intermediate_size)
        ),
        "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
        "routed_scaling_factor": m.number("expert_weights_scale", "routed_scaling_factor", 1.0) or 1.0,
        "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
        "n_group": m.count("expert_group_count", "n_group", 1),
        "topk_group": m.count("expert_group_used_count", "topk_group", 1),
        # not in the metadata: what the tensors say
        "use_qk_norm": f"blk.{sample}.attn_q_norm.weight" in g.tensors,
        "attention_bias": f"blk.{sample}.attn_q.bias" in g.tensors,
    }
    width = g.shape(f"blk.{dense[0]}.ffn_up.weight", "a dense layer's MLP")[0] if dense else None
    fields["intermediate_size"] = int(width or m.count("feed_forward_length", "intermediate_size"))
    if dense != list(range(fields["first_k_dense_replace"])):
        raise CheckpointError(
            m.path,
            f"glm4moe: layers {dense[:8]} have no experts but leading_dense_block_count="
            f"{fields['first_k_dense_replace']}",
        )

    def names(layer: int) -> dict[str, str]:
        qkv = {k: v for k, v in QKV.items() if fields["attention_bias"] or not k.endswith(".bias")}
        norms = QK_NORM if fields["use_qk_norm"] else {}
        mlp = GLM_ROUTER | DEEPSEEK_SHARED if layer in layout.moe_layers else DENSE_MLP
        return GLM_NORMS | qkv | norms | mlp

    return fields, names
