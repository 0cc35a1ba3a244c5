"""Malformed checkpoints: every one is a CheckpointError that names the file and says what is wrong.

Each case copies a tiny checkpoint from the session cache, breaks one thing, and reads every MoE
layer; the message must contain the listed words (the tensor or file at fault, what was
expected, what was found), so a user can act on it without a debugger.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import TinyCache, load_state, make_gguf, read_json, write_checkpoint

from hetmoe.checkpoint import CheckpointError, open_source
from hetmoe.checkpoint.config import read_config
from hetmoe.checkpoint.experts import read_layer_experts
from hetmoe.checkpoint.layout import moe_layout
from hetmoe.checkpoint.quant_config import check_requested

State = dict[str, torch.Tensor]
Config = dict[str, object]
Case = Callable[[TinyCache, Path], Callable[[], object]]


def read_all(path: Path) -> None:
    source = open_source(path)
    layout = moe_layout(read_config(path), source)
    for layer in layout.moe_layers:
        read_layer_experts(source, layout, layer)


def variant(
    base: Path,
    tmp: Path,
    state_fn: Callable[[State], None] | None = None,
    config_fn: Callable[[Config], None] | None = None,
) -> Path:
    """A copy of ``base`` with its tensors and/or config changed in place by the given functions."""
    state, config = load_state(base), read_json(base / "config.json")
    if state_fn:
        state_fn(state)
    if config_fn:
        config_fn(config)
    return write_checkpoint(base, tmp / "broken", state, config)


def reads(
    kind: str, state_fn: Callable[[State], None] | None = None, config_fn: Callable[[Config], None] | None = None
) -> Case:
    """A case that breaks the cached checkpoint ``kind`` (``qwen3``, ``deepseek``, ``fp8``, ...) and reads it."""

    def make(cache: TinyCache, tmp: Path) -> Callable[[], object]:
        path = variant(_base(cache, kind), tmp, state_fn, config_fn)
        return lambda: read_all(path)

    return make


def _base(cache: TinyCache, kind: str) -> Path:
    bases = {
        "qwen3": lambda: cache.model("qwen3_moe"),
        "qwen3_fused": lambda: cache.model("qwen3_moe", True),
        "deepseek": lambda: cache.model("deepseek_v3"),
        "gpt_oss": lambda: cache.model("gpt_oss"),
        "fp8": cache.fp8,
        "int4": cache.int4,
        "gptq": cache.gptq,
        "mxfp4": cache.mxfp4,
    }
    return bases[kind]()


def file_case(kind: str, damage: Callable[[Path], None]) -> Case:
    """A case that damages the files of a copy of ``kind`` (a directory, or the GGUF file)."""

    def make(cache: TinyCache, tmp: Path) -> Callable[[], object]:
        src = cache.gguf() if kind == "gguf" else _base(cache, kind)
        path = cache.copy(src, tmp / src.name)
        damage(path)
        return lambda: read_all(path)

    return make


# --- the damage ---------------------------------------------------------------------------------


def drop(*patterns: str) -> Callable[[State], None]:
    def fn(state: State) -> None:
        for key in [k for k in state if any(p in k for p in patterns)]:
            del state[key]

    return fn


def replace(key: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[State], None]:
    def fn(state: State) -> None:
        state[key] = make(state[key])

    return fn


def add(key: str, value: torch.Tensor) -> Callable[[State], None]:
    def fn(state: State) -> None:
        state[key] = value

    return fn


def for_experts(
    layer: int, proj: str, suffix: str, make: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[State], None]:
    def fn(state: State) -> None:
        for e in range(8):
            key = f"model.layers.{layer}.mlp.experts.{e}.{proj}{suffix}"
            state[key] = make(state[key])

    return fn


def set_config(**fields: object) -> Callable[[Config], None]:
    def fn(config: Config) -> None:
        config.update(fields)

    return fn


def del_config(*names: str) -> Callable[[Config], None]:
    def fn(config: Config) -> None:
        for name in names:
            config.pop(name, None)

    return fn


def set_quant(**fields: object) -> Callable[[Config], None]:
    def fn(config: Config) -> None:
        qc = config["quantization_config"]
        assert isinstance(qc, dict)
        qc.update(fields)

    return fn


def set_ct_weights(**fields: object) -> Callable[[Config], None]:
    def fn(config: Config) -> None:
        config["quantization_config"]["config_groups"]["group_0"]["weights"].update(fields)  # type: ignore[index]

    return fn


def nan_at(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[0] = float("nan")
    return out


def truncate(name: str, keep_fraction: float = 0.6) -> Callable[[Path], None]:
    def fn(path: Path) -> None:
        target = path if path.is_file() else path / name
        data = target.read_bytes()
        target.write_bytes(data[: int(len(data) * keep_fraction)])

    return fn


def overwrite(name: str, offset: int, data: bytes) -> Callable[[Path], None]:
    def fn(path: Path) -> None:
        target = path if path.is_file() else path / name
        raw = bytearray(target.read_bytes())
        raw[offset : offset + len(data)] = data
        target.write_bytes(bytes(raw))

    return fn


def unlink(name: str) -> Callable[[Path], None]:
    return lambda path: (path / name).unlink()


def write_text(name: str, text: str) -> Callable[[Path], None]:
    return lambda path: (path / name).write_text(text)


def gguf_case(**kw: object) -> Case:
    def make(cache: TinyCache, tmp: Path) -> Callable[[], object]:
        path = make_gguf(tmp / "bad.gguf", **kw)  # type: ignore[arg-type]
        return lambda: read_all(path)

    return make


def direct(call: Callable[[], object]) -> Case:
    return lambda cache, tmp: call


def layer_case(kind: str, layer: int) -> Case:
    def make(cache: TinyCache, tmp: Path) -> Callable[[], object]:
        path = _base(cache, kind)

        def call() -> object:
            source = open_source(path)
            return read_layer_experts(source, moe_layout(read_config(path), source), layer)

        return call

    return make


L1 = "model.layers.1.mlp.experts"
CASES: dict[str, tuple[Case, type[ValueError], list[str]]] = {
    "missing expert tensors": (
        reads("qwen3", drop(*(f"{L1}.{e}.{p}_proj" for e in range(2, 8) for p in ("gate", "up")))),
        CheckpointError,
        ["layer 1", "12 of 24 expert tensors are missing", f"{L1}.2.gate_proj.weight"],
    ),
    "expert 0 missing from the first MoE layer": (
        reads("qwen3", drop("model.layers.0.mlp.experts.0.")),
        CheckpointError,
        ["layer 0", "3 of 24 expert tensors are missing", "model.layers.0.mlp.experts.0.gate_proj.weight"],
    ),
    "expert shape disagrees with config": (
        reads("qwen3", config_fn=set_config(moe_intermediate_size=48)),
        CheckpointError,
        ["model.safetensors", "gate_proj.weight", "expected shape [48, 64]", "found [32, 64]"],
    ),
    "more experts per token than experts": (
        reads("qwen3", config_fn=set_config(num_experts_per_tok=99)),
        CheckpointError,
        ["config.json", "num_experts_per_tok (99) is larger than the expert count (8)"],
    ),
    "one expert with another dtype": (
        reads("qwen3", replace(f"{L1}.3.up_proj.weight", lambda t: t.to(torch.int8))),
        CheckpointError,
        [f"{L1}.3.up_proj.weight", "dtype torch.int8", "expert 0"],
    ),
    "NaN in a bf16 expert": (
        reads("qwen3", replace(f"{L1}.2.down_proj.weight", nan_at)),
        CheckpointError,
        [f"{L1}.2.down_proj.weight", "finite", "NaN"],
    ),
    "fp8 scale with the wrong shape": (
        reads("fp8", for_experts(1, "gate_proj", ".weight_scale_inv", lambda t: t.repeat(2, 1))),
        CheckpointError,
        [f"{L1}.0.gate_proj.weight_scale_inv", "expected shape [1, 1]", "found shape [2, 1]"],
    ),
    "NaN fp8 scale": (
        reads("fp8", replace("model.layers.2.mlp.experts.5.down_proj.weight_scale_inv", nan_at)),
        CheckpointError,
        ["model.layers.2.mlp.experts.5.down_proj.weight_scale_inv", "finite", "NaN"],
    ),
    "fp8 weight stored bf16 (config disagrees with tensors)": (
        reads("fp8", for_experts(1, "gate_proj", ".weight", lambda t: t.float().bfloat16())),
        CheckpointError,
        ["quantization_config says the experts are fp8", "stored as bf16", f"{L1}.0.gate_proj"],
    ),
    "zero point in a symmetric format (sample expert)": (
        reads("int4", add(f"{L1}.0.gate_proj.weight_zero_point", torch.zeros(4, 2, dtype=torch.int32))),
        CheckpointError,
        ["int4-asym", "weight_zero_point", "quantization_config"],
    ),
    "zero point in a symmetric format (other expert)": (
        reads(
            "int4", add("model.layers.2.mlp.experts.4.up_proj.weight_zero_point", torch.zeros(4, 2, dtype=torch.int32))
        ),
        CheckpointError,
        ["model.layers.2.mlp.experts.4.up_proj.weight_zero_point", "a zero point", "int4 g32"],
    ),
    "int4 weight_shape disagrees": (
        reads("int4", replace(f"{L1}.6.gate_proj.weight_shape", lambda t: torch.tensor([32, 48]))),
        CheckpointError,
        [f"{L1}.6.gate_proj.weight_shape", "[32, 64]", "[32, 48]"],
    ),
    "GPTQ desc_act=True": (
        reads("gptq", config_fn=set_quant(desc_act=True)),
        CheckpointError,
        ["config.json", "desc_act=True", "re-quantize with desc_act=False"],
    ),
    "GPTQ permuted g_idx (act-order) under desc_act=False": (
        reads("gptq", replace(f"{L1}.1.down_proj.g_idx", lambda t: t.flip(0).contiguous())),
        CheckpointError,
        [f"{L1}.1.down_proj.g_idx", "desc_act"],
    ),
    "GPTQ bits=8": (
        reads("gptq", config_fn=set_quant(bits=8)),
        CheckpointError,
        ["gptq bits=8", "4-bit"],
    ),
    "group size not dividing K": (
        reads("int4", config_fn=set_ct_weights(group_size=48)),
        CheckpointError,
        ["config.json", "divisible by 48", "K (hidden_size)=64"],
    ),
    "group size disagrees with the scales": (
        reads("int4", config_fn=set_ct_weights(group_size=16)),
        CheckpointError,
        ["group_size 16", "groups of 32"],
    ),
    "compressed-tensors 8-bit pack-quantized": (
        reads("int4", config_fn=set_ct_weights(num_bits=8)),
        CheckpointError,
        ["num_bits=8", "only num_bits 4"],
    ),
    "unsupported quant_method": (
        reads("qwen3", config_fn=set_config(quantization_config={"quant_method": "awq", "bits": 4})),
        CheckpointError,
        ["'awq'", "not supported", "gptq"],
    ),
    "fp8 in e5m2": (
        reads("fp8", config_fn=set_quant(fmt="e5m2")),
        CheckpointError,
        ["'e5m2'", "only e4m3"],
    ),
    "quantization_config disagreeing with the tensors": (
        reads(
            "qwen3", config_fn=set_config(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
        ),
        CheckpointError,
        ["quantization_config says the experts are fp8", "stored as bf16", "mlp.experts.0.gate_proj"],
    ),
    "truncated shard": (
        file_case("qwen3", truncate("model.safetensors")),
        CheckpointError,
        ["model.safetensors", "truncated"],
    ),
    "corrupt header": (
        file_case("qwen3", overwrite("model.safetensors", 8, b"\x00garbage{{{")),
        CheckpointError,
        ["model.safetensors", "corrupt header"],
    ),
    "missing config.json": (
        file_case("qwen3", unlink("config.json")),
        CheckpointError,
        ["config.json", "missing"],
    ),
    "config.json not JSON": (
        file_case("qwen3", write_text("config.json", '{"model_type": "qwen3_moe",')),
        CheckpointError,
        ["config.json", "not valid JSON"],
    ),
    "config without expert count": (
        reads("qwen3", config_fn=del_config("num_local_experts", "num_experts")),
        CheckpointError,
        ["config.json", "no expert count", "num_experts"],
    ),
    "config without hidden_size": (
        reads("qwen3", config_fn=del_config("hidden_size")),
        CheckpointError,
        ["config.json", "hidden_size"],
    ),
    "index listing a missing shard": (
        file_case("fp8", unlink("model-00002-of-00002.safetensors")),
        CheckpointError,
        ["model.safetensors.index.json", "missing", "model-00002-of-00002.safetensors"],
    ),
    "unknown model_type with no experts found": (
        reads("qwen3", drop(".experts."), set_config(model_type="llama")),
        CheckpointError,
        ["unknown model_type 'llama'", "no expert tensors found", "qwen3_moe"],
    ),
    "known model_type with no experts found": (
        reads("qwen3", drop(".experts.")),
        CheckpointError,
        ["no routed-expert tensors", "qwen3_moe"],
    ),
    "more experts than the config says (per-expert)": (
        reads("qwen3", config_fn=set_config(num_local_experts=6)),
        CheckpointError,
        ["layer 0 has at least 8 experts", "model.layers.0.mlp.experts.6.gate_proj.weight", "says 6"],
    ),
    "expert count disagrees (fused)": (
        reads("qwen3_fused", config_fn=set_config(num_local_experts=10)),
        CheckpointError,
        ["gate_up_proj", "expected shape [10, 64, 64]", "found [8, 64, 64]"],
    ),
    "experts in a layer the config makes dense": (
        reads("deepseek", config_fn=set_config(first_k_dense_replace=2)),
        CheckpointError,
        ["layers [1]", "dense", "first_k_dense_replace=2"],
    ),
    "reading a dense layer": (
        layer_case("deepseek", 0),
        CheckpointError,
        ["layer 0 is not an MoE layer", "[1, 2]"],
    ),
    "gpt-oss without its bias": (
        reads("gpt_oss", drop("layers.1.mlp.experts.gate_up_proj_bias")),
        CheckpointError,
        ["missing tensor", "model.layers.1.mlp.experts.gate_up_proj_bias"],
    ),
    "gpt-oss mxfp4 NaN exponent": (
        reads("mxfp4", replace("model.layers.0.mlp.experts.down_proj_scales", lambda t: t.clone().fill_(255))),
        CheckpointError,
        ["model.layers.0.mlp.experts.down_proj_scales", "NaN exponents (255)"],
    ),
    "GGUF bad magic": (
        file_case("gguf", overwrite("", 0, b"GGML")),
        CheckpointError,
        ["experts.gguf", "bad magic"],
    ),
    "GGUF data past EOF": (
        file_case("gguf", truncate("", 0.7)),
        CheckpointError,
        ["experts.gguf", "truncated: tensor", "the file has"],
    ),
    "GGUF without model metadata": (
        gguf_case(metadata=False),
        CheckpointError,
        ["bad.gguf", "GGUF metadata lacks", "deepseek2.block_count"],
    ),
    "GGUF expert count disagrees with its tensors": (
        gguf_case(expert_count=6),
        CheckpointError,
        ["blk.1.ffn_gate_exps.weight", "expected shape [6, 256, 256]", "found [4, 256, 256]"],
    ),
    "conversion to an unknown method": (
        direct(lambda: check_requested("fp8", "int3")),
        ValueError,
        ["unknown method 'int3'", "int4"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_input_is_a_clear_error(tiny_cache: TinyCache, tmp_path: Path, name: str) -> None:
    make, error, words = CASES[name]
    call = make(tiny_cache, tmp_path)
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 20


def test_config_json_that_is_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        read_config(tmp_path)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{", ["is not valid JSON", "line 1 column 2"]),
        ("", ["is not valid JSON"]),
        ("[1, 2]", ["must hold a JSON object, found list"]),
        ('{"max_new_tokens": "x"}', ["max_new_tokens must be a non-negative integer, found 'x'"]),
        ('{"eos_token_id": [1, "a"]}', ["eos_token_id must be a token id or a list of token ids"]),
        ('{"temperature": "hot"}', ["temperature must be a number, found 'hot'"]),
        ('{"pad_token_id": -1}', ["pad_token_id must be a token id"]),
        ('{"min_p": 3}', ["min_p must be in [0, 1], found 3"]),
        ('{"top_p": 0}', ["top_p must be in (0, 1], found 0"]),
        ('{"repetition_penalty": 0.0}', ["repetition_penalty must be in [0.01, 10], found 0.0"]),
        ('{"temperature": -0.5}', ["temperature must be >= 0, found -0.5"]),
        ('{"no_repeat_ngram_size": 2.5}', ["no_repeat_ngram_size must be a non-negative integer, found 2.5"]),
    ],
)
def test_broken_generation_config_is_one_error(tiny_cache: TinyCache, tmp_path: Path, text: str, words: list) -> None:
    """A model whose generation_config.json is broken: a CheckpointError naming the file and what is
    wrong (transformers' own reader raises a multi-line OSError, or a TypeError from a comparison)."""
    from hetmoe import load_model

    path = tiny_cache.copy(_base(tiny_cache, "qwen3"), tmp_path / "model")
    (path / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    message = str(info.value)
    assert "generation_config.json" in message and "\n" not in message
    for word in words:
        assert word in message, message


def test_generate_with_a_broken_generation_config_prints_one_line(tmp_path: Path) -> None:
    """The same through `hetmoe generate` on a copy of the embedded model: exit 1, one line, no traceback."""
    import os
    import shutil
    import subprocess
    import sys

    from hetmoe.models.default import default_model_path

    path = Path(shutil.copytree(default_model_path(), tmp_path / "model"))
    (path / "generation_config.json").write_text('{"do_sample": true,')
    proc = subprocess.run(
        [sys.executable, "-m", "hetmoe.cli.main", "generate", "--max-new-tokens", "2", str(path), "def f():"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "generation_config.json: is not valid JSON" in lines[0], proc.stderr
