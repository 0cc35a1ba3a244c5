"""load_model: a transformers MoE model whose routed experts run in hetmoe's CPU engine.

The model is built on the meta device from ``config.json``, so nothing is allocated for it. Each
sparse MoE block is replaced by a HybridMoE before any weight is read: the architecture's own
expert parameters never exist. Every other tensor (attention, norms, router, shared experts,
embeddings) is read from the memory-mapped safetensors one at a time, cast to the dtype
transformers would give it, and placed on ``device``; on the CPU in its stored dtype it stays a
view of the file (no copy). Each MoE layer's experts are then read with ``read_layer_experts`` in
their stored precision (views of the file for fused layouts, one stacked copy for per-expert
ones) or converted to the requested engine method one layer (and a bounded chunk of experts) at a
time, and handed to CPUExperts; the few experts placed on the device are dequantized there.
Peak memory is the stored experts plus the non-expert weights plus one layer's conversion.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointError, TensorSource, open_source
from ..checkpoint.config import read_config
from ..checkpoint.convert import expert_keys
from ..checkpoint.experts import LayerExperts, read_layer_experts
from ..checkpoint.layout import MoELayout, moe_layout
from ..formats import get_codec
from ..formats.base import QuantizedTensor
from ..gc_pause import freeze_for_decoding, gc_paused
from ..kernels.dispatch import activation_bits, set_num_threads
from ..kernels.quantize import engine_quantize
from ..runtime.cpu_experts import ENGINE_METHODS, CPUExperts
from ..runtime.expert_parallel import ExpertPlacement, RemoteExperts, serve_experts
from ..runtime.hybrid import ExpertBackend, HybridMoE
from ..runtime.kv_cache import generate_grows_caches
from ..runtime.layerwise import DEFAULT_CHUNK_BYTES
from ..runtime.placement import plan_placement
from ..runtime.process_group import Ranks, leave
from ..runtime.session import HybridRuntime, check_modes
from ..runtime.stats import RuntimeStats, load_routing
from ..runtime.stored_embedding import StoredEmbedding
from ..runtime.torch_experts import TorchCPUExperts
from .adapters import MoEAdapter, adapter_class
from .cpu_attention import use_cpu_attention
from .delta_rule import install_delta_rule
from .dense_engine import STORED, DenseConverter, resolve_dense_method
from .expert_parallel_load import placements, shard, start_group, stop_at_exit
from .fast_decode import install_fast_decode
from .fused_norms import fuse_rms_norms
from .fused_rope import fuse_rotary
from .generation_config import load_generation_config
from .mla_attention import attach_stored_heads, install_mla, weight_read_linears
from .paths import layer_paths
from .planner import plan_memory
from .prompt_tail import install_prompt_tail

_FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@gc_paused()
def load_model(
    path: str | Path,
    method: str | None = None,
    device: str | torch.device = "cpu",
    gpu_experts: int = 0,
    placement: str = "uniform",
    cpu_threads: int | None = None,
    dtype: torch.dtype | str | None = None,
    *,
    gpu_experts_total: int | None = None,
    group_size: int | None = None,
    routing_stats: str | Path | None = None,
    record_routing: str | Path | None = None,
    seed: int = 0,
    replace_every: int = 0,
    replace_margin: float = 0.25,
    gemv_max_tokens: int | None = None,
    expert_backend: str = "auto",
    prefill_threshold: int | None = None,
    prefill_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    defer_experts: int = 0,
    dense_method: str | None = None,
    dense_group_size: int | None = None,
    check_memory: bool = True,
    progress: bool | None = None,
    expert_parallel: int | None = None,
    expert_placement: str = "id",
    dist_init_method: str | None = None,
    dist_rank: int | None = None,
) -> Any:
    """A transformers causal LM ready for ``generate``, its routed experts in the CPU engine.

    ``path``: a checkpoint directory or file, or a llama.cpp GGUF file of an architecture
    models/gguf_model.py's ARCHITECTURES names (config from its metadata, experts as stored in their
    ggml blocks, the rest in the engine as stored or dequantized).
    ``method``: the experts' CPU precision: None runs them as stored (any method the engine runs:
    bf16, int8, int4 incl. Kimi-K2's, int4-asym, gptq, mxfp4, fp8, fp8-channel); ``"bf16"``,
    ``"int8"``, ``"int4"`` (or another engine method) convert layer by layer while loading
    (``group_size`` for the grouped ones; int4 defaults to 32). ``device``: where everything but the CPU experts runs.
    ``gpu_experts``: experts per MoE layer kept on ``device`` (or ``gpu_experts_total`` for the
    whole model), chosen by ``placement`` (uniform, frequency, front-loading, random; frequency
    reads ``routing_stats``, a file written by a run with ``record_routing=PATH``).
    ``replace_every``: re-place device experts from live counts every N calls of each layer.
    ``dtype``: the model's dtype (default: the config's, else the stored embedding's). ``cpu_threads``: the engine's
    worker threads (default: one per usable CPU). ``prefill_threshold``: forwards of more tokens
    compute every routed expert on ``device``, the CPU experts streamed there in chunks of at most
    ``prefill_chunk_bytes`` (runtime/layerwise.py). ``defer_experts``: each token's K lowest-scored CPU
    experts finish during the next MoE layer (runtime/deferred.py). ``expert_backend``: ``"auto"`` (the engine
    where it runs the architecture's experts, else the torch fallback), ``"engine"`` or ``"torch"``.

    ``dense_method``: CPU only: the non-expert Linear layers (attention, dense MLPs, shared
    experts, lm_head; not the routers) run in the CPU engine in this method (int8, int4 with
    ``dense_group_size``, bf16, a GGUF type), quantized one layer at a time as they are read
    (models/dense_engine.py). ``gemv_max_tokens``: an expert with at most this many tokens in a
    forward streams its weights through the GEMV kernels, more dequantize panels for the GEMM (None:
    the per-method defaults of runtime/cpu_experts.py and cpu_linear.py). ``check_memory``: before
    reading any weight, the memory planner (models/planner.py) checks that the model fits the RAM and
    device memory, else PlanError. ``progress``: a bar over the experts' bytes while they load (layers,
    GB, GB/s) on stderr; None shows it where stderr is a terminal.

    ``expert_parallel``: N processes share each layer's routed experts (models/expert_parallel_load.py):
    start N ranks (torchrun) that all call ``load_model`` alike; rank 0 gets the model, the others
    serve their experts and leave when rank 0's process ends. ``expert_placement``: ``"id"``
    (contiguous blocks of expert ids) or ``"load"`` (balanced by ``routing_stats``' counts).
    ``dist_init_method``/``dist_rank``: an explicit rendezvous (``tcp://HOST:PORT`` for every rank,
    each its own rank) instead of torchrun's environment.

    The returned model carries ``model.hetmoe`` (a HybridRuntime): placement, timing, routing
    statistics (``save_routing_stats()``).
    """
    started = time.perf_counter()
    p = Path(path)
    directory = p if p.is_dir() else p.parent
    source = open_source(p)
    layout = moe_layout(read_config(p), source)
    gguf = None
    if layout.style == "gguf":  # llama.cpp's metadata and names, seen as transformers' (gguf_model.py)
        from .gguf_model import GGUFModel

        gguf = GGUFModel(p, source, layout)
        source, layout = gguf.source, gguf.layout
    adapter_cls = adapter_class(layout.model_type)  # aliases (kimi_k2) already resolved by the layout
    config = gguf.config if gguf is not None else _transformers_config(directory, adapter_cls)
    adapter = adapter_cls(config)
    model_dtype = _model_dtype(dtype, config, source)
    dev = torch.device(device)
    if method is not None and method not in ENGINE_METHODS and not _is_gguf_method(method):
        raise ValueError(
            f"method {method!r}: load_model converts experts to {', '.join(ENGINE_METHODS[:-1])} or a GGUF type "
            "hetmoe quantizes (gguf:q4_0, gguf:q8_0, gguf:q4_k, gguf:q6_k, ...), or runs them as stored (None)"
        )
    if method is None and group_size is not None:
        raise ValueError("group_size needs a method to convert to (e.g. method='int4')")
    params = {"group_size": group_size} if group_size is not None else {}
    if expert_backend not in ("auto", "engine", "torch"):
        raise ValueError(f"expert_backend {expert_backend!r}: expected 'auto', 'engine' or 'torch'")
    dense_method = resolve_dense_method(dense_method, dev)  # None on a CPU load: as stored (dense_engine.py)
    ranks = None
    if expert_parallel is not None:
        incompatible = {
            "gpu_experts": gpu_experts or gpu_experts_total,
            "prefill_threshold": prefill_threshold,
            "defer_experts": defer_experts,
            "replace_every": replace_every,
            "expert_backend='torch'": expert_backend == "torch",
        }
        ranks = start_group(expert_parallel, expert_placement, incompatible, dist_init_method, dist_rank)
    if cpu_threads is not None:
        set_num_threads(cpu_threads)
    if check_memory:
        plan_memory(
            p,
            method,
            dense_method if dense_method != STORED else None,
            device=dev,
            gpu_experts=gpu_experts,
            group_size=group_size,
            dense_group_size=dense_group_size,
            dtype=model_dtype,
            source=source,
            layout=layout,
            expert_parallel=ranks.world if ranks is not None else 1,
            rank=ranks.rank if ranks is not None else 0,
        ).check()

    check_modes(prefill_threshold, prefill_chunk_bytes, defer_experts, layout.top_k)
    frequencies = load_routing(routing_stats, layout.num_experts) if routing_stats is not None else None
    plan = plan_placement(
        placement, layout.moe_layers, layout.num_experts, gpu_experts, gpu_experts_total, frequencies, seed
    )
    shares = placements(layout, ranks.world, expert_placement, frequencies) if ranks is not None else {}
    if ranks is not None and not ranks.main:
        _serve_expert_share(source, layout, adapter, method, params, ranks, shares, config, expert_backend)

    model = _meta_model(config, model_dtype)
    stats = RuntimeStats(layout.num_experts, layout.top_k, layout.model_type, record_routing=record_routing is not None)
    modules = gguf.layers_prefix if gguf is not None else layout.prefix  # GGUF's blk.N: model.layers.N
    hybrids = _replace_blocks(model, adapter, layout, stats, model_dtype, dev, modules)
    dense = None
    if dense_method is not None:
        keep_fp32 = _fp32_patterns(model, model_dtype)
        dense = DenseConverter(
            model,
            dense_method,
            dense_group_size,
            list(hybrids.values()),
            keep_fp32,
            gemv_max_tokens,
            keep_torch=weight_read_linears(adapter),
            dtype=model_dtype,
        )
    layer_keys = _layer_keys(source, layout)
    keeps_views = method is None and layout.style != "per_expert"  # per-expert tensors are stacked (a copy)
    reader = _ReadAhead(source, [layer_keys[x][0] for x in layout.moe_layers], keeps_views)
    bar = _progress_bar(sum(b for _, b in layer_keys.values()), progress)
    try:
        reader.start(0)  # the first MoE layer comes off the disk while the rest of the model loads
        _load_non_experts(model, source, adapter, model_dtype, dev, config, dense)
        dense_notes = dense.finish(model) if dense is not None else []
        _materialize_leftovers(model, dev)

        methods = set()
        for index, layer in enumerate(layout.moe_layers):
            reader.start(index + 1)  # the disk reads the next layer while this one converts and packs
            reader.wait(index)
            experts = read_layer_experts(source, layout, layer, method, quantize=engine_quantize, **params)
            bar.set_postfix_str(f"layers {index + 1}/{len(layout.moe_layers)}", refresh=False)
            bar.update(layer_keys[layer][1])
            release_freed_memory()  # the reader's validation and conversion temporaries
            if ranks is not None:  # this rank's share here, the rest on the other ranks
                own = _cpu_backend(shard(experts, shares[layer], 0), adapter, layout, gemv_max_tokens, expert_backend)
                backend: ExpertBackend = RemoteExperts(ranks, layer, shares[layer], own)
            else:
                backend = _cpu_backend(experts, adapter, layout, gemv_max_tokens, expert_backend)
            methods.add(backend.gate.method)
            hybrids[layer].attach(backend, plan.get(layer, []), experts.biases)
            if replace_every:
                hybrids[layer].enable_replacement(replace_every, replace_margin)
            del experts
            release_freed_memory()
    finally:  # the read-ahead thread and the bar end with the load, failed or not
        reader.close()
        bar.close()

    model.eval()
    model.requires_grad_(False)
    if dev.type == "cpu":
        torch_threads_note = _one_torch_thread()
        use_cpu_attention(model)  # torch's CPU SDPA is slow for one-token queries (cpu_attention.py)
        fuse_rms_norms(model)  # one engine call per norm instead of ~7 eager ops (fused_norms.py)
        fuse_rotary(model)  # and one per rotary embedding (fused_rope.py)
        install_mla(model, adapter)  # latent attention in the absorbed form (mla_attention.py)
        if gguf is not None and dense_method == STORED:  # W_UK / W_UV decode from the file's attn_k_b / attn_v_b
            attach_stored_heads(model, source)
        install_delta_rule(model)  # Qwen3-Next's one-token delta rule in the engine (delta_rule.py)
        install_fast_decode(model, adapter)  # one-token decoder layers without transformers' glue (fast_decode.py)
    install_prompt_tail(model)  # a prompt's last MLP only for the rows whose logits are kept (prompt_tail.py)
    generate_grows_caches(model)  # generate's own cache appends in place (runtime/kv_cache.py)
    load_generation_config(model, directory)
    model.config._name_or_path = str(p)
    runtime = HybridRuntime(
        layers=hybrids,
        stats=stats,
        method="/".join(sorted(methods)),
        device=dev,
        routing_path=Path(record_routing) if record_routing is not None else None,
        load_seconds=time.perf_counter() - started,
        prefill_threshold=prefill_threshold,
        prefill_chunk_bytes=prefill_chunk_bytes,
        defer_experts=defer_experts,
    )
    if any(isinstance(m.cpu, TorchCPUExperts) for m in hybrids.values()):
        runtime.notes.append(f"{adapter.name}: experts run on the torch CPU fallback, not the engine")
    runtime.notes += dense_notes
    if gguf is not None:
        runtime.notes += gguf.notes
    if dev.type == "cpu" and torch_threads_note:
        runtime.notes.append(torch_threads_note)
    if activation_bits() == 8:  # the explicit lower-accuracy choice, said wherever the notes are shown
        runtime.notes.append("4- to 6-bit GEMVs on int8 activations (HETMOE_ACTIVATION_BITS=8)")
    runtime.layer_paths = layer_paths(model)
    if ranks is not None:
        runtime.notes.append(f"experts split over {ranks.world} processes ({expert_placement} placement)")
        stop_at_exit(ranks, int(config.hidden_size), layout.top_k)
    model.hetmoe = runtime
    return model


def _serve_expert_share(
    source: TensorSource,
    layout: MoELayout,
    adapter: MoEAdapter,
    method: str | None,
    params: dict[str, Any],
    ranks: Ranks,
    shares: dict[int, ExpertPlacement],
    config: Any,
    expert_backend: str,
) -> None:
    """An expert rank's whole life: read its share of every layer (into the backend rank 0 chooses
    for its own share), serve rank 0, leave (never returns)."""
    backends = {}
    for layer in layout.moe_layers:
        experts = read_layer_experts(source, layout, layer, method, quantize=engine_quantize, **params)
        mine = shard(experts, shares[layer], ranks.rank)
        backends[layer] = _cpu_backend(mine, adapter, layout, None, expert_backend)
        del experts
        release_freed_memory()
    freeze_for_decoding()  # this process only serves from here on
    try:
        serve_experts(ranks, backends, int(config.hidden_size), layout.top_k)
    finally:
        leave(ranks)
    raise SystemExit(0)


# --- configuration -------------------------------------------------------------------------------


def _one_torch_thread() -> str | None:
    """A CPU-only model runs its linears, experts and attention on the engine's pool, one thread a
    core; torch is left the small ops between them. torch's OpenMP workers then only spin beside
    the pool's threads after each of those ops and take their cores: measured on a 2-core Xeon,
    DeepSeek-V2-Lite-shaped 4 layers, decode 88.6 ms a token with torch at 2 threads, 61.5 ms at 1.
    So torch gets one intra-op thread; returns the note saying so where that changed it."""
    before = torch.get_num_threads()
    if before == 1:
        return None
    torch.set_num_threads(1)
    return f"torch intra-op threads {before} -> 1: the CPU engine's pool runs on every core"


def _is_gguf_method(method: str) -> bool:
    """A GGUF block type hetmoe can quantize to (``gguf:q4_k``); the engine runs it natively or transcoded."""
    if not method.startswith("gguf:"):
        return False
    try:
        codec = get_codec(method)
    except ValueError:
        return False
    return getattr(codec, "can_quantize", True)


def _transformers_config(directory: Path, adapter_cls: type[MoEAdapter]) -> Any:
    """The transformers config; aliases transformers does not know (kimi_k2) built as their base type."""
    from transformers import CONFIG_MAPPING, AutoConfig

    raw = json.loads((directory / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type in CONFIG_MAPPING:
        return AutoConfig.from_pretrained(str(directory))
    target = adapter_cls.transformers_model_type
    if target is None:
        raise ValueError(f"{directory}: transformers has no model_type {model_type!r}")
    skip = ("model_type", "auto_map", "architectures", "transformers_version")
    return CONFIG_MAPPING[target](**{k: v for k, v in raw.items() if k not in skip})


def _model_dtype(dtype: torch.dtype | str | None, config: Any, source: TensorSource) -> torch.dtype:
    """The requested dtype, else the config's, else the stored embedding's, else bf16."""
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or _stored_dtype(source)
    if isinstance(dtype, str):
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_FLOAT_DTYPES)}")
        dtype = _FLOAT_DTYPES[dtype]
    if dtype not in _FLOAT_DTYPES.values():
        raise ValueError(f"dtype {dtype}: expected bfloat16, float16 or float32")
    return dtype


def _stored_dtype(source: TensorSource) -> torch.dtype:
    for key in source.keys():
        if key.endswith("embed_tokens.weight"):
            dtype = source.info(key).dtype
            if dtype in _FLOAT_DTYPES.values():
                return dtype  # type: ignore[return-value]
    return torch.bfloat16


def _layer_keys(source: TensorSource, layout: MoELayout) -> dict[int, tuple[list[str], int]]:
    """Each MoE layer's stored expert tensors and their bytes."""
    present = set(source.keys())
    out = {}
    for layer in layout.moe_layers:
        keys = sorted(expert_keys(source, layout, layer) & present)
        out[layer] = (keys, sum(source.info(k).nbytes for k in keys))
    return out


class _ReadAhead:
    """Reads each layer's expert tensors on a background thread, one layer ahead of the reader: the
    kernel is asked for all of a layer's bytes at once (``prefetch``, POSIX_FADV_WILLNEED), then,
    where the engine keeps views of the file (a store, fused tensors in their stored precision), they
    are mapped in (``populate``; both release the GIL). Nothing else would read such views before the
    first forwards, so the loader waits for each layer's read (``wait``): the model it returns is in
    memory, and its progress bar moves at the disk's pace."""

    def __init__(self, source: TensorSource, layers: list[list[str]], keeps_views: bool = True) -> None:
        self.prefetch = getattr(source, "prefetch", None)
        # Where the reader copies or converts the bytes, it maps them in itself and lets them go.
        self.populate = getattr(source, "populate", None) if keeps_views else None
        self.layers = layers
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hetmoe-readahead") if self.prefetch else None
        self.reads: dict[int, Future[None]] = {}

    def start(self, index: int) -> None:
        if self.pool is not None and index < len(self.layers):
            self.reads[index] = self.pool.submit(self._fetch, self.layers[index])

    def wait(self, index: int) -> None:
        """Until layer ``index`` is in memory, where this reader maps layers in (a failed read is
        left for the reader to report)."""
        if self.populate is not None and index in self.reads:
            futures_wait([self.reads.pop(index)])

    def _fetch(self, keys: list[str]) -> None:
        assert self.prefetch is not None
        for key in keys:
            self.prefetch(key)
        if self.populate is not None:
            for key in keys:
                self.populate(key)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _progress_bar(total: int, enabled: bool | None) -> Any:
    from tqdm import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(
        total=total,
        desc="loading experts",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not show or total == 0,
        dynamic_ncols=True,
    )


def _meta_model(config: Any, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# --- the model's structure -----------------------------------------------------------------------


def _replace_blocks(
    model: nn.Module,
    adapter: MoEAdapter,
    layout: MoELayout,
    stats: RuntimeStats,
    dtype: torch.dtype,
    device: torch.device,
    prefix: str,
) -> dict[int, HybridMoE]:
    try:
        layers = model.get_submodule(prefix)
    except AttributeError:
        name = type(model).__name__
        raise ValueError(f"the {name} model has no {prefix} (where the checkpoint's layers are)") from None
    hybrids: dict[int, HybridMoE] = {}
    for layer in layout.moe_layers:
        decoder = layers[layer]
        block = getattr(decoder, adapter.block_attr, None)
        if block is None or not adapter.is_moe_block(block):
            found = type(block).__name__ if block is not None else "nothing"
            raise ValueError(
                f"layer {layer}: expected a {' or '.join(adapter.block_classes)} at .{adapter.block_attr}, "
                f"found {found} (config and checkpoint disagree about which layers are MoE)"
            )
        hybrid = HybridMoE(block, adapter, layer, stats, dtype, device)
        setattr(decoder, adapter.block_attr, hybrid)  # the block and its meta experts are dropped
        hybrids[layer] = hybrid
    return hybrids


def _named_tensors(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """``(full name, owner, local name, tensor, is_parameter)`` for parameters and persistent buffers."""
    out = []
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for name, t in mod._parameters.items():
            if t is not None:
                out.append((prefix + name, mod, name, t, True))
        for name, t in mod._buffers.items():
            if t is not None and name not in mod._non_persistent_buffers_set:
                out.append((prefix + name, mod, name, t, False))
    return out


def _fp32_patterns(model: nn.Module, dtype: torch.dtype) -> list[re.Pattern[str]]:
    """transformers' keep-in-fp32 rules (e.g. DeepSeek's router), as from_pretrained applies them."""
    plan_fn = getattr(model, "_get_dtype_plan", None)
    plan = plan_fn(dtype) if plan_fn is not None else {}
    return [re.compile(re.escape(k).replace(r"\*", ".*")) for k, v in plan.items() if v == torch.float32]


def _release(source: TensorSource, key: str) -> None:
    """The file's pages of ``key`` dropped from memory where the source can (a copy holds them now)."""
    release = getattr(source, "release", None)
    if release is not None:
        release(key)


def _load_non_experts(
    model: nn.Module,
    source: TensorSource,
    adapter: MoEAdapter,
    dtype: torch.dtype,
    device: torch.device,
    config: Any,
    dense: DenseConverter | None = None,
) -> None:
    keys = set(source.keys())
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    fp32 = _fp32_patterns(model, dtype)
    table = model.get_input_embeddings()
    embedding: StoredEmbedding | None = None
    missing: list[str] = []
    for name, owner, local, tensor, is_param in _named_tensors(model):
        if name in tied:
            continue
        key = next((k for k in adapter.checkpoint_names(name) if k in keys), None)
        if key is None:
            missing.append(name)
            continue
        info = source.info(key)
        if tuple(info.shape) != tuple(tensor.shape):
            raise CheckpointError(
                info.file, f"tensor {key}: expected shape {list(tensor.shape)} for {name}, found {list(info.shape)}"
            )
        if owner is table and local == "weight" and device.type == "cpu" and not tied:
            stored = _read_stored(source, key, keys, config)
            if stored is not None and stored.method.startswith("gguf:"):
                embedding = StoredEmbedding(stored, tensor.dtype, key)  # its rows decoded as looked up
                continue
        target = torch.float32 if any(p.search(name) for p in fp32) else tensor.dtype
        if dense is not None and dense.wants(owner, local):
            stored = _read_stored(source, key, keys, config)
            if stored is not None and dense.take(owner, local, None, stored):
                _release(source, key)  # runs in the engine as stored, from its copy: never decoded
                continue
        value = _read_dense(source, key, keys, config)
        if dense is not None and dense.take(owner, local, value):
            _release(source, key)  # quantized for the CPU engine as read: never held in full precision
            continue
        # On the CPU in the stored dtype this is the file's own memory-mapped view: no copy.
        value = value.to(device=device, dtype=target if value.is_floating_point() else value.dtype)
        value._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' init skips it
        if is_param:
            owner._parameters[local] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[local] = value
    if missing:
        raise CheckpointError(
            source.path,
            f"{len(missing)} non-expert tensors the model needs are not in the checkpoint, first: {missing[:5]}",
        )
    if embedding is not None:
        model.set_input_embeddings(embedding)
    if tied:
        model.tie_weights()


def _read_stored(source: TensorSource, key: str, keys: set[str], config: Any) -> QuantizedTensor | None:
    """A non-expert weight as the file holds it when that is a quantized format: a GGUF block type
    (gguf_model.py), fp8 with its block or channel scales (DeepSeek-V3, MiniMax-M2 releases); None
    for plain floats."""
    stored = getattr(source, "stored", None)  # GGUFTensors
    if stored is not None:
        return stored(key)
    if not key.endswith(".weight") or source.info(key).dtype != torch.float8_e4m3fn:
        return None
    t = source.get(key)
    if key + "_scale_inv" in keys:
        qc = getattr(config, "quantization_config", None) or {}
        block = qc.get("weight_block_size", [128, 128]) if isinstance(qc, dict) else [128, 128]
        codec, scale = get_codec("fp8", block_size=block), ".weight_scale_inv"
    elif key + "_scale" in keys:
        codec, scale = get_codec("fp8-channel"), ".weight_scale"
    else:
        raise CheckpointError(source.info(key).file, f"tensor {key}: fp8 without a weight_scale_inv or weight_scale")
    s = source.get(key.removesuffix(".weight") + scale)
    if scale == ".weight_scale" and s.dim() == 1:
        s = s.unsqueeze(1)
    return QuantizedTensor(codec.method, tuple(t.shape), {".weight": t, scale: s}, codec.params)


def _read_dense(source: TensorSource, key: str, keys: set[str], config: Any) -> torch.Tensor:
    """A non-expert tensor as floats: fp8 weights dequantized, GGUF blocks decoded."""
    if getattr(source, "stored", None) is None:
        q = _read_stored(source, key, keys, config)
        if q is not None:
            return get_codec(q.method, **q.params).dequantize(q, torch.float32)
    return source.get(key)


def _materialize_leftovers(model: nn.Module, device: torch.device) -> None:
    """Give the tensors no checkpoint holds (rotary inv_freq and other non-persistent buffers) real
    storage and let the model's own ``_init_weights`` compute them, as from_pretrained does."""
    owners: dict[str, nn.Module] = {}
    for mod_name, mod in model.named_modules():
        for name, p in mod._parameters.items():
            if p is not None and p.is_meta:
                raise ValueError(f"{mod_name}.{name}: a parameter that nothing loaded (a bug in the adapter)")
        for name, b in mod._buffers.items():
            if b is not None and b.is_meta:
                fill = math.nan if b.is_floating_point() else 0
                mod._buffers[name] = torch.full(b.shape, fill, dtype=b.dtype, device=device)
                owners[mod_name] = mod
    init = getattr(model, "_init_weights", None)
    for mod_name, mod in owners.items():
        if init is not None:
            with torch.no_grad():
                init(mod)
        for name, b in mod._buffers.items():
            if b is not None and b.is_floating_point() and bool(torch.isnan(b).any()):
                raise ValueError(f"{mod_name}.{name}: a buffer the model's initialisation does not compute")


# --- experts -------------------------------------------------------------------------------------


def release_freed_memory() -> None:
    """Hand the heap memory freed by a layer's temporaries back to the OS (glibc keeps freed
    blocks below its dynamic mmap threshold, and fragmentation leaves most of them unused: without
    this, resident memory grows by about two layers' worth of validation temporaries per layer)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD_ENV = "HETMOE_MMAP_THRESHOLD"


def pin_mmap_threshold() -> int:
    """Fix glibc's mmap threshold at ``HETMOE_MMAP_THRESHOLD`` bytes for a long-running process
    (``hetmoe serve`` calls it); returns the bytes set, 0 where glibc's own rule was left in place
    (the variable unset or 0, or not glibc).

    Blocks of at least the threshold get a mapping of their own, returned to the OS when freed.
    Under glibc's own rule the threshold rises to the size of the largest such block freed so far
    (up to 32 MiB), and from then on blocks of that size (a batch's logits, activations) come from
    the heap, whose freed space can fragment and stay resident. Pinning it keeps the server's RSS
    lower and flatter, at a cost in speed: on 2 vCPUs of a Zen 4, 32 streaming clients of the
    4-layer Qwen3-30B-A3B-shaped Q4_0 GGUF got 108-109 tokens/s with 131072 (glibc's starting
    value) against 135-148 without, and held ~100 MiB less (docs/benchmarks.md). So it is a choice,
    not the default."""
    raw = os.environ.get(MMAP_THRESHOLD_ENV, "").strip()
    try:
        nbytes = int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"{MMAP_THRESHOLD_ENV}={raw!r}: expected a number of bytes (0: glibc's own rule)") from None
    if nbytes <= 0:
        return 0
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return 0
    return nbytes if mallopt(M_MMAP_THRESHOLD, nbytes) == 1 else 0


def _engine_activations() -> set[str]:
    from ..runtime import cpu_experts

    return set(getattr(cpu_experts, "ACTIVATIONS", {"silu": 0}))


def _cpu_backend(
    experts: LayerExperts, adapter: MoEAdapter, layout: MoELayout, gemv_max_tokens: int | None, backend: str
) -> ExpertBackend:
    """CPUExperts when the engine runs these experts; the torch fallback otherwise (or when asked)."""
    act = adapter.engine_activation()
    engine_ok = act is not None and act.get("activation", "silu") in _engine_activations()
    if experts.biases and not act:
        engine_ok = False  # biases only come with an activation that declares them (gpt-oss)
    if backend == "torch" or (backend == "auto" and not engine_ok):
        return TorchCPUExperts(experts.gate, experts.up, experts.down, experts.biases, adapter.activation)
    if not engine_ok:
        raise ValueError(f"{adapter.name}: this build of the CPU engine cannot run these experts (activation {act})")
    stored = experts.gate.method
    if stored not in ENGINE_METHODS and not stored.startswith("gguf:"):
        raise ValueError(
            f"{layout.config_source}: experts are stored as {stored}, which the CPU engine does not run; "
            "pass method='int8', 'int4' or 'bf16' to convert them layer by layer while loading"
        )
    kwargs: dict[str, Any] = dict(act or {})
    for name, bias in experts.biases.items():
        kwargs[f"{name}_bias"] = bias
    return CPUExperts(experts.gate, experts.up, experts.down, gemv_max_tokens=gemv_max_tokens, **kwargs)
