"""A model's configuration as one flat dict: ``config.json``, or the same fields from GGUF metadata.

Multimodal wrappers (Kimi-K2.5, Qwen3-VL-MoE, ...) keep the language model's fields under
``text_config``; readers of experts only care about those, so they are lifted to the top level.
A quantization config that only the wrapper carries still describes the text model's weights and
is kept. GGUF files carry no ``config.json``: the fields the expert reader needs are rebuilt from
the ``{arch}.*`` metadata keys under their transformers names.

Keys starting with ``_`` are hetmoe's own annotations (``_source``: the file the fields came from,
so later errors can name it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .gguf_file import GGUFFile

REQUIRED = ("model_type", "num_hidden_layers", "hidden_size")

# GGUF ``general.architecture`` -> transformers ``model_type``. llama.cpp files every DeepSeek-V2/V3
# descendant (Kimi-K2 included) under "deepseek2" and Mixtral under "llama" with an expert count.
GGUF_ARCHITECTURES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "qwen3next": "qwen3_next",
    "qwen3vlmoe": "qwen3_vl_moe",
    "deepseek2": "deepseek_v3",
    "glm4moe": "glm4_moe",
    "olmoe": "olmoe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "llama": "mixtral",
}


def read_config(path: str | Path) -> dict[str, Any]:
    """The model configuration for a checkpoint directory, a file in it, or a GGUF file."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(p, "no such file or directory")
    gguf_file = _gguf_of(p)
    if gguf_file is not None:
        return config_from_gguf(GGUFFile(gguf_file))
    directory = p if p.is_dir() else p.parent
    return _read_json_config(directory / "config.json")


def _gguf_of(p: Path) -> Path | None:
    """The GGUF file to take metadata from, when ``p`` is one or a directory holding only GGUF."""
    if p.is_file():
        return p if p.suffix == ".gguf" else None
    if (p / "config.json").exists():
        return None
    ggufs = sorted(p.glob("*.gguf"))
    # A split set's metadata lives in its first part, which sorts first.
    return ggufs[0] if ggufs else None


def read_json_object(path: Path) -> dict[str, Any]:
    """A side file's JSON object (config.json, generation_config.json), or one CheckpointError naming
    the file: unreadable, not JSON (with line and column), or not an object."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(path, f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise CheckpointError(path, "is nested too deeply (arrays or objects in one another hundreds deep)") from None
    if not isinstance(raw, dict):
        raise CheckpointError(path, f"must hold a JSON object, found {type(raw).__name__}")
    return raw


def _read_json_config(cfg_path: Path) -> dict[str, Any]:
    if not cfg_path.exists():
        raise CheckpointError(
            cfg_path, "missing config.json: a transformers checkpoint needs it to say the architecture and sizes"
        )
    config = _resolve_text_config(read_json_object(cfg_path))
    config["_source"] = str(cfg_path)
    _check_required(config, cfg_path)
    return config


def _resolve_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config")
    if not isinstance(text, dict) or "num_hidden_layers" in raw:
        return dict(raw)
    config = dict(text)
    config["_wrapper_model_type"] = raw.get("model_type")
    for key in ("quantization_config", "architectures", "tie_word_embeddings"):
        if key not in config and key in raw:
            config[key] = raw[key]
    if "model_type" not in config and "model_type" in raw:
        config["model_type"] = raw["model_type"]
    return config


def _check_required(config: dict[str, Any], where: Path, what: str = "config.json") -> None:
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise CheckpointError(where, f"{what} lacks required field(s) {missing}")
    if not isinstance(config["model_type"], str):
        raise CheckpointError(where, f"{what}: model_type must be a string, found {config['model_type']!r}")
    for key in ("num_hidden_layers", "hidden_size"):
        value = config[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(where, f"{what}: {key} must be a positive integer, found {value!r}")


def config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    """The transformers-named fields the expert reader needs, from a GGUF file's metadata."""
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(gguf.path, "GGUF metadata lacks general.architecture")

    def field(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    config: dict[str, Any] = {
        "model_type": GGUF_ARCHITECTURES.get(arch, arch),
        "gguf_architecture": arch,
        # GLM-4-MoE counts its multi-token-prediction block(s) in block_count (llama.cpp's n_layer
        # subtracts them): the decoder layers are the ones before
        "num_hidden_layers": _decoder_layers(field("block_count"), field("nextn_predict_layers", 0)),
        "hidden_size": field("embedding_length"),
        "num_experts": field("expert_count"),
        "num_experts_per_tok": field("expert_used_count"),
        # Mixtral-era files have no expert length: their experts are the plain feed-forward width.
        "moe_intermediate_size": field("expert_feed_forward_length", field("feed_forward_length")),
        "first_k_dense_replace": field("leading_dense_block_count", 0),
        "_source": str(gguf.path),
    }
    config |= _attention_fields(field, arch)
    needed = {"block_count": config["num_hidden_layers"], "embedding_length": config["hidden_size"]}
    missing = [f"{arch}.{k}" for k, v in needed.items() if v is None]
    if missing:
        raise CheckpointError(gguf.path, f"GGUF metadata lacks {missing}")
    config = {k: v for k, v in config.items() if v is not None}
    _check_required(config, gguf.path, "GGUF metadata")
    return config


def _decoder_layers(blocks: Any, nextn: Any) -> Any:
    """block_count less the prediction blocks, where both are counts (else block_count, checked later)."""
    if isinstance(blocks, int) and isinstance(nextn, int) and 0 < nextn < blocks:
        return blocks - nextn
    return blocks


def _attention_fields(field: Any, arch: str) -> dict[str, Any]:
    """Heads and head sizes under transformers' names, for the memory planner's KV-cache estimate.

    ``head_count_kv`` may be one number per layer (models mixing attention kinds); the largest is the
    one that bounds the cache. deepseek2 (MLA): transformers caches every head's decompressed K and V,
    whose sizes are the ``*_mla`` keys in files written since llama.cpp split kv_b_proj (there
    key/value_length describe its compressed single-head view), and key/value_length before that.
    """

    def largest(value: Any) -> Any:
        return max(value) if isinstance(value, (list, tuple)) and value else value

    heads = largest(field("attention.head_count"))
    fields: dict[str, Any] = {"num_attention_heads": heads}
    if arch == "deepseek2":
        rope = field("rope.dimension_count")
        key = field("attention.key_length_mla", field("attention.key_length"))
        value = field("attention.value_length_mla", field("attention.value_length"))
        if rope is not None and key is not None:
            fields |= {
                "kv_lora_rank": field("attention.kv_lora_rank"),
                "qk_rope_head_dim": rope,
                "qk_nope_head_dim": key - rope,
                "v_head_dim": value,
            }
        return fields
    fields |= {
        "num_key_value_heads": largest(field("attention.head_count_kv", heads)),
        "head_dim": field("attention.key_length"),
    }
    if arch == "qwen3next":  # only its full-attention layers cache per token (models/gguf_model.py)
        blocks = field("block_count")
        blocks = blocks if isinstance(blocks, int) else 0
        flags, interval = field("attention.recurrent_layers"), field("full_attention_interval", 4)
        fields["layer_types"] = qwen3next_layer_types(flags, interval, blocks) or []
    return fields


def qwen3next_layer_types(flags: Any, interval: Any, layers: int) -> list[str] | None:
    """A qwen3next GGUF's layer kinds as llama.cpp reads them: ``attention.recurrent_layers`` (a flag
    per layer, true for the gated delta-net), else every ``full_attention_interval``-th layer full
    attention; None where the metadata is malformed."""
    if flags is None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            return None
        flags = [(layer + 1) % interval != 0 for layer in range(layers)]
    elif not isinstance(flags, list) or len(flags) < layers or not all(isinstance(f, (bool, int)) for f in flags):
        return None
    return ["linear_attention" if f else "full_attention" for f in flags[:layers]]
