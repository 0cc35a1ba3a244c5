"""Expert extraction from transformers modules, placeholders, memory held, loading experts for
training in their stored precision, and the clear errors for bad inputs."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from test_sft_support import runnable
from torch import nn
from torch.nn.utils import parametrize

import hetmoe.sft.frozen as frozen_mod
from hetmoe.sft import load_for_training, parameter_counts, placeholders, prepare_model
from hetmoe.sft.data import read_chat_jsonl
from hetmoe.sft.extract import extract_experts
from hetmoe.sft.memory import held_bytes
from hetmoe.sft.peft_wrap import get_peft_model

E, H, INTER = 4, 64, 32


class _MLP(nn.Module):
    def __init__(self, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(H, INTER, bias=False))
        setattr(self, names[1], nn.Linear(H, INTER, bias=False))
        setattr(self, names[2], nn.Linear(INTER, H, bias=False))


def _per_expert(names: tuple[str, str, str]) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([_MLP(names) for _ in range(E)])


def _stack(experts: nn.ModuleList, name: str) -> torch.Tensor:
    return torch.stack([getattr(m, name).weight.detach() for m in experts])


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_per_expert_lists(names) -> None:
    experts = _per_expert(names)
    ex = extract_experts(experts, "mlp.experts.")
    for got, name in zip((ex.gate, ex.up, ex.down), names, strict=True):
        assert torch.equal(got, _stack(experts, name))
    assert ex.layout == "per_expert" and ex.names == names
    assert ex.sources[0].name == f"mlp.experts.0.{names[0]}.weight"


def test_peft_wrapped_and_parametrized() -> None:
    from peft import LoraConfig
    from peft import get_peft_model as peft_get

    holder = nn.Module()
    holder.experts = _per_expert(("gate_proj", "up_proj", "down_proj"))
    want = {n: _stack(holder.experts, n).clone() for n in ("gate_proj", "up_proj", "down_proj")}

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    parametrize.register_parametrization(holder.experts[1].down_proj, "weight", Double())
    wrapped = peft_get(holder, LoraConfig(r=2, target_modules=["gate_proj"]))
    ex = extract_experts(wrapped.base_model.model.experts, "experts.")
    assert torch.equal(ex.gate, want["gate_proj"])  # the base layer under PEFT's LoRA
    want_down = want["down_proj"].clone()
    want_down[1] *= 2  # the parametrized value
    assert torch.equal(ex.down, want_down)
    assert "experts.0.gate_proj.base_layer.weight" in [s.name for s in ex.sources]


def test_gpt_oss_layout_matches_transformers(tiny_cache) -> None:
    """gpt-oss's transposed, interleaved gate/up with biases and its clamped SwiGLU: same logits."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_cache.model("gpt_oss"), dtype=torch.float32).eval()
    ours = prepare_model(copy.deepcopy(ref), "bf16")
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in placeholders(ours)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    assert float((a - b).norm() / a.norm()) < 1e-4


def _fake_partition(experts: nn.ModuleList) -> dict[int, torch.Tensor]:
    """ZeRO-3's look: empty local data plus ds_id/ds_status/ds_shape; returns the full values by id."""
    full = {}
    for i, p in enumerate(experts.parameters()):
        full[id(p)] = p.data.clone()
        p.ds_id, p.ds_status, p.ds_shape = i, "NOT_AVAILABLE", tuple(p.shape)
        p.data = torch.empty(0)
    return full


def test_zero3_partitioned_parameters_are_gathered(monkeypatch) -> None:
    experts = _per_expert(("gate_proj", "up_proj", "down_proj"))
    want = _stack(experts, "gate_proj").clone()
    full = _fake_partition(experts)
    calls: list[int] = []

    @contextlib.contextmanager
    def gather(params):
        calls.append(len(params))
        for p in params:
            p.data = full[id(p)]
        try:
            yield
        finally:
            for p in params:
                p.data = torch.empty(0)

    ex = extract_experts(experts, "experts.", gather=gather)
    assert torch.equal(ex.gate, want)
    assert calls == [1] * (3 * E)  # one expert module's Linear at a time
    assert all(p.numel() == 0 for p in experts.parameters())  # partitioned again afterwards
    # as without deepspeed (a dev dependency; tests/test_sft_zero3.py gathers with it for real)
    monkeypatch.setattr("hetmoe.sft.zero3.deepspeed_gather", lambda: None)
    with pytest.raises(
        ValueError, match=r"experts\.0\.gate_proj\.weight: partitioned by DeepSpeed ZeRO-3.*not installed"
    ):
        extract_experts(experts, "experts.")


def test_bad_weights_are_refused(tiny_cache) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_cache.model("qwen3_moe")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: on the meta device"):
        prepare_model(meta)
    model = AutoModelForCausalLM.from_pretrained(path)
    prepare_model(model)
    with pytest.raises(ValueError, match="already prepared"):
        prepare_model(model)
    experts = _per_expert(("gate_proj", "up_proj", "down_proj"))
    experts[2].up_proj.weight = nn.Parameter(torch.empty(0))
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj\.weight: a zero-storage tensor"):
        extract_experts(experts, "experts.")
    with pytest.raises(ValueError, match=r"match no module.*gate_proj"):
        from peft import LoraConfig

        get_peft_model(model, LoraConfig(target_modules=["nope"]))
    hosted = model.model.layers[0].mlp.experts[0].gate_proj
    with pytest.raises(RuntimeError, match="only hosts the LoRA"):
        hosted(torch.zeros(1, H))


def test_placeholder_inventory_and_counts(tiny_cache) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_cache.model("qwen3_moe"))
    logical_before = sum(p.numel() for p in model.parameters())
    prepare_model(model, "int8")
    found = placeholders(model)
    assert found["model.layers.1.mlp.experts.gate_up_proj"] == (8, 64, 64)
    counts = parameter_counts(model)
    assert counts.logical == logical_before
    assert counts.held == logical_before - counts.cpu_experts
    assert counts.cpu_expert_bytes < counts.cpu_experts * 2  # int8 codes + scales, below bf16
    experts = model.model.layers[1].mlp.experts
    original = experts.gate_up_proj
    experts.gate_up_proj = nn.Parameter(torch.zeros(8, 64, 64), requires_grad=False)  # re-materialised
    with pytest.raises(ValueError, match=r"disappeared \['model\.layers\.1\.mlp\.experts\.gate_up_proj'\]"):
        placeholders(model)
    experts.gate_up_proj = original
    placeholders(model)
    from hetmoe.sft.placeholders import make_placeholder

    model.model.layers[1].mlp.register_parameter("stray", make_placeholder((3, 3), torch.bfloat16))
    with pytest.raises(ValueError, match=r"appeared \['model\.layers\.1\.mlp\.stray'\]"):
        placeholders(model)


def test_memory_holds_each_expert_once(tiny_cache, monkeypatch) -> None:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_cache.model("qwen3_moe"))
    before = held_bytes(model)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    assert expert_bytes > before / 2  # experts dominate this model, so a second copy could not hide
    originals = [weakref.ref(p) for n, p in model.named_parameters() if ".experts." in n]
    prepare_model(model, "bf16")
    gc.collect()
    assert all(r() is None for r in originals), "the model's original expert tensors are still alive"
    assert held_bytes(model) == before  # same bytes: experts now live once, in the CPU engine's base

    # During a training step no more than one expert (3 matrices) exists dequantized at a time.
    live, peak = [0], [0]
    real = frozen_mod.dequantize_one

    def tracked(q, e):
        t = real(q, e)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(t, lambda: live.__setitem__(0, live[0] - 1))
        return t

    monkeypatch.setattr(frozen_mod, "dequantize_one", tracked)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    ids = torch.randint(0, 128, (2, 16))
    peft_model(ids, labels=ids).loss.backward()
    assert peak[0] == 3, f"{peak[0]} dequantized expert matrices alive at once (one expert: 3)"
    lora_bytes = sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if "lora_" in n)
    assert held_bytes(peft_model) - before == lora_bytes  # the adapters are all that was added


@pytest.mark.parametrize("kind", ["fp8", "int4", "int8-store"])
def test_training_from_stored_precision(tiny_cache, tmp_path, kind) -> None:
    """Experts read from the checkpoint in their stored precision: no full-precision base."""
    from peft import LoraConfig

    from hetmoe.checkpoint.convert import convert

    if kind == "fp8":
        path, method = tiny_cache.fp8(), "fp8"
    elif kind == "int4":
        path, method = tiny_cache.int4(), "int4"
    else:
        path = tmp_path / "store"
        convert(runnable(tiny_cache, "deepseek_v3"), path, "int8", progress=False)
        method = "int8"
    cfg = json.loads((Path(path) / "config.json").read_text())
    if cfg.get("qk_rope_head_dim") and cfg.get("head_dim") != cfg["qk_rope_head_dim"]:
        cfg["head_dim"] = cfg["qk_rope_head_dim"]  # transformers' DeepSeek-V3 rotary (see test_sft_support)
        path = tiny_cache.copy(Path(path), tmp_path / "fixed")
        (path / "config.json").write_text(json.dumps(cfg))
    model = load_for_training(path, dtype="float32")
    block = model.model.layers[1].mlp
    assert block.base.method == method
    codes = next(iter(block.base.gate.tensors.values()))  # the stored codes, not a float copy
    assert codes.dtype in (torch.float8_e4m3fn, torch.int8, torch.int32, torch.uint8), codes.dtype
    assert "model.layers.1.mlp.experts.gate_up_proj" in placeholders(model)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"]))
    ids = torch.randint(0, 128, (1, 12))
    peft_model(ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "experts.3.gate_proj.lora_B" in n]
    assert grads and all(g is not None for g in grads)


def test_chat_data_errors(tmp_path) -> None:
    f = tmp_path / "d.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    cases = {
        f"{good}\n\n{{bad": r"d\.jsonl:3: invalid JSON",
        f'{good}\n{{"text": "x"}}': r'd\.jsonl:2: expected an object with a "messages" list',
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}): r"d\.jsonl:1: no assistant turn",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}): r"messages\[0\]\.role: expected one of",
        "": r"no conversations",
    }
    for text, pattern in cases.items():
        f.write_text(text)
        with pytest.raises(ValueError, match=pattern):
            read_chat_jsonl(f)
