"""A random Qwen3-MoE of a real shape written straight into a 4-bit format, never as bf16 first.

Qwen3-30B-A3B at its real depth (48 layers of 128 experts of 768) is 61 GB in bf16, more than a
benchmark machine's disk leaves beside its quantized forms, and converting it would time the
converter, not the model. So its quantized forms are written here from random codes:

- ``q4_0-gguf``: one GGUF file laid out as llama.cpp's converter and ``llama-quantize --pure
  Q4_0`` write Qwen3-MoE: ``qwen3moe.*`` metadata, every 2-D weight in Q4_0 blocks (fp16 ``d``
  then 16 bytes of nibbles, weight = d * (nibble - 8), low nibbles the block's first 16 weights),
  the router ``ffn_gate_inp`` and the norms in F32 (llama-quantize never quantizes those), and a
  byte-level BPE vocabulary and a ChatML chat template so that llama.cpp and transformers both
  build a tokenizer from it and a server takes chat requests.
- ``int4-ct``: a compressed-tensors ``pack-quantized`` int4 g32 directory as Kimi-K2 ships one:
  each routed expert's projections as ``weight_packed`` (int32, value i of a word at bits 4i, code
  + 8), ``weight_scale`` (bf16 per group of 32) and ``weight_shape``; everything else bf16 and in
  the quantization config's ``ignore`` list.

Codes are uniform over the 16 nibbles. The scales (a spread of +-50% around one value) put the
weights' standard deviation at transformers' initializer range (0.02), as model_build.py's bf16
weights have, so activations stay in range through every layer. The bytes come from one random
pool read at a random offset per tensor: drawing 17 GB from a generator would take longer than
the benchmark, and nothing a kernel does depends on two tensors holding different bytes.
Each model is written under a temporary name and renamed when whole, so a cached one is complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..checkpoint.atomic import atomic_path
from ..checkpoint.quant_config import compressed_tensors_int4_config
from ..checkpoint.safetensors_stream import INDEX_FILE, PlannedTensor, open_shard
from .model_build import INIT_STD, ModelShape, build_model

SOURCES = ("bf16", "q4_0-gguf", "int4-ct")
GROUP = 32  # Q4_0's block and the int4 directory's group
_POOL_BYTES = 1 << 26
_NIBBLE_RMS = math.sqrt((16**2 - 1) / 12 + 0.25)  # the rms of (code - 8) for codes uniform on 0..15
_SCALE = INIT_STD / _NIBBLE_RMS


class _Random:
    """Random bytes and scales, read cyclically from pools at a fresh offset per tensor."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.codes = self.rng.integers(0, 256, _POOL_BYTES, dtype=np.uint8)
        spread = self.rng.uniform(0.5, 1.5, 1 << 16)
        self.scales = (spread * _SCALE).astype(np.float16)

    def take(self, pool: np.ndarray, count: int) -> np.ndarray:
        out = np.empty(count, pool.dtype)
        pos, done = int(self.rng.integers(len(pool))), 0
        while done < count:
            n = min(count - done, len(pool) - pos)
            out[done : done + n] = pool[pos : pos + n]
            done, pos = done + n, 0
        return out

    def q4_0(self, rows: tuple[int, ...], cols: int) -> np.ndarray:
        """Q4_0 blocks of a ``[*rows, cols]`` weight, as bytes ``[*rows, cols / 32 * 18]``."""
        blocks = math.prod(rows) * cols // GROUP
        out = np.empty((blocks, 18), np.uint8)
        out[:, :2] = self.take(self.scales, blocks).view(np.uint8).reshape(blocks, 2)
        out[:, 2:] = self.take(self.codes, blocks * 16).reshape(blocks, 16)
        return out.reshape(*rows, cols // GROUP * 18)

    def normal(self, shape: tuple[int, ...]) -> np.ndarray:
        return (self.rng.standard_normal(shape, dtype=np.float32) * INIT_STD).astype(np.float32)


# --- a byte-level BPE vocabulary ------------------------------------------------------------------

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's ChatML turns, so that a server can take chat requests on the written model.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies are spelled in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def bpe_vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, their GGUF token types and merges of a byte-level BPE vocabulary of ``size`` tokens:
    the 256 bytes, then pairs of bytes, then byte pairs followed by a byte, each made by one merge
    of two tokens already there; the last three are control tokens (<|endoftext|>, <|im_start|>,
    <|im_end|>), as in Qwen's vocabulary."""
    base = _byte_chars()
    merged = size - len(base) - len(SPECIALS)
    if merged < 0 or merged > 256 * 256 * (1 + 256):
        raise ValueError(f"a byte-level vocabulary of {size} tokens: expected 259 to {259 + 256**2 * 257}")
    merges: list[str] = []
    pairs = [(a, b) for a in base for b in base]
    for left, right in pairs[:merged]:
        merges.append(f"{left} {right}")
    for left, right in pairs:
        for third in base:
            if len(merges) >= merged:
                break
            merges.append(f"{left}{right} {third}")
        if len(merges) >= merged:
            break
    tokens = base + [m.replace(" ", "") for m in merges] + list(SPECIALS)
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # normal, then control
    return tokens, types, merges


# --- the GGUF file ----------------------------------------------------------------------------------


# Each tensor as (name, logical shape [*rows, cols], how it is made): "q4_0" blocks, "ones" (the
# norms, as transformers initialises them) or "normal" F32 (the router, which llama-quantize keeps).
_GGUFTensor = tuple[str, tuple[int, ...], str]


def _gguf_plan(shape: ModelShape) -> list[_GGUFTensor]:
    """Every tensor of the file in file order, under llama.cpp's qwen3moe names."""
    h, e, i, hd = shape.hidden, shape.experts, shape.intermediate, shape.head_dim
    out = [("token_embd.weight", (shape.vocab, h), "q4_0")]
    for layer in range(shape.layers):
        p = f"blk.{layer}."
        out += [
            (p + "attn_norm.weight", (h,), "ones"),
            (p + "attn_q.weight", (shape.heads * hd, h), "q4_0"),
            (p + "attn_k.weight", (shape.kv_heads * hd, h), "q4_0"),
            (p + "attn_v.weight", (shape.kv_heads * hd, h), "q4_0"),
            (p + "attn_output.weight", (h, shape.heads * hd), "q4_0"),
            (p + "attn_q_norm.weight", (hd,), "ones"),
            (p + "attn_k_norm.weight", (hd,), "ones"),
            (p + "ffn_norm.weight", (h,), "ones"),
            (p + "ffn_gate_inp.weight", (e, h), "normal"),
            (p + "ffn_gate_exps.weight", (e, i, h), "q4_0"),
            (p + "ffn_up_exps.weight", (e, i, h), "q4_0"),
            (p + "ffn_down_exps.weight", (e, h, i), "q4_0"),
        ]
    return [*out, ("output_norm.weight", (h,), "ones"), ("output.weight", (shape.vocab, h), "q4_0")]


def _stored_shape(dims: tuple[int, ...], kind: str) -> tuple[tuple[int, ...], np.dtype]:
    """The numpy array written for a tensor: Q4_0 as bytes ``[*rows, cols / 32 * 18]``, else F32."""
    if kind == "q4_0":
        return (*dims[:-1], dims[-1] // GROUP * 18), np.dtype(np.uint8)
    return dims, np.dtype(np.float32)


def _make(dims: tuple[int, ...], kind: str, rnd: _Random) -> np.ndarray:
    if kind == "q4_0":
        return rnd.q4_0(dims[:-1], dims[-1])
    return np.ones(dims, np.float32) if kind == "ones" else rnd.normal(dims)


def _check_widths(shape: ModelShape) -> None:
    widths = {
        "hidden": shape.hidden,
        "intermediate": shape.intermediate,
        "heads x head_dim": shape.heads * shape.head_dim,
    }
    bad = {k: v for k, v in widths.items() if v % GROUP}
    if bad:
        raise ValueError(f"a 4-bit model of groups of {GROUP} needs every row width a multiple of it; found {bad}")


def write_q4_0_gguf(shape: ModelShape, path: Path, seed: int = 0) -> Path:
    """The model as one pure-Q4_0 GGUF at ``path`` (written atomically)."""
    import gguf

    _check_widths(shape)
    rnd = _Random(seed)
    plan = _gguf_plan(shape)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), "qwen3moe")
        w.add_name(f"hetmoe random {shape.name}")
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(4096)
        w.add_embedding_length(shape.hidden)
        w.add_feed_forward_length(6144)
        w.add_block_count(shape.layers)
        w.add_head_count(shape.heads)
        w.add_head_count_kv(shape.kv_heads)
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
        w.add_rope_freq_base(1_000_000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.top_k)
        w.add_expert_feed_forward_length(shape.intermediate)
        tokens, types, merges = bpe_vocabulary(shape.vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(tokens.index("<|im_end|>"))  # as Qwen3's instruct GGUFs: a chat turn ends the text
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
        for name, dims, kind in plan:
            stored, dtype = _stored_shape(dims, kind)
            raw = gguf.GGMLQuantizationType.Q4_0 if kind == "q4_0" else None
            w.add_tensor_info(name, stored, dtype, math.prod(stored) * dtype.itemsize, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, dims, kind in plan:  # one tensor in memory at a time
            w.write_tensor_data(_make(dims, kind, rnd))
        w.close()
    return path


# --- the compressed-tensors directory -------------------------------------------------------------


def _ct_shards(shape: ModelShape) -> list[list[PlannedTensor]]:
    """model_build's shards with every routed expert projection as its three packed tensors."""
    h, i = shape.hidden, shape.intermediate
    shards = []
    for shard in shape.shards():
        out = []
        for t in shard:
            if ".experts." not in t.name:
                out.append(t)
                continue
            n, k = (h, i) if "down_proj" in t.name else (i, h)
            stem = t.name.removesuffix(".weight")
            out += [
                PlannedTensor(stem + ".weight_packed", torch.int32, (n, k // 8)),
                PlannedTensor(stem + ".weight_scale", torch.bfloat16, (n, k // GROUP)),
                PlannedTensor(stem + ".weight_shape", torch.int64, (2,)),
            ]
        shards.append(out)
    return shards


def _ct_value(t: PlannedTensor, shape: ModelShape, rnd: _Random) -> torch.Tensor:
    if t.name.endswith(".weight_shape"):  # (out, in) of the projection
        down = ".down_proj." in t.name
        return torch.tensor((shape.hidden, shape.intermediate) if down else (shape.intermediate, shape.hidden))
    if t.name.endswith(".weight_packed"):
        return torch.from_numpy(rnd.take(rnd.codes, t.nbytes).view(np.int32).reshape(t.shape))
    if t.name.endswith(".weight_scale"):
        return torch.from_numpy(rnd.take(rnd.scales, math.prod(t.shape)).reshape(t.shape)).to(torch.bfloat16)
    if len(t.shape) == 1:
        return torch.ones(t.shape, dtype=t.dtype)
    return torch.from_numpy(rnd.normal(t.shape)).to(t.dtype)


def write_int4_ct(shape: ModelShape, directory: Path, seed: int = 0) -> Path:
    """The model as a compressed-tensors int4 g32 directory at ``directory`` (renamed in when whole)."""
    _check_widths(shape)
    rnd = _Random(seed)
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shards = _ct_shards(shape)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, file in zip(shards, names, strict=True):
        with open_shard(staging / file, shard) as writer:
            for t in shard:
                writer.write(t.name, _ct_value(t, shape, rnd))
    weight_map = {t.name: file for shard, file in zip(shards, names, strict=True) for t in shard}
    total = sum(t.nbytes for shard in shards for t in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = shape.config()
    ignore = [t.name.removesuffix(".weight") for s in shape.shards() for t in s if _ignored(t)]
    config.quantization_config = compressed_tensors_int4_config(ignore, GROUP)  # type: ignore[attr-defined]
    config.save_pretrained(staging)  # type: ignore[attr-defined]
    (staging / "hetmoe-bench-shape.json").write_text(json.dumps({**asdict(shape), "seed": seed}, indent=1) + "\n")
    shutil.rmtree(directory, ignore_errors=True)  # an incomplete leftover (no config.json)
    os.replace(staging, directory)
    return directory


def _ignored(t: PlannedTensor) -> bool:
    """The Linear weights left in bf16: attention, the router and the lm_head (not norms or the embedding)."""
    return t.name.endswith(".weight") and len(t.shape) == 2 and ".experts." not in t.name and "embed" not in t.name


# --- one entry point ------------------------------------------------------------------------------


def build_source(
    shape: ModelShape, source: str, cache_dir: str | Path, seed: int = 0, log: Callable[[str], None] = print
) -> Path:
    """The model of ``shape`` in ``source`` form (SOURCES) under ``cache_dir``, written once."""
    if source == "bf16":
        return build_model(shape, cache_dir, seed, log)
    if source not in SOURCES:
        raise ValueError(f"model source {source!r}: expected one of {', '.join(SOURCES)}")
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if source == "q4_0-gguf":
        path = cache / f"{shape.name}-seed{seed}-Q4_0.gguf"
        if not path.exists():
            log(f"writing {path.name}: random Q4_0 blocks, one tensor at a time")
            write_q4_0_gguf(shape, path, seed)
        return path
    path = cache / f"{shape.name}-seed{seed}-int4-ct"
    if not (path / "config.json").exists():
        log(f"writing {path.name}: random compressed-tensors int4 g32 experts, one tensor at a time")
        write_int4_ct(shape, path, seed)
    return path
