"""Stream a checkpoint's routed experts into an expert store (``hetmoe.checkpoint.store``), layer by layer.

``convert(src, dst, method, group_size)`` reads any source ``open_source`` reads (bf16/fp16/fp32,
fp8 block or channel, compressed-tensors int4, GPTQ, mxfp4, GGUF, another store), converts each MoE
layer's experts to ``method`` and writes the store.

Memory: each layer is read through a freshly opened source, so the previous layer's memory-mapped
pages leave with the old source instead of piling up in the resident set; the engine's quantizer
(passed in as ``quantize``) reads per-expert full-precision weights straight from those pages, and
otherwise ``convert_experts`` bounds the float32 detour; files are written one tensor at a time.
The non-expert tensors are copied the same way, the source re-opened after every ``max(one layer's
source bytes, 64 MiB)``. Peak memory is therefore a small multiple of one layer's experts whatever the model's size.

Atomicity: every file is written under a temporary name, fsynced and renamed
(``atomic.atomic_path``); a progress journal (``hetmoe-progress.json``) records each finished file
with its size and sha256; the manifest (``hetmoe.json``) is written last and the journal removed.
``resume=True`` keeps the journal's files whose size and header still check out and redoes the
rest. Output is deterministic (same source and settings, same bytes), so a resumed store is
byte-identical to an uninterrupted one.

Testing aid: the environment variable ``HETMOE_CONVERT_PAUSE`` (seconds) sleeps before each
finished file is renamed into place, so a test can kill a conversion while a file is half done.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..formats import Codec, FormatError, QuantizedTensor, get_codec
from ..gc_pause import gc_paused
from .atomic import atomic_path, write_atomic, write_text_atomic
from .config import read_config
from .errors import CheckpointError
from .experts import CONVERT_CHUNK_BYTES, PROJECTIONS, Quantizer, codec_of, read_layer_experts
from .layout import MoELayout, fused_suffix, moe_layout
from .safetensors_file import SafetensorsFile, TensorInfo
from .source import TensorSource, open_source
from .store import (
    GGUF_TENSORS_KEY,
    JOURNAL,
    JOURNAL_FORMAT,
    MANIFEST,
    REST_FORMAT,
    STORE_FORMAT,
    STORE_VERSION,
    ExpertStore,
    LayerSpec,
    PlannedTensor,
    WrittenFile,
    check_layer_header,
    expert_prefix,
    is_store_dir,
    layer_file_name,
    layer_metadata,
    layer_tensors,
    read_json_file,
    read_layer_file,
    rest_file_names,
    write_safetensors,
)

# The methods a store holds: hetmoe's CPU formats that can be quantized to.
STORE_METHODS = ("bf16", "fp8", "fp8-channel", "int8", "int4", "int4-asym", "gptq", "mxfp4")
GROUPED_METHODS = ("int4", "int4-asym", "gptq")
REST_SHARD_BYTES = 5 << 30  # non-expert tensors per model-rest shard, as the hubs shard checkpoints
# Files copied from the source directory beside the tensors: configuration, tokenizer, generation
# settings, the tokenizer's own code for remote-code models, and the licence that travels with weights.
COPIED_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "tiktoken.model",
    "tokenization_*.py",
    "configuration_*.py",
    "LICENSE*",
)
PAUSE_ENV = "HETMOE_CONVERT_PAUSE"
_MIN_REOPEN_BYTES = 64 << 20
_FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of every source file: headers live at the start
_EXPERTISH = r"\.(?P<layer>\d+)\.(?:(?:mlp|block_sparse_moe|feed_forward)\.)?experts\."
_GGUF_REST_NOTE = "; GGUF tensors as raw ggml bytes, typed by the file's __metadata__.gguf_tensors"
_GGUF_EXPERTISH = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_\w+_exps\.")


def target_codec(method: str, group_size: int | None = None) -> Codec:
    """The codec a store in ``method`` is written with; clear errors for anything a store cannot hold."""
    choices = ", ".join(STORE_METHODS)
    if method not in STORE_METHODS:
        try:
            codec = get_codec(method)
        except ValueError:  # UnknownMethodError, or a family member that does not exist
            raise FormatError("--method", f"one of {choices}", repr(method)) from None
        if not codec.can_quantize:
            raise FormatError(
                "--method", f"a method hetmoe can quantize to ({choices})", f"{method!r}, a decode-only format"
            )
        raise FormatError(
            "--method",
            f"an expert store method ({choices})",
            repr(method),
            "GGUF files are written by llama.cpp; a store holds hetmoe's CPU formats",
        )
    if group_size is not None and method not in GROUPED_METHODS:
        raise FormatError(
            "--group-size", f"no group size for {method} (only {', '.join(GROUPED_METHODS)} take one)", str(group_size)
        )
    return get_codec(method, **({} if group_size is None else {"group_size": group_size}))


def check_dims(codec: Codec, layout: MoELayout) -> None:
    """Fail before anything is written when the experts' dimensions do not fit the method (group sizes)."""
    h, i = layout.hidden_size, layout.intermediate_size
    for what, (n, k) in (("gate/up", (i, h)), ("down", (h, i))):
        try:
            codec.quantize(torch.ones(1, n, k), f"{what} experts")
        except FormatError as exc:
            fits = [g for g in (256, 128, 64, 32, 16, 8) if h % g == 0 and i % g == 0]
            hint = f"choose a --group-size that divides {h} and {i}, e.g. {fits[0]}" if fits else ""
            if codec.method not in GROUPED_METHODS:
                hint = f"{codec.label()} cannot hold experts of hidden_size={h}, intermediate size={i}"
            raise FormatError(
                f"{codec.label()} for the {what} projections [N={n}, K={k}]", exc.expected, exc.found, hint
            ) from None


# --- the plan: everything decided from headers before DST is touched --------------------------------


@dataclass
class Plan:
    src: Path
    codec: Codec
    config: dict[str, Any]
    layout: MoELayout
    source_kind: str
    expert_scheme: str
    infos: dict[str, TensorInfo]
    expert_keys: dict[int, list[str]]
    rest_shards: list[list[str]]
    unconverted: list[str]
    copies: list[Path]
    fingerprint: str
    source_files: list[str]
    rest_files: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rest_files = rest_file_names(len(self.rest_shards))

    @property
    def method(self) -> str:
        return self.codec.method

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.codec.params)

    @property
    def synthesize_config(self) -> bool:
        return "gguf_architecture" in self.config  # the config came from GGUF metadata: no file to copy

    @property
    def copied_names(self) -> list[str]:
        return (["config.json"] if self.synthesize_config else []) + [p.name for p in self.copies]

    def layer_source_bytes(self, layer: int) -> int:
        return sum(self.infos[k].nbytes for k in self.expert_keys[layer])

    def shard_source_bytes(self, index: int) -> int:
        return sum(self.infos[k].nbytes for k in self.rest_shards[index])

    @property
    def reopen_bytes(self) -> int:
        return max([_MIN_REOPEN_BYTES, *(self.layer_source_bytes(x) for x in self.layout.moe_layers)])

    def layer_spec(self, layer: int) -> LayerSpec:
        lay = self.layout
        return LayerSpec(
            layer,
            lay.layer_prefix(layer),
            self.method,
            self.params,
            lay.num_experts,
            lay.hidden_size,
            lay.intermediate_size,
        )

    def identity(self) -> dict[str, Any]:
        """What ``--resume`` compares: a journal made under other settings must not be continued."""
        return {
            "store_version": STORE_VERSION,
            "method": self.method,
            "params": self.params,
            "source": {"path": str(self.src), "fingerprint": self.fingerprint},
            "moe_layers": list(self.layout.moe_layers),
            "rest_files": self.rest_files,
            "copied": self.copied_names,
        }


def make_plan(src: str | Path, method: str, group_size: int | None = None, shard_bytes: int = REST_SHARD_BYTES) -> Plan:
    codec = target_codec(method, group_size)
    src_path = Path(src).resolve()
    if not src_path.exists():
        raise CheckpointError(src, "no such file or directory")
    source = open_source(src_path)
    config = read_config(src_path)
    layout = moe_layout(config, source)
    check_dims(codec, layout)
    keys = source.keys()
    infos = {k: source.info(k) for k in keys}
    keys_by_layer = {layer: sorted(expert_keys(source, layout, layer) & infos.keys()) for layer in layout.moe_layers}
    used = {k for ks in keys_by_layer.values() for k in ks}
    rest = sorted(k for k in keys if k not in used)
    pattern = _GGUF_EXPERTISH if layout.style == "gguf" else re.compile("^" + re.escape(layout.prefix) + _EXPERTISH)
    moe = set(layout.moe_layers)
    unconverted = [k for k in rest if (m := pattern.match(k)) and int(m["layer"]) in moe]
    copies = [] if "gguf_architecture" in config else _metadata_files(src_path)
    root = src_path if src_path.is_dir() else src_path.parent
    files = sorted({info.file for info in infos.values()} | set(copies))
    return Plan(
        src=src_path,
        codec=codec,
        config=config,
        layout=layout,
        source_kind=_source_kind(source, layout),
        expert_scheme=_describe_scheme(layout, infos, keys_by_layer),
        infos=infos,
        expert_keys=keys_by_layer,
        rest_shards=_shards(rest, infos, shard_bytes),
        unconverted=unconverted,
        copies=copies,
        fingerprint=source_fingerprint(files),
        source_files=[_relative(f, root) for f in files],
    )


def expert_keys(source: TensorSource, layout: MoELayout, layer: int) -> set[str]:
    """The names ``read_layer_experts`` consumes for ``layer``; anything else stays a non-expert tensor."""
    if isinstance(source, ExpertStore):
        return set(source.layer_keys(layer))
    lp = layout.layer_prefix(layer)
    if layout.style == "gguf":
        return {lp + t + s for t in (layout.gate, layout.up, layout.down) if t for s in (".weight", ".bias")}
    codec = layout.scheme.codec()
    h, i = layout.hidden_size, layout.intermediate_size
    if layout.style == "per_expert":
        templates = ((layout.gate, (i, h)), (layout.up or layout.gate, (i, h)), (layout.down, (h, i)))
        return {
            layout.key(layer, t, spec.suffix, e)
            for t, shape in templates
            for spec in codec.tensor_specs(shape)
            for e in range(layout.num_experts)
        }
    out: set[str] = set()
    for t, shape in ((layout.gate, (2 * i, h)), (layout.down, (h, i))):  # fused: whole tensors (+ gpt-oss biases)
        out |= {lp + t + fused_suffix(spec.suffix) for spec in codec.tensor_specs(shape)}
        out.add(lp + t + "_bias")
    return out


def _source_kind(source: TensorSource, layout: MoELayout) -> str:
    if isinstance(source, ExpertStore):
        return "hetmoe-store"
    return "gguf" if layout.style == "gguf" else "safetensors"


def _describe_scheme(layout: MoELayout, infos: dict[str, TensorInfo], expert_keys: dict[int, list[str]]) -> str:
    if layout.style != "gguf":
        return layout.scheme.describe()
    types = sorted({str(infos[k].dtype) for ks in expert_keys.values() for k in ks if k.endswith(".weight")})
    return f"gguf ({', '.join(types)})"


def _shards(names: list[str], infos: dict[str, TensorInfo], limit: int) -> list[list[str]]:
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name in names:
        nbytes = infos[name].nbytes
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _metadata_files(src: Path) -> list[Path]:
    d = src if src.is_dir() else src.parent
    return sorted({p for pattern in COPIED_PATTERNS for p in d.glob(pattern) if p.is_file()})


def _relative(p: Path, root: Path) -> str:
    try:
        return str(p.resolve().relative_to(root))
    except ValueError:
        return str(p)


def source_fingerprint(files: list[Path]) -> str:
    """sha256 over each file's name, size and first and last MiB: cheap, and it changes with any header.

    Headers (safetensors, GGUF) sit at the start of a file, so a re-quantized or re-saved source
    changes the fingerprint; no data of gigabyte files is hashed.
    """
    h = hashlib.sha256()
    for p in sorted(files, key=lambda f: f.name):
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(_FINGERPRINT_SPAN))
            if size > 2 * _FINGERPRINT_SPAN:
                f.seek(-_FINGERPRINT_SPAN, os.SEEK_END)
                h.update(f.read(_FINGERPRINT_SPAN))
    return "sha256:" + h.hexdigest()


# --- the conversion ---------------------------------------------------------------------------------


@dataclass
class ConvertResult:
    dst: Path
    manifest: dict[str, Any]
    layers_converted: int
    layers_reused: int
    source_bytes: int  # source bytes processed in this run
    bytes_written: int  # bytes of tensor files written in this run
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.source_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


@gc_paused()
def convert(
    src: str | Path,
    dst: str | Path,
    method: str,
    group_size: int | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = True,
    shard_bytes: int = REST_SHARD_BYTES,
    log: Callable[[str], None] | None = None,
    quantize: Quantizer | None = None,
) -> ConvertResult:
    """Convert ``src``'s experts to ``method`` into the store ``dst`` (see the module docstring).

    ``quantize``: the engine's quantizer (kernels/quantize.py engine_quantize, which the CLI passes):
    the same bytes as the codecs', on the engine's threads."""
    start = time.perf_counter()
    say = log or (lambda msg: print(msg, file=sys.stderr))
    dst = Path(dst)
    if resume and overwrite:
        raise CheckpointError(dst, "--resume and --overwrite exclude each other")
    plan = make_plan(src, method, group_size, shard_bytes)
    _check_apart(plan.src, dst)
    done = _prepare(dst, plan, resume, overwrite, say)
    _save_journal(dst, plan, done)
    (dst / MANIFEST).unlink(missing_ok=True)  # incomplete until the manifest is written again
    _copy_metadata(plan, dst)

    layers = [x for x in plan.layout.moe_layers if layer_file_name(x) not in done]
    shards = [i for i, name in enumerate(plan.rest_files) if name not in done]
    todo = sum(plan.layer_source_bytes(x) for x in layers) + sum(plan.shard_source_bytes(i) for i in shards)
    written = 0
    bar = _bar(todo, "convert", progress and todo > 0)
    n_layers = len(plan.layout.moe_layers)
    # Files are written (and hashed, fsynced) on a thread while the next layer converts: the disk's
    # write-back and the quantizer overlap. The non-expert shards need no conversion, so they go first
    # and are written while the first layer converts. A file counts as done once its write returned;
    # at most one layer's converted experts wait for the writer.
    writer = ThreadPoolExecutor(1, thread_name_prefix="hetmoe-store-writer")
    pending: list[tuple[int, Future[dict[str, Any]]]] = []  # (source bytes, the file's journal record)

    def finish_oldest() -> None:
        nonlocal written
        source_bytes, future = pending.pop(0)
        record = future.result()
        written += record["bytes"]
        done[record["file"]] = record
        _save_journal(dst, plan, done)
        bar.update(source_bytes)

    try:
        pending += [(plan.shard_source_bytes(i), writer.submit(_write_rest, plan, dst, i)) for i in shards]
        for layer in layers:
            bar.set_postfix_str(f"layers {n_layers - len(layers) + layers.index(layer)}/{n_layers}", refresh=False)
            future = _convert_layer(plan, dst, layer, quantize, writer)
            while pending:  # the files before this layer's, so that no two layers' experts wait
                finish_oldest()
            pending.append((plan.layer_source_bytes(layer), future))
        bar.set_postfix_str(f"layers {n_layers}/{n_layers}", refresh=False)
        while pending:
            finish_oldest()
    finally:
        while pending:  # interrupted: a write already under way still lands in the journal
            try:
                finish_oldest()
            except Exception:  # the first error is the one being raised
                break
        writer.shutdown(wait=True)
        bar.close()
    report = _verify(plan, dst, done, progress) if verify else None
    manifest = build_manifest(plan, done, report)
    write_text_atomic(dst / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    (dst / JOURNAL).unlink(missing_ok=True)
    return ConvertResult(dst, manifest, len(layers), n_layers - len(layers), todo, written, time.perf_counter() - start)


def _bar(total: int, desc: str, enabled: bool, unit: str = "B") -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
    )


def _check_apart(src: Path, dst: Path) -> None:
    d = dst.resolve()
    if d == src or (src.is_dir() and src in d.parents):
        raise CheckpointError(dst, f"the store must not be written into the source {src}")


def _prepare(dst: Path, plan: Plan, resume: bool, overwrite: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Make ``dst`` ready; returns the finished files that can be kept. Refusals leave ``dst`` untouched."""
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(dst, "exists and is not a directory")
    if not dst.exists():
        dst.mkdir(parents=True)
        return {}
    # Temporary files of an interrupted write are not content: a directory holding only those is empty.
    empty = all(p.name.startswith(".") and p.name.endswith(".partial") for p in dst.iterdir())
    if overwrite:
        if not empty and not is_store_dir(dst):
            raise CheckpointError(
                dst, "exists and is not a hetmoe expert store: refusing to overwrite it (choose another DST)"
            )
        _clear_store(dst)
        return {}
    if not resume:
        raise CheckpointError(
            dst,
            "already exists; pass --resume to continue an interrupted conversion into it, or --overwrite to replace it",
        )
    if (dst / JOURNAL).exists():
        recorded = read_json_file(dst / JOURNAL, "progress journal")
        identity, done = recorded.get("plan"), recorded.get("done")
    elif (dst / MANIFEST).exists():
        recorded = read_json_file(dst / MANIFEST, "store manifest")
        identity = recorded.get("plan")
        # Without its SNR: a verification belongs to the run that asked for it (--verify measures again).
        records = [*recorded.get("layers", []), *recorded.get("rest", [])]
        done = {
            r["file"]: {k: v for k, v in r.items() if k != "snr_db"}
            for r in records
            if isinstance(r, dict) and "file" in r
        }
    elif empty:
        return {}
    else:
        raise CheckpointError(
            dst, f"exists but holds no hetmoe conversion to resume (no {JOURNAL} or {MANIFEST}); choose another DST"
        )
    if identity != plan.identity():
        raise CheckpointError(
            dst,
            f"holds a conversion made with other settings ({_differences(identity, plan.identity())}); resume with "
            "the same SRC, --method and --group-size, or start over with --overwrite",
        )
    for partial_file in dst.glob(".*.partial"):  # temporary files of writes a kill interrupted
        partial_file.unlink()
    wanted = {layer_file_name(x): x for x in plan.layout.moe_layers} | dict.fromkeys(plan.rest_files)
    kept = {}
    for name, record in (done if isinstance(done, dict) else {}).items():
        if name in wanted and _still_valid(dst / name, record, plan, wanted[name], say):
            kept[name] = record
    return kept


def _differences(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "unreadable settings"
    diffs = [f"{k}: {old.get(k)!r} then, {v!r} now" for k, v in new.items() if old.get(k) != v]
    return "; ".join(diffs)[:600]


def _still_valid(path: Path, record: Any, plan: Plan, layer: int | None, say: Callable[[str], None]) -> bool:
    """A finished file is kept when its size matches the journal and its header parses (and fits the plan)."""
    if not isinstance(record, dict) or not path.exists() or path.stat().st_size != record.get("bytes"):
        say(f"redoing {path.name}: missing or not the size the journal recorded")
        return False
    try:
        if layer is not None:
            check_layer_header(path, plan.layer_spec(layer))
        else:
            SafetensorsFile(path)
    except (CheckpointError, FormatError, ValueError) as exc:
        say(f"redoing {path.name}: {exc}")
        return False
    return True


def _clear_store(dst: Path) -> None:
    """Remove what an earlier conversion wrote into ``dst`` (and nothing else)."""
    copied: list[str] = []
    for doc_name in (JOURNAL, MANIFEST):
        doc = dst / doc_name
        if doc.exists():
            with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):  # unreadable: nothing to add
                copied += list(json.loads(doc.read_text()).get("plan", {}).get("copied", []))
    patterns = ("experts-L*.safetensors", "model-rest*.safetensors", ".*.partial")
    doomed = {p for pattern in patterns for p in dst.glob(pattern)}
    doomed |= {dst / name for name in copied if "/" not in name}
    for p in sorted(doomed):
        if p.is_file():
            p.unlink()
    for doc_name in (MANIFEST, JOURNAL):  # the journal last: until then the directory still reads as a store
        (dst / doc_name).unlink(missing_ok=True)


def _save_journal(dst: Path, plan: Plan, done: dict[str, Any]) -> None:
    journal = {"format": JOURNAL_FORMAT, "version": STORE_VERSION, "plan": plan.identity(), "done": done}
    write_text_atomic(dst / JOURNAL, json.dumps(journal, indent=1) + "\n")


def _copy_metadata(plan: Plan, dst: Path) -> None:
    if plan.synthesize_config:
        config = {k: v for k, v in plan.config.items() if not k.startswith("_")}
        write_text_atomic(dst / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    for p in plan.copies:
        data = p.read_bytes()
        write_atomic(dst / p.name, lambda tmp, data=data: tmp.write_bytes(data))


def _pause_for_tests() -> None:
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        time.sleep(float(pause))


def _write(path: Path, tensors: list[PlannedTensor], metadata: dict[str, str]) -> WrittenFile:
    with atomic_path(path) as tmp:
        written = write_safetensors(tmp, tensors, metadata)
        _pause_for_tests()
    return written


def _convert_layer(
    plan: Plan, dst: Path, layer: int, quantize: Quantizer | None = None, writer: Executor | None = None
) -> Future[dict[str, Any]]:
    """Read and convert one layer here; write its file on ``writer`` (here where None). The future's
    result is the layer's journal record."""
    # A fresh source per layer: the previous layer's memory maps are released with the old one.
    source = open_source(plan.src)
    experts = read_layer_experts(source, plan.layout, layer, plan.method, quantize=quantize, **plan.params)
    for proj, q in experts.projections.items():
        if q.method != plan.method:  # a pass-through would only differ by a bug in the codecs' labels
            raise CheckpointError(plan.src, f"layer {layer} {proj}: converted to {q.method}, not {plan.method}")
    name = layer_file_name(layer)
    tensors = layer_tensors(experts, plan.layout.layer_prefix(layer))
    shapes = {p: list(q.shape) for p, q in experts.projections.items()}
    biases = sorted(experts.biases)

    def write() -> dict[str, Any]:
        written = _write(dst / name, tensors, layer_metadata(layer, plan.method, plan.params))
        return {
            "layer": layer,
            "file": name,
            "bytes": written.bytes,
            "sha256": written.sha256,
            "source_bytes": plan.layer_source_bytes(layer),
            "shapes": shapes,
            "biases": biases,
        }

    if writer is not None:
        return writer.submit(write)
    future: Future[dict[str, Any]] = Future()
    future.set_result(write())
    return future


class _Pager:
    """Hands out source tensors, re-opening the source after ``budget`` bytes so old maps are released."""

    def __init__(self, path: Path, budget: int) -> None:
        self.path = path
        self.budget = budget
        self.source: TensorSource | None = None
        self.since = 0

    def get(self, name: str) -> torch.Tensor:
        if self.source is None or self.since >= self.budget:
            self.source = None  # dropped first, so its maps go as soon as the last view of them does
            self.source = open_source(self.path)
            self.since = 0
        t = self.source.get(name)
        self.since += t.numel() * t.element_size()
        return t


def _write_rest(plan: Plan, dst: Path, index: int) -> dict[str, Any]:
    names = plan.rest_shards[index]
    pager = _Pager(plan.src, plan.reopen_bytes)
    planned: list[PlannedTensor] = []
    gguf: dict[str, list[Any]] = {}
    for name in names:
        info = plan.infos[name]
        fetch = partial(pager.get, name)
        if isinstance(info.dtype, str):  # a GGUF tensor: kept as its raw ggml bytes, typed in the metadata
            lead = info.shape[:-1]
            raw_shape = (*lead, info.nbytes // max(1, math.prod(lead)))
            planned.append(PlannedTensor(name, torch.uint8, raw_shape, fetch))
            gguf[name] = [info.dtype, list(info.shape)]
        else:
            planned.append(PlannedTensor(name, info.dtype, tuple(info.shape), fetch))
    metadata = {"format": REST_FORMAT, "store_version": str(STORE_VERSION)}
    if gguf:
        metadata[GGUF_TENSORS_KEY] = json.dumps(gguf, sort_keys=True)
    file = plan.rest_files[index]
    written = _write(dst / file, planned, metadata)
    return {
        "file": file,
        "bytes": written.bytes,
        "sha256": written.sha256,
        "source_bytes": plan.shard_source_bytes(index),
        "tensors": len(names),
    }


# --- verification -------------------------------------------------------------------------------------


def _slice(q: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    return QuantizedTensor(
        q.method, (stop - start, *q.shape[1:]), {s: t[start:stop] for s, t in q.tensors.items()}, q.params
    )


def _energies(reference: QuantizedTensor, written: QuantizedTensor) -> tuple[float, float]:
    """(||w||², ||w - ŵ||²) of the dequantized tensors, a bounded chunk of experts at a time."""
    ref_codec, out_codec = codec_of(reference), codec_of(written)
    n_exp, n, k = reference.shape
    chunk = max(1, CONVERT_CHUNK_BYTES // max(1, n * k * 4))
    signal = error = 0.0
    for start in range(0, n_exp, chunk):
        stop = min(n_exp, start + chunk)
        w = ref_codec.dequantize(_slice(reference, start, stop))
        w_hat = out_codec.dequantize(_slice(written, start, stop))
        signal += float(w.square().sum(dtype=torch.float64))
        error += float((w - w_hat).square().sum(dtype=torch.float64))
    return signal, error


def _db(signal: float, error: float) -> float | str:
    """SNR in dB, rounded so that reports are deterministic; "inf" (JSON has no infinity) when exact."""
    if error == 0.0:
        return "inf"
    if signal == 0.0:
        return "-inf"
    return round(10.0 * math.log10(signal / error), 2)


def _verify(plan: Plan, dst: Path, done: dict[str, Any], progress: bool) -> dict[str, Any]:
    """Re-read every written layer and measure it against the source's experts, dequantized."""
    total_signal = total_error = 0.0
    worst: tuple[float, int] | None = None
    bar = _bar(len(plan.layout.moe_layers), "verify", progress, unit="layer")
    try:
        for layer in plan.layout.moe_layers:
            reference = read_layer_experts(open_source(plan.src), plan.layout, layer)
            name = layer_file_name(layer)
            written = read_layer_file(dst / name, plan.layer_spec(layer))
            snr: dict[str, float | str] = {}
            layer_signal = layer_error = 0.0
            for proj in PROJECTIONS:
                signal, error = _energies(reference.projections[proj], written.projections[proj])
                snr[proj] = _db(signal, error)
                layer_signal, layer_error = layer_signal + signal, layer_error + error
            for proj, bias in reference.biases.items():
                if not torch.equal(bias, written.biases.get(proj, torch.empty(0))):
                    raise CheckpointError(dst / name, f"{expert_prefix('', proj)}.bias differs from the source")
            snr["layer"] = _db(layer_signal, layer_error)
            done[name] = {**done[name], "snr_db": snr}
            total_signal, total_error = total_signal + layer_signal, total_error + layer_error
            value = 10 * math.log10(layer_signal / layer_error) if layer_error and layer_signal else math.inf
            if worst is None or value < worst[0]:
                worst = (value, layer)
            bar.update(1)
    finally:
        bar.close()
    return {
        "reference": "the source's experts dequantized to float32",
        "snr_db": _db(total_signal, total_error),
        "worst_layer": worst[1] if worst else None,
    }


# --- the manifest ---------------------------------------------------------------------------------------


def build_manifest(plan: Plan, done: dict[str, Any], verify: dict[str, Any] | None) -> dict[str, Any]:
    """The store's manifest: deterministic (no timestamps), so identical conversions give identical files."""
    lay = plan.layout
    layers = [done[layer_file_name(x)] for x in lay.moe_layers]
    rest = [done[name] for name in plan.rest_files]
    manifest: dict[str, Any] = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "method": plan.method,
        "params": plan.params,
        "codec": plan.codec.label(),
        "bits_per_weight": round(plan.codec.bits_per_weight((lay.intermediate_size, lay.hidden_size)), 4),
        "source": {
            "path": str(plan.src),
            "format": plan.source_kind,
            "experts": plan.expert_scheme,
            "fingerprint": plan.fingerprint,
            "files": plan.source_files,
        },
        "architecture": {
            "model_type": lay.model_type,
            "prefix": lay.prefix,
            "num_layers": lay.num_layers,
            "moe_layers": list(lay.moe_layers),
            "num_experts": lay.num_experts,
            "top_k": lay.top_k,
            "hidden_size": lay.hidden_size,
            "intermediate_size": lay.intermediate_size,
            "source_style": lay.style,
        },
        "tensor_names": {
            "experts": f"{lay.prefix}.<layer>.experts.<gate|up|down><codec suffix>, stacked [E, N, K]",
            "biases": f"{lay.prefix}.<layer>.experts.<gate|up|down>.bias [E, N]",
            "rest": "source names and precision" + (_GGUF_REST_NOTE if plan.source_kind == "gguf" else ""),
        },
        "layers": layers,
        "rest": rest,
        "copied": plan.copied_names,
        "config_from_gguf": plan.synthesize_config,
        "unconverted_expert_tensors": plan.unconverted,
        "totals": {
            "expert_bytes": sum(r["bytes"] for r in layers),
            "rest_bytes": sum(r["bytes"] for r in rest),
            "source_expert_bytes": sum(r["source_bytes"] for r in layers),
        },
        "plan": plan.identity(),
        "hetmoe_version": __version__,
    }
    if verify is not None:
        manifest["verify"] = verify
    return manifest


def format_verify_table(manifest: dict[str, Any]) -> str:
    """The per-layer SNR table ``--verify`` prints."""
    lines = [f"{'layer':>5s} {'gate dB':>9s} {'up dB':>9s} {'down dB':>9s} {'layer dB':>9s}"]
    for rec in manifest["layers"]:
        snr = rec.get("snr_db", {})
        cells = " ".join(f"{_cell(snr.get(k)):>9s}" for k in (*PROJECTIONS, "layer"))
        lines.append(f"{rec['layer']:>5d} {cells}")
    verify = manifest.get("verify")
    if verify:
        lines.append(
            f"model: {_cell(verify['snr_db'])} dB against {verify['reference']} "
            f"({manifest['codec']}); worst layer {verify['worst_layer']}"
        )
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.2f}"
