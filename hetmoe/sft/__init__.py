"""Fine-tuning with LoRA while the routed experts stay in the CPU engine.

Entry points: ``load_for_training(path, method)`` (experts from checkpoint files in their stored
precision) or ``prepare_model(model, method)`` (experts extracted from a model in memory); then
``get_peft_model(model, LoraConfig(...))``; ``apply_adapter`` puts a saved adapter on a
``hetmoe.load_model`` model for inference. ``routed_experts`` is the autograd
function itself. Layer: imports hetmoe.models, runtime, kernels, checkpoint, formats; only
hetmoe.cli imports this package.
"""

from __future__ import annotations

from .block import SFTMoE
from .frozen import FrozenExperts
from .function import ExpertLoRA, LoRAFactors, dropout_masks, routed_experts
from .inference import apply_adapter
from .load import load_for_training
from .placeholders import ParameterCounts, parameter_counts, placeholders
from .prepare import prepare_model

__all__ = [
    "ExpertLoRA",
    "FrozenExperts",
    "LoRAFactors",
    "ParameterCounts",
    "SFTMoE",
    "apply_adapter",
    "dropout_masks",
    "load_for_training",
    "parameter_counts",
    "placeholders",
    "prepare_model",
    "routed_experts",
]
