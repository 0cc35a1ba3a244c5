"""Shapes of well-known MoE models: enough to size their expert layers and estimate speed.

Numbers are from the models' published config.json files. ``dense_params`` counts everything
a token touches outside the routed experts (attention, shared experts, dense layers, embeddings
read per token: the lm_head), approximately, for decode estimates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int
    intermediate: int  # per routed expert
    experts: int
    top_k: int
    moe_layers: int
    dense_params: float  # parameters read per token outside the routed experts

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def active_expert_params(self) -> int:
        """Routed-expert parameters one token reads across all MoE layers."""
        return self.expert_params * self.top_k * self.moe_layers

    def layer_flops(self, tokens: int) -> float:
        """Multiply-add flops (x2) of one MoE layer's routed experts for ``tokens`` tokens."""
        return 2.0 * tokens * self.top_k * self.expert_params


SHAPES: dict[str, MoEShape] = {
    s.name: s
    for s in (
        MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8, 48, 0.85e9),
        MoEShape("qwen3-235b-a22b", 4096, 1536, 128, 8, 94, 8.0e9),
        MoEShape("deepseek-v3", 7168, 2048, 256, 8, 58, 16.5e9),
        MoEShape("kimi-k2", 7168, 2048, 384, 8, 60, 17.0e9),
        MoEShape("glm-4.5-air", 4096, 1408, 128, 8, 45, 5.5e9),
        MoEShape("minimax-m2", 3072, 1536, 256, 8, 62, 2.0e9),
        MoEShape("gpt-oss-120b", 2880, 2880, 128, 4, 36, 1.5e9),
        MoEShape("gpt-oss-20b", 2880, 2880, 32, 4, 24, 1.2e9),
        MoEShape("mixtral-8x7b", 4096, 14336, 8, 2, 32, 1.6e9),
    )
}


def get_shape(name: str) -> MoEShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}") from None
