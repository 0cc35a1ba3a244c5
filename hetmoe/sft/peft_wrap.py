"""PEFT on a hetmoe training model: LoRA configs that name expert projections, adapters on disk.

``get_peft_model(model, config)`` is ``peft.get_peft_model`` with the checks hetmoe needs first:
the routed experts' LoRA hosts are per-expert Linear modules named like the architecture's
per-expert checkpoints (``experts.{e}.gate_proj`` ...; ``w1/w3/w2`` for Mixtral-style models), so
``target_modules=["gate_proj", "up_proj", "down_proj"]`` reaches every routed expert (and the shared
experts and dense MLPs, which train on the device as ordinary LoRA). A target written in the fused
spelling (``"gate_up_proj"``, ``"experts.gate_up_proj"``, in ``target_modules`` or PEFT's
``target_parameters``) is translated to the per-expert hosts, gate and up each getting its own
adapter. A config that reaches nothing is a clear error naming what it could have reached.

``save_adapter`` writes PEFT's own files (``adapter_model.safetensors``, ``adapter_config.json``)
into a temporary directory and renames it into place, so a crash never leaves half an adapter.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from ..checkpoint.atomic import atomic_dir
from .block import SFTMoE
from .placeholders import placeholders, unwrap

FUSED_TARGETS = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}


def sft_blocks(model: nn.Module) -> list[SFTMoE]:
    return [m for m in unwrap(model).modules() if isinstance(m, SFTMoE)]


def host_module_names(model: nn.Module) -> tuple[str, str, str]:
    blocks = sft_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(unwrap(model)).__name__}: no SFTMoE blocks; prepare the model first "
            "(hetmoe.sft.load_for_training or prepare_model)"
        )
    return blocks[0].experts.proj_names


def _translate(config: Any, names: tuple[str, str, str]) -> Any:
    """A copy of ``config`` with fused expert targets rewritten to the per-expert host names."""
    role_name = dict(zip(("gate", "up", "down"), names, strict=True))
    cfg = copy.deepcopy(config)
    targets = cfg.target_modules
    fused_params = [t for t in (cfg.target_parameters or []) if t.split(".")[-1] in FUSED_TARGETS]
    others = [t for t in (cfg.target_parameters or []) if t not in fused_params]
    if others:
        raise ValueError(
            f"target_parameters {others}: hetmoe trains routed experts through per-expert LoRA hosts; name them in "
            f"target_modules ({', '.join(names)})"
        )
    if isinstance(targets, str):
        if fused_params:
            raise ValueError(
                "target_modules is a regex: write the expert projections into it instead of target_parameters"
            )
        return cfg
    wanted = set(targets or [])
    for t in list(wanted) + fused_params:
        leaf = t.split(".")[-1]
        if leaf in FUSED_TARGETS and (t.startswith("experts.") or t == leaf or ".experts." in f".{t}"):
            wanted.discard(t)
            wanted.update(role_name[r] for r in FUSED_TARGETS[leaf])
    cfg.target_modules = sorted(wanted)
    cfg.target_parameters = None
    return cfg


def _matches(config: Any, name: str) -> bool:
    targets = config.target_modules
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets or [])


@contextlib.contextmanager
def per_expert_targets() -> Iterator[None]:
    """Keep PEFT from rewriting per-expert targets into fused ``target_parameters``.

    PEFT (for transformers 5) converts a config naming ``gate_proj``/``up_proj`` of an MoE model
    into LoRA on the fused ``experts.gate_up_proj`` parameter, so that adapters trained on the
    per-expert transformers 4 layout load into fused models (and it rewrites the adapter's state
    dict the same way when loading). A hetmoe model really has per-expert modules (the LoRA hosts),
    so neither rewrite may happen here; outside this block (e.g. PEFT
    loading a hetmoe adapter into a plain transformers model) the conversion applies as usual.
    """
    try:
        from peft.utils import transformers_weight_conversion as conv
    except ImportError:  # a PEFT without the conversion: nothing to suspend
        yield
        return
    originals = (conv.convert_peft_config_for_transformers, conv.convert_peft_adapter_state_dict_for_transformers)
    conv.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    conv.convert_peft_adapter_state_dict_for_transformers = lambda *args, adapter_state_dict, **kwargs: (
        adapter_state_dict
    )
    try:
        yield
    finally:
        conv.convert_peft_config_for_transformers, conv.convert_peft_adapter_state_dict_for_transformers = originals


def get_peft_model(model: nn.Module, config: Any, adapter_name: str = "default", **kwargs: Any) -> Any:
    """``peft.get_peft_model`` for a model prepared by hetmoe.sft (see the module docstring)."""
    import peft

    names = host_module_names(model)
    cfg = _translate(config, names)
    module_names = [n for n, _ in unwrap(model).named_modules()]
    hosts = [n for n in module_names if re.search(r"\.experts\.\d+\.[^.]+$", n) and n.rsplit(".", 1)[1] in names]
    reached = [n for n in module_names if n and _matches(cfg, n)]
    if not reached:
        raise ValueError(
            f"LoRA target_modules {config.target_modules!r} match no module of this model; the routed experts' "
            f"projections are named {list(names)} (e.g. {hosts[0] if hosts else '-'}), other candidates: "
            f"{sorted({n.rsplit('.', 1)[-1] for n in module_names if n.endswith('_proj')})}"
        )
    with per_expert_targets():
        peft_model = peft.get_peft_model(model, cfg, adapter_name=adapter_name, **kwargs)
    placeholders(peft_model)  # the inventory still holds after PEFT's module surgery
    return peft_model


def load_adapter(model: nn.Module, directory: str | Path, is_trainable: bool = False, **kwargs: Any) -> Any:
    """``PeftModel.from_pretrained`` of a saved adapter onto a model prepared by hetmoe.sft."""
    from peft import PeftModel

    host_module_names(model)
    with per_expert_targets():
        peft_model = PeftModel.from_pretrained(model, str(directory), is_trainable=is_trainable, **kwargs)
    placeholders(peft_model)
    return peft_model


def expert_lora_reached(model: nn.Module) -> int:
    """How many routed-expert projections carry a LoRA layer (0: the experts are not adapted)."""
    count = 0
    for block in sft_blocks(model):
        for ex in block.experts:
            count += sum(hasattr(getattr(ex, n), "lora_A") for n in block.experts.proj_names)
    return count


def write_adapter(peft_model: Any, directory: str | Path) -> None:
    """PEFT's ``save_pretrained`` into ``directory`` (the placeholder inventory checked first)."""
    placeholders(peft_model)
    peft_model.save_pretrained(str(directory))


def save_adapter(peft_model: Any, directory: str | Path) -> Path:
    """``write_adapter``, atomically: into a temporary directory that then replaces ``directory``."""
    target = Path(directory)
    with atomic_dir(target) as tmp:
        write_adapter(peft_model, tmp)
    return target
