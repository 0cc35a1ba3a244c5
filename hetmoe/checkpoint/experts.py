"""Read one MoE layer's routed experts as stacked ``[E, ...]`` codec tensors, validated.

In the stored precision nothing passes through full precision: per-expert tensors are stacked
(the one copy per-expert storage forces), fused and GGUF tensors are views or slices of the
memory-mapped file, and gpt-oss's interleaved gate/up columns are separated. Asked for another
precision, the layer is dequantized and re-quantized one projection (and a bounded chunk of
experts) at a time, so memory stays bounded by a slice of one layer, never the model.

Logical shapes follow the codecs' ``[..., N, K]``: gate and up ``[E, I, H]``, down ``[E, H, I]``.
Everything is checked before it is returned (presence, shapes and dtypes against the config,
the codec's own validation: scale shapes, finite scales, divisibility, no stray zero points) and
every failure names the file and the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats import Codec, FormatError, QuantizedTensor, get_codec
from ..formats.base import TensorSpec
from ..formats.gguf import GGUFCodec
from ..formats.registry import UnknownMethodError
from ..hw import huge_pages
from .detect import SUFFIXES
from .errors import CheckpointError
from .layout import MoELayout, fused_suffix
from .safetensors_file import TensorInfo
from .source import TensorSource

PROJECTIONS = ("gate", "up", "down")
# Conversion dequantizes this many bytes of float32 at a time at most (one chunk of experts).
CONVERT_CHUNK_BYTES = 256 << 20
_GGUF_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# A faster quantizer for some codecs, injected from above (kernels/quantize.py engine_quantize: this
# layer sits below the engine): (codec, one [N, K] / [E, N, K] weight, a list of [N, K] experts or an
# fp8 QuantizedTensor, name) -> the codec's stored tensors, bit-identical to codec.quantize (of the
# fp8 weight's dequantized values), or None where it has none.
Quantizer = Callable[[Codec, "torch.Tensor | Sequence[torch.Tensor] | QuantizedTensor", str], "QuantizedTensor | None"]


@dataclass
class LayerExperts:
    """One layer's routed experts: gate/up ``[E, I, H]``, down ``[E, H, I]`` and optional biases.

    Read from fused or GGUF storage, the tensors are views of the memory-mapped file and may be
    strided (gate and up are two halves of one tensor); call ``.contiguous()`` where dense memory
    is needed. Biases keep their stored dtype.
    """

    layer: int
    gate: QuantizedTensor
    up: QuantizedTensor
    down: QuantizedTensor
    gate_bias: torch.Tensor | None = None  # [E, I] (gpt-oss)
    up_bias: torch.Tensor | None = None  # [E, I]
    down_bias: torch.Tensor | None = None  # [E, H]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def projections(self) -> dict[str, QuantizedTensor]:
        return {"gate": self.gate, "up": self.up, "down": self.down}

    @property
    def biases(self) -> dict[str, torch.Tensor]:
        found = {"gate": self.gate_bias, "up": self.up_bias, "down": self.down_bias}
        return {k: v for k, v in found.items() if v is not None}

    @property
    def nbytes(self) -> int:
        weights = sum(q.nbytes for q in self.projections.values())
        return weights + sum(b.numel() * b.element_size() for b in self.biases.values())


def codec_of(q: QuantizedTensor) -> Codec:
    """The codec that reads ``q`` back (its method and stored parameters)."""
    return get_codec(q.method, **q.params)


def read_layer_experts(
    source: TensorSource,
    layout: MoELayout,
    layer: int,
    method: str | None = None,
    /,
    *,
    quantize: Quantizer | None = None,
    **params: Any,  # the codec's (positional-only names above: a codec may take ``layout``)
) -> LayerExperts:
    """Layer ``layer``'s experts, in their stored precision (``method=None``) or converted to ``method``
    (with ``quantize`` where it takes the target: per-expert full-precision weights then go straight
    from the file's pages to the target, never stacked or widened)."""
    if method is None and params:
        raise ValueError(f"codec parameters {sorted(params)} given without a method")
    if layer not in layout.moe_layers:
        raise CheckpointError(
            source.path, f"layer {layer} is not an MoE layer of this checkpoint (MoE layers: {list(layout.moe_layers)})"
        )
    readers = {
        "per_expert": _read_per_expert,
        "fused": _read_fused,
        "fused_t": _read_fused_transposed,
        "gpt_oss": _read_gpt_oss,
        "gguf": _read_gguf,
        "store": _read_store,
    }
    if method is not None and quantize is not None and layout.style == "per_expert" and layout.scheme.method == "bf16":
        direct = _quantize_per_expert(source, layout, layer, method, quantize, params)
        if direct is not None:
            return direct
    experts = readers[layout.style](source, layout, layer)
    if method is not None:
        experts = convert_experts(experts, method, quantize=quantize, **params)
    return experts


def _shapes(layout: MoELayout) -> dict[str, tuple[int, int]]:
    h, i = layout.hidden_size, layout.intermediate_size
    return {"gate": (i, h), "up": (i, h), "down": (h, i)}


def _display(layout: MoELayout, layer: int, template: str) -> str:
    return layout.layer_prefix(layer) + template.replace("{e}", "*")


def _packaged(codec: Codec, shape: tuple[int, ...], tensors: dict[str, torch.Tensor]) -> QuantizedTensor:
    """A QuantizedTensor labelled the way the codec's own ``quantize`` labels its output."""
    if isinstance(codec, GGUFCodec):
        return QuantizedTensor(codec.label(), shape, tensors, {"ggml_type": codec.ggml_type.name})
    return QuantizedTensor(codec.method, shape, tensors, codec.params)


def _validate(codec: Codec, q: QuantizedTensor, name: str, file: str | Path) -> None:
    try:
        codec.validate(q, name)
    except FormatError as exc:
        raise CheckpointError(file, str(exc)) from exc
    q.validated = True


def _missing_error(source: TensorSource, layer: int, missing: list[str], total: int) -> CheckpointError:
    return CheckpointError(
        source.path,
        f"layer {layer}: {len(missing)} of {total} expert tensors are missing, first: {missing[:5]}",
    )


# --- per-expert storage -------------------------------------------------------------------------


def _read_per_expert(source: TensorSource, layout: MoELayout, layer: int) -> LayerExperts:
    codec, templates = _check_per_expert(source, layout, layer)
    shapes = _shapes(layout)
    out = {p: _stack(source, layout, layer, templates[p], shapes[p], codec) for p in PROJECTIONS}
    return LayerExperts(layer, out["gate"], out["up"], out["down"])


def _check_per_expert(source: TensorSource, layout: MoELayout, layer: int) -> tuple[Codec, dict[str, str]]:
    """Every expert tensor of the layer present and none beyond the config's count: (the stored codec,
    the key template of each projection)."""
    codec = layout.scheme.codec()
    shapes = _shapes(layout)
    if 3 * layout.num_experts > len(layout.keys):  # before listing names: the count may be a corrupt 2^31
        raise CheckpointError(
            source.path,
            f"the config gives {layout.num_experts} experts a layer, stored one tensor each per projection, "
            f"but the checkpoint holds only {len(layout.keys)} tensors",
        )
    templates = {"gate": layout.gate, "up": layout.up or layout.gate, "down": layout.down}
    wanted = [
        layout.key(layer, templates[p], spec.suffix, e)
        for p in PROJECTIONS
        for e in range(layout.num_experts)
        for spec in codec.tensor_specs(shapes[p])
    ]
    missing = [k for k in wanted if k not in layout.keys]
    if missing:
        raise _missing_error(source, layer, missing, len(wanted))
    main_suffix = codec.tensor_specs(shapes["gate"])[0].suffix
    beyond = layout.key(layer, layout.gate, main_suffix, layout.num_experts)
    if beyond in layout.keys:
        count = layout.num_experts
        while layout.key(layer, layout.gate, main_suffix, count) in layout.keys:
            count += 1
        raise CheckpointError(
            source.info(beyond).file,
            f"layer {layer} has at least {count} experts ({beyond} exists) but {Path(layout.config_source).name} "
            f"says {layout.num_experts}",
        )
    return codec, templates


def _quantize_per_expert(
    source: TensorSource, layout: MoELayout, layer: int, method: str, quantize: Quantizer, params: dict[str, Any]
) -> LayerExperts | None:
    """Per-expert full-precision weights quantized to ``method`` by ``quantize`` straight from their
    mapped pages (each read once, in its stored dtype: fp16 or fp32 experts are not rounded to bf16
    first, as the stacked path does); None where ``quantize`` does not take them."""
    target = get_codec(method, **params)
    if method == "bf16" or isinstance(target, type(layout.scheme.codec())):
        return None
    codec, templates = _check_per_expert(source, layout, layer)
    shapes = _shapes(layout)
    out: dict[str, QuantizedTensor] = {}
    for p in PROJECTIONS:
        spec = codec.tensor_specs(shapes[p])[0]
        keys = [layout.key(layer, templates[p], spec.suffix, e) for e in range(layout.num_experts)]
        infos = _check_stack_infos(source, layout, keys, codec, spec)
        name = _display(layout, layer, templates[p])
        try:
            q = quantize(target, [source.get(k) for k in keys], name)
        except FormatError as exc:
            expert = getattr(exc, "expert", None)
            file = infos[expert].file if isinstance(expert, int) and 0 <= expert < len(infos) else infos[0].file
            raise CheckpointError(file, str(exc)) from exc
        if q is None:
            return None
        if hasattr(source, "release"):  # read once: drop the pages, as _stack does
            for k in keys:
                source.release(k)
        out[p] = q
    return LayerExperts(layer, out["gate"], out["up"], out["down"])


def _check_stack_infos(
    source: TensorSource,
    layout: MoELayout,
    keys: list[str],
    codec: Codec,
    spec: TensorSpec | None,
) -> list[TensorInfo]:
    """One stored tensor of every expert (``keys``): each like expert 0, and where ``spec`` is given
    (the data tensor, whose shape follows from the config alone) expert 0 as the config and format
    say; their infos, or the error naming the file and tensor."""
    infos = [source.info(k) for k in keys]
    first = infos[0]
    if spec is not None:
        if first.shape != spec.shape:
            raise CheckpointError(
                first.file,
                f"tensor {keys[0]}: expected shape {list(spec.shape)} for hidden_size={layout.hidden_size}, "
                f"expert intermediate size={layout.intermediate_size} ({codec.label()}), found {list(first.shape)}",
            )
        full_precision = layout.scheme.method == "bf16"
        if not (_is_float(first.dtype) if full_precision else first.dtype == spec.dtype):
            want = "a float dtype" if full_precision else f"dtype {spec.dtype}"
            raise CheckpointError(
                first.file, f"tensor {keys[0]}: expected {want} ({codec.label()}), found {first.dtype}"
            )
    for key, info in zip(keys[1:], infos[1:], strict=True):
        if info.shape != first.shape or info.dtype != first.dtype:
            raise CheckpointError(
                info.file,
                f"tensor {key}: dtype {info.dtype} shape {list(info.shape)} differs from expert 0's "
                f"{first.dtype} {list(first.shape)} ({keys[0]})",
            )
    return infos


def _stack(
    source: TensorSource, layout: MoELayout, layer: int, template: str, shape: tuple[int, int], codec: Codec
) -> QuantizedTensor:
    n_exp = layout.num_experts
    specs = codec.tensor_specs(shape)
    full_precision = layout.scheme.method == "bf16"
    tensors: dict[str, torch.Tensor] = {}
    for index, spec in enumerate(specs):
        keys = [layout.key(layer, template, spec.suffix, e) for e in range(n_exp)]
        _check_stack_infos(source, layout, keys, codec, spec if index == 0 else None)
        first = source.get(keys[0])
        dtype = first.dtype
        if full_precision and dtype != torch.bfloat16:
            dtype = torch.bfloat16  # fp16/fp32 experts: bf16 is the full-precision form
        elif spec.dtype == torch.int64 and dtype != torch.int64 and not first.is_floating_point():
            dtype = torch.int64  # weight_shape is written int32 by some tools
        # One copy, converted as it goes, on the huge pages a decode step streams best (hw/huge_pages.py)
        stacked = huge_pages.empty((n_exp, *first.shape), dtype)
        for row, part in zip(stacked, (first, *map(source.get, keys[1:])), strict=True):
            row.copy_(part)
        del first
        # The stack is a copy: drop the mapped pages it was read from, so memory holds each expert once.
        if hasattr(source, "release"):
            for k in keys:
                source.release(k)
        tensors[spec.suffix] = stacked
    stored = {layout.scheme.stored_suffix(s.suffix) for s in specs}
    extras = ((layout.key(layer, template, "", e), s) for e in range(n_exp) for s in SUFFIXES if s not in stored)
    for base, suffix in extras:
        key = base + suffix
        if key in layout.keys:
            what = "a zero point" if "zero" in suffix else "a tensor"
            raise CheckpointError(
                source.info(key).file,
                f"tensor {key}: {what} that {codec.label()} does not have (expected only "
                f"{sorted(stored)}); the quantization_config and the tensors disagree",
            )
    q = _packaged(codec, (n_exp, *shape), tensors)
    try:
        codec.validate(q, _display(layout, layer, template))
    except FormatError as exc:
        _blame_expert(source, layout, layer, template, codec, q)
        raise CheckpointError(source.info(layout.key(layer, template, specs[0].suffix)).file, str(exc)) from exc
    q.validated = True
    return q


def _blame_expert(
    source: TensorSource, layout: MoELayout, layer: int, template: str, codec: Codec, q: QuantizedTensor
) -> None:
    """Re-validate expert by expert so the error names the one bad tensor and its file."""
    for e in range(layout.num_experts):
        one = QuantizedTensor(q.method, q.shape[1:], {s: t[e] for s, t in q.tensors.items()}, q.params)
        name = layout.layer_prefix(layer) + template.format(e=e)
        try:
            codec.validate(one, name)
        except FormatError as exc:
            suffix = exc.tensor[len(name) :] if exc.tensor.startswith(name) else ""
            key = layout.key(layer, template, suffix or codec.tensor_specs(q.shape[1:])[0].suffix, e)
            file = source.info(key).file if key in layout.keys else source.path
            raise CheckpointError(file, str(exc)) from exc


def _is_float(dtype: torch.dtype | str) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2


# --- fused storage (transformers 5, Qwen3-VL-MoE, gpt-oss) ----------------------------------------


def _read_whole(
    source: TensorSource, layout: MoELayout, layer: int, template: str, shape: tuple[int, ...], codec: Codec
) -> tuple[QuantizedTensor, Path]:
    """A fused tensor of logical ``shape`` (experts first), checked against the config and validated."""
    specs = codec.tensor_specs(shape)
    keys = {s.suffix: layout.layer_prefix(layer) + template + fused_suffix(s.suffix) for s in specs}
    missing = [k for k in keys.values() if k not in layout.keys]
    if missing:
        raise _missing_error(source, layer, missing, len(keys))
    main = specs[0]
    info = source.info(keys[main.suffix])
    if info.shape != main.shape:
        raise CheckpointError(
            info.file,
            f"tensor {keys[main.suffix]}: expected shape {list(main.shape)} ({layout.num_experts} experts, "
            f"hidden_size={layout.hidden_size}, expert intermediate size={layout.intermediate_size}), "
            f"found {list(info.shape)}",
        )
    tensors = {s: source.get(k) for s, k in keys.items()}
    if layout.scheme.method == "bf16" and tensors[main.suffix].dtype != torch.bfloat16:
        if not _is_float(info.dtype):
            raise CheckpointError(info.file, f"tensor {keys[main.suffix]}: expected a float dtype, found {info.dtype}")
        tensors[main.suffix] = huge_pages.copy_to_huge_pages(tensors[main.suffix], torch.bfloat16)
    q = _packaged(codec, tuple(shape), tensors)
    _validate(codec, q, layout.layer_prefix(layer) + template, info.file)
    return q, info.file


def slice_rows(q: QuantizedTensor, rows: slice, name: str = "weight") -> QuantizedTensor:
    """Rows ``rows`` of the N axis of a stacked ``[E, N, K]`` tensor, as views where the codec allows.

    Works for every codec whose tensors keep N on axis 1 (bf16, int8, fp8-channel, int4 bytes,
    mxfp4, gguf) and for fp8 when the slice falls on scale-block boundaries.
    """
    n = q.shape[1]
    picked = range(n)[rows]
    new_shape = (q.shape[0], len(picked), *q.shape[2:])
    method = q.method
    if method == "gptq" or (method == "int4-asym" and q.params.get("layout") == "compressed-tensors"):
        # N is the packed or the last axis of these layouts: rows cannot be cut out as a view.
        raise FormatError(name, "a format whose rows can be sliced", method, "split gate/up before quantizing")
    tensors: dict[str, torch.Tensor] = {}
    for suffix, t in q.tensors.items():
        if suffix == ".weight_scale_inv":  # fp8 block scales: one row per block of rows
            bn = int(q.params.get("block_size", [128, 128])[0])
            start, stop, step = rows.indices(n)
            if step != 1 or start % bn or (stop % bn and stop != n):
                raise FormatError(
                    name + suffix,
                    f"gate/up halves aligned to the {bn}-row scale blocks",
                    f"rows {start}..{stop}",
                    "a scale block would straddle gate and up",
                )
            tensors[suffix] = t[:, start // bn : -(-stop // bn)]
        elif suffix == ".weight_shape":
            fixed = t.clone()
            fixed[..., 0] = len(picked)
            tensors[suffix] = fixed
        else:
            tensors[suffix] = t[:, rows]
    return QuantizedTensor(q.method, new_shape, tensors, q.params)


def _split(q: QuantizedTensor, first: slice, second: slice, name: str, file: Path) -> tuple[QuantizedTensor, ...]:
    try:
        return slice_rows(q, first, name), slice_rows(q, second, name)
    except FormatError as exc:
        raise CheckpointError(file, str(exc)) from exc


def _read_fused(source: TensorSource, layout: MoELayout, layer: int) -> LayerExperts:
    codec = layout.scheme.codec()
    e, h, i = layout.num_experts, layout.hidden_size, layout.intermediate_size
    gate_up, file = _read_whole(source, layout, layer, layout.gate, (e, 2 * i, h), codec)
    down, _ = _read_whole(source, layout, layer, layout.down, (e, h, i), codec)
    gate, up = _split(gate_up, slice(0, i), slice(i, 2 * i), layout.layer_prefix(layer) + layout.gate, file)
    return LayerExperts(layer, gate, up, down)


def _shaped_info(
    source: TensorSource,
    layout: MoELayout,
    key: str,
    shape: tuple[int, ...],
    names: tuple[str, str] = ("hidden_size", "expert intermediate size"),
) -> TensorInfo:
    """The info of tensor ``key``, which must exist and have exactly ``shape``; ``names`` are the
    config fields the shape came from, as the source spells them (safetensors config or GGUF)."""
    if key not in layout.keys:
        raise CheckpointError(source.path, f"missing tensor {key}")
    info = source.info(key)
    if info.shape != shape:
        raise CheckpointError(
            info.file,
            f"tensor {key}: expected shape {list(shape)} ({layout.num_experts} experts, {names[0]}="
            f"{layout.hidden_size}, {names[1]}={layout.intermediate_size}), found {list(info.shape)}",
        )
    return info


def _full_precision(source: TensorSource, key: str, shape: tuple[int, ...], layout: MoELayout) -> torch.Tensor:
    """A bf16 (or castable float) tensor that must have exactly ``shape``."""
    info = _shaped_info(source, layout, key, shape)
    if not _is_float(info.dtype):
        raise CheckpointError(info.file, f"tensor {key}: expected a float dtype, found {info.dtype}")
    t = source.get(key)
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(info.file, f"tensor {key}: expected finite values, found NaN/Inf")
    return t if t.dtype == torch.bfloat16 else huge_pages.copy_to_huge_pages(t, torch.bfloat16)


def _bf16(t: torch.Tensor) -> QuantizedTensor:
    return QuantizedTensor("bf16", tuple(t.shape), {".weight": t})


def _read_fused_transposed(source: TensorSource, layout: MoELayout, layer: int) -> LayerExperts:
    if layout.scheme.method != "bf16":
        method = layout.scheme.method
        raise CheckpointError(source.path, f"fused [E, H, 2I] experts stored as {method} are not supported")
    e, h, i = layout.num_experts, layout.hidden_size, layout.intermediate_size
    lp = layout.layer_prefix(layer)
    gate_up = _full_precision(source, lp + layout.gate, (e, h, 2 * i), layout)
    down = _full_precision(source, lp + layout.down, (e, i, h), layout)
    return LayerExperts(
        layer,
        _bf16(gate_up[:, :, :i].transpose(1, 2)),
        _bf16(gate_up[:, :, i:].transpose(1, 2)),
        _bf16(down.transpose(1, 2)),
    )


def _read_gpt_oss(source: TensorSource, layout: MoELayout, layer: int) -> LayerExperts:
    e, h, i = layout.num_experts, layout.hidden_size, layout.intermediate_size
    lp = layout.layer_prefix(layer)
    if layout.scheme.method == "bf16":
        # [E, H, 2I] with gate at even columns: de-interleave, then transpose to the codecs' [E, N, K].
        gate_up = _full_precision(source, lp + layout.gate, (e, h, 2 * i), layout)
        down = _full_precision(source, lp + layout.down, (e, i, h), layout)
        # copies the engine streams each step: on huge pages (hw/huge_pages.py)
        gate = _bf16(huge_pages.copy_to_huge_pages(gate_up[:, :, 0::2].transpose(1, 2)))
        up = _bf16(huge_pages.copy_to_huge_pages(gate_up[:, :, 1::2].transpose(1, 2)))
        down_q = _bf16(huge_pages.copy_to_huge_pages(down.transpose(1, 2)))
    else:
        # Quantized gpt-oss (mxfp4) is stored [out, in]: gate/up interleaved along the 2I rows.
        codec = layout.scheme.codec()
        gate_up_q, file = _read_whole(source, layout, layer, layout.gate, (e, 2 * i, h), codec)
        down_q, _ = _read_whole(source, layout, layer, layout.down, (e, h, i), codec)
        gate, up = _split(gate_up_q, slice(0, 2 * i, 2), slice(1, 2 * i, 2), lp + layout.gate, file)
    bias = _full_precision(source, lp + layout.gate + "_bias", (e, 2 * i), layout)
    down_bias = _full_precision(source, lp + layout.down + "_bias", (e, h), layout)
    return LayerExperts(layer, gate, up, down_q, bias[:, 0::2], bias[:, 1::2], down_bias)


# --- GGUF ---------------------------------------------------------------------------------------


def _gguf_tensor(source: TensorSource, layout: MoELayout, key: str, shape: tuple[int, ...]) -> QuantizedTensor:
    info = _shaped_info(source, layout, key, shape, ("embedding_length", "expert_feed_forward_length"))
    try:
        codec = get_codec(f"gguf:{str(info.dtype).lower()}")
    except UnknownMethodError as exc:
        raise CheckpointError(info.file, f"tensor {key}: {exc}") from None
    q = _packaged(codec, shape, {".weight": source.get(key)})
    _validate(codec, q, key.removesuffix(".weight"), info.file)
    return q


def _gguf_bias(source: TensorSource, layout: MoELayout, key: str, shape: tuple[int, int]) -> torch.Tensor | None:
    if key not in layout.keys:
        return None
    info = source.info(key)
    dtype = _GGUF_FLOATS.get(str(info.dtype))
    if dtype is None or info.shape != shape:
        raise CheckpointError(
            info.file,
            f"tensor {key}: expected an F32/F16/BF16 bias of shape {list(shape)}, found {info.dtype} "
            f"{list(info.shape)}",
        )
    return source.get(key).view(dtype).reshape(shape)


def _read_gguf(source: TensorSource, layout: MoELayout, layer: int) -> LayerExperts:
    e, h, i = layout.num_experts, layout.hidden_size, layout.intermediate_size
    lp = layout.layer_prefix(layer)
    if layout.up is None:  # merged ffn_gate_up_exps [E, 2I, H], gate rows first
        key = lp + layout.gate + ".weight"
        gate_up = _gguf_tensor(source, layout, key, (e, 2 * i, h))
        gate, up = _split(gate_up, slice(0, i), slice(i, 2 * i), key, source.info(key).file)
    else:
        gate = _gguf_tensor(source, layout, lp + layout.gate + ".weight", (e, i, h))
        up = _gguf_tensor(source, layout, lp + layout.up + ".weight", (e, i, h))
    down = _gguf_tensor(source, layout, lp + layout.down + ".weight", (e, h, i))
    return LayerExperts(
        layer,
        gate,
        up,
        down,
        _gguf_bias(source, layout, lp + layout.gate + ".bias", (e, i)),
        _gguf_bias(source, layout, lp + (layout.up or layout.gate) + ".bias", (e, i)),
        _gguf_bias(source, layout, lp + layout.down + ".bias", (e, h)),
    )


# --- hetmoe expert store ------------------------------------------------------------------------


def _read_store(source: TensorSource, layout: MoELayout, layer: int) -> LayerExperts:
    from .store import ExpertStore  # lazy: the store module builds on this one

    if not isinstance(source, ExpertStore):
        raise CheckpointError(source.path, "a layout of style 'store' must be read from the ExpertStore it came from")
    return source.layer(layer)


# --- conversion ---------------------------------------------------------------------------------


def convert_experts(
    experts: LayerExperts, method: str, *, quantize: Quantizer | None = None, **params: Any
) -> LayerExperts:
    """Each projection in ``method`` (parameters not given default to the stored ones of the same method).

    A projection already stored that way is passed through untouched and one stored in another layout
    of the same precision is repacked (``Codec.repacked``); any other is re-quantized: a
    bf16 or fp8 one straight from its tensors by ``quantize`` where it takes the target, else dequantized in
    chunks of experts, so the float32 detour is bounded by ``CONVERT_CHUNK_BYTES``.
    """
    out: dict[str, QuantizedTensor] = {}
    for proj, q in experts.projections.items():
        source = codec_of(q)
        wanted = {**q.params, **params} if method == q.method else dict(params)
        target = get_codec(method, **wanted)
        moved = source.repacked(q, target)  # the same values, as stored or laid out anew: lossless
        name = f"layer {experts.layer} {proj}"
        out[proj] = moved if moved is not None else _requantize(q, source, target, name, quantize)
    return LayerExperts(
        experts.layer, out["gate"], out["up"], out["down"], experts.gate_bias, experts.up_bias, experts.down_bias
    )


def _requantize(
    q: QuantizedTensor, source: Codec, target: Codec, name: str, quantize: Quantizer | None = None
) -> QuantizedTensor:
    if quantize is not None and q.method in ("bf16", "fp8", "fp8-channel"):
        direct = quantize(target, q.tensors[".weight"] if q.method == "bf16" else q, name)
        if direct is not None:
            return direct  # read in place: no float32 copy, not even a chunk of one
    n_exp, n, k = q.shape
    chunk = max(1, CONVERT_CHUNK_BYTES // max(1, n * k * 4))
    parts: list[QuantizedTensor] = []
    for start in range(0, n_exp, chunk):
        stop = min(n_exp, start + chunk)
        part = {s: t[start:stop] for s, t in q.tensors.items()}
        sub = QuantizedTensor(q.method, (stop - start, n, k), part, q.params)
        weight = source.dequantize(sub)
        fast = quantize(target, weight, name) if quantize is not None else None
        parts.append(fast if fast is not None else target.quantize(weight, name))
    tensors = {s: _stacked([p.tensors[s] for p in parts]) for s in parts[0].tensors}
    return QuantizedTensor(parts[0].method, tuple(q.shape), tensors, parts[0].params)


def _stacked(chunks: list[torch.Tensor]) -> torch.Tensor:
    """The chunks of experts joined along dim 0, on huge pages (the engine streams them each step)."""
    if len(chunks) == 1:
        return chunks[0]
    out = huge_pages.empty((sum(c.shape[0] for c in chunks), *chunks[0].shape[1:]), chunks[0].dtype)
    return torch.cat(chunks, out=out)
