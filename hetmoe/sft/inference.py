"""A saved LoRA adapter on a ``hetmoe.load_model`` model, for inference.

``apply_adapter(model, adapter_dir)`` reads PEFT's ``adapter_config.json`` and
``adapter_model.safetensors`` and puts every adapter where the training put it:

- routed experts (``...mlp.experts.{e}.{gate_proj|up_proj|down_proj}``, or ``w1/w3/w2``): the layer's
  CPU backend becomes ``LoRAExpertsBackend``, which computes each routed expert on the CPU from
  its stored weights (dequantized one expert at a time) with the LoRA terms -- the same function
  the training ran, so the outputs match the trained model's. The compiled engine cannot add a
  low-rank term inside the expert MLP, so these layers run on the per-expert torch path;
- any other Linear module (attention, shared experts, dense MLPs): wrapped by ``LoRALinear``, which
  adds ``scaling * B(A(x))`` in the adapter's dtype exactly as PEFT's ``lora.Linear`` does.

``load_model`` itself cannot take the adapter (models sit below sft in the layering); this is the
separate step. Every key of the file must find its module, or nothing is changed and the error
says which did not.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..runtime.hybrid import HybridMoE
from .frozen import PROJECTIONS, FrozenExperts, activation_name
from .function import ExpertLoRA, LoRAFactors, check_lora, routed_experts
from .hosts import host_names

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)$")


class LoRAExpertsBackend:
    """CPUExperts' submit/wait interface over a frozen base plus LoRA, computed at submit (torch)."""

    def __init__(self, base: FrozenExperts, lora: ExpertLoRA) -> None:
        self.base, self.lora = base, lora
        self.gate, self.up, self.down = base.gate, base.up, base.down
        self.experts = base.num_experts
        self.method = base.method
        self.isa = "torch (LoRA experts)"
        self._results: dict[int, torch.Tensor] = {}
        self._next = 0

    def set_mask(self, mask: torch.Tensor) -> None:
        if bool(mask.any()):
            raise ValueError("experts with a LoRA adapter must all run on the CPU side (load with gpu_experts=0)")

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
        with torch.no_grad():
            y = routed_experts(x, topk_ids, topk_weights, self.base, self.lora)
        self._next += 1
        self._results[self._next] = y.to(x.dtype)
        return self._next

    def wait(self, handle: int) -> torch.Tensor:
        if handle not in self._results:
            raise ValueError(f"handle {handle!r} is not pending on this LoRAExpertsBackend")
        return self._results.pop(handle)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.wait(self.submit(x, topk_ids, topk_weights))


class LoRALinear(nn.Module):
    """``base(x) + scaling * B(A(x))``, the adapter in its own dtype, as PEFT's lora.Linear computes it."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Parameter(a.to(base.weight.device), requires_grad=False)
        self.lora_B = nn.Parameter(b.to(base.weight.device), requires_grad=False)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        dtype = result.dtype
        xa = x.to(self.lora_A.dtype)
        result = result + (xa @ self.lora_A.T) @ self.lora_B.T * self.scaling
        return result.to(dtype)


def read_adapter(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    d = Path(directory)
    cfg_path, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
    for f in (cfg_path, weights):
        if not f.is_file():
            raise ValueError(f"{d}: not a PEFT adapter directory (missing {f.name})")
    config = json.loads(cfg_path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type: expected 'LORA', found {config.get('peft_type')!r}")
    for field, empty in (("rank_pattern", {}), ("alpha_pattern", {}), ("modules_to_save", None)):
        if config.get(field) not in (empty, None, {}, []):
            raise ValueError(f"{cfg_path}: {field} is not supported by apply_adapter (found {config[field]!r})")
    for field in ("use_dora", "lora_bias", "target_parameters"):
        if config.get(field):
            raise ValueError(f"{cfg_path}: {field} is not supported by apply_adapter (found {config[field]!r})")
    return config, load_file(str(weights))


def _scaling(config: dict[str, Any]) -> float:
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def apply_adapter(model: nn.Module, directory: str | Path) -> nn.Module:
    """Put the PEFT adapter in ``directory`` on ``model`` (from ``hetmoe.load_model``); returns it."""
    config, state = read_adapter(directory)
    scaling = _scaling(config)
    runtime = getattr(model, "hetmoe", None)
    if runtime is None:
        raise ValueError(f"{type(model).__name__}: expected a model from hetmoe.load_model (it has no .hetmoe)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{directory}: tensor {key}: expected a LoRA weight '<module>.lora_A/B.weight'")
        module = re.sub(r"^base_model\.model\.", "", m["module"])
        pairs.setdefault(module, {})[m["ab"]] = t
    experts: dict[str, dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
    dense: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{directory}: {module}: expected lora_A and lora_B, found {sorted(ab)}")
        em = _EXPERT.match(module)
        if em is not None and isinstance(_get(model, em["block"]), HybridMoE):
            experts.setdefault(em["block"], {}).setdefault(em["proj"], {})[int(em["e"])] = (ab["A"], ab["B"])
        else:
            dense.append((module, ab["A"], ab["B"]))
    plans = [_expert_plan(model, block, per_proj, scaling, directory) for block, per_proj in experts.items()]
    wraps = [_dense_plan(model, name, a, b, directory) for name, a, b in dense]
    # Everything checked: now change the model.
    for hybrid, backend in plans:
        hybrid.cpu = backend
    for parent, leaf, base, a, b in wraps:
        setattr(parent, leaf, LoRALinear(base, a, b, scaling))
    runtime.notes.append(
        f"LoRA adapter {Path(directory).name}: {len(plans)} MoE layers' experts on the per-expert torch path, "
        f"{len(wraps)} other modules adapted"
    )
    return model


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _expert_plan(
    model: nn.Module,
    block: str,
    per_proj: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]],
    scaling: float,
    directory: str | Path,
) -> tuple[HybridMoE, LoRAExpertsBackend]:
    hybrid = model.get_submodule(block)
    assert isinstance(hybrid, HybridMoE) and hybrid.cpu is not None
    if hybrid.device_ids:
        raise ValueError(f"{block}: experts {hybrid.device_ids} are on the device; load with gpu_experts=0 for LoRA")
    adapter = hybrid.adapter
    names = host_names(adapter.name)
    cpu = hybrid.cpu
    base = FrozenExperts(cpu.gate, cpu.up, cpu.down, adapter.activation, activation_name(adapter), dict(hybrid.biases))
    factors: dict[str, LoRAFactors] = {}
    for proj, experts in per_proj.items():
        if proj not in names:
            raise ValueError(f"{directory}: {block}.experts.*.{proj}: expected a projection named one of {list(names)}")
        role = PROJECTIONS[names.index(proj)]
        bad = [e for e in experts if e >= base.num_experts]
        if bad:
            raise ValueError(f"{directory}: {block}: expert {bad[0]} >= the layer's {base.num_experts} experts")
        a0, b0 = next(iter(experts.values()))
        a = torch.stack([experts[e][0] if e in experts else a0.new_zeros(a0.shape) for e in range(base.num_experts)])
        b = torch.stack([experts[e][1] if e in experts else b0.new_zeros(b0.shape) for e in range(base.num_experts)])
        factors[role] = LoRAFactors(a, b, scaling)
    lora = ExpertLoRA(**factors)
    try:
        check_lora(base, lora)
    except ValueError as exc:
        raise ValueError(f"{directory}: {block}: {exc}") from None
    return hybrid, LoRAExpertsBackend(base, lora)


def _dense_plan(
    model: nn.Module, name: str, a: torch.Tensor, b: torch.Tensor, directory: str | Path
) -> tuple[nn.Module, str, nn.Linear, torch.Tensor, torch.Tensor]:
    base = _get(model, name)
    if not isinstance(base, nn.Linear):
        found = type(base).__name__ if base is not None else "nothing"
        raise ValueError(f"{directory}: {name}: expected a Linear module to adapt, found {found}")
    if tuple(a.shape) != (a.shape[0], base.in_features) or tuple(b.shape) != (base.out_features, a.shape[0]):
        raise ValueError(
            f"{directory}: {name}: LoRA A {list(a.shape)} / B {list(b.shape)} do not fit a Linear "
            f"{base.in_features} -> {base.out_features}"
        )
    parent_name, _, leaf = name.rpartition(".")
    return model.get_submodule(parent_name), leaf, base, a, b
