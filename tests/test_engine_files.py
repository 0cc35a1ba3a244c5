"""Experts straight from real checkpoint layouts into the engine, and what that costs in memory.

Each stored precision is read by the checkpoint layer (DeepSeek fp8 blocks, Kimi-K2 compressed-tensors
int4, GPTQ, gpt-oss mxfp4 with its clamped SwiGLU and biases, GGUF with mixed block types) and run
through CPUExperts; the output is held against the float64 reference built from the same stored
bytes, dequantized by the codecs.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_models import make_gptq

from hetmoe.checkpoint import open_source
from hetmoe.checkpoint.config import read_config
from hetmoe.checkpoint.experts import read_layer_experts
from hetmoe.checkpoint.layout import moe_layout
from hetmoe.formats import get_codec
from hetmoe.kernels import moe_forward_reference
from hetmoe.runtime import CPUExperts


def _run_layers(path: Path, bound: float, **kw) -> list[str]:
    source = open_source(path)
    layout = moe_layout(read_config(path), source)
    methods = []
    for layer in layout.moe_layers:
        le = read_layer_experts(source, layout, layer)
        biases = {
            f"{p}_bias": b
            for p, b in (("gate", le.gate_bias), ("up", le.up_bias), ("down", le.down_bias))
            if b is not None
        }
        ce = CPUExperts(le.gate, le.up, le.down, **kw, **biases, verbose=False)
        methods.append(ce.method if ce.method != "mixed" else "+".join(q.method for q in (le.gate, le.up, le.down)))
        deq = [get_codec(q.method, **q.params).dequantize(q) for q in (le.gate, le.up, le.down)]
        g = torch.Generator().manual_seed(layer)
        for tokens in (1, 19):
            ids = torch.randint(0, ce.experts, (tokens, 2), generator=g)
            x = torch.randn(tokens, ce.hidden, generator=g)
            w = torch.rand(tokens, 2, generator=g)
            ref = moe_forward_reference(x, *deq, ids, w, **kw, **biases)
            err = float((ce.forward(x, ids, w).double() - ref.double()).norm() / ref.double().norm())
            assert err < bound, (path.name, layer, tokens, err)
    return methods


def test_deepseek_fp8_from_files(tiny_cache) -> None:
    assert set(_run_layers(tiny_cache.fp8(), 1e-5)) == {"fp8"}


def test_kimi_int4_from_files(tiny_cache) -> None:
    assert set(_run_layers(tiny_cache.int4(), 3e-4)) == {"int4"}


def test_gptq_from_files(tiny_cache, tmp_path: Path) -> None:
    path = make_gptq(tiny_cache.model("qwen3_moe"), tmp_path / "gptq", group_size=32, sym=False)
    assert set(_run_layers(path, 3e-4)) == {"gptq"}


def test_gpt_oss_mxfp4_from_files(tiny_cache) -> None:
    cfg = json.loads((tiny_cache.mxfp4() / "config.json").read_text())
    kw = {"activation": "swiglu-oai", "alpha": 1.702, "limit": float(cfg.get("swiglu_limit", 7.0))}
    assert set(_run_layers(tiny_cache.mxfp4(), 3e-4, **kw)) == {"mxfp4"}


def test_gguf_mixed_types_from_file(tiny_cache) -> None:
    methods = _run_layers(tiny_cache.gguf(), 3e-4)
    assert methods == ["gguf:q4_k+gguf:q4_k+gguf:q6_k", "gguf:q8_0+gguf:q5_k+gguf:q4_k"]


# ---- memory: loading holds each expert once, plus a bounded working set ----

LAYERS, EXPERTS, HIDDEN, INTER = 6, 32, 512, 256
PEAK_SCRIPT = textwrap.dedent(
    """
    import sys, json
    from pathlib import Path
    import torch
    from hetmoe.checkpoint import open_source
    from hetmoe.checkpoint.config import read_config
    from hetmoe.checkpoint.experts import read_layer_experts
    from hetmoe.checkpoint.layout import moe_layout
    from hetmoe.models.loader import release_freed_memory
    from hetmoe.runtime import CPUExperts

    def rss():
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    def high_water():
        # VmHWM belongs to this process image (ru_maxrss would carry the parent's peak across exec)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    path = Path(sys.argv[1])
    CPUExperts(torch.randn(2, 32, 64), torch.randn(2, 32, 64), torch.randn(2, 64, 32), "int4")  # warm the engine
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    base = rss()
    source = open_source(path)
    layout = moe_layout(read_config(path), source)
    layers = []
    for layer in layout.moe_layers:
        le = read_layer_experts(source, layout, layer)
        release_freed_memory()  # where load_model hands the heap's freed temporaries back
        layers.append(CPUExperts(le.gate, le.up, le.down, verbose=False))
        release_freed_memory()
        x = torch.randn(8, layout.hidden_size)
        ids = torch.randint(0, layout.num_experts, (8, 2))
        layers[-1].forward(x, ids, torch.rand(8, 2))  # touch the weights
    stored = sum(ce.nbytes for ce in layers)
    peak = high_water()
    print(json.dumps({"base": base, "end": rss(), "peak": peak, "stored": stored}))
    """
)


def _fp8_per_expert_checkpoint(path: Path) -> Path:
    """A DeepSeek-style fp8 checkpoint with per-expert tensors (the form the hub files have)."""
    codec = get_codec("fp8")
    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for proj, shape in (
                ("gate_proj", (INTER, HIDDEN)),
                ("up_proj", (INTER, HIDDEN)),
                ("down_proj", (HIDDEN, INTER)),
            ):
                prefix = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                state.update(codec.quantize(torch.randn(shape, generator=g) * 0.02).state_dict(prefix))
    path.mkdir()
    save_file(state, path / "model.safetensors")
    config = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": HIDDEN,
        "moe_intermediate_size": INTER,
        "intermediate_size": 2 * INTER,
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": 2,
        "num_hidden_layers": LAYERS,
        "first_k_dense_replace": 0,
        "n_shared_experts": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_loading_holds_each_expert_once(tmp_path: Path) -> None:
    path = _fp8_per_expert_checkpoint(tmp_path / "fp8")
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    stored = m["stored"]
    assert stored > 40e6  # the bound below must be meaningful: experts dwarf the allowance
    # The working set: one layer being stacked and validated (its copy, the mapped pages it is read
    # from until they are released, validation temporaries) and the allocator's slack; it does not
    # grow with the number of layers, which is what makes the bound meaningful.
    per_layer = stored / LAYERS
    allowance = 3 * per_layer + 32e6
    assert m["peak"] - m["base"] < stored + allowance, m
    assert m["end"] - m["base"] < stored + allowance, m
