"""Per-architecture adapters for transformers MoE models, and the registry that picks one."""

from __future__ import annotations

from typing import Any

from .base import MoEAdapter
from .deepseek_v2 import DeepseekV2Adapter
from .deepseek_v3 import DeepseekV3Adapter
from .glm4_moe import Glm4MoeAdapter
from .gpt_oss import GptOssAdapter
from .minimax_m2 import MiniMaxM2Adapter
from .mixtral import MixtralAdapter
from .olmoe import OlmoeAdapter
from .qwen2_moe import Qwen2MoeAdapter
from .qwen3_moe import Qwen3MoeAdapter
from .qwen3_next import Qwen3NextAdapter

ADAPTERS: tuple[type[MoEAdapter], ...] = (
    Qwen2MoeAdapter,
    Qwen3MoeAdapter,
    Qwen3NextAdapter,
    MixtralAdapter,
    DeepseekV2Adapter,
    DeepseekV3Adapter,
    Glm4MoeAdapter,
    MiniMaxM2Adapter,
    GptOssAdapter,
    OlmoeAdapter,
)
REGISTRY: dict[str, type[MoEAdapter]] = {t: a for a in ADAPTERS for t in a.model_types}


def adapter_class(model_type: str) -> type[MoEAdapter]:
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"no hetmoe adapter for model_type {model_type!r}; supported: {', '.join(sorted(REGISTRY))}"
        ) from None


def get_adapter(config: Any) -> MoEAdapter:
    """The adapter for a transformers config (its ``model_type``)."""
    return adapter_class(str(config.model_type))(config)


__all__ = ["ADAPTERS", "REGISTRY", "MoEAdapter", "adapter_class", "get_adapter"]
