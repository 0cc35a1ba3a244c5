"""The memory planner against what loading actually holds, and its verdicts under fake limits."""

import json

import pytest
import torch

from hetmoe.checkpoint.safetensors_file import SafetensorsFile
from hetmoe.cli.main import main
from hetmoe.models import planner
from hetmoe.models.planner import DEVICE_RESERVE, RAM_RESERVE, PlanError, parse_size, plan_memory
from hetmoe.runtime.cpu_linear import CPULinear

GiB = 2**30


def _loaded_non_expert_bytes(model) -> int:
    """Bytes of the non-expert weights a loaded model holds: tensors, and CPULinear's stored codes."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(m.weight_q.nbytes for m in model.modules() if isinstance(m, CPULinear))


@pytest.mark.parametrize(("method", "dense_method"), [(None, None), ("int4", "int8"), ("int8", "gguf:q4_0")])
def test_bytes_match_the_loaded_model(tiny_cache, method, dense_method) -> None:
    from hetmoe import load_model

    path = tiny_cache.model("qwen3_moe")
    plan = plan_memory(path, method, dense_method, ram="64GiB")
    model = load_model(path, method, dense_method=dense_method)
    assert plan.cpu_expert_bytes == model.hetmoe.cpu_expert_bytes
    assert plan.dense_bytes == _loaded_non_expert_bytes(model)
    if dense_method:
        linear = sum(m.weight_q.nbytes for m in model.modules() if isinstance(m, CPULinear))
        assert plan.dense_linear_bytes == linear > 0
    assert plan.expert_device_bytes == 3 * 64 * 32 * 2  # gate, up, down of hidden 64 x 32 in bf16


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3", "deepseek_v2"])
def test_kv_bytes_per_token_match_transformers_cache(tiny_cache, model_type, tmp_path) -> None:
    from hetmoe import load_model

    path = tiny_cache.model(model_type)
    config = json.loads((path / "config.json").read_text())
    if config.get("qk_rope_head_dim") not in (None, config.get("head_dim")):
        # transformers' DeepSeek-V3 rotary tables are head_dim wide: the tiny config's 16 against its
        # rope dimension 8 fails in transformers itself; head_dim = qk_rope_head_dim, as its config derives
        path = tiny_cache.copy(path, tmp_path / model_type)
        (path / "config.json").write_text(json.dumps(config | {"head_dim": config["qk_rope_head_dim"]}))
    plan = plan_memory(path, ram="64GiB")
    model = load_model(path)
    tokens = 8  # below gpt-oss's tiny sliding window, so every layer caches every token
    with torch.no_grad():
        cache = model(torch.arange(tokens).unsqueeze(0), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert plan.kv_bytes_per_token * tokens == held
    c = model.config
    if model_type.startswith("deepseek"):  # MLA: one latent row a token and layer, nothing per head
        assert plan.kv_bytes_per_token == (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * c.num_hidden_layers


def test_check_refuses_what_does_not_fit_with_the_numbers(tiny_cache) -> None:
    path = tiny_cache.model("qwen3_moe")
    ok = plan_memory(path, "int4", "int8", ram="4GiB")
    assert ok.check() is ok and not ok.problems()
    # The RAM need is the reserve (1 GiB + 5%) plus a few hundred KiB of model: 1 GiB cannot hold it.
    small = plan_memory(path, "int4", "int8", ram="1GiB")
    with pytest.raises(PlanError, match=r"will not fit: RAM: needs 1\.\d\d GiB .*routed experts .*has 1\.00 GiB given"):
        small.check()
    expected_need = small.cpu_expert_bytes + small.dense_bytes + small.kv_bytes + small.conversion_bytes
    expected_need += RAM_RESERVE[0] + int(RAM_RESERVE[1] * GiB)
    assert small.ram_need == expected_need


def test_device_experts_and_kv_tokens(tiny_cache) -> None:
    path = tiny_cache.model("qwen3_moe")
    memory = 2 * GiB
    plan = plan_memory(path, "int4", device="cuda", device_memory=memory, ram="64GiB", gpu_experts=3, context=1000)
    reserve = DEVICE_RESERVE[0] + int(DEVICE_RESERVE[1] * memory)
    per_expert_all_layers = 2 * 3 * 64 * 32 * 2  # 2 MoE layers, bf16
    free_for_experts = memory - reserve - plan.dense_bytes - 1000 * plan.kv_bytes_per_token
    assert plan.max_gpu_experts == min(8, free_for_experts // per_expert_all_layers) == 8
    free_for_kv = memory - reserve - plan.dense_bytes - 3 * per_expert_all_layers
    assert plan.kv_tokens == free_for_kv // plan.kv_bytes_per_token
    assert plan.check() is plan
    tight = plan_memory(path, device="cuda", device_memory="800MiB", ram="64GiB", gpu_experts=8)
    with pytest.raises(PlanError, match=r"device cuda: needs .* has 800\.00 MiB"):
        tight.check()


def test_load_model_checks_before_reading_any_weight(tiny_cache, monkeypatch) -> None:
    from hetmoe import load_model

    path = tiny_cache.model("qwen3_moe")
    monkeypatch.setattr(planner, "available_ram", lambda: 512 * 2**20)

    def no_reads(self, name):
        raise AssertionError(f"read {name} before the memory check")

    with monkeypatch.context() as m:
        m.setattr(SafetensorsFile, "get", no_reads)
        with pytest.raises(PlanError, match="will not fit: RAM"):
            load_model(path, "int4")
    model = load_model(path, "int4", check_memory=False)  # the caller may take the risk
    assert model.hetmoe.cpu_expert_bytes > 0


def test_sizes_and_bad_input(tiny_cache) -> None:
    assert parse_size("24GiB") == 24 * GiB
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="ram: expected a size such as 24GiB"):
        plan_memory(tiny_cache.model("qwen3_moe"), ram="lots")
    with pytest.raises(ValueError, match="device_memory is for a GPU device"):
        plan_memory(tiny_cache.model("qwen3_moe"), device_memory="8GiB")
    with pytest.raises(ValueError, match="dense_method"):
        plan_memory(tiny_cache.model("qwen3_moe"), dense_method="int3")


def test_cli_plan_prints_the_table_and_exits_1_when_it_does_not_fit(tiny_cache, capsys) -> None:
    path = str(tiny_cache.model("qwen3_moe"))
    assert main(["plan", path, "--method", "int4", "--dense-method", "int8", "--ram", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per token" in out and "verdict" in out and "fits" in out
    assert main(["plan", path, "--ram", "1GiB"]) == 1
    assert "DOES NOT FIT: RAM" in capsys.readouterr().out
