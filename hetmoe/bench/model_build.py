"""A random Qwen3-MoE checkpoint of a real model's shape, written tensor by tensor.

The whole-model benchmark needs a model of Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of
768, top-8, 32 query / 4 KV heads of 128) with a few layers. Instantiating it in transformers and
calling ``save_pretrained`` would hold the model (4 layers: ~5 GB in bf16) and then a second copy
while saving; here every tensor is drawn and written on its own into safetensors shards laid out in
advance (checkpoint/safetensors_stream.py), so memory stays at one tensor. The tensor names are
the ones transformers' ``save_pretrained`` writes for Qwen3-MoE (per-expert, as the hub checkpoints
are), and ``config.json`` is written by transformers' own config class, so the directory loads in
transformers and in hetmoe alike. The directory is assembled under a temporary name and renamed
when complete: a cached model is always whole.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..checkpoint.safetensors_stream import INDEX_FILE, PlannedTensor, open_shard

DEFAULT_CACHE = Path(os.environ.get("HETMOE_BENCH_MODELS", Path.home() / ".cache" / "hetmoe" / "bench-models"))
INIT_STD = 0.02  # transformers' initializer_range for Qwen3-MoE


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3-MoE shape; the defaults are Qwen3-30B-A3B's layers with 4 of them and a small vocab."""

    layers: int = 4
    hidden: int = 2048
    experts: int = 128
    intermediate: int = 768  # per expert
    top_k: int = 8
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 8192

    @property
    def name(self) -> str:
        return (
            f"qwen3moe-L{self.layers}-H{self.hidden}-E{self.experts}x{self.intermediate}-k{self.top_k}"
            f"-A{self.heads}x{self.head_dim}kv{self.kv_heads}-V{self.vocab}"
        )

    def config(self) -> object:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=6144,  # the dense MLP's width: unused, every layer is MoE
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            num_experts=self.experts,
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.intermediate,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
            dtype="bfloat16",
            architectures=["Qwen3MoeForCausalLM"],  # what llama.cpp's converter detects the model by
        )

    def bytes_bf16(self) -> int:
        return sum(t.nbytes for shard in self.shards() for t in shard)

    def shards(self) -> list[list[PlannedTensor]]:
        """One shard per decoder layer, then the embeddings, final norm and lm_head."""
        bf16 = torch.bfloat16
        h, i, hd = self.hidden, self.intermediate, self.head_dim
        out = []
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            t = [
                PlannedTensor(p + "input_layernorm.weight", bf16, (h,)),
                PlannedTensor(p + "post_attention_layernorm.weight", bf16, (h,)),
                PlannedTensor(p + "self_attn.q_proj.weight", bf16, (self.heads * hd, h)),
                PlannedTensor(p + "self_attn.k_proj.weight", bf16, (self.kv_heads * hd, h)),
                PlannedTensor(p + "self_attn.v_proj.weight", bf16, (self.kv_heads * hd, h)),
                PlannedTensor(p + "self_attn.o_proj.weight", bf16, (h, self.heads * hd)),
                PlannedTensor(p + "self_attn.q_norm.weight", bf16, (hd,)),
                PlannedTensor(p + "self_attn.k_norm.weight", bf16, (hd,)),
                PlannedTensor(p + "mlp.gate.weight", bf16, (self.experts, h)),
            ]
            for e in range(self.experts):
                q = f"{p}mlp.experts.{e}."
                t += [
                    PlannedTensor(q + "gate_proj.weight", bf16, (i, h)),
                    PlannedTensor(q + "up_proj.weight", bf16, (i, h)),
                    PlannedTensor(q + "down_proj.weight", bf16, (h, i)),
                ]
            out.append(t)
        out.append(
            [
                PlannedTensor("model.embed_tokens.weight", bf16, (self.vocab, h)),
                PlannedTensor("model.norm.weight", bf16, (h,)),
                PlannedTensor("lm_head.weight", bf16, (self.vocab, h)),
            ]
        )
        return out


def _values(t: PlannedTensor, gen: torch.Generator) -> torch.Tensor:
    if len(t.shape) == 1:  # RMSNorm weights: transformers initialises them to one
        return torch.ones(t.shape, dtype=t.dtype)
    return (torch.randn(t.shape, generator=gen) * INIT_STD).to(t.dtype)


def _stream(shard: list[PlannedTensor], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for t in shard:
        yield t.name, _values(t, gen)


def build_model(
    shape: ModelShape = ModelShape(),
    cache_dir: str | Path = DEFAULT_CACHE,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """The model's directory under ``cache_dir``, built (once) if it is not there."""
    final = Path(cache_dir) / f"{shape.name}-seed{seed}"
    if (final / "config.json").exists():
        return final
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shards = shape.shards()
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    log(f"building {final.name}: {shape.bytes_bf16() / 1e9:.2f} GB of random bf16 weights, one tensor at a time")
    for index, (shard, file) in enumerate(zip(shards, names, strict=True)):
        with open_shard(staging / file, shard) as writer:
            for name, value in _stream(shard, seed * 1000 + index):
                writer.write(name, value)
        log(f"  {file} ({sum(t.nbytes for t in shard) / 1e9:.2f} GB)")
    weight_map = {t.name: file for shard, file in zip(shards, names, strict=True) for t in shard}
    index_doc = {"metadata": {"total_size": shape.bytes_bf16()}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n")
    shape.config().save_pretrained(staging)  # type: ignore[attr-defined]
    (staging / "hetmoe-bench-shape.json").write_text(json.dumps({**asdict(shape), "seed": seed}, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)  # an incomplete leftover (no config.json) of an older layout
    os.replace(staging, final)
    return final
