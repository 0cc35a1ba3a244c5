"""Tiny random MoE checkpoints, built offline with transformers, and rewrites of them.

``build_tiny`` makes a real transformers model of an architecture (hidden 64, 8 experts, top-2,
a dense first layer where the architecture has one) and saves it with ``save_pretrained``, so the
files are exactly what transformers writes. The other helpers turn such a checkpoint into the
layouts and precisions found on the hubs (fused <-> per-expert, DeepSeek fp8, Kimi-K2 int4,
GPTQ, gpt-oss mxfp4) or write a GGUF file with experts of several ggml types. Quantized experts
are made with hetmoe's codecs, whose conventions are tested against the foreign references
elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from hetmoe.checkpoint.quant_config import compressed_tensors_int4_config as int4_ct_config
from hetmoe.formats import get_codec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HIDDEN = 64
NUM_EXPERTS = 8
TOP_K = 2
_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "num_experts_per_tok": TOP_K,
    "tie_word_embeddings": False,
}
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
# Per architecture: the config fields beyond _COMMON. Expert width is 32 everywhere, dense MLPs 96.
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_hidden_layers": 2, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8},
    "qwen2_moe": {
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "shared_expert_intermediate_size": 48,
    },
    "qwen3_next": {
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "shared_expert_intermediate_size": 48,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    "mixtral": {"num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 8},
    "minimax_m2": {"num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 8},
    "olmoe": {"num_hidden_layers": 2, "intermediate_size": 32, "num_experts": 8},
    "gpt_oss": {
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "num_local_experts": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 16,
    },
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        **_MLA,
    },
    "deepseek_v2": {
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        **_MLA,
    },
    "glm4_moe": {
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
}
MODEL_TYPES = tuple(ARCH_CONFIGS)
EXPERT_INTERMEDIATE = 32
# Architectures whose per-expert checkpoints use Mixtral's names (block_sparse_moe, w1/w3/w2).
MIXTRAL_NAMES = ("mixtral", "minimax_m2")
ALWAYS_FUSED = ("gpt_oss",)

_PER_EXPERT_KEY = re.compile(
    r"^(?P<layers>.+)\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_FUSED_KEY = re.compile(r"^(?P<layers>.+)\.(?P<layer>\d+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of the reference ``b``."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def tokens(seed: int = 0, shape: tuple[int, int] = (2, 12), vocab: int = 128) -> torch.Tensor:
    """Random token ids for the tiny models (vocab 128)."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for ``ids`` (moved to the model's device), on the CPU."""
    return model(ids.to(model.device)).logits.cpu()


def greedy_logits(model: torch.nn.Module, ids: torch.Tensor, steps: int, cache: Any = None) -> list[torch.Tensor]:
    """The last-position logits before each of ``steps`` greedy one-token steps after the prompt ``ids``,
    continuing ``cache`` (None: the cache the model's first forward returns)."""
    out = model(ids, cache=cache, use_cache=True)
    cache = out.past_key_values if cache is None else cache
    logits = []
    for _ in range(steps):
        logits.append(out.logits[:, -1].clone())
        out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    return logits


def check_block_counts_and_recorded_routing(
    model: torch.nn.Module, monkeypatch: Any, run: Any, every_layer_in_block: bool
) -> None:
    """A one-call decode block that runs its layer's MoE half adds each decode token's experts to the
    HybridMoE's counts, as forward_routed does (``run(model, ids, steps)``: the prompt's logits, then
    greedy one-token steps); ``every_layer_in_block``: every layer's second half ran in its block,
    dense layers included. Recording routing is forward_routed's work in Python, so the MoE half then
    runs there again; it routes alike, so the recorded counts equal the block's and the logits are
    bit-identical. (tests/test_fast_decode.py and tests/test_mla_decode.py, one per block.)"""
    import hetmoe.models.fast_decode as fast_decode
    from hetmoe.runtime.hybrid import HybridMoE

    moe = [m for m in model.modules() if isinstance(m, HybridMoE)]
    assert moe and all(fast_decode.whole_layer_in_one_call(m) for m in moe)
    k = model.config.num_experts_per_tok
    calls = []
    real = HybridMoE.forward_routed

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(self.layer)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HybridMoE, "forward_routed", spy)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    before = [m.cpu_counts.clone() for m in moe]
    fast = run(model, ids, 9)  # the prompt, then 9 one-token steps
    counted = [m.cpu_counts - b for m, b in zip(moe, before, strict=True)]
    assert len(calls) == len(moe)  # forward_routed ran for the prompt only
    assert all(int(c.sum()) == (5 + 9) * k for c in counted)
    if every_layer_in_block:
        assert all(layer.__dict__.get("_hetmoe_ffn_half") is not None for layer in model.model.layers)
    calls.clear()
    moe[0].stats.record_routing = True
    assert not any(fast_decode.whole_layer_in_one_call(m) for m in moe)  # what paths.py reports
    recorded = run(model, ids, 9)
    assert len(calls) == 10 * len(moe)  # the prompt and every step in Python
    for m, c in zip(moe, counted, strict=True):
        assert torch.equal(moe[0].stats.routing[m.layer], c)
    for a, b in zip(fast, recorded, strict=True):
        assert torch.equal(a, b)


def spy_taken(monkeypatch: Any, owner: Any, name: str) -> list[bool]:
    """Replace ``owner.name`` (a function a fast path may decline by returning None) with one that
    records, per call, whether it returned something; the list grows as the tests call it."""
    taken: list[bool] = []
    real = getattr(owner, name)

    def spy(*args: Any) -> Any:
        out = real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(owner, name, spy)
    return taken


def tiny_config(model_type: str, **overrides: Any) -> Any:
    import transformers

    fields = {**_COMMON, **ARCH_CONFIGS[model_type], **overrides}
    if "qk_rope_head_dim" in fields and "head_dim" not in overrides:
        # MLA's rotary embedding is sized by head_dim, which DeepSeek's configs set to the rope part
        # (qk_rope_head_dim); _COMMON's GQA head_dim would size it wrong for a whole forward.
        fields["head_dim"] = fields["qk_rope_head_dim"]
    return transformers.CONFIG_MAPPING[model_type](**fields)


def build_tiny(
    model_type: str,
    out_dir: str | Path,
    *,
    fused: bool | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """A tiny random ``model_type`` saved by ``save_pretrained`` into ``out_dir``.

    ``fused=None`` saves the way transformers does by default (per-expert for every architecture
    but gpt-oss, whose only layout is fused); ``True`` saves transformers 5's in-memory fused
    layout (``save_original_format=False``); ``False`` insists on per-expert. ``overrides`` are config
    fields beyond ARCH_CONFIGS' (a variant of the architecture).
    """
    from transformers import AutoModelForCausalLM

    if fused is False and model_type in ALWAYS_FUSED:
        raise ValueError(f"{model_type} has no per-expert checkpoint layout")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    # Re-draw every expert parameter (biases included: transformers zeroes gpt-oss's) so that a
    # reader that mixed up gate and up, or two experts, could not pass by accident.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    out = Path(out_dir)
    model.save_pretrained(out, save_original_format=fused is not True)
    return out


def load_state(src: Path) -> dict[str, torch.Tensor]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(src / shard))
        return state
    return load_file(src / "model.safetensors")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def write_checkpoint(
    src: Path, dst: Path, state: dict[str, torch.Tensor], config: dict[str, Any] | None = None, shards: int = 1
) -> Path:
    """Write ``state`` (and ``config``, else src's) into ``dst`` with src's other small files."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config or read_json(src / "config.json"), indent=2))
    for old in dst.glob("model*.safetensors*"):
        old.unlink()
    if shards == 1:
        save_file(state, dst / "model.safetensors")
        return dst
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k] for k in part}, dst / name)
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


# --- layout rewrites -----------------------------------------------------------------------------


def to_fused(src: str | Path, dst: str | Path) -> Path:
    """Per-expert -> transformers 5 fused (``mlp.experts.gate_up_proj [E,2I,H]``, ``down_proj [E,H,I]``)."""
    src, dst = Path(src), Path(dst)
    state = load_state(src)
    experts: dict[tuple[str, int], dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        m = _PER_EXPERT_KEY.match(key)
        if m:
            experts[(m["layers"], int(m["layer"]))][_ROLE[m["proj"]]][int(m["e"])] = t
        else:
            # transformers 5 keeps Mixtral-style MoE blocks under "mlp" once fused.
            out[key.replace(".block_sparse_moe.", ".mlp.")] = t
    for (layers, layer), roles in experts.items():

        def stacked(role: str, roles: dict[str, dict[int, torch.Tensor]] = roles) -> torch.Tensor:
            return torch.stack([roles[role][e] for e in sorted(roles[role])])

        base = f"{layers}.{layer}.mlp.experts."
        out[base + "gate_up_proj"] = torch.cat([stacked("gate"), stacked("up")], dim=1).contiguous()
        out[base + "down_proj"] = stacked("down").contiguous()
    return write_checkpoint(src, dst, out)


def to_per_expert(src: str | Path, dst: str | Path) -> Path:
    """Transformers 5 fused -> the per-expert names the architecture's hub checkpoints use."""
    src, dst = Path(src), Path(dst)
    config = read_json(src / "config.json")
    if config["model_type"] in ALWAYS_FUSED:
        raise ValueError(f"{config['model_type']} has no per-expert checkpoint layout")
    mixtral = config["model_type"] in MIXTRAL_NAMES
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {r: f"{r}_proj" for r in ("gate", "up", "down")}
    state = load_state(src)
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        m = _FUSED_KEY.match(key)
        if not m:
            out[key.replace(".mlp.", ".block_sparse_moe.") if mixtral and ".mlp." in key else key] = t
            continue
        module = "block_sparse_moe" if mixtral else "mlp"
        base = f"{m['layers']}.{m['layer']}.{module}.experts."
        if m["proj"] == "gate_up_proj":
            inter = t.shape[1] // 2
            parts = {"gate": t[:, :inter], "up": t[:, inter:]}
        else:
            parts = {"down": t}
        for role, stacked in parts.items():
            for e in range(stacked.shape[0]):
                out[f"{base}{e}.{names[role]}.weight"] = stacked[e].contiguous()
    return write_checkpoint(src, dst, out)


# --- quantized checkpoints -----------------------------------------------------------------------


def _quantize_experts(
    src: Path, dst: Path, method: str, params: dict[str, Any], quantization_config: dict[str, Any], **kw: Any
) -> Path:
    codec = get_codec(method, **params)
    state = load_state(src)
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if _PER_EXPERT_KEY.match(key):
            out.update(codec.quantize(t.float(), key).state_dict(key.removesuffix(".weight")))
        else:
            out[key] = t
    config = read_json(src / "config.json")
    config["quantization_config"] = quantization_config
    config.update(kw.pop("config_updates", {}))
    return write_checkpoint(src, dst, out, config, **kw)


def make_fp8(src: str | Path, dst: str | Path, block_size: tuple[int, int] = (128, 128), **qc_extra: Any) -> Path:
    """DeepSeek-V3 convention: experts e4m3 + ``weight_scale_inv`` per block, two shards + index.

    ``qc_extra`` overrides quantization_config fields (MiniMax-M2 spells ``fmt`` "float8_e4m3fn"
    and lists ``modules_to_not_convert``).
    """
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block_size),
        **qc_extra,
    }
    return _quantize_experts(Path(src), Path(dst), "fp8", {"block_size": block_size}, qc, shards=2)


def compressed_tensors_int4_config(state_keys: list[str], group_size: int = 32) -> dict[str, Any]:
    """Kimi-K2-Thinking's quantization_config: int4 groups on every Linear but the listed non-experts."""
    ignore = [
        k.removesuffix(".weight")
        for k in state_keys
        if k.endswith(".weight") and ".experts." not in k and "norm" not in k and "embed" not in k
    ]
    return int4_ct_config(ignore, group_size)


def make_int4_ct(src: str | Path, dst: str | Path, group_size: int = 32, model_type: str = "kimi_k2") -> Path:
    """Kimi-K2 convention: compressed-tensors pack-quantized int4 experts (weight_packed/scale/shape)."""
    src = Path(src)
    qc = compressed_tensors_int4_config(list(load_state(src)), group_size)
    params = {"group_size": group_size, "layout": "compressed-tensors"}
    return _quantize_experts(src, Path(dst), "int4", params, qc, config_updates={"model_type": model_type})


def make_gptq(src: str | Path, dst: str | Path, group_size: int = 32, sym: bool = True, **qc_extra: Any) -> Path:
    """AutoGPTQ convention experts (qweight/qzeros/scales/g_idx); ``qc_extra`` overrides config fields."""
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": sym,
        "checkpoint_format": "gptq",
        **qc_extra,
    }
    params = {"group_size": group_size, "sym": sym, "checkpoint_format": "gptq"}
    return _quantize_experts(Path(src), Path(dst), "gptq", params, qc)


def make_mxfp4_gpt_oss(src: str | Path, dst: str | Path) -> Path:
    """gpt-oss's released form: experts as mxfp4 ``*_blocks``/``*_scales`` stored ``[E, out, in]``."""
    src, dst = Path(src), Path(dst)
    codec = get_codec("mxfp4")
    out: dict[str, torch.Tensor] = {}
    for key, t in load_state(src).items():
        if _FUSED_KEY.match(key):
            # bf16 gpt-oss keeps [E, in, out]; the mxfp4 release keeps [E, out, in].
            q = codec.quantize(t.float().transpose(1, 2).contiguous(), key)
            out.update(q.state_dict(key))
        else:
            out[key] = t
    config = read_json(src / "config.json")
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    return write_checkpoint(src, dst, out, config)


# --- GGUF ----------------------------------------------------------------------------------------

GGUF_TYPES = {1: ("Q4_K", "Q4_K", "Q6_K"), 2: ("Q8_0", "Q5_K", "Q4_K")}


def make_gguf(
    path: str | Path,
    *,
    arch: str = "deepseek2",
    layers: int = 3,
    dense: int = 1,
    experts: int = 4,
    hidden: int = 256,
    inter: int = 256,
    types: dict[int, tuple[str, str, str]] | None = None,
    seed: int = 0,
    metadata: bool = True,
    biases: bool = False,
    expert_count: int | None = None,
    merged_gate_up: bool = False,
) -> Path:
    """A GGUF with ``layers`` blocks, the first ``dense`` dense, experts typed per layer (gate, up, down).

    The default mirrors a Q4_K_M file: gate/up Q4_K and down Q6_K in one layer, other types in the
    next. Dimensions are 256 so the K-quants' 256-weight super-blocks fit. ``metadata=False`` leaves
    out the ``{arch}.*`` keys (a malformed file); ``biases`` adds gpt-oss-style F32 expert biases;
    ``expert_count`` overrides the count written in the metadata; ``merged_gate_up`` writes gate and
    up as one ``ffn_gate_up_exps`` ``[E, 2I, H]`` (gate rows first) in the gate's type.
    """
    import gguf

    path = Path(path)
    types = types or GGUF_TYPES
    gen = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    if metadata:
        writer.add_block_count(layers)
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(inter * 2)
        writer.add_expert_count(experts if expert_count is None else expert_count)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(inter)
        writer.add_leading_dense_block_count(dense)
    writer.add_tensor("token_embd.weight", (torch.randn(32, hidden, generator=gen) * 0.02).numpy())
    for layer in range(layers):
        if layer < dense:
            writer.add_tensor(f"blk.{layer}.ffn_up.weight", (torch.randn(inter, hidden, generator=gen) * 0.02).numpy())
            continue
        gate_t, up_t, down_t = types[layer]
        shapes = {"gate": (experts, inter, hidden), "up": (experts, inter, hidden), "down": (experts, hidden, inter)}
        roles = {"gate": gate_t, "up": up_t, "down": down_t}
        if merged_gate_up:
            shapes = {"gate_up": (experts, 2 * inter, hidden), "down": shapes["down"]}
            roles = {"gate_up": gate_t, "down": down_t}
        for role, ggml in roles.items():
            w = torch.randn(shapes[role], generator=gen) * 0.02
            q = get_codec(f"gguf:{ggml.lower()}").quantize(w)
            raw = np.ascontiguousarray(q.tensors[".weight"].numpy())
            writer.add_tensor(f"blk.{layer}.ffn_{role}_exps.weight", raw, raw_dtype=gguf.GGMLQuantizationType[ggml])
            if biases:  # gpt-oss keeps F32 expert biases beside the weights
                bias = (torch.randn(shapes[role][:2], generator=gen) * 0.02).numpy()
                writer.add_tensor(f"blk.{layer}.ffn_{role}_exps.bias", bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class TinyCache:
    """Builds each tiny checkpoint once per test session under ``root``; tests copy before breaking one."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._built: dict[str, Path] = {}

    def _once(self, name: str, make: Any) -> Path:
        if name not in self._built:
            self._built[name] = make(self.root / name)
        return self._built[name]

    def model(self, model_type: str, fused: bool | None = None) -> Path:
        """``fused=None``: as transformers saves by default; True: transformers 5's fused layout."""
        return self._once(f"{model_type}-{fused}", lambda d: build_tiny(model_type, d, fused=fused))

    def fp8(self) -> Path:
        return self._once("deepseek_v3-fp8", lambda d: make_fp8(self.model("deepseek_v3"), d))

    def int4(self) -> Path:
        return self._once("kimi_k2-int4", lambda d: make_int4_ct(self.model("deepseek_v3"), d))

    def gptq(self) -> Path:
        return self._once("qwen3_moe-gptq", lambda d: make_gptq(self.model("qwen3_moe"), d, group_size=16))

    def mxfp4(self) -> Path:
        return self._once("gpt_oss-mxfp4", lambda d: make_mxfp4_gpt_oss(self.model("gpt_oss"), d))

    def gguf(self) -> Path:
        return self._once("experts.gguf", lambda p: make_gguf(p, biases=True))

    def copy(self, src: Path, dst: Path) -> Path:
        """A private copy of a cached checkpoint (a directory or a file) for a test to modify."""
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
        return dst


# --- a tiny chat model (serve, chat) ---------------------------------------------------------------

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHAT_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Mixture-of-experts models route every token to a few experts. "
    "Hello, how are you today? I am fine, thank you. What is the capital of France? Paris is the capital. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Café, naïve, über, 東京, emoji 🙂 and math π ≈ 3.14159. "
    "def main():\n    return 42\n"
)


def build_tiny_chat_model(
    out_dir: str | Path,
    *,
    bpe_vocab: int = 512,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """A tiny random Qwen3-MoE with a byte-level BPE tokenizer: ChatML special tokens and chat template.

    The BPE (at most ``bpe_vocab`` tokens) is trained on a small built-in corpus; every byte is in
    its alphabet, so any text, emoji included, tokenizes, and random models can emit partial UTF-8
    sequences. The model's vocabulary is exactly the tokenizer's (a random model never emits an id
    the tokenizer lacks) and ``<|im_end|>`` is its end-of-sequence token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    out = Path(out_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        special_tokens=list(CHATML_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CHAT_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE
    )
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")

    torch.manual_seed(seed)
    config = tiny_config(
        "qwen3_moe",
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def tiny_chat_model(cache: TinyCache) -> Path:
    """The tiny chat model (``build_tiny_chat_model``), built once per test session in ``cache``."""
    return cache._once("qwen3_moe-chat", build_tiny_chat_model)
