"""Which precision a checkpoint's experts are stored in: ``quantization_config`` checked against tensors.

A config alone is not trusted (files get re-quantized, configs copied between repos), and tensors
alone are ambiguous (a GPTQ file does not say whether its zero points mean anything, an fp8 scale
grid does not say its block size when a dimension is smaller than the block). So the config says
what the experts should be, one expert's tensors say what they are, and any disagreement is an
error naming the tensor. The result is a ``(method, params)`` that ``get_codec`` accepts.

Supported conventions: ``fp8`` with ``weight_block_size`` (DeepSeek-V3, MiniMax-M2, Qwen3-FP8);
compressed-tensors ``pack-quantized`` int4 (Kimi-K2) and ``float-quantized`` fp8 (channel or block
strategy); GPTQ 4-bit with ``desc_act=False``; ``mxfp4`` (gpt-oss); no config at all (plain bf16,
fp16 or fp32 experts, or a hetmoe-written tensor layout recognised by its names).
``compressed_tensors_int4_config`` writes Kimi-K2's config for a directory hetmoe writes itself (the
benchmark's full-depth model).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats import Codec, FormatError, get_codec
from ..formats.base import check_divisible
from .detect import FULL_PRECISION, classify
from .errors import CheckpointError
from .safetensors_file import TensorInfo

SUPPORTED = (
    "fp8 (weight_block_size), compressed-tensors (pack-quantized int4, float-quantized fp8), "
    "gptq (4-bit, desc_act=False), mxfp4"
)


@dataclass(frozen=True)
class ExpertScheme:
    """How experts are stored: a codec ``method`` + ``params``, and where that was learnt.

    ``rename`` maps a codec suffix to the suffix a convention stores it under, for conventions
    that name a tensor differently from the codec (compressed-tensors' block-fp8 ``weight_scale``
    is hetmoe's ``weight_scale_inv``: same meaning, multiplied).
    """

    method: str
    params: dict[str, Any] = field(default_factory=dict)
    rename: dict[str, str] = field(default_factory=dict)
    origin: str = "tensors"

    def codec(self) -> Codec:
        return get_codec(self.method, **self.params)

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.method} ({extra})" if extra else self.method

    def stored_suffix(self, codec_suffix: str) -> str:
        return self.rename.get(codec_suffix, codec_suffix)


def scheme_from_config(qc: Any, where: str | Path, module: str = "") -> ExpertScheme | None:
    """What ``quantization_config`` says an expert ``module`` is stored in; None when unquantized."""
    if qc is None or qc == {}:
        return None
    if not isinstance(qc, Mapping):
        raise CheckpointError(where, f"quantization_config must be an object, found {type(qc).__name__}")
    for key in ("modules_to_not_convert", "ignore"):
        _check_names(qc.get(key), f"quantization_config {key}", where)
    method = qc.get("quant_method")
    if method == "fp8":
        return None if _ignored(qc.get("modules_to_not_convert"), module) else _fp8(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where, module)
    if method == "gptq":
        return None if _ignored(qc.get("modules_to_not_convert"), module) else _gptq(qc, where)
    if method == "mxfp4":
        return None if _ignored(qc.get("modules_to_not_convert"), module) else ExpertScheme("mxfp4", {}, {}, "config")
    raise CheckpointError(
        where, f"quantization_config quant_method {method!r} is not supported for experts; supported: {SUPPORTED}"
    )


def _fp8(qc: Mapping[str, Any], where: str | Path) -> ExpertScheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn", "float8_e4m3"):  # spellings seen in released configs
        raise CheckpointError(where, f"quantization_config fp8 fmt {fmt!r} is not supported: only e4m3 weights")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            where,
            f"quantization_config fp8 needs weight_block_size [rows, cols] (per-block scales), found {block!r}; "
            "per-tensor fp8 is not supported",
        )
    return ExpertScheme("fp8", {"block_size": list(block)}, {}, "config")


def _gptq(qc: Mapping[str, Any], where: str | Path) -> ExpertScheme:
    bits = qc.get("bits", 4)
    if bits != 4:
        raise CheckpointError(where, f"quantization_config gptq bits={bits} is not supported: hetmoe reads 4-bit GPTQ")
    if qc.get("desc_act", False):
        raise CheckpointError(
            where,
            "quantization_config gptq desc_act=True (act-order) is not supported: its permuted g_idx breaks the "
            "contiguous groups the CPU kernels read; re-quantize with desc_act=False",
        )
    group = _group_size(qc.get("group_size", 128), "quantization_config gptq group_size", where, per_channel=True)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(where, f"quantization_config gptq checkpoint_format {fmt!r} is not supported")
    params = {"group_size": group, "sym": bool(qc.get("sym", True)), "checkpoint_format": fmt}
    return ExpertScheme("gptq", params, {}, "config")


def _compressed_tensors(qc: Mapping[str, Any], where: str | Path, module: str) -> ExpertScheme | None:
    if _ignored(qc.get("ignore"), module):
        return None
    group = _target_group(qc.get("config_groups"), module, where)
    if group is None:
        return None
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise CheckpointError(where, "quantization_config compressed-tensors group has no 'weights' scheme")
    fmt = group.get("format") or qc.get("format")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    symmetric = bool(weights.get("symmetric", True))
    what = f"compressed-tensors format={fmt!r} num_bits={bits} type={kind!r} strategy={strategy!r}"
    if fmt == "pack-quantized":
        if kind != "int" or bits != 4:
            raise CheckpointError(where, f"quantization_config {what}: only num_bits 4 type int is supported")
        if strategy != "group":
            raise CheckpointError(where, f"quantization_config {what}: only the group strategy is supported")
        group = _group_size(weights.get("group_size"), "quantization_config weights group_size", where)
        params = {"group_size": group, "layout": "compressed-tensors"}
        return ExpertScheme("int4" if symmetric else "int4-asym", params, {}, "config")
    if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
        if strategy == "channel":
            return ExpertScheme("fp8-channel", {}, {}, "config")
        if strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            return ExpertScheme("fp8", {"block_size": list(block)}, {".weight_scale_inv": ".weight_scale"}, "config")
    raise CheckpointError(where, f"quantization_config {what} is not supported for experts; supported: {SUPPORTED}")


def _target_group(groups: Any, module: str, where: str | Path) -> Mapping[str, Any] | None:
    """The config group whose targets cover ``module`` (``Linear`` covers every linear layer)."""
    if not isinstance(groups, Mapping) or not groups:
        raise CheckpointError(where, "quantization_config compressed-tensors has no config_groups")
    for group in groups.values():
        if not isinstance(group, Mapping):
            continue
        targets = group.get("targets") or []
        _check_names(targets, "quantization_config config_groups targets", where)
        if "Linear" in targets or _ignored(targets, module):
            return group
    return None


def _check_names(value: Any, what: str, where: str | Path) -> None:
    """A list of module names or patterns (or absent)."""
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise CheckpointError(where, f"{what} must be a list of module names, found {value!r}"[:300])


def _group_size(value: Any, what: str, where: str | Path, per_channel: bool = False) -> int:
    """A group size: a positive integer (how many weights of a row share one scale); GPTQ's -1 is a row."""
    if not isinstance(value, int) or isinstance(value, bool) or not (value > 0 or (per_channel and value == -1)):
        expected = "a positive integer" + (" or -1 (one group a row)" if per_channel else "")
        raise CheckpointError(where, f"{what} must be {expected}, found {value!r}"[:300])
    return value


def _ignored(patterns: Any, module: str) -> bool:
    """Whether ``module`` matches one of ``patterns``: exact, ``re:`` regex, glob, or a module above it."""
    if not patterns or not module:
        return False
    for pattern in patterns:
        if not isinstance(pattern, str):
            continue
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif "*" in pattern:
            if fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*"):
                return True
        elif module == pattern or module.startswith(pattern + "."):
            return True
    return False


def scheme_from_tensors(prefix: str, tensors: dict[str, TensorInfo]) -> ExpertScheme | None:
    """The method one weight's tensors (by codec suffix) are stored in; None if none matches."""
    entry = classify(prefix, tensors)
    if entry.method in FULL_PRECISION.values():
        # Full-precision experts are read as bf16, fp16/fp32 ones cast on the way.
        return ExpertScheme("bf16", {}, {}, "tensors")
    if not entry.method:
        return None
    params = dict(entry.params)
    if entry.method == "fp8":
        params = {}  # the block size is ambiguous from shapes alone; the codec default is DeepSeek's
    return ExpertScheme(entry.method, params, {}, "tensors")


def resolve_scheme(
    config: Mapping[str, Any],
    prefix: str,
    tensors: dict[str, TensorInfo],
    where: str | Path,
    dims: tuple[int, int] | None = None,
) -> ExpertScheme:
    """The experts' scheme from ``config``'s quantization_config, checked against one expert's tensors.

    ``prefix`` names the sample expert weight (for messages and ignore lists), ``tensors`` holds
    its stored tensors keyed by codec suffix (``".weight"``, ``".weight_scale_inv"``, ``"_blocks"``).
    ``dims`` = (hidden, expert intermediate) are checked against the claimed groups first, so a
    group size that cannot divide the model is reported as such rather than as a shape mismatch.
    """
    claimed = scheme_from_config(config.get("quantization_config"), where, prefix)
    if claimed is not None and dims is not None:
        check_dims(claimed, *dims, what=prefix)
    if claimed is not None and claimed.rename:
        inverse = {stored: codec for codec, stored in claimed.rename.items()}
        tensors = {inverse.get(s, s): info for s, info in tensors.items()}
    found = scheme_from_tensors(prefix, tensors)
    sample = next(iter(tensors.values()), None)
    sample_file = sample.file if sample is not None else where
    stored = ", ".join(f"{prefix}{s}: {_dtype(i)} {list(i.shape)}" for s, i in tensors.items()) or "no tensors"
    if found is None:
        raise CheckpointError(sample_file, f"cannot tell how expert weight {prefix} is stored ({stored})")
    if claimed is None:
        if config.get("quantization_config") and found.method != "bf16":
            raise CheckpointError(
                sample_file,
                f"quantization_config leaves the experts unquantized, but tensor {prefix} is stored as "
                f"{found.describe()} ({stored})",
            )
        return found
    if claimed.method != found.method:
        raise CheckpointError(
            sample_file,
            f"quantization_config says the experts are {claimed.describe()}, but tensor {prefix} is stored as "
            f"{found.describe()} ({stored})",
        )
    _check_group(claimed, found, prefix, sample_file, tensors)
    return claimed


def _check_group(
    claimed: ExpertScheme, found: ExpertScheme, prefix: str, file: str | Path, tensors: dict[str, TensorInfo]
) -> None:
    layouts = claimed.params.get("layout"), found.params.get("layout")
    if None not in layouts and layouts[0] != layouts[1]:
        raise CheckpointError(
            file, f"quantization_config says the {layouts[0]} layout, but tensor {prefix} is in the {layouts[1]} layout"
        )
    want, got = claimed.params.get("group_size"), found.params.get("group_size")
    if want is None or got is None:
        return
    k = classify(prefix, tensors).shape[-1]
    if want == -1:
        want = k
    if want != got:
        raise CheckpointError(
            file,
            f"quantization_config says group_size {claimed.params['group_size']}, but the scales of {prefix} "
            f"imply groups of {got} (K={k})",
        )


def _dtype(info: TensorInfo) -> str:
    return info.dtype if isinstance(info.dtype, str) else str(info.dtype).removeprefix("torch.")


def check_dims(scheme: ExpertScheme, hidden: int, intermediate: int, what: str = "experts") -> None:
    """The expert dimensions fit the scheme's groups: K of gate/up is ``hidden``, of down ``intermediate``."""
    group = scheme.params.get("group_size")
    if scheme.method == "mxfp4":
        group = 32
    if not isinstance(group, int) or group == -1:
        return
    check_divisible(hidden, group, f"{what} gate/up projections", "K (hidden_size)")
    check_divisible(intermediate, group, f"{what} down projection", "K (intermediate size)")


def check_requested(
    stored_method: str,
    requested: str | None,
    stored_params: Mapping[str, Any] | None = None,
    requested_params: Mapping[str, Any] | None = None,
) -> str | None:
    """None when ``requested`` is what is stored; otherwise a message saying the experts will be converted.

    Parameters left out of ``requested_params`` default to the stored ones when the method names
    match, so asking for ``int4`` on an int4 g32 checkpoint reads it as is. An unknown method or one
    hetmoe cannot quantize to raises.
    """
    if requested is None:
        return None
    stored_params = dict(stored_params or {})
    params = dict(requested_params or {})
    if requested == stored_method:
        params = {**stored_params, **params}
    target = get_codec(requested, **params)
    if not target.can_quantize:
        raise FormatError(
            "method", f"a method hetmoe can quantize to (not {target.label()})", requested, "it is decode-only"
        )
    source = get_codec(stored_method, **stored_params)
    if type(target) is type(source) and target.params == source.params:
        return None
    return (
        f"experts are stored as {source.label()}; {target.label()} was requested: they will be converted "
        "(dequantized and re-quantized one layer at a time), which costs fidelity and conversion time"
    )


def compressed_tensors_int4_config(ignore: list[str], group_size: int = 32) -> dict[str, object]:
    """Kimi-K2-Thinking's quantization_config: int4 groups on every Linear but those in ``ignore``."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": sorted(ignore),
    }
