"""Zero-storage placeholders for the expert parameters the CPU engine now holds.

After extraction the model's own expert parameters are replaced, under their own names, by
parameters with no storage (``torch.empty(0)``) that remember the logical shape and dtype
(``hetmoe_shape``, ``hetmoe_dtype``) and never require grad. The model then holds each expert
once (in the CPU engine), and anything that tries to compute with a placeholder fails loudly on
the shape rather than silently using zeros.

``placeholders(model)`` lists them by name, normalised through PEFT's wrapping
(``base_model.model.`` and ``.base_layer`` dropped), and checks them against the inventory taken
when the model was prepared: a placeholder that appeared, disappeared or got storage since then is
an error (someone re-materialised or swapped modules behind hetmoe's back). ``parameter_counts``
reports what is held and what the architecture logically has.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn

_FLAG = "hetmoe_placeholder"
_INVENTORIES: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[tuple[int, ...], torch.dtype]]] = (
    weakref.WeakKeyDictionary()
)


def make_placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Parameter:
    p = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
    setattr(p, _FLAG, True)
    p.hetmoe_shape = tuple(int(s) for s in shape)  # type: ignore[attr-defined]
    p.hetmoe_dtype = dtype  # type: ignore[attr-defined]
    return p


def is_placeholder(t: object) -> bool:
    return isinstance(t, torch.Tensor) and bool(getattr(t, _FLAG, False))


def placeholder_error(name: str, t: torch.Tensor) -> ValueError:
    return ValueError(
        f"{name}: a hetmoe placeholder (logical shape {list(getattr(t, 'hetmoe_shape', ()))}, no storage): its "
        "weights live in the CPU engine; this model was already prepared by hetmoe.sft"
    )


def normalize_name(name: str) -> str:
    """A parameter name with PEFT's wrapping removed, so it is stable across get_peft_model."""
    name = re.sub(r"^(base_model\.model\.)+", "", name)
    return name.replace(".base_layer.", ".")


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT's wrappers (PeftModel -> LoraModel -> model)."""
    seen = 0
    while seen < 4:
        inner = getattr(model, "get_base_model", None)
        if callable(inner) and inner() is not model:
            model = inner()
        elif type(model).__name__ == "LoraModel" and isinstance(getattr(model, "model", None), nn.Module):
            model = model.model
        else:
            break
        seen += 1
    return model


def replace_parameter(owner: nn.Module, local: str, full_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Put a placeholder where ``owner.local`` was (a parametrization is removed first)."""
    from torch.nn.utils import parametrize

    device = torch.device("cpu")
    if parametrize.is_parametrized(owner, local):
        parametrize.remove_parametrizations(owner, local, leave_parametrized=False)
    old = owner._parameters.get(local)
    if old is not None and old.device.type != "meta":
        device = old.device
    if local in owner._parameters:
        del owner._parameters[local]
    elif hasattr(owner, local):
        delattr(owner, local)
    owner.register_parameter(local, make_placeholder(shape, dtype, device))


def record_inventory(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Take the inventory of ``model``'s placeholders (after preparing it) and return it."""
    found = _scan(unwrap(model))
    _INVENTORIES[unwrap(model)] = {n: (p.hetmoe_shape, p.hetmoe_dtype) for n, p in found.items()}
    return {n: s for n, (s, _) in _INVENTORIES[unwrap(model)].items()}


def _scan(model: nn.Module) -> dict[str, torch.Tensor]:
    return {normalize_name(n): p for n, p in model.named_parameters(remove_duplicate=False) if is_placeholder(p)}


def placeholders(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """``{name: logical shape}`` of the model's placeholders, checked against its inventory."""
    inner = unwrap(model)
    found = _scan(inner)
    inventory = _INVENTORIES.get(inner)
    if inventory is None:
        if found:
            first = next(iter(found))
            raise ValueError(
                f"{first}: a hetmoe placeholder in a model hetmoe.sft has no inventory of (not prepared here)"
            )
        return {}
    appeared = sorted(set(found) - set(inventory))
    gone = sorted(set(inventory) - set(found))
    if appeared or gone:
        raise ValueError(
            f"placeholders changed since the model was prepared: appeared {appeared[:5]}, disappeared {gone[:5]} "
            f"({len(inventory)} expected)"
        )
    for name, p in found.items():
        shape, _ = inventory[name]
        if p.numel() != 0 or p.untyped_storage().nbytes() != 0:
            raise ValueError(
                f"{name}: a placeholder that now holds {p.untyped_storage().nbytes()} bytes (expected none)"
            )
        if tuple(getattr(p, "hetmoe_shape", ())) != shape:
            raise ValueError(f"{name}: placeholder shape {getattr(p, 'hetmoe_shape', None)}, inventory says {shape}")
        if p.requires_grad:
            raise ValueError(f"{name}: a placeholder that requires grad (it has no values to train)")
    return {n: s for n, (s, _) in inventory.items()}


@dataclass
class ParameterCounts:
    """``held``: elements the model's parameters store; ``logical``: what the architecture has
    (placeholders at their logical shape); ``trainable``: requires_grad; ``cpu_experts``: expert
    weights held by the CPU engine (logical elements) and ``cpu_expert_bytes`` their stored bytes."""

    held: int
    logical: int
    trainable: int
    cpu_experts: int
    cpu_expert_bytes: int


def parameter_counts(model: nn.Module) -> ParameterCounts:
    from .block import SFTMoE

    placeholders(model)  # the inventory check
    held = logical = trainable = 0
    for p in model.parameters():
        held += p.numel()
        logical += int(torch.Size(getattr(p, "hetmoe_shape", ())).numel()) if is_placeholder(p) else p.numel()
        trainable += p.numel() if p.requires_grad else 0
    blocks = [m for m in model.modules() if isinstance(m, SFTMoE)]
    return ParameterCounts(
        held,
        logical,
        trainable,
        sum(b.base.logical_params for b in blocks),
        sum(b.base.nbytes for b in blocks),
    )
