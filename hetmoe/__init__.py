"""hetmoe: Mixture-of-Experts inference and fine-tuning with routed experts in CPU memory.

Layers (imports point down): cli -> models -> runtime -> kernels -> checkpoint -> formats; hw beside
them. See ARCHITECTURE.md. ``load_model`` and ``CPUExperts`` are imported on first use so that
``import hetmoe`` stays cheap (no torch, no transformers).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["CPUExperts", "__version__", "load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from .models.loader import load_model

        return load_model
    if name == "CPUExperts":
        from .runtime.cpu_experts import CPUExperts

        return CPUExperts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
