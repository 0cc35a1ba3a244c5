"""Random models of the MoE architectures users run, each at a released model's layer shape.

``hetmoe bench model --arch`` (bench/arch_bench.py) and bench/bench_fast_decode.py measure models
with a real model's layers (its hidden size, attention, expert width, expert count and top-k) but a
few layers and a small vocabulary. ``ARCHS`` holds those shapes as transformers config fields.

A model is written as ``save_pretrained`` would write it, without ever holding it: the model is
instantiated on the meta device (shapes, no data), transformers' own ``revert_weight_conversion``
turns its state dict into the names and shapes of the checkpoint format (per-expert tensors where
the hub checkpoints have them, gpt-oss's fused ones), and each tensor is then drawn and written on
its own into safetensors shards laid out in advance (checkpoint/safetensors_stream.py), so memory
stays at one tensor: a GLM-4.5-Air-shaped model is 14.5 GB in bf16. Beside the weights: the config
(transformers' own class), and a byte-level BPE tokenizer of the vocabulary's size (GPT-2's
pre-tokenizer; the added tokens of Qwen's and GLM's chat formats, which llama.cpp's converter looks
up). The directory is assembled under a temporary name and renamed when whole.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.safetensors_stream import DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, PlannedTensor, open_shard, plan_shards
from .model_build import DEFAULT_CACHE, INIT_STD
from .model_write import CHATML, bpe_vocabulary

# The added tokens written into every model's tokenizer: Qwen's ChatML ones (bpe_vocabulary's
# last three) and those llama.cpp's converter looks up for GLM (its _set_vocab_glm).
GLM_TOKENS = ("[gMASK]", "<|user|>", "<|observation|>")


@dataclass(frozen=True)
class Arch:
    """One architecture at a released model's layer shape."""

    model: str  # the released model whose layers these are
    fields: dict[str, Any]  # transformers config fields, less the layer count and the vocabulary
    experts_field: str  # the config field holding the routed-expert count
    layer_pattern: tuple[str, ...] = field(default=())  # layer_types, repeated over the layers

    @property
    def experts(self) -> int:
        return int(self.fields[self.experts_field])


ARCHS: dict[str, Arch] = {
    "qwen3_moe": Arch(
        "Qwen3-30B-A3B",
        {
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "num_experts",
    ),
    "deepseek_v3": Arch(
        "DeepSeek-V2-Lite with q_lora 1536",  # in the V3 architecture: sigmoid routing with a bias
        {
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "rope_interleave": True,
            "first_k_dense_replace": 1,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "n_group": 1,
            "topk_group": 1,
        },
        "n_routed_experts",
    ),
    "gpt_oss": Arch(
        "gpt-oss-20b",
        {
            "hidden_size": 2880,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "attention_bias": True,
            "sliding_window": 128,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            "intermediate_size": 2880,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
        },
        "num_local_experts",
        ("sliding_attention", "full_attention"),
    ),
    "glm4_moe": Arch(
        "GLM-4.5-Air",
        {
            "hidden_size": 4096,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attention_bias": True,
            "use_qk_norm": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
            "first_k_dense_replace": 1,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
        },
        "n_routed_experts",
    ),
    "mixtral": Arch(
        "Mixtral-8x7B",
        {
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 14336,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "num_local_experts",
    ),
    "minimax_m2": Arch(
        "MiniMax-M2",
        {
            "hidden_size": 3072,
            "num_attention_heads": 48,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
            "intermediate_size": 1536,
            "num_local_experts": 256,
            "num_experts_per_tok": 8,
        },
        "num_local_experts",
    ),
}


@dataclass(frozen=True)
class ArchModel:
    """What to build: an architecture, its layer count, vocabulary and (optionally fewer) experts."""

    arch: str
    layers: int = 4
    vocab: int = 32000
    experts: int | None = None  # None: the released model's count
    # config fields over the released shape's (tests shrink a model this way)
    overrides: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"architecture {self.arch!r}: expected one of {', '.join(ARCHS)}")
        if self.layers < 1:
            raise ValueError(f"{self.arch}: layers must be >= 1, got {self.layers}")
        top_k = int({**ARCHS[self.arch].fields, **self.overrides}["num_experts_per_tok"])
        if self.experts is not None and self.experts < top_k:
            raise ValueError(f"{self.arch}: {self.experts} experts is fewer than its top-k ({top_k})")
        bpe_vocabulary(self.vocab - len(GLM_TOKENS))  # raises on a size no byte-level vocabulary has

    @property
    def expert_count(self) -> int:
        return ARCHS[self.arch].experts if self.experts is None else self.experts

    @property
    def name(self) -> str:
        fewer = "" if self.experts is None else f"-E{self.experts}"
        changed = f"-x{zlib.crc32(json.dumps(self.overrides, sort_keys=True).encode()):08x}" if self.overrides else ""
        return f"{self.arch}-L{self.layers}-V{self.vocab}{fewer}{changed}"

    def config(self) -> Any:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = ARCHS[self.arch]
        fields = {**arch.fields, **self.overrides, arch.experts_field: self.expert_count}
        if arch.layer_pattern:
            fields["layer_types"] = [arch.layer_pattern[i % len(arch.layer_pattern)] for i in range(self.layers)]
        return transformers.CONFIG_MAPPING[self.arch](
            architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.arch]],  # what llama.cpp's converter reads
            num_hidden_layers=self.layers,
            vocab_size=self.vocab,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            dtype="bfloat16",
            **fields,
        )

    def tensors(self) -> list[PlannedTensor]:
        """The checkpoint's tensors as ``save_pretrained`` names and shapes them, in its order."""
        from transformers import AutoModelForCausalLM
        from transformers.core_model_loading import revert_weight_conversion

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config(), dtype=torch.bfloat16)
        saved = revert_weight_conversion(model, model.state_dict())
        return [PlannedTensor(name, t.dtype, tuple(t.shape)) for name, t in saved.items()]


def _values(t: PlannedTensor, seed: int) -> torch.Tensor:
    """transformers' initialisation, near enough for speed: norms one, score-correction biases
    zero, everything else normal with its initializer_range; the same draw for the same name."""
    if t.name.endswith("norm.weight") or t.name.endswith("layernorm.weight"):
        return torch.ones(t.shape, dtype=t.dtype)
    if t.name.endswith("e_score_correction_bias"):
        return torch.zeros(t.shape, dtype=t.dtype)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(t.name.encode()))
    return (torch.randn(t.shape, generator=gen) * INIT_STD).to(t.dtype)


def write_tokenizer(directory: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of exactly ``vocab`` tokens (model_write.bpe_vocabulary's, then
    GLM_TOKENS) with the ChatML template, as tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, types, merges = bpe_vocabulary(vocab - len(GLM_TOKENS))
    special = [t for t, kind in zip(tokens, types, strict=True) if kind == 3]
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind != 3}
    bpe = Tokenizer(models.BPE(vocab=normal, merges=[tuple(m.split(" ")) for m in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([*special, *GLM_TOKENS])
    if bpe.get_vocab_size() != vocab:
        raise AssertionError(f"tokenizer of {bpe.get_vocab_size()} tokens, expected {vocab}")
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(directory)


def build_arch_model(
    spec: ArchModel, cache_dir: str | Path = DEFAULT_CACHE, seed: int = 0, log: Callable[[str], None] = print
) -> Path:
    """``spec``'s safetensors directory under ``cache_dir``, written (once) if it is not there."""
    final = Path(cache_dir) / f"{spec.name}-seed{seed}"
    if (final / "config.json").exists():
        return final
    tensors = spec.tensors()
    total = sum(t.nbytes for t in tensors)
    final.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(final.parent).free
    if total > free:
        raise ValueError(f"{final}: the model needs {total / 1e9:.1f} GB, the disk has {free / 1e9:.1f} GB free")
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    shards = plan_shards(tensors, DEFAULT_MAX_SHARD_BYTES)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    shape_of = ARCHS[spec.arch].model
    log(f"building {final.name} ({shape_of}): {total / 1e9:.2f} GB of random weights, one tensor at a time")
    for shard, file in zip(shards, names, strict=True):
        with open_shard(staging / file, shard) as writer:
            for t in shard:
                writer.write(t.name, _values(t, seed))
        log(f"  {file} ({sum(t.nbytes for t in shard) / 1e9:.2f} GB)")
    weight_map = {t.name: file for shard, file in zip(shards, names, strict=True) for t in shard}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    spec.config().save_pretrained(staging)
    write_tokenizer(staging, spec.vocab)
    shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover (no config.json)
    os.replace(staging, final)
    return final
