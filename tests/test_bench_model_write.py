"""The benchmark's models written straight into 4-bit files (hetmoe/bench/model_write.py), held
against the conventions by code that is not hetmoe's reader:

- the Q4_0 GGUF is read back by the ``gguf`` package (metadata, ggml types, llama.cpp's dimension
  order), its tensors dequantized by ``gguf.quants.dequantize`` and renamed by the package's own
  llama.cpp name map into a per-expert transformers checkpoint, which transformers loads and runs;
- the compressed-tensors directory is dequantized here from the format's published packing (value i
  of an int32 at bits 4i, stored code + 8, one bf16 scale per 32 weights) into the same kind of
  checkpoint.

hetmoe's load of each file must give transformers' logits on those weights. Bound: rel <= 5e-5
(``rel`` = max |a - b| / max |b|), as tests/test_gguf_model.py states for float32 models: the
weights are the same, and only summation order and the engine's int16-level activation quantization
(its integer dot products with the 4-bit codes) differ (measured: 3.4e-6 for the GGUF, 2.9e-6 for
the compressed-tensors directory). That is the arithmetic of the GEMVs and of the AVX-512/AVX2
GEMMs, which these tests select: on AMX, a prompt's 4-bit rows run as two int8 weight digits on a
row-wide grid (kernels_amx.cpp, gemm_digits_t), whose own bound tests/test_amx.py holds per element
(this model's logits measured 1.07e-4 there, where every dense 2-D weight is Q4_0 as well).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

import gguf
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file
from tiny_models import rel
from transformers import AutoModelForCausalLM

from hetmoe import load_model
from hetmoe.bench.model import ModelBenchConfig, format_table, run_bench
from hetmoe.bench.model_build import ModelShape
from hetmoe.bench.model_write import bpe_vocabulary, build_source
from hetmoe.models.tokenizer import load_tokenizer

TINY = ModelShape(layers=2, hidden=64, experts=8, intermediate=32, top_k=2, heads=4, kv_heads=2, head_dim=16, vocab=300)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("written-models")


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model(_ids()).logits.float()


def _transformers_on(state: dict[str, torch.Tensor], tmp: Path) -> torch.nn.Module:
    """transformers' Qwen3-MoE of TINY's config loading ``state`` (per-expert names, as the hub keeps them)."""
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
    TINY.config().save_pretrained(tmp)
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def test_q4_0_gguf_is_read_by_the_gguf_package_as_llama_cpp_lays_it_out(cache: Path) -> None:
    path = build_source(TINY, "q4_0-gguf", cache, log=lambda _: None)
    reader = gguf.GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "qwen3moe"
    assert field("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_0
    assert field("qwen3moe.block_count") == TINY.layers
    assert field("qwen3moe.expert_count") == TINY.experts and field("qwen3moe.expert_used_count") == TINY.top_k
    assert field("qwen3moe.expert_feed_forward_length") == TINY.intermediate
    assert field("qwen3moe.attention.key_length") == TINY.head_dim
    tensors = {t.name: t for t in reader.tensors}
    Q = gguf.GGMLQuantizationType
    # llama.cpp's dimension order (ne0 innermost): the experts are [in, out, experts]
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    assert gate.tensor_type == Q.Q4_0 and list(gate.shape) == [TINY.hidden, TINY.intermediate, TINY.experts]
    down = tensors["blk.1.ffn_down_exps.weight"]
    assert list(down.shape) == [TINY.intermediate, TINY.hidden, TINY.experts]
    # llama-quantize --pure Q4_0: every 2-D weight but the router in Q4_0, router and norms F32
    for name, t in tensors.items():
        want = Q.F32 if name.endswith("norm.weight") or "ffn_gate_inp" in name else Q.Q4_0
        assert t.tensor_type == want, name
    values = dequantize(gate.data, Q.Q4_0)
    assert np.isfinite(values).all()
    # codes uniform on 0..15 and scales uniform on 0.5..1.5 of 0.02 / rms(code - 8): std 0.02 * sqrt(13/12)
    assert values.std() == pytest.approx(0.02 * (13 / 12) ** 0.5, rel=0.05)


@pytest.mark.usefixtures("vector_arithmetic")
def test_q4_0_gguf_runs_as_transformers_runs_its_weights(cache: Path, tmp_path: Path) -> None:
    path = build_source(TINY, "q4_0-gguf", cache, log=lambda _: None)
    reader = gguf.GGUFReader(path)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, TINY.layers)
    hf_names = {}  # llama.cpp name -> transformers name, from the package's own map
    for hf in _hf_module_names():
        mapped = names.get_name(hf)
        assert mapped is not None, hf
        hf_names[mapped] = hf
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        stem, suffix = t.name.rsplit(".", 1)
        values = torch.tensor(dequantize(t.data, t.tensor_type), dtype=torch.float32)
        shape = tuple(int(d) for d in reversed(t.shape))  # back to row-major
        values = values.reshape(shape)
        if stem.endswith("_exps"):  # [experts, out, in] -> one tensor per expert
            layer = stem.split(".")[1]
            proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
            for e in range(TINY.experts):
                state[f"model.layers.{layer}.mlp.experts.{e}.{proj[stem.split('.')[2]]}.weight"] = values[e]
        else:
            state[f"{hf_names[stem]}.{suffix}"] = values
    want = _logits(_transformers_on(state, tmp_path / "reference"))
    ours = load_model(path, dtype=torch.float32)
    assert rel(_logits(ours), want) <= 5e-5


def _hf_module_names() -> list[str]:
    """transformers' Qwen3-MoE module names of TINY that llama.cpp stores one tensor each for."""
    out = ["model.embed_tokens", "model.norm", "lm_head"]
    for layer in range(TINY.layers):
        p = f"model.layers.{layer}."
        out += [p + "input_layernorm", p + "post_attention_layernorm", p + "mlp.gate"]
        out += [p + f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    return out


@pytest.mark.usefixtures("vector_arithmetic")
def test_int4_ct_directory_runs_as_its_published_packing_says(cache: Path, tmp_path: Path) -> None:
    path = build_source(TINY, "int4-ct", cache, log=lambda _: None)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"] and "lm_head" in qc["ignore"]
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        stored |= load_file(f)
    state = {}
    for name, t in stored.items():
        if name.endswith(".weight_packed"):
            stem = name.removesuffix(".weight_packed")
            words = t.to(torch.int64) & 0xFFFFFFFF
            codes = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(t.shape[0], -1) - 8
            scale = stored[stem + ".weight_scale"].float().repeat_interleave(32, dim=1)
            assert stored[stem + ".weight_shape"].tolist() == list(codes.shape)
            state[stem + ".weight"] = codes.float() * scale
        elif not name.endswith((".weight_scale", ".weight_shape")):
            state[name] = t.float()
    want = _logits(_transformers_on(state, tmp_path / "reference"))
    ours = load_model(path, dtype=torch.float32)
    assert rel(_logits(ours), want) <= 5e-5


def test_gguf_vocabulary_is_a_byte_level_bpe_both_tokenizers_read(cache: Path) -> None:
    tokens, types, merges = bpe_vocabulary(TINY.vocab)
    assert len(tokens) == len(set(tokens)) == TINY.vocab
    known = set(tokens)
    assert all(left in known and right in known and left + right in known for left, right in map(str.split, merges))
    assert types[-3:] == [3, 3, 3] and set(types[:-3]) == {1}
    tok = load_tokenizer(build_source(TINY, "q4_0-gguf", cache, log=lambda _: None))
    text = "def f(x):\n    return x + 1  # naïve café 東京"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < TINY.vocab
    assert tok.eos_token == "<|im_end|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="byte-level vocabulary of 100 tokens"):
        bpe_vocabulary(100)


def test_bench_measures_the_load_of_a_written_model(cache: Path) -> None:
    cfg = ModelBenchConfig(
        shape=TINY,
        source="q4_0-gguf",
        variants=("stored/default",),
        context=8,
        steps=2,
        prefill=(16,),
        repeats=1,
        cache_dir=cache,
        flush_bytes=1 << 20,
    )
    result = run_bench(cfg, log=lambda _: None)
    record = result["records"][0]
    assert record["experts"] == "stored" and record["dense"] == "load_model's default"
    load = record["load"]
    assert load["stored_gb"] == round(Path(result["model_path"]).stat().st_size / 1e9, 3)
    assert load["s"] > 0 and load["plain_read_s"] >= 0 and load["peak_rss_gb"] >= load["rss_after_gb"] > 0
    assert "load (the plain read just before it" in format_table(result)
    with pytest.raises(ValueError, match="needs --llama-gguf"):
        run_bench(ModelBenchConfig(shape=TINY, source="int4-ct", llama_bench=Path("llama-bench"), cache_dir=cache))
    with pytest.raises(ValueError, match="model source 'fp4'"):
        build_source(TINY, "fp4", cache)
