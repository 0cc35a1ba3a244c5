"""Where a checkpoint keeps its routed experts: layer prefix, MoE layers, sizes and storage style.

The configuration says the sizes and (per architecture) which layers are MoE; the tensor names say
how the experts are stored. Both are needed and checked against each other, because either can be
wrong: a config copied from a sibling model, a checkpoint re-saved by another tool.

Storage styles, as transformers 5 and the hubs write them (``L`` = layer, ``e`` = expert):

``per_expert``
    ``{prefix}.L.mlp.experts.e.{gate,up,down}_proj.*`` (Qwen2/3-MoE, Qwen3-Next, DeepSeek-V2/V3,
    Kimi-K2, GLM-4-MoE, OLMoE) or ``{prefix}.L.block_sparse_moe.experts.e.{w1,w3,w2}.*`` (Mixtral,
    MiniMax-M2). ``save_pretrained`` writes this by default: it reverts its in-memory fusion.
``fused``
    ``{prefix}.L.mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first, then up) and
    ``down_proj [E, H, I]``: transformers 5's in-memory layout, written by
    ``save_pretrained(save_original_format=False)`` (also for Mixtral/MiniMax, under ``mlp``).
``fused_t``
    Qwen3-VL-MoE's hub layout: ``gate_up_proj [E, H, 2I]`` (gate columns first), ``down_proj [E, I, H]``.
``gpt_oss``
    ``gate_up_proj [E, H, 2I]`` with gate/up interleaved (gate at even columns) + ``gate_up_proj_bias
    [E, 2I]``, ``down_proj [E, I, H]`` + ``down_proj_bias [E, H]``; or mxfp4 ``gate_up_proj_blocks
    [E, 2I, H/32, 16]`` / ``_scales`` stored ``[out, in]`` with gate/up interleaved along the 2I rows.
``gguf``
    ``blk.L.ffn_{gate,up,down}_exps.weight`` (logical ``[E, I, H]`` / ``[E, H, I]``), or a merged
    ``ffn_gate_up_exps`` ``[E, 2I, H]``; each tensor carries its own ggml type.
``store``
    a hetmoe expert store (``hetmoe.checkpoint.store``): ``{prefix}.L.experts.{gate,up,down}`` + codec
    suffix, one file per layer; the store's manifest says the layout, nothing is inferred.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats import FormatError
from .detect import SUFFIXES
from .errors import CheckpointError
from .quant_config import ExpertScheme, check_dims, resolve_scheme
from .safetensors_file import TensorInfo
from .source import TensorSource

KNOWN_PREFIXES = ("model.layers", "model.language_model.layers", "language_model.model.layers", "blk")
_EXPERT_KEY = re.compile(r"^(?P<prefix>.+?)\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.")
_GGUF_EXPERT_KEY = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?:gate|up|down|gate_up)_exps\.")
_PER_EXPERT = re.compile(r"^(?P<module>(?:mlp|block_sparse_moe|feed_forward)\.experts)\.\d+\.(?P<proj>gate_proj|w1)\.")

# Fused storage names a quantized tensor ``gate_up_proj_scale_inv`` where a Linear has
# ``weight_scale_inv``: the codec suffix ``.weight_X`` becomes ``_X`` and ``.weight`` nothing.
_FUSED_CODEC_SUFFIXES = (".weight", ".weight_scale_inv", ".weight_scale", "_blocks", "_scales")


def _int_field(config: Mapping[str, Any], name: str, default: int, minimum: int) -> int:
    """An optional integer field of the config (absent or null: ``default``), or an error naming it."""
    value = config.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointError(
            config.get("_source", "config.json"), f"{name} must be an integer >= {minimum}, found {value!r}"
        )
    return value


def _sparse_step(config: Mapping[str, Any], layer: int) -> bool:
    step = _int_field(config, "decoder_sparse_step", 1, 1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in dense):
        raise CheckpointError(
            config.get("_source", "config.json"), f"mlp_only_layers must be a list of layer indices, found {dense!r}"
        )
    return layer not in dense and (layer + 1) % step == 0


def _first_k_dense(config: Mapping[str, Any], layer: int) -> bool:
    # moe_layer_freq is DeepSeek's original remote code; transformers ignores it because every
    # released checkpoint sets 1, but honouring it costs nothing.
    freq = _int_field(config, "moe_layer_freq", 1, 1)
    return layer >= _int_field(config, "first_k_dense_replace", 0, 0) and layer % freq == 0


def _every_layer(config: Mapping[str, Any], layer: int) -> bool:
    return True


@dataclass(frozen=True)
class _Arch:
    is_moe: Callable[[Mapping[str, Any], int], bool]
    intermediate_key: str  # the config field that sizes one expert


ARCHITECTURES: dict[str, _Arch] = {
    "qwen2_moe": _Arch(_sparse_step, "moe_intermediate_size"),
    "qwen3_moe": _Arch(_sparse_step, "moe_intermediate_size"),
    "qwen3_next": _Arch(_sparse_step, "moe_intermediate_size"),
    "qwen3_vl_moe": _Arch(_sparse_step, "moe_intermediate_size"),
    "deepseek_v2": _Arch(_first_k_dense, "moe_intermediate_size"),
    "deepseek_v3": _Arch(_first_k_dense, "moe_intermediate_size"),
    "glm4_moe": _Arch(_first_k_dense, "moe_intermediate_size"),
    # These size their experts with intermediate_size (they have no dense MLP to tell apart).
    "mixtral": _Arch(_every_layer, "intermediate_size"),
    "minimax_m2": _Arch(_every_layer, "intermediate_size"),
    "olmoe": _Arch(_every_layer, "intermediate_size"),
    "gpt_oss": _Arch(_every_layer, "intermediate_size"),
}
ALIASES = {
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "deepseek_v32": "deepseek_v3",
    "qwen3_moe_text": "qwen3_moe",
    "qwen3_vl_moe_text": "qwen3_vl_moe",
}
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")


@dataclass
class MoELayout:
    """The routed experts of one checkpoint: what ``read_layer_experts`` needs to find and check them.

    ``gate``/``up``/``down`` are tensor-name templates relative to a layer (``{e}`` = expert index for
    per-expert storage); ``up`` is None when gate and up share one tensor. ``scheme`` is the stored
    precision (method ``"gguf"`` for GGUF, whose tensors each carry their own type).
    """

    model_type: str
    prefix: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    style: str
    gate: str
    up: str | None
    down: str
    scheme: ExpertScheme
    config_source: str
    keys: frozenset[str] = field(default_factory=frozenset, repr=False, compare=False)

    @property
    def method(self) -> str:
        return self.scheme.method

    @property
    def params(self) -> dict[str, Any]:
        return self.scheme.params

    def layer_prefix(self, layer: int) -> str:
        return f"{self.prefix}.{layer}."

    def key(self, layer: int, template: str, codec_suffix: str, expert: int = 0) -> str:
        """The stored name of one tensor: a projection ``template``'s codec suffix in ``layer``."""
        base = self.layer_prefix(layer) + template.format(e=expert)
        if self.style in ("per_expert", "store"):
            return base + self.scheme.stored_suffix(codec_suffix)
        if self.style == "gguf":
            return base + ".weight"
        return base + fused_suffix(codec_suffix)


def fused_suffix(codec_suffix: str) -> str:
    if codec_suffix == ".weight":
        return ""
    if codec_suffix.startswith(".weight_"):
        return "_" + codec_suffix[len(".weight_") :]
    return codec_suffix


def moe_layout(config: Mapping[str, Any], source: TensorSource) -> MoELayout:
    """Find and check the routed experts of ``source`` described by ``config`` (see :func:`read_config`)."""
    own_layout = getattr(source, "moe_layout", None)
    if callable(own_layout):  # an expert store: its manifest records the layout
        return own_layout(config)
    where = config.get("_source") or str(Path(source.path) / "config.json")
    raw_type = str(config.get("model_type"))
    model_type = ALIASES.get(raw_type, raw_type)
    arch = ARCHITECTURES.get(model_type)
    keys = frozenset(source.keys())
    from_gguf_metadata = "gguf_architecture" in config
    # GGUF tensor names, even when the sizes came from a config.json lying beside the file.
    gguf = from_gguf_metadata or any(_GGUF_EXPERT_KEY.match(k) for k in keys)
    found = _layers_with_experts(keys, gguf)
    if not found:
        if arch is None and not gguf:
            raise CheckpointError(
                source.path,
                f"unknown model_type {raw_type!r} and no expert tensors found (looked for "
                f"'<prefix>.<layer>.mlp.experts.*' and '.block_sparse_moe.experts.*'); supported architectures: "
                f"{', '.join(sorted(ARCHITECTURES))}",
            )
        if from_gguf_metadata:  # e.g. a dense llama file, which llama.cpp's Mixtral shares an architecture with
            raise CheckpointError(
                source.path,
                f"general.architecture {config['gguf_architecture']!r} without routed-expert tensors "
                "(blk.N.ffn_*_exps): a dense model; hetmoe runs MoE models",
            )
        raise CheckpointError(source.path, f"no routed-expert tensors found for model_type {raw_type!r}")
    prefix = _choose_prefix(found)
    num_layers = _positive(config, ("num_hidden_layers",), where, "layer count")
    if num_layers > len(keys):  # every decoder layer holds at least one tensor
        raise CheckpointError(
            where, f"num_hidden_layers is {num_layers}, but the checkpoint holds only {len(keys)} tensors"
        )
    present = sorted(layer for layer in found[prefix] if layer < num_layers)  # later layers: MTP heads
    if gguf or arch is None:
        moe_layers = present
    else:
        moe_layers = [layer for layer in range(num_layers) if arch.is_moe(config, layer)]
    dense_with_experts = sorted(set(present) - set(moe_layers))
    if gguf and config.get("first_k_dense_replace"):
        dense_with_experts = [layer for layer in present if layer < config["first_k_dense_replace"]]
    if dense_with_experts:
        raise CheckpointError(
            source.path,
            f"layers {dense_with_experts[:8]} hold expert tensors but {Path(where).name} makes them dense "
            f"(first_k_dense_replace={config.get('first_k_dense_replace')}, "
            f"decoder_sparse_step={config.get('decoder_sparse_step')}, "
            f"mlp_only_layers={config.get('mlp_only_layers')})",
        )
    sample = next((layer for layer in moe_layers if layer in found[prefix]), None)
    if sample is None:
        raise CheckpointError(source.path, f"none of the MoE layers {moe_layers[:8]} has expert tensors")

    num_experts = _positive(config, EXPERT_COUNT_KEYS, where, "expert count")
    top_k = _positive(config, TOP_K_KEYS, where, "experts per token")
    if top_k > num_experts:
        name = next(n for n in TOP_K_KEYS if config.get(n) is not None)
        raise CheckpointError(where, f"{name} ({top_k}) is larger than the expert count ({num_experts})")
    hidden = _positive(config, ("hidden_size",), where, "hidden size")
    if from_gguf_metadata:  # config_from_gguf names the expert width moe_intermediate_size everywhere
        inter_keys: tuple[str, ...] = ("moe_intermediate_size",)
    elif arch is not None:
        inter_keys = (arch.intermediate_key,)
    else:
        inter_keys = ("moe_intermediate_size", "intermediate_size")
    intermediate = _positive(config, inter_keys, where, "expert intermediate size")
    style, gate, up, down = _style(keys, prefix, sample, model_type, source, hidden, intermediate)
    layout = MoELayout(
        model_type=model_type,
        prefix=prefix,
        num_layers=num_layers,
        moe_layers=tuple(moe_layers),
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=intermediate,
        style=style,
        gate=gate,
        up=up,
        down=down,
        scheme=ExpertScheme("gguf", {}, {}, "gguf"),
        config_source=str(where),
        keys=keys,
    )
    if style != "gguf":
        layout.scheme = _scheme(layout, config, source, sample, where)
    return layout


def _layers_with_experts(keys: frozenset[str], gguf: bool) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for key in keys:
        m = _GGUF_EXPERT_KEY.match(key) if gguf else _EXPERT_KEY.match(key)
        if m:
            found.setdefault("blk" if gguf else m["prefix"], set()).add(int(m["layer"]))
    return found


def _choose_prefix(found: dict[str, set[int]]) -> str:
    for prefix in KNOWN_PREFIXES:
        if prefix in found:
            return prefix
    return max(found, key=lambda p: len(found[p]))


def _positive(config: Mapping[str, Any], names: tuple[str, ...], where: str, what: str) -> int:
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(where, f"{name} must be a positive integer, found {value!r}")
        return value
    raise CheckpointError(where, f"no {what}: the config has none of {list(names)}")


def _style(
    keys: frozenset[str], prefix: str, layer: int, model_type: str, source: TensorSource, hidden: int, inter: int
) -> tuple[str, str, str | None, str]:
    lp = f"{prefix}.{layer}."
    if prefix == "blk":
        if lp + "ffn_gate_up_exps.weight" in keys:
            return "gguf", "ffn_gate_up_exps", None, "ffn_down_exps"
        return "gguf", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"
    layer_keys = sorted(k[len(lp) :] for k in keys if k.startswith(lp))
    for rest in layer_keys:
        m = _PER_EXPERT.match(rest)
        if m:
            module = m["module"]
            g, u, d = ("gate_proj", "up_proj", "down_proj") if m["proj"] == "gate_proj" else ("w1", "w3", "w2")
            return "per_expert", f"{module}.{{e}}.{g}", f"{module}.{{e}}.{u}", f"{module}.{{e}}.{d}"
    base = "mlp.experts.gate_up_proj"
    if any(rest.startswith(base) for rest in layer_keys):
        if model_type == "gpt_oss":
            return "gpt_oss", base, None, "mlp.experts.down_proj"
        style = _fused_orientation(lp + base, keys, model_type, source, hidden, inter)
        return style, base, None, "mlp.experts.down_proj"
    expert_keys = [lp + k for k in layer_keys if ".experts." in "." + k]
    raise CheckpointError(
        source.path,
        f"unrecognised expert layout in layer {layer}: {expert_keys[:5]} ({len(expert_keys)} expert tensors); "
        "expected mlp.experts.<e>.{gate,up,down}_proj, block_sparse_moe.experts.<e>.{w1,w3,w2} or "
        "mlp.experts.gate_up_proj/down_proj",
    )


def _fused_orientation(
    key: str, keys: frozenset[str], model_type: str, source: TensorSource, hidden: int, inter: int
) -> str:
    """``[E, 2I, H]`` (transformers 5) or ``[E, H, 2I]`` (Qwen3-VL-MoE's hub files) from the shape."""
    if key not in keys:
        return "fused"  # quantized fused storage: only the transformers 5 orientation exists
    shape = source.info(key).shape
    if hidden == 2 * inter:  # square: the shape cannot tell, the architecture can
        return "fused_t" if model_type == "qwen3_vl_moe" else "fused"
    if len(shape) == 3 and shape[1] == hidden and shape[2] == 2 * inter:
        return "fused_t"
    return "fused"


def _scheme(layout: MoELayout, config: Mapping[str, Any], source: TensorSource, layer: int, where: str) -> ExpertScheme:
    """The experts' stored precision, from quantization_config checked against one expert of ``layer``."""
    module = layout.layer_prefix(layer) + layout.gate.format(e=0)
    tensors: dict[str, TensorInfo] = {}
    if layout.style == "per_expert":
        # The first expert that has tensors: a missing expert 0 is reported by the reader, listed.
        for e in range(layout.num_experts):
            module = layout.layer_prefix(layer) + layout.gate.format(e=e)
            tensors = {s: source.info(module + s) for s in SUFFIXES if module + s in layout.keys}
            if tensors:
                break
    else:
        for suffix in _FUSED_CODEC_SUFFIXES:
            if module + fused_suffix(suffix) in layout.keys:
                tensors[suffix] = source.info(module + fused_suffix(suffix))
    try:
        scheme = resolve_scheme(config, module, tensors, where, (layout.hidden_size, layout.intermediate_size))
        check_dims(scheme, layout.hidden_size, layout.intermediate_size, module)
    except FormatError as exc:  # the config's sizes do not fit the stored format's groups
        raise CheckpointError(where, str(exc)) from None
    return scheme
