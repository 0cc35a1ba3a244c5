"""Model architectures: adapters for transformers MoE models, ``load_model``, well-known MoE shapes.

``load_model`` is imported lazily (it pulls in transformers).
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from .loader import load_model

        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
