"""Which weights of a dense checkpoint ``hetmoe gptq`` quantizes, and under which names.

Every linear projection inside the decoder blocks is a candidate. They are found from the model
itself where transformers can build the architecture (on the meta device: no memory, no weights
read): every ``nn.Linear`` under the decoder's block list. Where it cannot (an architecture this
transformers does not know), they are found by name: 2-D weights under a numbered block
(``...layers.N.``, ``...h.N.``, ``...blocks.N.``). Either way nothing is specific to one model.

Fused projections are split along the output dimension first, so the written checkpoint has the
ordinary names vLLM's stacked-parameter mapping expects: ``qkv_proj`` / ``q_k_v_proj`` into
``q_proj``, ``k_proj``, ``v_proj`` (num_heads*head_dim and num_kv_heads*head_dim rows, from the
config), ``gate_up_proj`` into ``gate_proj`` and ``up_proj`` (intermediate_size rows each, gate
first as Phi-3 stores it). GPTQ groups run along the input dimension, so quantizing the parts is
exactly quantizing the whole and slicing it.

The embedding table and the output head are quantized only when asked (``--quantize-embedding``,
``--quantize-lm-head``; a tied head is then untied: the table stays as it is for lookups and
the head gets its own 4-bit copy).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .source import TensorSource

FUSED_QKV = ("qkv_proj", "q_k_v_proj")
FUSED_GATE_UP = ("gate_up_proj",)
# Leaf names vLLM stacks into one layer (QKVParallelLinear, MergedColumnParallelLinear): the
# parts of one stack must share a precision, or vLLM refuses the checkpoint.
STACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_BLOCK_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?(?:layers|h|blocks|block))\.(?P<index>\d+)\.(?P<rest>.+)\.weight$")
_EMBEDDING_NAMES = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings")
_MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class LinearSpec:
    """One output linear: the rows ``rows`` of source tensor ``source`` written as module ``name``."""

    name: str  # output module, e.g. model.layers.0.self_attn.q_proj
    source: str  # source tensor holding the weight, e.g. model.layers.0.self_attn.qkv_proj.weight
    rows: tuple[int, int]  # row range of the source weight
    in_features: int
    block: int | None  # decoder block index; None for the embedding and the head
    module: str  # the module that computes it in the model (the fused one for split parts)
    role: str = "linear"  # "linear", "lm_head" or "embedding"
    bias: str | None = None  # source bias, when the module is fused and has one (sliced by rows)
    quantize: bool = True

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.in_features)

    @property
    def fused(self) -> bool:
        return self.module != self.name


@dataclass
class LinearPlan:
    """The linears of a checkpoint, in block order, and what else the search learnt."""

    specs: list[LinearSpec]
    layers_prefix: str  # e.g. "model.layers"
    num_blocks: int
    found_by: str  # "modules" (transformers built the architecture) or "names"
    embedding: str | None  # source name of the token embedding table
    tied: bool  # the output head reuses the embedding table
    consumed: set[str] = field(default_factory=set)  # source tensors the specs replace
    notes: list[str] = field(default_factory=list)

    def quantized(self) -> list[LinearSpec]:
        return [s for s in self.specs if s.quantize]


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (multimodal configs nest it under ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def reject_moe(config: Mapping[str, Any], keys: Sequence[str], where: str | Path) -> None:
    cfg = text_config(config)
    experts = [k for k in _MOE_CONFIG_KEYS if isinstance(cfg.get(k), int) and cfg.get(k, 0) > 0]
    expert_tensors = [k for k in keys if ".experts." in k]
    if experts or expert_tensors:
        what = f"config {experts[0]}={cfg[experts[0]]}" if experts else f"tensor {expert_tensors[0]}"
        raise CheckpointError(
            where,
            f"this is a Mixture-of-Experts checkpoint ({what}); hetmoe gptq writes dense models: "
            "convert MoE experts with hetmoe convert",
        )


def find_linears(
    source: TensorSource,
    config: Mapping[str, Any],
    src_dir: str | Path,
    *,
    quantize_embedding: bool = False,
    quantize_lm_head: bool = False,
    skip: Sequence[str] = (),
) -> LinearPlan:
    """The plan for ``source``: every block linear (fused ones split), head and table as asked, skips applied."""
    keys = list(source.keys())
    key_set = set(keys)
    found = _from_modules(src_dir, key_set)
    if found is None:
        found = _from_names(source, keys)
    modules, layers_prefix, embedding, found_by, notes = found
    if not modules:
        arch = config.get("architectures") or config.get("model_type") or "unknown"
        raise CheckpointError(
            src_dir,
            f"no linear layers found (architecture {arch}): looked for nn.Linear modules under the decoder's block "
            "list and, by name, for 2-D '<...>.layers.N.<...>.weight' tensors",
        )
    cfg = text_config(config)
    specs: list[LinearSpec] = []
    consumed: set[str] = set()
    for module, block in modules:
        specs.extend(_split(module, block, source, cfg, key_set, consumed))

    tied = "lm_head.weight" not in key_set and embedding is not None and bool(cfg.get("tie_word_embeddings", True))
    if quantize_embedding:
        if embedding is None:
            raise CheckpointError(src_dir, "--quantize-embedding: no token embedding table found")
        module = embedding.removesuffix(".weight")
        specs.insert(0, _whole(module, embedding, source, None, "embedding"))
        consumed.add(embedding)
    if quantize_lm_head:
        if "lm_head.weight" in key_set:
            specs.append(_whole("lm_head", "lm_head.weight", source, None, "lm_head"))
            consumed.add("lm_head.weight")
        elif tied and embedding is not None:
            # Untie: the table stays full precision for lookups; the head gets its own 4-bit copy.
            specs.append(_whole("lm_head", embedding, source, None, "lm_head"))
            notes.append(f"the output head was tied to {embedding}: untied, lm_head quantized from a copy")
        else:
            raise CheckpointError(src_dir, "--quantize-lm-head: no lm_head.weight and no tied embedding table found")

    specs = _apply_skips(specs, skip, src_dir)
    num_blocks = 1 + max((s.block for s in specs if s.block is not None), default=-1)
    return LinearPlan(specs, layers_prefix, num_blocks, found_by, embedding, tied, consumed, notes)


def _whole(module: str, weight: str, source: TensorSource, block: int | None, role: str) -> LinearSpec:
    shape = source.info(weight).shape
    if len(shape) != 2:
        raise CheckpointError(source.path, f"{weight}: expected a 2-D weight [N, K], found shape {list(shape)}")
    return LinearSpec(module, weight, (0, shape[0]), shape[1], block, module, role)


def _split(
    module: str,
    block: int | None,
    source: TensorSource,
    cfg: Mapping[str, Any],
    keys: set[str],
    consumed: set[str],
) -> list[LinearSpec]:
    whole = _whole(module, f"{module}.weight", source, block, "linear")
    parent, _, leaf = module.rpartition(".")
    if leaf in FUSED_QKV:
        heads = _int(cfg, "num_attention_heads", source, module)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or _int(cfg, "hidden_size", source, module) // heads)
        parts = [("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)]
        why = f"num_attention_heads={heads}, num_key_value_heads={kv_heads}, head_dim={head_dim}"
    elif leaf in FUSED_GATE_UP:
        inter = _int(cfg, "intermediate_size", source, module)
        parts = [("gate_proj", inter), ("up_proj", inter)]
        why = f"intermediate_size={inter}"
    else:
        return [whole]
    rows = whole.shape[0]
    if sum(n for _, n in parts) != rows:
        raise CheckpointError(
            source.info(whole.source).file,
            f"{whole.source}: fused projection has {rows} output rows, the config implies "
            f"{' + '.join(str(n) for _, n in parts)} ({why})",
        )
    bias = f"{module}.bias" if f"{module}.bias" in keys else None
    consumed.add(whole.source)
    if bias:
        consumed.add(bias)
    specs, start = [], 0
    for name, n in parts:
        out = f"{parent}.{name}" if parent else name
        specs.append(LinearSpec(out, whole.source, (start, start + n), whole.in_features, block, module, bias=bias))
        start += n
    return specs


def _int(cfg: Mapping[str, Any], key: str, source: TensorSource, module: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or value <= 0:
        raise CheckpointError(source.path, f"splitting fused {module} needs config {key}, found {value!r}")
    return value


def _apply_skips(specs: list[LinearSpec], patterns: Sequence[str], where: str | Path) -> list[LinearSpec]:
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise CheckpointError(where, f"--skip {p!r} is not a valid regular expression: {exc}") from None
    if not compiled:
        return specs
    out = [
        replace(s, quantize=False) if any(c.search(s.name) or c.search(s.module) for c in compiled) else s
        for s in specs
    ]
    stacks: dict[tuple[str, int], list[LinearSpec]] = {}
    for s in out:
        parent, _, leaf = s.name.rpartition(".")
        for i, names in enumerate(STACKED):
            if leaf in names:
                stacks.setdefault((parent, i), []).append(s)
    for members in stacks.values():
        if len({s.quantize for s in members}) > 1:
            kept = [s.name for s in members if s.quantize]
            skipped = [s.name for s in members if not s.quantize]
            raise CheckpointError(
                where,
                f"--skip matched {', '.join(skipped)} but not {', '.join(kept)}: vLLM runs these as one stacked "
                "layer whose parts must share a precision; skip all of them or none",
            )
    return out


# -- discovery --------------------------------------------------------------------------------


_Found = tuple[list[tuple[str, int | None]], str, str | None, str, list[str]]


def _from_modules(src_dir: str | Path, keys: set[str]) -> _Found | None:
    """Linear modules of the decoder blocks of the model transformers builds from the config, on meta."""
    try:
        import torch

        model = build_meta_model(src_dir)
    except Exception:  # unknown architecture, no transformers, a config it rejects: fall back to names
        return None
    _, layers_prefix, layers = decoder_layers(model)
    if layers is None:
        return None
    modules: list[tuple[str, int | None]] = []
    for index, block in enumerate(layers):
        for name, sub in block.named_modules():
            if isinstance(sub, torch.nn.Linear):
                modules.append((f"{layers_prefix}.{index}.{name}", index))
    if modules and not all(f"{m}.weight" in keys for m, _ in modules):
        return None  # the checkpoint names its tensors differently from the modules: trust the names
    embedding = None
    table = model.get_input_embeddings()
    for name, sub in model.named_modules():
        if sub is table and f"{name}.weight" in keys:
            embedding = f"{name}.weight"
    return modules, layers_prefix, embedding, "modules", []


def build_meta_model(src_dir: str | Path) -> Any:
    """The transformers model of ``src_dir``'s config on the meta device (no memory; local files only)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    # Config sanity warnings (token ids outside a tiny vocab and the like) are not ours to print.
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(str(src_dir), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        logging.set_verbosity(verbosity)
    return model.eval()


def decoder_layers(model: Any) -> tuple[Any, str, Any]:
    """(decoder module, dotted name of its block list, the block list) of a causal LM, or Nones."""
    import torch

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    names = {id(m): n for n, m in model.named_modules()}
    for root in (decoder, model):
        if root is None:
            continue
        for child_name in ("layers", "h", "blocks"):
            child = getattr(root, child_name, None)
            if isinstance(child, torch.nn.ModuleList) and len(child) > 0:
                return root, names[id(child)], child
    return decoder, "", None


def _from_names(source: TensorSource, keys: list[str]) -> _Found:
    modules: list[tuple[str, int | None]] = []
    prefixes: set[str] = set()
    for key in keys:
        m = _BLOCK_KEY.match(key)
        if not m:
            continue
        info = source.info(key)
        if len(info.shape) != 2 or isinstance(info.dtype, str) or not info.dtype.is_floating_point:
            continue
        leaf = m["rest"].rpartition(".")[2]
        if "norm" in leaf or leaf.startswith("ln") or "embed" in leaf:
            continue
        modules.append((key.removesuffix(".weight"), int(m["index"])))
        prefixes.add(m["prefix"])
    order = {k: i for i, k in enumerate(keys)}
    modules.sort(key=lambda mb: (mb[1], order[f"{mb[0]}.weight"]))
    embedding = next((k for k in keys if k.endswith(".weight") and k.rsplit(".", 2)[-2] in _EMBEDDING_NAMES), None)
    notes = ["linear layers found by name: transformers could not build this architecture"] if modules else []
    return modules, min(prefixes, key=len) if prefixes else "", embedding, "names", notes


def modules_in_block_to_quantize(plan: LinearPlan) -> list[list[str]]:
    """``modules_in_block_to_quantize`` for the config, as both vLLM and transformers read it.

    vLLM tests ``name in prefix`` of each layer (after mapping a stacked layer to its parts),
    transformers ``module_name.endswith(name)``; names relative to the block satisfy both when every
    block quantizes the same projections, full names otherwise. A fused source also lists its fused
    name, for vLLM models that keep the fused layer (Phi-3 maps ``qkv_proj`` to itself).
    """
    quantized = plan.quantized()
    in_blocks = [s for s in quantized if s.block is not None]
    per_block: dict[int, set[str]] = {i: set() for i in range(plan.num_blocks)}
    for s in in_blocks:
        start = f"{plan.layers_prefix}.{s.block}."
        per_block[s.block].add(s.name.removeprefix(start))
        if s.fused:
            per_block[s.block].add(s.module.removeprefix(start))
    sets = list(per_block.values())
    if sets and all(x == sets[0] for x in sets):
        names = sorted(sets[0])
    else:
        names = sorted({s.name for s in in_blocks} | {s.module for s in in_blocks if s.fused})
    names += [s.name for s in quantized if s.block is None]
    return [names]
