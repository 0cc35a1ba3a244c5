"""A llama.cpp GGUF MoE model as load_model sees it: a transformers config and transformers names.

A GGUF file has no ``config.json`` and names its tensors llama.cpp's way. :class:`GGUFModel` turns
the ``{arch}.*`` metadata into the transformers config of the same model and presents the file as a
:class:`TensorSource` whose non-expert tensors carry transformers names and come back dequantized
(``hetmoe.formats.gguf`` decodes every block type; F32/F16/BF16 tensors are views of the file), while
the routed experts keep their GGUF names and raw blocks, so ``read_layer_experts`` hands them to the
CPU engine as stored (memory-mapped, one layer at a time, never dequantized as a whole).

The conventions matched are those of llama.cpp's ``convert_hf_to_gguf.py`` and ``src/models/*.cpp``:

- GGUF lists dims fastest first; the reader (``checkpoint/gguf_file.py``) gives torch order, so a
  Linear weight is ``[out, in]`` as in transformers, ``token_embd`` ``[vocab, hidden]`` and the
  stacked experts ``ffn_{gate,up}_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]``.
- Only llama-architecture files permute the rows of ``attn_q``/``attn_k`` (``LlamaModel.permute``, for
  ggml's interleaved rope); for Mixtral (llama with experts) the rows are put back in transformers'
  order, whole rows of the stored blocks moved so q/k still run as stored. qwen2moe, qwen3moe,
  glm4moe, minimax-m2 and gpt-oss keep transformers' order (neox rope), and deepseek2 keeps the
  original DeepSeek order, which transformers reads with its interleaved rope.
- glm4moe (GLM-4.5/4.6, GLM-4.5-Air) and minimax-m2 rotate the leading ``rope.dimension_count``
  values of each head (transformers' ``partial_rotary_factor``), route by sigmoid scores with the
  selection bias ``exp_probs_b`` and say nothing of q/k norms or biases: those are read off the
  tensors present. MiniMax-M2's q/k norms span the whole projection; it always renormalises the
  top-k weights (``norm_w = true`` in ``minimax-m2.cpp``). GLM-4-MoE files count their
  multi-token-prediction block(s) in ``block_count`` (``nextn_predict_layers``); llama.cpp's graph
  and transformers skip them, and so does this reader.
- gpt-oss (llama.cpp's openai-moe graph): MXFP4 experts with biases, a router with a bias, attention
  biases and a sink logit per head (``attn_sinks``), sliding-window layers by
  ``attention.sliding_window_pattern`` (default: every other layer, the first sliding); the clamped
  SwiGLU's alpha and limit are fixed in llama.cpp's graph (1.702, 7), and its YaRN floors and ceils
  the correction range (transformers' ``truncate``), whatever the original config.json said.
- olmoe (OLMoE): every layer MoE, softmax routing never renormalised (``norm_w = false`` in
  ``olmoe.cpp``), q/k norms over the whole projections (transformers' OLMoE; llama.cpp sizes both
  ``n_embd``, so its files have as many KV heads as heads), neox rope, no biases.
- ``output.weight`` absent means the embedding is tied to the output.
- What the file does not say but llama.cpp's graph fixes: qwen3moe always renormalises the top-k
  routing weights (``norm_w = true`` in ``qwen3moe.cpp``), qwen2moe never does (``false``); the
  shared-expert gate of qwen2moe is stored as a vector ``[H]``.
- qwen3next (Qwen3-Next): full-attention layers (q_proj holding each head's output gate beside its
  query, q/k norms, neox rope over ``rope.dimension_count`` values of a head) between gated
  delta-net layers (``attention.recurrent_layers``, else every ``full_attention_interval``-th layer
  full, 4 by default, as llama.cpp reads them); softmax routing renormalised (``norm_w = true``) and
  a sigmoid-gated shared expert. The converter stores the zero-centred norms as ``1 + w`` (all but
  the delta-net's gated norm), ``A_log`` as ``-exp(A_log)`` (``ssm_a``), the conv weight squeezed,
  and ``in_proj_qkvz`` split into ``attn_qkv`` (all q heads, then k, then v) and ``attn_gate`` (z)
  out of its per-key-head groups ``[q k v z]``; each is undone here (``_next_entry``), the last by
  moving whole rows of the stored blocks, so in_proj_qkvz still runs as stored.
- deepseek2 (DeepSeek-V2/V3, Kimi-K2): newer files split ``kv_b_proj`` into ``attn_k_b``
  (``[heads, kv_lora_rank, qk_nope]``, i.e. transposed per head) and ``attn_v_b``
  (``[heads, v_head_dim, kv_lora_rank]``); both are put back together here. Sigmoid gating with
  ``exp_probs_b`` is DeepSeek-V3 (``e_score_correction_bias``), softmax gating DeepSeek-V2. A file
  without ``expert_gating_func`` is softmax gating, llama.cpp's default (a note says so); with
  ``exp_probs_b`` it is run as DeepSeek-V3 with softmax scores (``scoring_func``), the bias added to
  the selection scores and ``expert_weights_norm`` applied, as llama.cpp's graph does.

Anything the file holds that has no place in the transformers model, and anything the model needs
that the file lacks, is an error naming the file and the tensor or metadata key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, TensorInfo, TensorSource
from ..checkpoint.config import qwen3next_layer_types
from ..checkpoint.gguf_file import GGUFFile
from ..checkpoint.layout import MoELayout
from ..formats import FormatError, QuantizedTensor, UnknownMethodError, get_codec

# Where transformers keeps the decoder layers of every architecture read here.
MODULE_PREFIX = "model.layers"
ARCHITECTURES = ("qwen2moe", "qwen3moe", "qwen3next", "deepseek2", "glm4moe", "minimax-m2", "gpt-oss", "olmoe", "llama")

_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_BLOCK = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<leaf>.+)$")
_EXPERT_LEAF = re.compile(r"^ffn_(?:gate|up|down|gate_up)_exps\.(?:weight|bias)$")

# llama.cpp tensor names -> transformers names (``model.layers.N.`` + the value for blk.N.*).
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_QKV = {f"attn_{x}.{p}": f"self_attn.{x}_proj.{p}" for x in ("q", "k", "v") for p in ("weight", "bias")} | {
    "attn_output.weight": "self_attn.o_proj.weight"
}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_ROUTER = {"ffn_gate_inp.weight": "mlp.gate.weight"}
_DENSE_MLP = {f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
_QWEN2_SHARED = {f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")} | {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"
}
_DEEPSEEK_SHARED = {f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}
# GLM-4-MoE names its post-attention norm for what it is; the gate holds the selection bias.
_GLM_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
}
_GLM_ROUTER = _ROUTER | {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
# MiniMax-M2 keeps the selection bias on the MoE block itself.
_MINIMAX_ROUTER = _ROUTER | {"exp_probs_b.bias": "mlp.e_score_correction_bias"}
# Qwen3-Next: the full-attention layers' names are Qwen3-MoE's (GLM's norm names); the delta-net
# layers' in_proj_qkvz has no tensor of its own (``ssm_in``: joined from attn_qkv and attn_gate).
_NEXT_LINEAR = {
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# its norms whose weight is zero-centred (transformers computes (1 + w) * x), stored as 1 + w
_NEXT_OFFSET_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")
# gpt-oss: biases everywhere in its attention and router, a sink logit per head, GLM's norm names.
_GPT_OSS = (
    _GLM_NORMS
    | {f"attn_{x}.{p}": f"self_attn.{x}_proj.{p}" for x in ("q", "k", "v") for p in ("weight", "bias")}
    | {"attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias"}
    | {"attn_sinks.weight": "self_attn.sinks"}
    | {"ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias"}
)
_MLA = {
    "attn_q.weight": "self_attn.q_proj.weight",  # no q_lora_rank (V2-Lite)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # older files; newer split it into k_b / v_b
    "attn_output.weight": "self_attn.o_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}


class _Meta:
    """The metadata of a GGUF file, read with the key (and file) named in every error."""

    def __init__(self, file: GGUFFile, arch: str) -> None:
        self.values = file.metadata
        self.path = file.path
        self.arch = arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{key}", default)

    def need(self, key: str, what: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(self.path, f"GGUF metadata lacks {self.arch}.{key} ({what})")
        return value

    def count(self, key: str, what: str, default: int | None = None) -> int:
        value = self.get(key, default) if default is not None else self.need(key, what)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(self.path, f"{self.arch}.{key} ({what}) must be a positive integer, found {value!r}")
        return int(value)

    def number(self, key: str, what: str, default: float | None = None) -> float:
        value = self.get(key, default) if default is not None else self.need(key, what)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise CheckpointError(self.path, f"{self.arch}.{key} ({what}) must be a finite number, found {value!r}")
        return float(value)

    def token_id(self, name: str) -> int | None:
        value = self.values.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class _Entry:
    """One transformers tensor: read from ``parts`` (GGUF names), then ``build`` when it is not just
    the parts' rows one after the other (reshaped to ``shape``); ``rows``: those rows in transformers'
    order (a llama file's q/k, permuted by the converter; qwen3next's in_proj_qkvz), applied to the
    stored blocks as to the decoded values."""

    parts: tuple[str, ...]
    shape: tuple[int, ...]
    build: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    rows: torch.Tensor | None = None


class GGUFTensors:
    """A GGUF file under transformers names: non-expert tensors dequantized on ``get`` (F32/F16/BF16
    as views of the file), routed-expert tensors passed through raw under their GGUF names."""

    def __init__(self, raw: TensorSource, entries: dict[str, _Entry], experts: list[str]) -> None:
        self.path = raw.path
        self._raw = raw
        self._entries = entries
        self._experts = set(experts)

    def keys(self) -> list[str]:
        return [*self._entries, *sorted(self._experts)]

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._experts

    def info(self, name: str) -> TensorInfo:
        if name in self._experts:
            return self._raw.info(name)
        entry = self._entry(name)
        infos = [self._raw.info(p) for p in entry.parts]
        stored = str(infos[0].dtype)
        dtype = _FLOATS[stored] if len(infos) == 1 and stored in _FLOATS else torch.float32
        return TensorInfo(name, dtype, entry.shape, sum(i.nbytes for i in infos), infos[0].file)

    def get(self, name: str) -> torch.Tensor:
        if name in self._experts:
            return self._raw.get(name)
        entry = self._entry(name)
        parts = [self._decode(p) for p in entry.parts]
        if entry.build is not None:
            value = entry.build(parts)
        else:
            value = parts[0] if len(parts) == 1 else torch.cat([p.float() for p in parts])
        if entry.rows is not None:
            value = value.reshape(entry.shape).index_select(0, entry.rows)
        return value.reshape(entry.shape)

    def prefetch(self, name: str) -> None:
        """Start reading the stored bytes of ``name`` into the page cache (GGUFFile.prefetch)."""
        prefetch = getattr(self._raw, "prefetch", None)
        if prefetch is None:
            return
        for key in [name] if name in self._experts else self._entry(name).parts:
            prefetch(key)

    def stored(self, name: str) -> QuantizedTensor | None:
        """A non-expert weight in its GGUF block type, as the file holds it (a view of the mapped
        bytes, or whole rows of blocks gathered where the rows move or come from several tensors of
        one type), where its parts are rows of the transformers shape in a block (not float) type;
        else None (``get`` decodes it)."""
        if name in self._experts:
            return None
        entry = self._entry(name)
        if entry.build is not None or len(entry.shape) != 2:
            return None
        infos = [self._raw.info(p) for p in entry.parts]
        types = {str(i.dtype) for i in infos}
        if len(types) != 1 or types & set(_FLOATS) or any(len(i.shape) != 2 for i in infos):
            return None
        if sum(i.shape[0] for i in infos) != entry.shape[0] or any(i.shape[1] != entry.shape[1] for i in infos):
            return None
        try:
            parts = [self._blocks(p)[1] for p in entry.parts]
        except UnknownMethodError:
            return None
        if len(parts) == 1 and entry.rows is None:
            return parts[0]
        raw = torch.cat([b.tensors[".weight"].reshape(b.shape[0], -1) for b in parts])  # whole rows of blocks
        if entry.rows is not None:
            raw = raw.index_select(0, entry.rows)
        return dataclasses.replace(parts[0], shape=tuple(entry.shape), tensors={".weight": raw})

    def _blocks(self, key: str) -> tuple[Any, QuantizedTensor]:
        """``(codec, the tensor's blocks)`` of a GGUF tensor in a block type; UnknownMethodError for a
        type hetmoe has no codec for."""
        info = self._raw.info(key)
        stored = str(info.dtype)
        codec = get_codec(f"gguf:{stored.lower()}")
        return codec, QuantizedTensor(
            codec.label(), tuple(info.shape), {".weight": self._raw.get(key)}, {"ggml_type": stored}
        )

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(self.path, f"no tensor named {name!r}") from None

    def _decode(self, key: str) -> torch.Tensor:
        """A GGUF tensor as floats in its logical (torch-order) shape."""
        info = self._raw.info(key)
        stored = str(info.dtype)
        if stored in _FLOATS:
            return self._raw.get(key).view(_FLOATS[stored]).reshape(info.shape)  # a view of the mapped file
        try:
            codec, q = self._blocks(key)
        except UnknownMethodError as exc:
            raise CheckpointError(info.file, f"tensor {key}: {exc}") from None
        try:
            return codec.dequantize(q)
        except FormatError as exc:
            raise CheckpointError(info.file, f"tensor {key}: {exc}") from exc


class GGUFModel:
    """A GGUF MoE file ready for load_model: ``config`` (transformers), ``source`` (transformers names
    for everything but the routed experts) and ``layout`` (the experts, as ``moe_layout`` found them)."""

    layers_prefix = MODULE_PREFIX

    def __init__(self, path: str | Path, source: TensorSource, layout: MoELayout) -> None:
        self.path = Path(path)
        self.notes: list[str] = []  # defaults taken where the metadata is silent, as llama.cpp takes them
        file = _first_file(source)
        arch = file.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(
                file.path,
                f"general.architecture {arch!r}: load_model runs GGUF MoE models of architecture "
                f"{', '.join(ARCHITECTURES)}; convert this one from its transformers checkpoint instead",
            )
        self.arch = str(arch)
        self.meta = _Meta(file, self.arch)
        self.tensors = {k: source.info(k) for k in source.keys()}
        self._kv_b_split: dict[str, int] = {}  # deepseek2: the sizes that put kv_b_proj back together
        self._permuted_rows: dict[str, torch.Tensor] = {}  # llama: q/k leaf -> rows in transformers' order
        if self.arch in ("glm4moe", "qwen3next"):
            # their multi-token-prediction block(s) follow the decoder layers (block_count counts them,
            # nextn_predict_layers says how many; llama.cpp's graph and transformers skip them): left
            # unread. Any other tensor past the layers is still an error (_entries).
            blocks = int(self.meta.get("block_count", layout.num_layers))
            self.tensors = {k: v for k, v in self.tensors.items() if not layout.num_layers <= _layer_of(k) < blocks}
        builders = {
            "qwen2moe": self._qwen2moe,
            "qwen3moe": self._qwen3moe,
            "qwen3next": self._qwen3next,
            "deepseek2": self._deepseek2,
            "glm4moe": self._glm4moe,
            "minimax-m2": self._minimax_m2,
            "gpt-oss": self._gpt_oss,
            "olmoe": self._olmoe,
            "llama": self._llama,
        }
        fields, self._layer_names = builders[self.arch](layout)
        self.config = _make_config(fields, file.path)
        entries = self._entries(layout)
        experts = [k for k in self.tensors if _is_expert(k)]
        self.source = GGUFTensors(source, entries, experts)
        self.layout = dataclasses.replace(layout, model_type=self.config.model_type)

    # --- configuration -------------------------------------------------------------------------

    def _common(self, layout: MoELayout) -> dict[str, Any]:
        m = self.meta
        hidden = m.count("embedding_length", "hidden_size")
        heads = m.count("attention.head_count", "num_attention_heads")
        embedding = self._shape("token_embd.weight", "the token embedding")
        if len(embedding) != 2 or embedding[1] != hidden:
            raise CheckpointError(
                self.meta.path,
                f"tensor token_embd.weight: expected shape [vocab, {hidden}] ({self.arch}.embedding_length), "
                f"found {list(embedding)}",
            )
        return {
            "vocab_size": embedding[0],
            "hidden_size": hidden,
            "num_hidden_layers": layout.num_layers,
            "num_attention_heads": heads,
            "max_position_embeddings": m.count("context_length", "max_position_embeddings"),
            "rms_norm_eps": m.number("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
            "num_experts_per_tok": layout.top_k,
            "moe_intermediate_size": layout.intermediate_size,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": m.token_id("bos"),
            "eos_token_id": m.token_id("eos"),
            "pad_token_id": m.token_id("padding"),
            "hidden_act": "silu",
            "dtype": "bfloat16",
        }

    def _rope(self) -> dict[str, Any]:
        m = self.meta
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.number("rope.freq_base", "rope_theta", 10000.0)}
        kind = m.get("rope.scaling.type", "none")
        if kind in ("none", None):
            return rope
        factor = m.number("rope.scaling.factor", "the rope scaling factor")
        if kind == "linear":
            return rope | {"rope_type": "linear", "factor": factor}
        if kind == "yarn":
            rope |= {
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": m.count("rope.scaling.original_context_length", "YaRN"),
                "beta_fast": m.number("rope.scaling.yarn_beta_fast", "YaRN beta_fast", 32.0),
                "beta_slow": m.number("rope.scaling.yarn_beta_slow", "YaRN beta_slow", 1.0),
            }
            return rope
        raise CheckpointError(
            m.path, f"{self.arch}.rope.scaling.type {kind!r}: only none, linear and yarn rope scaling are supported"
        )

    def _no_expert_scale(self) -> None:
        scale = self.meta.get("expert_weights_scale")
        if scale not in (None, 0.0, 1.0):
            raise CheckpointError(
                self.meta.path,
                f"{self.arch}.expert_weights_scale={scale}: transformers' {self.arch} has no routed scaling factor",
            )

    def _attention(self, fields: dict[str, Any], head_dim: int) -> None:
        """KV heads and head size, checked against what llama.cpp's qwen graphs assume."""
        m = self.meta
        heads = fields["num_attention_heads"]
        fields["num_key_value_heads"] = m.count("attention.head_count_kv", "num_key_value_heads", heads)
        value_dim = m.count("attention.value_length", "the value head size", head_dim)
        rotary = m.count("rope.dimension_count", "the rotary dimensions", head_dim)
        if value_dim != head_dim or rotary != head_dim:
            raise CheckpointError(
                m.path,
                f"{self.arch}: key_length={head_dim}, value_length={value_dim}, rope.dimension_count={rotary}: "
                "transformers' model needs all three equal",
            )
        fields["rope_parameters"] = self._rope()

    def _gqa_fields(self, layout: MoELayout) -> dict[str, Any]:
        """``_common`` plus the head size (``attention.key_length``, else hidden / heads) and what
        ``_attention`` reads: the fields of the full-rotary GQA families."""
        fields = self._common(layout)
        head_dim = self.meta.count(
            "attention.key_length", "head_dim", fields["hidden_size"] // fields["num_attention_heads"]
        )
        fields["head_dim"] = head_dim
        self._attention(fields, head_dim)
        return fields

    def _all_moe(self, layout: MoELayout) -> None:
        """The families whose every decoder layer is MoE: a layer without experts is not their model."""
        if len(layout.moe_layers) != layout.num_layers:
            dense = sorted(set(range(layout.num_layers)) - set(layout.moe_layers))
            raise CheckpointError(
                self.meta.path, f"{self.arch}: layers {dense[:8]} have no experts; every layer is MoE"
            )

    def _qwen_fields(self, layout: MoELayout, model_type: str, norm_topk_prob: bool) -> dict[str, Any]:
        """What Qwen2-MoE and Qwen3-MoE configs share: sizes, experts, heads and head size."""
        fields = self._gqa_fields(layout)
        fields |= {"model_type": model_type, "num_experts": layout.num_experts, "norm_topk_prob": norm_topk_prob}
        return fields

    def _qwen_layers(self, fields: dict[str, Any], layout: MoELayout) -> None:
        dense = [layer for layer in range(layout.num_layers) if layer not in layout.moe_layers]
        fields["decoder_sparse_step"] = 1
        fields["mlp_only_layers"] = dense
        if dense:
            fields["intermediate_size"] = self._shape(f"blk.{dense[0]}.ffn_up.weight", "a dense layer's MLP")[0]

    def _qwen3moe(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        fields = self._qwen_fields(layout, "qwen3_moe", norm_topk_prob=True)
        fields["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        self._qwen_layers(fields, layout)
        self._no_expert_scale()

        def names(layer: int) -> dict[str, str]:
            bias = fields["attention_bias"]
            qkv = {k: v for k, v in _QKV.items() if bias or not k.endswith(".bias")}
            mlp = _ROUTER if layer in layout.moe_layers else _DENSE_MLP
            return _NORMS | qkv | _QK_NORM | mlp

        return fields, names

    def _qwen3next(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        m = self.meta
        fields = self._common(layout)
        head_dim = m.count("attention.key_length", "head_dim")
        value_dim = m.count("attention.value_length", "the value head size", head_dim)
        if value_dim != head_dim:
            raise CheckpointError(
                m.path, f"qwen3next: key_length={head_dim}, value_length={value_dim}: transformers needs them equal"
            )
        rotary = m.count("rope.dimension_count", "the rotary dimensions", head_dim)
        value_heads = m.count("ssm.time_step_rank", "linear_num_value_heads")
        inner = m.count("ssm.inner_size", "the delta-net's value width")
        if inner % value_heads:
            raise CheckpointError(
                m.path, f"qwen3next.ssm.inner_size={inner} is not a multiple of ssm.time_step_rank={value_heads}"
            )
        self._no_expert_scale()
        sample = layout.moe_layers[0]
        fields |= {
            "model_type": "qwen3_next",
            "num_key_value_heads": m.count("attention.head_count_kv", "num_key_value_heads"),
            "head_dim": head_dim,
            "rope_parameters": self._rope() | {"partial_rotary_factor": rotary / head_dim},
            "num_experts": layout.num_experts,
            "norm_topk_prob": True,  # llama.cpp's qwen3next graph: norm_w = true
            "shared_expert_intermediate_size": self._shape(f"blk.{sample}.ffn_up_shexp.weight", "the shared expert")[0],
            "layer_types": self._recurrent_layers(layout.num_layers),
            "linear_conv_kernel_dim": m.count("ssm.conv_kernel", "linear_conv_kernel_dim"),
            "linear_key_head_dim": m.count("ssm.state_size", "linear_key_head_dim"),
            "linear_num_key_heads": m.count("ssm.group_count", "linear_num_key_heads"),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": inner // value_heads,
            "attention_bias": False,
        }
        self._qwen_layers(fields, layout)
        attention = {k: v for k, v in _QKV.items() if not k.endswith(".bias")} | _QK_NORM
        types = fields["layer_types"]

        def names(layer: int) -> dict[str, str]:
            mixer = _NEXT_LINEAR if types[layer] == "linear_attention" else attention
            mlp = _ROUTER | _QWEN2_SHARED if layer in layout.moe_layers else _DENSE_MLP
            return _GLM_NORMS | mixer | mlp

        return fields, names

    def _recurrent_layers(self, layers: int) -> list[str]:
        """The layer kinds (checkpoint/config.py: qwen3next_layer_types), or an error naming the keys."""
        flags, interval = self.meta.get("attention.recurrent_layers"), self.meta.get("full_attention_interval", 4)
        types = qwen3next_layer_types(flags, interval, layers)
        if types is None:
            raise CheckpointError(
                self.meta.path,
                f"qwen3next.attention.recurrent_layers: expected {layers} flags, found {flags!r} "
                f"(or without it, full_attention_interval a positive count, found {interval!r})",
            )
        return types

    def _olmoe(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        fields = self._gqa_fields(layout)
        self._all_moe(layout)
        self._no_expert_scale()
        fields |= {
            "model_type": "olmoe",
            "num_experts": layout.num_experts,
            "intermediate_size": layout.intermediate_size,  # OLMoE's config names the experts' width so
            "norm_topk_prob": False,
            "attention_bias": False,
            "clip_qkv": None,
        }
        attention = {k: v for k, v in _QKV.items() if not k.endswith(".bias")} | _QK_NORM

        def names(layer: int) -> dict[str, str]:
            return _NORMS | attention | _ROUTER

        return fields, names

    def _qwen2moe(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        fields = self._qwen_fields(layout, "qwen2_moe", norm_topk_prob=False)
        fields["qkv_bias"] = "blk.0.attn_q.bias" in self.tensors
        fields["use_sliding_window"] = False
        self._qwen_layers(fields, layout)
        self._no_expert_scale()
        # llama.cpp takes this from expert_shared_feed_forward_length (else the dense width) and checks
        # it against the tensors; the tensor is the one truth here.
        shared = f"blk.{layout.moe_layers[0]}.ffn_up_shexp.weight"
        fields["shared_expert_intermediate_size"] = self._shape(shared, "the shared expert")[0]

        def names(layer: int) -> dict[str, str]:
            qkv = {k: v for k, v in _QKV.items() if fields["qkv_bias"] or not k.endswith(".bias")}
            mlp = _ROUTER | _QWEN2_SHARED if layer in layout.moe_layers else _DENSE_MLP
            return _NORMS | qkv | mlp

        return fields, names

    def _deepseek2(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        m = self.meta
        fields = self._common(layout)
        heads = fields["num_attention_heads"]
        rope_dim = m.count("rope.dimension_count", "qk_rope_head_dim")
        # Since llama.cpp split kv_b_proj (MLA absorption), key/value_length describe the compressed
        # MQA view and the *_mla keys the per-head sizes; older files only have the per-head ones.
        if m.get("attention.key_length_mla") is not None:
            key_dim = m.count("attention.key_length_mla", "qk_nope_head_dim + qk_rope_head_dim")
            value_dim = m.count("attention.value_length_mla", "v_head_dim")
        else:
            key_dim = m.count("attention.key_length", "qk_nope_head_dim + qk_rope_head_dim")
            value_dim = m.count("attention.value_length", "v_head_dim")
        if key_dim <= rope_dim:
            raise CheckpointError(
                m.path, f"deepseek2: key length {key_dim} must exceed rope.dimension_count {rope_dim} (qk_nope > 0)"
            )
        q_lora = m.get("attention.q_lora_rank")
        gating = m.get("expert_gating_func")
        sigmoid = gating == 2  # llama.cpp: 1 softmax (the default of V2 files), 2 sigmoid
        sample = layout.moe_layers[0]
        # DeepSeek-V3's layout: a selection bias (e_score_correction_bias), which llama.cpp adds to the
        # selection scores whatever the gating function
        biased = f"blk.{sample}.exp_probs_b.bias" in self.tensors
        if gating is None:
            self.notes.append(
                "deepseek2: no expert_gating_func in the metadata: softmax gating, as llama.cpp assumes"
                + (" (with the file's selection bias, as llama.cpp adds it)" if biased else "")
            )
        scale = m.number("expert_weights_scale", "routed_scaling_factor", 1.0) or 1.0  # 0: llama.cpp's "unset"
        norm = bool(m.get("expert_weights_norm", False))
        groups = m.count("expert_group_count", "n_group", 1)
        groups_used = m.count("expert_group_used_count", "topk_group", 1)
        shared_rows = self._shape(f"blk.{sample}.ffn_up_shexp.weight", "the shared experts")[0]
        fields |= {
            "model_type": "deepseek_v3" if sigmoid or biased else "deepseek_v2",
            "num_key_value_heads": heads,  # the file says 1: llama.cpp's MQA view of MLA
            "head_dim": rope_dim,
            "q_lora_rank": int(q_lora) if q_lora else None,
            "kv_lora_rank": m.count("attention.kv_lora_rank", "kv_lora_rank"),
            "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": key_dim - rope_dim,
            "v_head_dim": value_dim,
            "n_routed_experts": layout.num_experts,
            "n_shared_experts": m.count(
                "expert_shared_count", "n_shared_experts", max(1, shared_rows // layout.intermediate_size)
            ),
            "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
            "routed_scaling_factor": scale,
            "n_group": groups,
            "topk_group": groups_used,
            "norm_topk_prob": norm,
            "rope_parameters": self._rope(),
        }
        mscale = m.get("rope.scaling.yarn_log_multiplier")
        if fields["rope_parameters"]["rope_type"] == "yarn" and mscale:
            # convert_hf_to_gguf writes 0.1 * mscale_all_dim here (its TAG_DEEPSEEK2_YARN_LOG_MUL_FIX);
            # every DeepSeek/Kimi release has mscale == mscale_all_dim.
            fields["rope_parameters"] |= {"mscale_all_dim": float(mscale) / 0.1, "mscale": float(mscale) / 0.1}
        dense = [layer for layer in range(layout.num_layers) if layer not in layout.moe_layers]
        width = m.get("feed_forward_length")
        if dense:
            width = self._shape(f"blk.{dense[0]}.ffn_up.weight", "a dense layer's MLP")[0]
        if width:
            fields["intermediate_size"] = int(width)
        if sigmoid or biased:
            fields["rope_interleave"] = True  # llama.cpp's deepseek2 rope is the interleaved (GPT-J) one
            if not sigmoid:
                fields["scoring_func"] = "softmax"  # DeepSeek's own config field (deepseek_v3 adapter)
        else:
            # softmax with expert_weights_norm: llama.cpp renormalises the top-k weights before the
            # scale; the DeepSeek-V2 adapter does too where norm_topk_prob is set (no V2 release sets it)
            fields["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
        if dense and dense != list(range(fields["first_k_dense_replace"])):
            raise CheckpointError(
                m.path,
                f"deepseek2: layers {dense[:8]} have no experts but leading_dense_block_count="
                f"{fields['first_k_dense_replace']}",
            )

        def names(layer: int) -> dict[str, str]:
            attention = {k: v for k, v in _MLA.items() if not k.startswith(("attn_q", "exp_probs_b"))}
            if fields["q_lora_rank"]:
                attention |= {k: v for k, v in _MLA.items() if k.startswith("attn_q_")}
            else:
                attention["attn_q.weight"] = _MLA["attn_q.weight"]
            if layer not in layout.moe_layers:
                return _NORMS | attention | _DENSE_MLP
            mlp = _ROUTER | _DEEPSEEK_SHARED
            if sigmoid or biased:
                mlp = mlp | {"exp_probs_b.bias": _MLA["exp_probs_b.bias"]}
            return _NORMS | attention | mlp

        self._kv_b_split = {
            "heads": heads,
            "nope": key_dim - rope_dim,
            "value": value_dim,
            "rank": fields["kv_lora_rank"],
        }
        return fields, names

    def _head_dim_and_rotary(self, fields: dict[str, Any]) -> None:
        """head_dim, KV heads and the rotary part (``rope.dimension_count`` of each head's leading
        values, llama.cpp's NEOX rope = transformers' rotate_half) of the partial-rotary families."""
        m = self.meta
        heads = fields["num_attention_heads"]
        head_dim = m.count("attention.key_length", "head_dim", fields["hidden_size"] // heads)
        value_dim = m.count("attention.value_length", "the value head size", head_dim)
        rotary = m.count("rope.dimension_count", "the rotary dimensions", head_dim)
        if value_dim != head_dim or rotary > head_dim or rotary % 2:
            raise CheckpointError(
                m.path,
                f"{self.arch}: key_length={head_dim}, value_length={value_dim}, rope.dimension_count={rotary}: "
                "transformers' model needs equal key and value lengths and an even rotary part within them",
            )
        fields["head_dim"] = head_dim
        fields["num_key_value_heads"] = m.count("attention.head_count_kv", "num_key_value_heads", heads)
        fields["rope_parameters"] = self._rope() | {"partial_rotary_factor": rotary / head_dim}

    def _sigmoid_gating(self) -> None:
        """GLM-4-MoE and MiniMax-M2 route by sigmoid scores (the bias only selects): a file that says
        otherwise is not one transformers' model runs."""
        gating = self.meta.get("expert_gating_func")
        if gating is None:
            self.notes.append(f"{self.arch}: no expert_gating_func in the metadata: sigmoid gating, the architecture's")
        elif gating != 2:
            raise CheckpointError(
                self.meta.path,
                f"{self.arch}.expert_gating_func={gating!r}: transformers' {self.arch} routes by sigmoid scores (2)",
            )

    def _glm4moe(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        m = self.meta
        fields = self._common(layout)
        self._head_dim_and_rotary(fields)
        self._sigmoid_gating()
        sample = layout.moe_layers[0]
        shared_rows = self._shape(f"blk.{sample}.ffn_up_shexp.weight", "the shared experts")[0]
        dense = [layer for layer in range(layout.num_layers) if layer not in layout.moe_layers]
        fields |= {
            "model_type": "glm4_moe",
            "n_routed_experts": layout.num_experts,
            "n_shared_experts": m.count(
                "expert_shared_count", "n_shared_experts", max(1, shared_rows // layout.intermediate_size)
            ),
            "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
            "routed_scaling_factor": m.number("expert_weights_scale", "routed_scaling_factor", 1.0) or 1.0,
            "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
            "n_group": m.count("expert_group_count", "n_group", 1),
            "topk_group": m.count("expert_group_used_count", "topk_group", 1),
            # not in the metadata: what the tensors say
            "use_qk_norm": f"blk.{sample}.attn_q_norm.weight" in self.tensors,
            "attention_bias": f"blk.{sample}.attn_q.bias" in self.tensors,
        }
        width = self._shape(f"blk.{dense[0]}.ffn_up.weight", "a dense layer's MLP")[0] if dense else None
        fields["intermediate_size"] = int(width or m.count("feed_forward_length", "intermediate_size"))
        if dense != list(range(fields["first_k_dense_replace"])):
            raise CheckpointError(
                m.path,
                f"glm4moe: layers {dense[:8]} have no experts but leading_dense_block_count="
                f"{fields['first_k_dense_replace']}",
            )

        def names(layer: int) -> dict[str, str]:
            qkv = {k: v for k, v in _QKV.items() if fields["attention_bias"] or not k.endswith(".bias")}
            norms = _QK_NORM if fields["use_qk_norm"] else {}
            mlp = _GLM_ROUTER | _DEEPSEEK_SHARED if layer in layout.moe_layers else _DENSE_MLP
            return _GLM_NORMS | qkv | norms | mlp

        return fields, names

    def _minimax_m2(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        fields = self._common(layout)
        self._head_dim_and_rotary(fields)
        self._sigmoid_gating()
        self._no_expert_scale()
        self._all_moe(layout)
        # transformers' MiniMax-M2 sizes its experts with intermediate_size; its router always
        # renormalises the top-k weights (llama.cpp's graph: norm_w = true)
        fields |= {
            "model_type": "minimax_m2",
            "num_local_experts": layout.num_experts,
            "intermediate_size": layout.intermediate_size,
        }
        fields.pop("moe_intermediate_size")

        def names(layer: int) -> dict[str, str]:
            qkv = {k: v for k, v in _QKV.items() if not k.endswith(".bias")}
            return _NORMS | qkv | _QK_NORM | _MINIMAX_ROUTER

        return fields, names

    def _gpt_oss(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        """gpt-oss as llama.cpp's openai-moe graph runs it: softmax over the top-k router logits, the
        clamped SwiGLU with alpha 1.702 and limit 7 (fixed in its graph, and transformers' defaults),
        sliding-window layers by ``attention.sliding_window_pattern`` (default 2: even layers slide),
        YaRN as ggml computes it (correction dims floored and ceiled: transformers' ``truncate``)."""
        m = self.meta
        fields = self._gqa_fields(layout)
        self._no_expert_scale()
        self._all_moe(layout)
        base, swa_base = fields["rope_parameters"]["rope_theta"], m.get("rope.freq_base_swa")
        if swa_base is not None and swa_base != base:
            raise CheckpointError(
                m.path,
                f"gpt-oss.rope.freq_base_swa={swa_base} differs from rope.freq_base={base}: transformers' "
                "gpt-oss has one rope base for all layers",
            )
        fields |= {
            "model_type": "gpt_oss",
            "num_local_experts": layout.num_experts,
            "intermediate_size": layout.intermediate_size,
            "sliding_window": m.count("attention.sliding_window", "sliding_window"),
            "layer_types": self._sliding_layers(layout.num_layers),
            "attention_bias": True,
            "swiglu_limit": 7.0,
        }
        fields.pop("moe_intermediate_size")
        fields.pop("hidden_act")
        return fields, lambda layer: _GPT_OSS

    def _llama(self, layout: MoELayout) -> tuple[dict[str, Any], Callable[[int], dict[str, str]]]:
        """Mixtral, which llama.cpp files as llama with experts: softmax top-k renormalised (its graph's
        norm_w), every layer MoE, q and k rows permuted by the converter for ggml's interleaved rope
        (``LlamaModel.permute``), put back in transformers' order here (``_entries``)."""
        fields = self._gqa_fields(layout)
        self._no_expert_scale()
        self._all_moe(layout)
        fields |= {"model_type": "mixtral", "num_local_experts": layout.num_experts}
        fields["intermediate_size"] = fields.pop("moe_intermediate_size")
        self._permuted_rows = {
            "attn_q.weight": _unpermute_rows(fields["num_attention_heads"], fields["head_dim"]),
            "attn_k.weight": _unpermute_rows(fields["num_key_value_heads"], fields["head_dim"]),
        }

        def names(layer: int) -> dict[str, str]:
            qkv = {k: v for k, v in _QKV.items() if not k.endswith(".bias")}
            return _NORMS | qkv | _ROUTER

        return fields, names

    def _sliding_layers(self, layers: int) -> list[str]:
        """llama.cpp's ``load_swa_pattern``: a per-layer array, or every n-th layer full (the others
        sliding), n from the metadata or 2."""
        pattern = self.meta.get("attention.sliding_window_pattern", 2)
        if isinstance(pattern, list):
            if len(pattern) < layers or not all(isinstance(v, (bool, int)) for v in pattern[:layers]):
                raise CheckpointError(
                    self.meta.path,
                    f"{self.arch}.attention.sliding_window_pattern: expected {layers} flags, found {pattern!r}",
                )
            sliding = [bool(v) for v in pattern[:layers]]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
            sliding = [pattern == 0 or layer % pattern < pattern - 1 for layer in range(layers)]
        else:
            raise CheckpointError(
                self.meta.path,
                f"{self.arch}.attention.sliding_window_pattern must be a count or per-layer flags, found {pattern!r}",
            )
        return ["sliding_attention" if s else "full_attention" for s in sliding]

    # --- tensors -------------------------------------------------------------------------------

    def _shape(self, key: str, what: str) -> tuple[int, ...]:
        if key not in self.tensors:
            raise CheckpointError(self.meta.path, f"missing tensor {key} ({what})")
        return tuple(self.tensors[key].shape)

    def _entries(self, layout: MoELayout) -> dict[str, _Entry]:
        """Every non-expert tensor under its transformers name; the file must hold exactly these."""
        wanted: dict[str, str] = {k: v for k, v in _GLOBAL.items() if k != "output.weight"}
        if not self.config.tie_word_embeddings:
            wanted["output.weight"] = _GLOBAL["output.weight"]
        for layer in range(layout.num_layers):
            for leaf, hf in self._layer_names(layer).items():
                wanted[f"blk.{layer}.{leaf}"] = f"{MODULE_PREFIX}.{layer}.{hf}"
        entries: dict[str, _Entry] = {}
        consumed: set[str] = set()
        for key, hf in wanted.items():
            combined = self._combined(key)
            if combined is not None:
                entries[hf] = combined
                consumed.update(combined.parts)
                continue
            if key not in self.tensors:
                raise CheckpointError(
                    self.meta.path, f"missing tensor {key} (transformers {hf}), which a {self.arch} model needs"
                )
            rows = self._permuted_rows.get(key.split(".", 2)[-1])
            entries[hf] = _Entry((key,), self._hf_shape(key), rows=rows)
            consumed.add(key)
        extra = [k for k in self.tensors if k not in consumed and not _is_expert(k)]
        if extra:
            raise CheckpointError(
                self.meta.path,
                f"{len(extra)} tensors have no place in the transformers {self.config.model_type} model "
                f"(an architecture variant hetmoe does not know), first: {extra[:5]}",
            )
        return entries

    def _hf_shape(self, key: str) -> tuple[int, ...]:
        shape = tuple(self.tensors[key].shape)
        if key.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1:
            return (1, shape[0])  # stored [H]; transformers' shared_expert_gate is a Linear(H, 1)
        return shape

    def _combined(self, key: str) -> _Entry | None:
        """A transformers tensor that is not one GGUF tensor as stored (qwen3next's, ``_next_entry``;
        deepseek2's split kv_b_proj, below); None for the others."""
        if self.arch == "qwen3next":
            return self._next_entry(key)
        return self._kv_b(key)

    def _next_entry(self, key: str) -> _Entry | None:
        """What convert_hf_to_gguf's Qwen3NextModel.modify_tensors did to a tensor, undone: ``1 + w``
        norms, ``-exp(A_log)``, the squeezed conv weight, in_proj_qkvz split out of its groups."""
        leaf = key.split(".", 2)[-1] if key.startswith("blk.") else key
        if key in self.tensors and (leaf in _NEXT_OFFSET_NORMS or key == "output_norm.weight"):
            return _Entry((key,), self._hf_shape(key), lambda parts: parts[0].float() - 1)
        if leaf == "ssm_a" and key in self.tensors:
            return _Entry((key,), self._hf_shape(key), lambda parts: torch.log(-parts[0].float()))
        if leaf == "ssm_conv1d.weight" and key in self.tensors:
            channels, kernel = self._shape(key, "the delta-net's conv weight")
            return _Entry((key,), (channels, 1, kernel))
        if leaf != "ssm_in.weight":
            return None
        stem = key.removesuffix("ssm_in.weight")
        qkv, gate = stem + "attn_qkv.weight", stem + "attn_gate.weight"
        missing = [k for k in (qkv, gate) if k not in self.tensors]
        if missing:
            raise CheckpointError(self.meta.path, f"missing tensor {missing[0]} (qwen3next in_proj_qkvz)")
        c = self.config
        groups, dk = c.linear_num_key_heads, c.linear_key_head_dim
        dv = c.linear_num_value_heads // groups * c.linear_value_head_dim  # a group's v (and z) rows
        hidden = c.hidden_size
        expected = {qkv: (groups * (2 * dk + dv), hidden), gate: (groups * dv, hidden)}
        for name, want in expected.items():
            if tuple(self.tensors[name].shape) != want:
                raise CheckpointError(
                    self.meta.path,
                    f"tensor {name}: expected shape {list(want)} (from the ssm.* metadata), "
                    f"found {list(self.tensors[name].shape)}",
                )

        # attn_qkv's rows then attn_gate's: all q (groups x dk), all k, all v (groups x dv), all z;
        # transformers' order is per group [q k v z]
        starts = ((0, dk), (groups * dk, dk), (2 * groups * dk, dv), (2 * groups * dk + groups * dv, dv))
        rows = torch.cat([torch.arange(n) + start + g * n for g in range(groups) for start, n in starts])
        return _Entry((qkv, gate), (groups * (2 * dk + 2 * dv), hidden), rows=rows)

    def _kv_b(self, key: str) -> _Entry | None:
        """deepseek2's kv_b_proj when the file holds it split into attn_k_b and attn_v_b; None otherwise.

        convert_hf_to_gguf views kv_b_proj ``[heads * (nope + v), rank]`` as ``[heads, nope + v, rank]``,
        splits it into k_b ``[heads, nope, rank]`` and v_b ``[heads, v, rank]`` and stores k_b transposed
        (``[heads, rank, nope]``); this undoes exactly that.
        """
        if not key.endswith(".attn_kv_b.weight") or key in self.tensors:
            return None
        stem = key.removesuffix("attn_kv_b.weight")
        k_b, v_b = stem + "attn_k_b.weight", stem + "attn_v_b.weight"
        missing = [k for k in (k_b, v_b) if k not in self.tensors]
        if missing:
            raise CheckpointError(
                self.meta.path, f"missing tensor {key}, and of its split form {missing} (deepseek2 kv_b_proj)"
            )
        d = self._kv_b_split
        heads, nope, value, rank = d["heads"], d["nope"], d["value"], d["rank"]
        expected = {k_b: (heads, rank, nope), v_b: (heads, value, rank)}
        for name, want in expected.items():
            found = tuple(self.tensors[name].shape)
            if found != want:
                raise CheckpointError(
                    self.meta.path,
                    f"tensor {name}: expected shape {list(want)} (heads, kv_lora_rank, qk_nope_head_dim / "
                    f"v_head_dim), found {list(found)}",
                )

        def join(parts: list[torch.Tensor]) -> torch.Tensor:
            k, v = parts
            return torch.cat([k.float().transpose(1, 2), v.float()], dim=1).reshape(heads * (nope + value), rank)

        return _Entry((k_b, v_b), (heads * (nope + value), rank), join)


def _unpermute_rows(heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of convert_hf_to_gguf's ``LlamaModel.permute`` on the rows of q or k: stored row
    ``h * D + 2 i + j`` is transformers' row ``h * D + j * D / 2 + i``; returns, per transformers row,
    the stored row holding it."""
    half = head_dim // 2
    h, i, j = torch.meshgrid(torch.arange(heads), torch.arange(half), torch.arange(2), indexing="ij")
    stored = (h * head_dim + 2 * i + j).flatten()
    original = (h * head_dim + j * half + i).flatten()
    rows = torch.empty(heads * head_dim, dtype=torch.long)
    rows[original] = stored
    return rows


def _layer_of(key: str) -> int:
    """The decoder layer a GGUF tensor belongs to (-1 for the global ones)."""
    m = _BLOCK.match(key)
    return int(m["layer"]) if m else -1


def _is_expert(key: str) -> bool:
    m = _BLOCK.match(key)
    return m is not None and _EXPERT_LEAF.match(m["leaf"]) is not None


def _first_file(source: TensorSource) -> GGUFFile:
    """The file holding the metadata: the GGUF itself, or the first part of a split set."""
    if isinstance(source, GGUFFile):
        return source
    files = getattr(source, "files", None)
    if files and isinstance(files[0], GGUFFile):
        return files[0]
    raise CheckpointError(source.path, "not a GGUF file")


def _make_config(fields: dict[str, Any], path: Path) -> Any:
    from transformers import CONFIG_MAPPING

    model_type = fields.pop("model_type")
    try:
        return CONFIG_MAPPING[model_type](**fields)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(path, f"the {model_type} config built from the GGUF metadata is invalid: {exc}") from None


# --- tokenizer -----------------------------------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a GGUF model: the tokenizer files beside it when there are any (they are the
    model's own), else one built from the file's ``tokenizer.ggml.*`` metadata by transformers' GGUF
    tokenizer conversion (byte-level BPE, sentencepiece and unigram vocabularies)."""
    p = Path(path)
    directory = p.parent
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if any((directory / f).exists() for f in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(str(directory))
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, vocabulary, settings = get_gguf_tokenizer(str(p))
    except KeyError as exc:
        raise CheckpointError(p, f"GGUF metadata lacks {exc}, needed for the tokenizer") from None
    if "tokens" not in vocabulary:
        raise CheckpointError(
            p,
            "GGUF metadata lacks tokenizer.ggml.tokens: no tokenizer in the file; put the model's "
            "tokenizer.json beside it",
        )
    try:
        backend, extra = convert_gguf_tokenizer(arch, vocabulary)
    except ValueError as exc:
        raise CheckpointError(p, f"cannot build a tokenizer from the GGUF metadata: {exc}") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra)
