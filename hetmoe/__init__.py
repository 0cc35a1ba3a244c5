"""hetmoe: Mixture-of-Experts inference and fine-tuning with routed experts in CPU memory.

Layers (imports point down): cli -> models -> runtime -> kernels -> checkpoint -> formats; hw beside
them. See ARCHITECTURE.md. ``load_model`` and ``CPUExperts`` are imported on first use so that
``import hetmoe`` stays cheap (no torch, no transformers).
"""

from __future__ import annotations

import os
from typing import Any

# torch's OpenMP workers spin-wait after every parallel region (libgomp's default ACTIVE policy) and
# take the cores the engine's pinned workers need: serving a tiny model on 2 cores measured 5.8
# tokens/s with spinning workers against 527 without. libgomp reads the policy when torch loads it,
# so it is set here, before any torch import hetmoe makes; a value the user set wins.
# What hetmoe set is kept apart: the peers the benchmarks run (bench/llama_cpp.py) must not inherit
# it. llama.cpp's own OpenMP threads, sleeping between its many small parallel regions, decoded a
# DeepSeek-V3-shaped Q4_0 file at 69-83 tokens/s on a Zen 4 where they run 116-121 without it.
ENVIRONMENT_SET = {key: value for key, value in {"OMP_WAIT_POLICY": "PASSIVE"}.items() if key not in os.environ}
os.environ.update(ENVIRONMENT_SET)


def user_environment() -> dict[str, str]:
    """This process's environment without what hetmoe set in it: for the programs hetmoe runs that
    are not hetmoe (llama.cpp's tools), which must run as they would from the user's shell."""
    return {k: v for k, v in os.environ.items() if ENVIRONMENT_SET.get(k) != v}


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
