"""Per-architecture adapters for transformers MoE models, and the registry that picks one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import deepseek_v2, glm4_moe, gpt_oss, minimax_m2, mixtral, olmoe, qwen2_moe, qwen3_moe, qwen3_next
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
# llama.cpp's general.architecture -> the adapter file's gguf_config(g, layout), which reads that
# architecture's metadata into a transformers config and names its tensors (models/gguf_model.py).
_GGUF_FILES = (qwen2_moe, qwen3_moe, qwen3_next, deepseek_v2, glm4_moe, minimax_m2, gpt_oss, olmoe, mixtral)
GGUF_BUILDERS: dict[str, Callable[..., Any]] = {m.GGUF_ARCHITECTURE: m.gguf_config for m in _GGUF_FILES}


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


__all__ = ["ADAPTERS", "GGUF_BUILDERS", "REGISTRY", "MoEAdapter", "adapter_class", "get_adapter"]
