"""The memory planner: what a model needs where, and whether it fits, before any weight is read.

From ``config.json`` and the checkpoint's tensor headers (never the tensors themselves) it counts:

- routed experts: bytes of one expert and of one MoE layer in the CPU method (the stored bytes when
  the experts run as stored, the codec's size when they are converted), and the experts kept on the
  device, which are held there in the model's dtype;
- non-expert weights: the dense Linear layers in ``dense_method`` when it is given (as
  ``load_model(dense_method=...)`` converts them; routers and layers the engine cannot run stay in
  the model's dtype), everything else (embeddings, norms, routers) in the model's dtype;
- the KV cache per token, as transformers' cache holds it: K and V per full-attention layer,
  sliding-window layers capped at their window, linear-attention layers none (their state is
  fixed), and for MLA (DeepSeek-V2/V3, Kimi-K2) the decompressed per-head K and V transformers keeps;
- a reserve for what is not weights: the runtime (CUDA context, allocator, activations) and, when
  converting, one layer's conversion.

With the device memory and the RAM (measured, or given) it says how many experts per layer fit on
the device and how many tokens of KV cache it holds; ``check()`` refuses a plan that does not fit,
naming what is over and by how much. The numbers are estimates within a few percent: the loader
reports the exact bytes once it has loaded.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import TensorSource, open_source
from ..checkpoint.config import read_config
from ..checkpoint.experts import CONVERT_CHUNK_BYTES
from ..checkpoint.layout import MoELayout, moe_layout
from ..formats import get_codec
from ..runtime.cpu_linear import check_method, codec_params, unsupported_reason
from ..runtime.process_group import contiguous_share

GiB = 2**30
MiB = 2**20
DEFAULT_CONTEXT = 4096
# Not weights: on the device the CUDA context, cuBLAS workspace and activations; in RAM the
# Python/torch runtime and the engine's buffers. A fixed part plus a fraction of the memory.
DEVICE_RESERVE = (768 * MiB, 0.05)
RAM_RESERVE = (1 * GiB, 0.05)
# Routers (and Qwen's shared-expert gate) stay in the model's dtype under dense_method.
_ROUTER = re.compile(r"\.(gate|router|shared_expert_gate)\.weight$")
_EMBEDDING = re.compile(r"(embed_tokens|wte|word_embeddings|embeddings)\.weight$")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS: dict[str, float] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS.update({_p: 1000.0**_i, _p + "b": 1000.0**_i, _p + "i": 1024.0**_i, _p + "ib": 1024.0**_i})


class PlanError(ValueError):
    """The model does not fit the memory given or measured."""


def parse_size(text: str | int | float, name: str = "size") -> int:
    """``"24GiB"``, ``"512MB"``, ``"1.5TiB"`` or a number of bytes -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"{name}: expected a size >= 0, found {text}")
        return int(text)
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{name}: expected a size such as 24GiB, 512MB or a number of bytes, found {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def human(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (free plus reclaimable cache), else total physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def available_device_memory(device: torch.device) -> int | None:
    """Free memory of a CUDA device (None for the CPU, or when it cannot be queried)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


@dataclass
class MemoryPlan:
    model: str
    model_type: str
    device: str
    method: str  # the experts' CPU method ("as stored: ..." when not converted)
    dense_method: str | None
    dtype_bytes: int
    moe_layers: int
    experts: int
    top_k: int
    expert_bytes: int  # one expert (gate, up, down) in the CPU method
    expert_device_bytes: int  # one expert on the device, in the model's dtype
    dense_bytes: int  # non-expert weights as they will be held
    dense_linear_bytes: int  # of which the Linear layers dense_method converts
    kv_bytes_per_token: int
    kv_note: str
    gpu_experts: int  # per MoE layer
    context: int
    device_memory: int | None  # bytes usable on the device (None: CPU only)
    ram: int
    conversion_bytes: int  # peak extra RAM while converting one layer
    ram_measured: bool = True
    device_measured: bool = True
    notes: list[str] = field(default_factory=list)
    expert_parallel: int = 1  # processes sharing each layer's routed experts
    rank: int = 0  # the process this plan's RAM figures are for (0: the one that runs the model)

    # --- derived -----------------------------------------------------------------------------
    @property
    def on_device(self) -> bool:
        """Non-expert weights and the KV cache live on a device, not in RAM."""
        return self.device != "cpu"

    @property
    def layer_expert_bytes(self) -> int:
        return self.expert_bytes * self.experts

    def experts_on(self, rank: int) -> int:
        """Experts of a layer ``rank`` holds (placement by id or by load deals the same counts)."""
        return len(contiguous_share(range(self.experts), rank, self.expert_parallel))

    @property
    def cpu_expert_bytes(self) -> int:
        # Device experts stay in CPU memory too: the engine skips them by mask, and dynamic
        # re-placement copies from there. Under expert parallelism, this rank's share.
        return self.expert_bytes * self.experts_on(self.rank) * self.moe_layers

    @property
    def gpu_expert_bytes(self) -> int:
        return self.gpu_experts * self.moe_layers * self.expert_device_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.context

    def reserve(self, total: int, kind: tuple[int, float]) -> int:
        return int(kind[0] + kind[1] * total)

    @property
    def device_need(self) -> int:
        """Device bytes: non-expert weights, device experts, KV cache for the context, reserve."""
        if self.device_memory is None:
            return 0
        reserve = self.reserve(self.device_memory, DEVICE_RESERVE)
        return self.dense_bytes + self.gpu_expert_bytes + self.kv_bytes + reserve

    @property
    def ram_need(self) -> int:
        need = self.cpu_expert_bytes + self.conversion_bytes + self.reserve(self.ram, RAM_RESERVE)
        if not self.on_device and self.rank == 0:  # an expert rank holds nothing but its experts
            need += self.dense_bytes + self.kv_bytes
        return need

    def _device_free(self, gpu_experts: int, kv_tokens: int) -> int:
        assert self.device_memory is not None
        used = self.dense_bytes + gpu_experts * self.moe_layers * self.expert_device_bytes
        used += kv_tokens * self.kv_bytes_per_token + self.reserve(self.device_memory, DEVICE_RESERVE)
        return self.device_memory - used

    @property
    def max_gpu_experts(self) -> int | None:
        """Experts per MoE layer the device holds next to the KV cache for ``context`` tokens."""
        if self.device_memory is None:
            return None
        free = self._device_free(0, self.context)
        per = self.moe_layers * self.expert_device_bytes
        return max(0, min(self.experts, free // per)) if per else 0

    @property
    def kv_tokens(self) -> int | None:
        """Tokens of KV cache the memory that holds it (device, else RAM) has room for."""
        if self.kv_bytes_per_token == 0 or (self.on_device and self.device_memory is None):
            return None  # no per-token cache (all linear attention), or a device of unknown size
        if self.device_memory is not None:
            free = self._device_free(self.gpu_experts, 0)
        else:
            free = self.ram - (self.ram_need - self.kv_bytes)
        return max(0, free // self.kv_bytes_per_token)

    # --- verdict -----------------------------------------------------------------------------
    def problems(self) -> list[str]:
        out = []
        if self.device_memory is not None and self.device_need > self.device_memory:
            fit = self.max_gpu_experts
            hint = (
                f"at most {fit} experts per layer fit with {self.context} tokens of context"
                if fit
                else ("not even the non-expert weights and the KV cache fit")
            )
            out.append(
                f"device {self.device}: needs {human(self.device_need)} (non-expert weights {human(self.dense_bytes)}, "
                f"{self.gpu_experts} experts x {self.moe_layers} layers {human(self.gpu_expert_bytes)}, KV cache "
                f"{self.context} tokens {human(self.kv_bytes)}, reserve "
                f"{human(self.reserve(self.device_memory, DEVICE_RESERVE))}), has {human(self.device_memory)}; {hint}"
            )
        if self.ram_need > self.ram:
            parts = f"routed experts {human(self.cpu_expert_bytes)} ({self.method})"
            if not self.on_device:
                dense = f" ({self.dense_method})" if self.dense_method else ""
                parts += f", non-expert weights {human(self.dense_bytes)}{dense}, KV cache {human(self.kv_bytes)}"
            if self.conversion_bytes:
                parts += f", conversion of one layer {human(self.conversion_bytes)}"
            parts += f", reserve {human(self.reserve(self.ram, RAM_RESERVE))}"
            out.append(
                f"RAM: needs {human(self.ram_need)} ({parts}), has {human(self.ram)} "
                f"{'available' if self.ram_measured else 'given'}; a smaller --method (int4) or fewer layers would fit"
            )
        return out

    def check(self) -> MemoryPlan:
        """Raise PlanError naming every limit the plan exceeds; returns the plan when it fits."""
        problems = self.problems()
        if problems:
            raise PlanError(f"{self.model} will not fit: " + "; ".join(problems))
        return self

    def rows(self) -> list[tuple[str, str]]:
        """The plan as (what, value) rows for a table."""
        dense = f" (Linear layers {human(self.dense_linear_bytes)} in {self.dense_method})" if self.dense_method else ""
        rows = [
            ("model", f"{self.model} ({self.model_type})"),
            ("experts", f"{self.experts} per layer x {self.moe_layers} MoE layers, top-{self.top_k}, {self.method}"),
            ("one expert", f"{human(self.expert_bytes)} on the CPU, {human(self.expert_device_bytes)} on a device"),
            (
                "routed experts (RAM)",
                f"{human(self.layer_expert_bytes)} per layer, {human(self.layer_expert_bytes * self.moe_layers)} all",
            ),
            ("non-expert weights", f"{human(self.dense_bytes)} on {self.device}{dense}"),
            ("KV cache per token", f"{human(self.kv_bytes_per_token)} ({self.kv_note})"),
            (f"KV cache for {self.context} tokens", human(self.kv_bytes)),
        ]
        if self.conversion_bytes:
            rows.append(("conversion peak", f"{human(self.conversion_bytes)} (one layer at a time)"))
        if self.device_memory is not None:
            rows += [
                ("device memory", f"{human(self.device_memory)} ({'free' if self.device_measured else 'given'})"),
                ("device experts", f"{self.gpu_experts} per layer = {human(self.gpu_expert_bytes)}"),
                ("device needs", human(self.device_need)),
                ("max device experts", f"{self.max_gpu_experts} per layer (with {self.context} tokens of KV cache)"),
            ]
        if self.expert_parallel > 1:
            per = self.expert_bytes * self.moe_layers  # one expert of every layer
            share = [(r, self.experts_on(r)) for r in range(self.expert_parallel)]
            split = "; ".join(f"rank {r}: {n} experts a layer, {human(per * n)}" for r, n in share)
            rows.append(("expert parallel", f"{self.expert_parallel} processes ({split})"))
            rows.append(("this plan's RAM", f"rank {self.rank}'s" + (" (and the model's)" if self.rank == 0 else "")))
        rows += [("note", note) for note in self.notes]
        rows += [
            ("RAM", f"{human(self.ram)} ({'available, measured' if self.ram_measured else 'given'})"),
            ("RAM needs", human(self.ram_need)),
        ]
        tokens = self.kv_tokens
        rows.append(("KV cache capacity", "-" if tokens is None else f"{tokens} tokens"))
        problems = self.problems()
        rows.append(("verdict", "fits" if not problems else "DOES NOT FIT: " + "; ".join(problems)))
        return rows

    def table(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        return "\n".join(f"{k:<{width}}  {v}" for k, v in self.rows())


# --- building a plan ----------------------------------------------------------------------------


def plan_memory(
    path: str | Path,
    method: str | None = None,
    dense_method: str | None = None,
    *,
    device: str | torch.device = "cpu",
    gpu_experts: int = 0,
    context: int = DEFAULT_CONTEXT,
    device_memory: int | str | None = None,
    ram: int | str | None = None,
    group_size: int | None = None,
    dense_group_size: int | None = None,
    dtype: torch.dtype | None = None,
    source: TensorSource | None = None,
    layout: MoELayout | None = None,
    expert_parallel: int = 1,
    rank: int = 0,
) -> MemoryPlan:
    """The plan for ``path`` loaded as ``load_model(path, method, device, gpu_experts, dense_method=...)``.

    ``device_memory``/``ram``: bytes or a size string; measured when None (free CUDA memory;
    MemAvailable). ``source``/``layout``: the caller's already opened checkpoint (load_model).
    ``expert_parallel``/``rank``: the experts split over that many processes; the RAM figures are
    ``rank``'s (rank 0 also holds the non-expert weights and the KV cache).
    """
    if expert_parallel < 1 or not 0 <= rank < expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel}, rank={rank}: expected 0 <= rank < expert_parallel")
    p = Path(path)
    config = read_config(p)
    source = source if source is not None else open_source(p)
    layout = layout if layout is not None else moe_layout(config, source)
    dev = torch.device(device)
    if method is not None:
        check_method(method)
    if dense_method is not None:
        check_method(dense_method, "dense_method")
    if gpu_experts < 0 or context < 0:
        raise ValueError(f"gpu_experts and context must be >= 0, got {gpu_experts} and {context}")
    dtype = dtype or _config_dtype(config)
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()

    expert_keys = _expert_keys(layout, source)
    stored_layer = sum(source.info(k).nbytes for k in expert_keys) // max(1, len(layout.moe_layers))
    h, i = layout.hidden_size, layout.intermediate_size
    if method is None:
        expert_bytes = stored_layer // max(1, layout.num_experts)
        method_label = f"as stored ({layout.method})"
        conversion = 0
    else:
        codec = get_codec(method, **codec_params(method, group_size))
        bits = 2 * codec.bits_per_weight((i, h)) + codec.bits_per_weight((h, i))  # gate, up [I, H]; down [H, I]
        expert_bytes = math.ceil(bits * i * h / 8)
        method_label = method
        # One layer converted at a time: the new layer, plus the float32 detour of a chunk of experts.
        conversion = expert_bytes * layout.num_experts + min(CONVERT_CHUNK_BYTES, layout.num_experts * 3 * h * i * 4)

    dense, dense_linear = _dense_bytes(source, set(expert_keys), dtype_bytes, dense_method, dense_group_size)
    kv, kv_note = kv_bytes_per_token(config, dtype_bytes)
    notes: list[str] = []
    if device_memory is None:
        device_bytes = available_device_memory(dev) if dev.type != "cpu" else None
        device_measured = True
        if dev.type != "cpu" and device_bytes is None:
            notes.append(f"the memory of {dev} cannot be measured here: not checked (pass device_memory)")
    else:
        device_bytes, device_measured = parse_size(device_memory, "device_memory"), False
        if dev.type == "cpu":
            raise ValueError("device_memory is for a GPU device; on the CPU everything counts against ram")
    return MemoryPlan(
        model=str(p),
        model_type=layout.model_type,
        device=str(dev),
        method=method_label,
        dense_method=dense_method,
        dtype_bytes=dtype_bytes,
        moe_layers=len(layout.moe_layers),
        experts=layout.num_experts,
        top_k=layout.top_k,
        expert_bytes=int(expert_bytes),
        expert_device_bytes=3 * h * i * dtype_bytes,
        dense_bytes=dense,
        dense_linear_bytes=dense_linear,
        kv_bytes_per_token=kv,
        kv_note=kv_note,
        gpu_experts=int(gpu_experts),
        context=int(context),
        device_memory=device_bytes,
        ram=available_ram() if ram is None else parse_size(ram, "ram"),
        conversion_bytes=int(conversion),
        ram_measured=ram is None,
        device_measured=device_measured,
        notes=notes,
        expert_parallel=int(expert_parallel),
        rank=int(rank),
    )


def _config_dtype(config: dict[str, Any]) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return {"float32": torch.float32, "float16": torch.float16}.get(str(name), torch.bfloat16)


def _expert_keys(layout: MoELayout, source: TensorSource) -> list[str]:
    """Every stored tensor that belongs to a routed expert of an MoE layer."""
    stems = []
    for layer in layout.moe_layers:
        for template in (layout.gate, layout.up, layout.down):
            if template is not None:
                stems.append(layout.layer_prefix(layer) + template.split("{e}")[0])
    stems_t = tuple(stems)
    return [k for k in source.keys() if k.startswith(stems_t)]


def _dense_bytes(
    source: TensorSource, expert_keys: set[str], dtype_bytes: int, dense_method: str | None, group_size: int | None
) -> tuple[int, int]:
    """(all non-expert bytes as loaded, of which Linear weights held in ``dense_method``)."""
    total = linear = 0
    for key in source.keys():
        if key in expert_keys or key.endswith(("_scale_inv", "_scale", ".weight_scale")):
            continue  # fp8 scales of dense weights are folded in at load
        info = source.info(key)
        numel = math.prod(info.shape)
        is_linear = (
            dense_method is not None
            and key.endswith(".weight")
            and len(info.shape) == 2
            and not _ROUTER.search(key)
            and not _EMBEDDING.search(key)
            and unsupported_reason(dense_method, int(info.shape[1]), group_size) is None
        )
        if is_linear:
            codec = get_codec(dense_method, **codec_params(dense_method, group_size))
            n = math.ceil(codec.bits_per_weight(tuple(int(d) for d in info.shape)) * numel / 8)
            linear += n
            total += n
        else:
            total += numel * dtype_bytes
    return total, linear


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> tuple[int, str]:
    """Bytes of KV cache one token adds across all layers (sliding layers counted in full), and how."""
    layers = int(config.get("num_hidden_layers", 0))
    heads = int(config.get("num_attention_heads", 1))
    types = (config.get("layer_types") or ["full_attention"] * layers)[:layers]  # past them: MTP blocks
    full = sum(1 for t in types if t == "full_attention")
    sliding = sum(1 for t in types if t in ("sliding_attention", "sliding_window"))
    linear = len(types) - full - sliding
    if config.get("kv_lora_rank"):  # MLA: one latent row a token (mla_attention.py; transformers' too)
        rank, rope_dim = int(config["kv_lora_rank"]), int(config.get("qk_rope_head_dim", 0))
        per_layer = (rank + rope_dim) * dtype_bytes
        how = f"MLA latent, kv_lora_rank {rank} + rope key {rope_dim}"
    else:
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(1, heads))
        per_layer = 2 * kv_heads * head_dim * dtype_bytes
        how = f"K and V, {kv_heads} KV heads x {head_dim}"
    attention_layers = full + sliding
    how += f", {attention_layers} attention layers"
    if sliding:
        how += f" ({sliding} sliding-window of {config.get('sliding_window')}: counted in full, an upper bound)"
    if linear:
        how += f", {linear} linear-attention layers without a per-token cache"
    return per_layer * attention_layers, how
