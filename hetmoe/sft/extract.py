"""Expert weights out of a transformers experts module, as stacked ``[E, N, K]`` float tensors.

Layouts read (``experts`` is the MoE block's ``experts`` child):

- fused (transformers 5: Qwen3-MoE, Mixtral, DeepSeek-V3, ...): ``gate_up_proj [E, 2I, H]`` with
  gate rows first, ``down_proj [E, H, I]``;
- gpt-oss: ``gate_up_proj [E, H, 2I]`` with gate and up interleaved along the last axis
  (gate at even columns), ``down_proj [E, I, H]``, biases ``gate_up_proj_bias [E, 2I]`` and
  ``down_proj_bias [E, H]``;
- per-expert lists: ``experts[e].{gate_proj, up_proj, down_proj}`` or ``{w1, w3, w2}`` Linear
  modules ``[out, in]``, possibly wrapped by PEFT LoRA layers (their ``base_layer`` is read: an
  adapter already on an expert stays where it is, in the host module);
- any of those parametrized (``torch.nn.utils.parametrize``): the parametrized value is read.

Every value is checked before it is trusted: a meta tensor (nothing loaded), a hetmoe placeholder
(already extracted) or any zero-storage tensor is refused, naming the parameter. ZeRO-3
partitioned parameters are gathered (``zero3.gathered``) one expert module at a time and copied
out before the gather ends. Otherwise the results are views of the module's own parameters (no
copy) -- the caller replaces those with placeholders afterwards, so the memory is held once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from .placeholders import is_placeholder, placeholder_error
from .zero3 import GatherFn, gathered, is_partitioned, logical_shape

PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass
class Source:
    """A parameter that was read, to be replaced by a placeholder: ``owner.local`` (``name`` in full)."""

    owner: nn.Module
    local: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class ExtractedExperts:
    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]
    biases: dict[str, torch.Tensor] = field(default_factory=dict)
    sources: list[Source] = field(default_factory=list)
    layout: str = "fused"  # "fused", "gpt_oss" or "per_expert"
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # the per-expert module names

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]


def base_linear(module: nn.Module) -> nn.Module:
    """The Linear inside PEFT tuner layers (``base_layer`` chains)."""
    while hasattr(module, "base_layer") and isinstance(module.base_layer, nn.Module):
        module = module.base_layer
    return module


def _raw_params(owner: nn.Module, local: str, name: str) -> list[tuple[str, torch.Tensor]]:
    """The stored tensors behind ``owner.local``: the parameter itself, or a parametrization's originals."""
    if parametrize.is_parametrized(owner, local):
        plist = owner.parametrizations[local]
        return [(f"{name}.{n}", t) for n, t in plist.named_parameters(recurse=False)]
    t = owner._parameters.get(local)
    if t is None:
        raise ValueError(f"{name}: expected a parameter, found none")
    return [(name, t)]


def _check_stored(name: str, t: torch.Tensor) -> None:
    if is_placeholder(t):
        raise placeholder_error(name, t)
    if t.device.type == "meta":
        raise ValueError(
            f"{name}: on the meta device (shape {list(t.shape)}, no values were loaded); load the weights first, or "
            "read the experts from the checkpoint with hetmoe.sft.load_for_training(path)"
        )
    if is_partitioned(t) and tuple(t.shape) != logical_shape(t):
        return  # gathered by the caller before the value is read
    if t.numel() == 0 or t.untyped_storage().nbytes() == 0:
        raise ValueError(
            f"{name}: a zero-storage tensor (shape {list(t.shape)}, {t.untyped_storage().nbytes()} bytes): a "
            "placeholder or an offloaded parameter, not weights to extract"
        )


def _value(owner: nn.Module, local: str, name: str, copy: bool) -> torch.Tensor:
    with torch.no_grad():
        v = getattr(owner, local)  # a parametrization computes its value here
    if not isinstance(v, torch.Tensor) or v.numel() == 0:
        raise ValueError(f"{name}: expected weights, found {type(v).__name__} of shape {list(getattr(v, 'shape', []))}")
    v = v.detach()
    return v.clone() if copy else v


def _read(
    owner: nn.Module, locals_: list[str], prefix: str, gather: GatherFn | None
) -> tuple[dict[str, torch.Tensor], list[Source]]:
    """Values of ``owner``'s parameters ``locals_`` (gathering partitioned ones) and their Sources."""
    raw: list[tuple[str, torch.Tensor]] = []
    for local in locals_:
        for n, t in _raw_params(owner, local, f"{prefix}{local}"):
            _check_stored(n, t)
            raw.append((n, t))
    partitioned = any(is_partitioned(t) for _, t in raw)
    values: dict[str, torch.Tensor] = {}
    sources: list[Source] = []
    with gathered(raw, gather):
        for local in locals_:
            name = f"{prefix}{local}"
            v = _value(owner, local, name, copy=partitioned)
            values[local] = v
            sources.append(Source(owner, local, name, tuple(v.shape), v.dtype))
    return values, sources


def _has(owner: nn.Module, local: str) -> bool:
    return owner._parameters.get(local) is not None or parametrize.is_parametrized(owner, local)


def extract_experts(experts: nn.Module, prefix: str = "", gather: GatherFn | None = None) -> ExtractedExperts:
    """Read ``experts`` (see the module docstring); ``prefix`` (the module's name + ".") names errors."""
    if _has(experts, "gate_up_proj") and _has(experts, "down_proj"):
        if _has(experts, "gate_up_proj_bias"):
            return _gpt_oss(experts, prefix, gather)
        return _fused(experts, prefix, gather)
    children = list(experts.children()) if isinstance(experts, (nn.ModuleList, nn.Sequential)) else []
    if children:
        for names in PER_EXPERT_NAMES:
            if all(hasattr(children[0], n) for n in names):
                return _per_expert(children, names, prefix, gather)
    found = sorted(n for n, _ in experts.named_parameters())[:6]
    raise ValueError(
        f"{prefix.rstrip('.') or 'experts'}: expected fused gate_up_proj/down_proj parameters or a list of experts "
        f"with gate_proj/up_proj/down_proj (or w1/w3/w2) Linear modules, found {type(experts).__name__} with "
        f"parameters {found}"
    )


def _fused(experts: nn.Module, prefix: str, gather: GatherFn | None) -> ExtractedExperts:
    v, sources = _read(experts, ["gate_up_proj", "down_proj"], prefix, gather)
    gu, down = v["gate_up_proj"], v["down_proj"]
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[1] % 2:
        raise ValueError(
            f"{prefix}gate_up_proj: expected [E, 2I, H] and down_proj [E, H, I], found {list(gu.shape)} and "
            f"{list(down.shape)}"
        )
    e, two_i, h = gu.shape
    i = two_i // 2
    if tuple(down.shape) != (e, h, i):
        raise ValueError(f"{prefix}down_proj: expected shape {[e, h, i]} (from gate_up_proj), found {list(down.shape)}")
    return ExtractedExperts(gu[:, :i], gu[:, i:], down, {}, sources, "fused")


def _gpt_oss(experts: nn.Module, prefix: str, gather: GatherFn | None) -> ExtractedExperts:
    locals_ = ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]
    v, sources = _read(experts, locals_, prefix, gather)
    gu, down = v["gate_up_proj"], v["down_proj"]
    e, h, two_i = gu.shape
    i = two_i // 2
    if tuple(down.shape) != (e, i, h) or tuple(v["gate_up_proj_bias"].shape) != (e, two_i):
        raise ValueError(
            f"{prefix}: expected gpt-oss experts gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj "
            f"[E, I, H]; found {list(gu.shape)}, {list(v['gate_up_proj_bias'].shape)}, {list(down.shape)}"
        )
    b = v["gate_up_proj_bias"]
    biases = {"gate": b[:, 0::2], "up": b[:, 1::2], "down": v["down_proj_bias"]}
    return ExtractedExperts(
        gu[:, :, 0::2].transpose(1, 2), gu[:, :, 1::2].transpose(1, 2), down.transpose(1, 2), biases, sources, "gpt_oss"
    )


def _per_expert(
    children: list[nn.Module], names: tuple[str, str, str], prefix: str, gather: GatherFn | None
) -> ExtractedExperts:
    per: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    bias: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    sources: list[Source] = []
    for e, child in enumerate(children):
        for n in names:
            lin = base_linear(getattr(child, n))
            # The Linear's own name through any PEFT wrapping, as named_parameters would spell it.
            path = f"{prefix}{e}.{n}." + ("base_layer." if lin is not getattr(child, n) else "")
            locals_ = ["weight"] + (["bias"] if _has(lin, "bias") else [])
            # One expert module at a time: under ZeRO-3 only its parameters are gathered at once.
            v, src = _read(lin, locals_, path, gather)
            per[n].append(v["weight"])
            if "bias" in v:
                bias[n].append(v["bias"])
            sources += src
    gate, up, down = (torch.stack(per[n]) for n in names)
    if gate.shape != up.shape or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
        raise ValueError(
            f"{prefix}: expected per-expert {names[0]}/{names[1]} [I, H] and {names[2]} [H, I], found "
            f"{list(gate.shape[1:])}, {list(up.shape[1:])}, {list(down.shape[1:])}"
        )
    biases = {role: torch.stack(bias[n]) for role, n in zip(("gate", "up", "down"), names, strict=True) if bias[n]}
    return ExtractedExperts(gate, up, down, biases, sources, "per_expert", names)
