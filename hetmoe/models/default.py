"""The embedded default model: a small Qwen3-MoE trained by ``scripts/train_default_model.py``.

It ships inside the package (``hetmoe/assets/default_model``: config, weights, byte-level BPE
tokenizer with a ChatML chat template), so ``hetmoe generate``, ``serve``, ``chat`` and ``sft``
run on a fresh clone without any download.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "hetmoe-default"
_ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_model"


def default_model_path() -> Path:
    """The directory of the embedded default model; a clear error if the package lacks it."""
    if not (_ASSET_DIR / "config.json").is_file():
        raise ValueError(
            f"the embedded default model is missing from {_ASSET_DIR} (expected config.json, model.safetensors, "
            "tokenizer.json); rebuild it with `python scripts/train_default_model.py` or name a model directory"
        )
    return _ASSET_DIR
