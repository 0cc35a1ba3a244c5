"""A llama.cpp GGUF MoE model as load_model sees it: a transformers config and transformers names.

A GGUF file has no ``config.json`` and names its tensors llama.cpp's way. :class:`GGUFModel` turns
the ``{arch}.*`` metadata into the transformers config of the same model and presents the file as a
:class:`TensorSource` whose non-expert tensors carry transformers names and come back dequantized
(``hetmoe.formats.gguf`` decodes every block type; F32/F16/BF16 tensors are views of the file), while
the routed experts keep their GGUF names and raw blocks, so ``read_layer_experts`` hands them to the
CPU engine as stored (memory-mapped, one layer at a time, never dequantized as a whole).

Each architecture's GGUF facts live in its adapter file (``models/adapters/*.py``: its llama.cpp
architecture name, ``gguf_config`` reading its metadata keys into the transformers config and
naming its tensors, the names only it has); ``models/gguf_names.py`` holds the names several
share; this module holds what every architecture uses (the common fields, rope, the checks the
adapters call on a ``GGUFModel``) and the tensor transforms below.

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
from ..checkpoint.gguf_file import GGUFFile
from ..checkpoint.layout import MoELayout
from ..formats import FormatError, QuantizedTensor, UnknownMethodError, get_codec
from .adapters import GGUF_BUILDERS
from .adapters.qwen3_next import NEXT_OFFSET_NORMS

# Where transformers keeps the decoder layers of every architecture read here.
MODULE_PREFIX = "model.layers"
ARCHITECTURES = tuple(GGUF_BUILDERS)

_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_BLOCK = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<leaf>.+)$")
_EXPERT_LEAF = re.compile(r"^ffn_(?:gate|up|down|gate_up)_exps\.(?:weight|bias)$")

# llama.cpp tensor names -> transformers names (``model.layers.N.`` + the value for blk.N.*).
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
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

    def release(self, name: str) -> None:
        """Drop the stored bytes of ``name`` from this process's memory, for a reader that copied
        them and will not read them again (GGUFFile.release)."""
        release = getattr(self._raw, "release", None)
        if release is None:
            return
        for key in [name] if name in self._experts else self._entry(name).parts:
            release(key)

    def stored(self, name: str) -> QuantizedTensor | None:
        """A non-expert weight in its GGUF block type, as the file holds it (a view of the mapped
        bytes, or whole rows of blocks gathered where the rows move or come from several tensors of
        one type), where its parts are rows of the transformers shape in a block (not float) type;
        else None (``get`` decodes it)."""
        entry = None if name in self._experts else self._entry(name)
        if entry is None or entry.build is not None or len(entry.shape) != 2:
            return None
        infos = [self._raw.info(p) for p in entry.parts]
        if len({str(i.dtype) for i in infos}) != 1 or any(len(i.shape) != 2 for i in infos):
            return None
        if sum(i.shape[0] for i in infos) != entry.shape[0] or any(i.shape[1] != entry.shape[1] for i in infos):
            return None
        parts = self.stored_parts(name)  # None for a float type or one without a codec
        if parts is None:
            return None
        if len(parts) == 1 and entry.rows is None:
            return parts[0]
        raw = torch.cat([b.tensors[".weight"].reshape(b.shape[0], -1) for b in parts])  # whole rows of blocks
        if entry.rows is not None:
            raw = raw.index_select(0, entry.rows)
        return dataclasses.replace(parts[0], shape=tuple(entry.shape), tensors={".weight": raw})

    def stored_parts(self, name: str) -> list[QuantizedTensor] | None:
        """The GGUF tensors a non-expert weight is built from, each in its block type as the file holds
        it (views of the mapped bytes, the file's shapes): deepseek2's attn_k_b ``[heads, rank, nope]``
        and attn_v_b ``[heads, v, rank]`` for kv_b_proj, which MLA's decode step reads per head
        (mla_decode.py); None where any is in a float type or a type hetmoe has no codec for."""
        if name in self._experts:
            return None
        parts = []
        for key in self._entry(name).parts:
            if str(self._raw.info(key).dtype) in _FLOATS:
                return None
            try:
                parts.append(self._blocks(key)[1])
            except UnknownMethodError:
                return None
        return parts

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
        self.kv_b_split: dict[str, int] = {}  # deepseek2: the sizes that put kv_b_proj back together
        self.permuted_rows: dict[str, torch.Tensor] = {}  # llama: q/k leaf -> rows in transformers' order
        if self.arch in ("glm4moe", "qwen3next"):
            # their multi-token-prediction block(s) follow the decoder layers (block_count counts them,
            # nextn_predict_layers says how many; llama.cpp's graph and transformers skip them): left
            # unread. Any other tensor past the layers is still an error (_entries).
            blocks = int(self.meta.get("block_count", layout.num_layers))
            self.tensors = {k: v for k, v in self.tensors.items() if not layout.num_layers <= _layer_of(k) < blocks}
        # The architecture's adapter file reads its metadata keys and names its tensors.
        fields, self._layer_names = GGUF_BUILDERS[self.arch](self, layout)
        self.config = _make_config(fields, file.path)
        entries = self._entries(layout)
        experts = [k for k in self.tensors if _is_expert(k)]
        self.source = GGUFTensors(source, entries, experts)
        self.layout = dataclasses.replace(layout, model_type=self.config.model_type)

    # --- configuration -------------------------------------------------------------------------

    def common(self, layout: MoELayout) -> dict[str, Any]:
        m = self.meta
        hidden = m.count("embedding_length", "hidden_size")
        heads = m.count("attention.head_count", "num_attention_heads")
        embedding = self.shape("token_embd.weight", "the token embedding")
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

    def rope(self) -> dict[str, Any]:
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

    def no_expert_scale(self) -> None:
        scale = self.meta.get("expert_weights_scale")
        if scale not in (None, 0.0, 1.0):
            raise CheckpointError(
                self.meta.path,
                f"{self.arch}.expert_weights_scale={scale}: transformers' {self.arch} has no routed scaling factor",
            )

    def attention(self, fields: dict[str, Any], head_dim: int) -> None:
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
        fields["rope_parameters"] = self.rope()

    def gqa_fields(self, layout: MoELayout) -> dict[str, Any]:
        """``common`` plus the head size (``attention.key_length``, else hidden / heads) and what
        ``attention`` reads: the fields of the full-rotary GQA families."""
        fields = self.common(layout)
        head_dim = self.meta.count(
            "attention.key_length", "head_dim", fields["hidden_size"] // fields["num_attention_heads"]
        )
        fields["head_dim"] = head_dim
        self.attention(fields, head_dim)
        return fields

    def all_moe(self, layout: MoELayout) -> None:
        """The families whose every decoder layer is MoE: a layer without experts is not their model."""
        if len(layout.moe_layers) != layout.num_layers:
            dense = sorted(set(range(layout.num_layers)) - set(layout.moe_layers))
            raise CheckpointError(
                self.meta.path, f"{self.arch}: layers {dense[:8]} have no experts; every layer is MoE"
            )

    def qwen_fields(self, layout: MoELayout, model_type: str, norm_topk_prob: bool) -> dict[str, Any]:
        """What Qwen2-MoE and Qwen3-MoE configs share: sizes, experts, heads and head size."""
        fields = self.gqa_fields(layout)
        fields |= {"model_type": model_type, "num_experts": layout.num_experts, "norm_topk_prob": norm_topk_prob}
        return fields

    def qwen_layers(self, fields: dict[str, Any], layout: MoELayout) -> None:
        dense = [layer for layer in range(layout.num_layers) if layer not in layout.moe_layers]
        fields["decoder_sparse_step"] = 1
        fields["mlp_only_layers"] = dense
        if dense:
            fields["intermediate_size"] = self.shape(f"blk.{dense[0]}.ffn_up.weight", "a dense layer's MLP")[0]

    def head_dim_and_rotary(self, fields: dict[str, Any]) -> None:
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
        fields["rope_parameters"] = self.rope() | {"partial_rotary_factor": rotary / head_dim}

    def sigmoid_gating(self) -> None:
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

    # --- tensors -------------------------------------------------------------------------------

    def shape(self, key: str, what: str) -> tuple[int, ...]:
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
            rows = self.permuted_rows.get(key.split(".", 2)[-1])
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
        if key in self.tensors and (leaf in NEXT_OFFSET_NORMS or key == "output_norm.weight"):
            return _Entry((key,), self._hf_shape(key), lambda parts: parts[0].float() - 1)
        if leaf == "ssm_a" and key in self.tensors:
            return _Entry((key,), self._hf_shape(key), lambda parts: torch.log(-parts[0].float()))
        if leaf == "ssm_conv1d.weight" and key in self.tensors:
            channels, kernel = self.shape(key, "the delta-net's conv weight")
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
        d = self.kv_b_split
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
