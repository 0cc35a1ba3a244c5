"""``hetmoe gptq``: write a 4-bit GPTQ checkpoint of a dense model that vLLM (CPU backend included) loads.

The steps, each bounded in memory:

1. Plan, reading headers only: which linears (``gptq_linears``), every output tensor's name,
   dtype and shape, the shards. Every problem a user can fix (a K the group size does not
   divide, an unknown architecture, MoE, an already quantized source, a non-empty destination)
   is reported here, before anything is written.
2. Produce tensor by tensor into a staging directory beside DST: quantized linears by
   round-to-nearest straight from the memory-mapped source, or with ``--calibrate`` by GPTQ,
   block after block (``gptq_calibrate``); every other tensor is copied as stored. Shards are
   streamed (``safetensors_stream``), each file atomic.
3. Copy tokenizer and generation files, write ``quantize_config.json`` and the report, verify
   if asked (``gptq_verify``: an independent decoder reading the files back), ``config.json``
   last, then move the staging directory into place. Any failure leaves DST as it was.

On-disk convention (DESIGN.md, gptq row): ``qweight`` int32 ``[K/8, N]``, ``qzeros`` int32
``[K/g, N/8]``, ``scales`` fp16 ``[K/g, N]``, ``g_idx`` int32 ``[K]`` = k // g. Symmetric
checkpoints are vLLM's ``uint4b8`` (``w = (q - 8) * s``, qzeros the classic constant);
asymmetric ones store real zero points in GPTQ v1 (``z - 1``, ``checkpoint_format: "gptq"``)
by default, the convention every GPTQ loader reads; ``gptq_v2`` (``z``) on request.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..formats.base import QuantizedTensor, snr_db
from ..formats.gptq import GPTQCodec
from .atomic import write_text_atomic
from .errors import CheckpointError
from .gptq_linears import LinearPlan, LinearSpec, find_linears, modules_in_block_to_quantize, reject_moe
from .gptq_solver import DEFAULT_DAMP, gptq_quantize
from .gptq_verify import SUFFIXES, GPTQDecodeError, open_written, verify_written
from .safetensors_stream import (
    DEFAULT_MAX_SHARD_BYTES,
    PlannedTensor,
    open_shard,
    plan_shards,
    shard_file_names,
    write_index,
)
from .source import MultiFileSource, TensorSource, open_source

REPORT_FILE = "quantization_report.json"
QUANTIZE_CONFIG_FILE = "quantize_config.json"
# Files of a model directory that are weights (replaced by the output shards) or rewritten here.
_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|gguf|ckpt|h5|msgpack|onnx)$|\.index\.json$")
_REWRITTEN = {"config.json", QUANTIZE_CONFIG_FILE, REPORT_FILE}
_FLOAT_SOURCES = (torch.bfloat16, torch.float16, torch.float32)
VLLM_CPU_GROUP_SIZES = (-1, 32, 64, 128)


class GPTQWriteError(CheckpointError):
    """A checkpoint cannot be written as asked; nothing at DST was changed."""


class GPTQVerifyError(CheckpointError):
    """The written files do not decode to what the quantizer reported; DST was left as it was."""


@dataclass
class GPTQOptions:
    group_size: int = 128
    sym: bool = True
    checkpoint_format: str = "gptq"
    quantize_embedding: bool = False
    quantize_lm_head: bool = False
    skip: tuple[str, ...] = ()
    calibrate: str | None = None
    calib_samples: int = 128
    calib_seqlen: int = 512
    damp: float = DEFAULT_DAMP
    verify: bool = False
    overwrite: bool = False
    max_shard_size: int | None = None
    quiet: bool = False


@dataclass
class _Item:
    """One output tensor: where it goes and how to make it (called once, in production order)."""

    planned: PlannedTensor
    produce: Callable[[], torch.Tensor]
    block: int | None = None


@dataclass
class _Progress:
    bar: Any = None

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)


@dataclass
class _Quantizer:
    """Quantized tensors of the linears on demand: RTN per tensor, or GPTQ one block at a time."""

    source: TensorSource
    codec: GPTQCodec
    plan: LinearPlan
    damp: float
    calibrator: Any = None  # gptq_calibrate.LayerwiseCalibrator with --calibrate
    progress: _Progress = field(default_factory=_Progress)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    _cache: dict[str, QuantizedTensor] = field(default_factory=dict)
    _next_block: int = 0

    def original(self, spec: LinearSpec) -> torch.Tensor:
        weight = self.source.get(spec.source)
        return weight[spec.rows[0] : spec.rows[1]].float()

    def quantized(self, spec: LinearSpec) -> QuantizedTensor:
        if spec.name not in self._cache:
            self._cache.clear()
            if self.calibrator is not None and spec.role != "embedding":
                self._calibrate_until(spec)
            if spec.name not in self._cache:
                self._rtn(spec)
        return self._cache[spec.name]

    def _rtn(self, spec: LinearSpec) -> None:
        weight = self.original(spec)
        q = self.codec.quantize(weight, spec.name)
        self._cache[spec.name] = q
        self._record(spec, weight, q, None)

    def _record(
        self, spec: LinearSpec, weight: torch.Tensor, q: QuantizedTensor, stats: Any, approx: torch.Tensor | None = None
    ) -> None:
        entry: dict[str, Any] = {
            "shape": list(spec.shape),
            "snr_db": snr_db(weight, self.codec.dequantize(q) if approx is None else approx),
            "bits_per_weight": self.codec.bits_per_weight(spec.shape),
            "source": spec.source,
            "role": spec.role,
            "method": "rtn" if stats is None else "gptq",
        }
        if spec.rows != (0, self.source.info(spec.source).shape[0]):
            entry["rows"] = list(spec.rows)
        if stats is not None:
            entry["calibration"] = asdict(stats)
        self.records[spec.name] = entry

    def _calibrate_until(self, spec: LinearSpec) -> None:
        last = spec.block if spec.block is not None else len(self.calibrator.layers) - 1
        while self._next_block <= last:
            self._calibrate_block(self._next_block)
            self._next_block += 1
        if spec.role == "lm_head":
            self.progress.describe("calibrating lm_head")
            hessian = self.calibrator.head_hessian()
            if hessian is None:
                self.plan.notes.append("no final norm found before the head: lm_head rounded to nearest")
                return
            self._gptq(spec, self.original(spec), hessian)

    def _calibrate_block(self, index: int) -> None:
        self.progress.describe(f"calibrating block {index}")
        specs = [s for s in self.plan.quantized() if s.block == index]
        by_module: dict[str, list[LinearSpec]] = {}
        for s in specs:
            by_module.setdefault(s.module, []).append(s)

        def quantize(module: str, weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
            out = weight.clone()
            for s in by_module[module]:
                out[s.rows[0] : s.rows[1]] = self._gptq(s, weight[s.rows[0] : s.rows[1]], hessian)
            return out

        self.calibrator.run_block(index, set(by_module), quantize)
        self.progress.describe("writing")

    def _gptq(self, spec: LinearSpec, weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
        """GPTQ ``spec`` (cached for writing); returns the dequantized weight the model continues with."""
        q, stats = gptq_quantize(weight, hessian, self.codec, self.damp, name=spec.name)
        approx = self.codec.dequantize(q)
        self._cache[spec.name] = q
        self._record(spec, weight, q, stats, approx)
        return approx


def write_gptq(src: str | Path, dst: str | Path, options: GPTQOptions | None = None) -> dict[str, Any]:
    """Write the GPTQ checkpoint of ``src`` into ``dst``; returns the report (also in ``dst``)."""
    opts = options or GPTQOptions()
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    config = _check_paths(src, dst, opts)
    codec = GPTQCodec(opts.group_size, opts.sym, opts.checkpoint_format)
    source = open_source(src)
    files = source.files if isinstance(source, MultiFileSource) else [source]
    if any(f.path.suffix == ".gguf" for f in files):
        raise GPTQWriteError(src, "hetmoe gptq reads safetensors checkpoints, not GGUF")
    reject_moe(config, list(source.keys()), src)
    plan = find_linears(
        source,
        config,
        src,
        quantize_embedding=opts.quantize_embedding,
        quantize_lm_head=opts.quantize_lm_head,
        skip=opts.skip,
    )
    _check_specs(plan, source, codec)

    calibrator = None
    if opts.calibrate:
        from .gptq_calibrate import LayerwiseCalibrator, calibration_samples

        if plan.found_by != "modules":
            raise GPTQWriteError(src, "--calibrate needs transformers to build this architecture; it cannot")
        samples = calibration_samples(src, Path(opts.calibrate), opts.calib_samples, opts.calib_seqlen)
        calibrator = LayerwiseCalibrator(src, source, samples)

    quantizer = _Quantizer(source, codec, plan, opts.damp, calibrator)
    items = _items(plan, source, codec, quantizer)
    max_bytes = opts.max_shard_size or _input_shard_limit(source)
    shards = plan_shards([i.planned for i in items], max_bytes)
    names = shard_file_names(len(shards))

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        _write_shards(staging, items, shards, names, quantizer, opts.quiet)
        write_index(staging, shards, names)
        copied = _copy_side_files(src, staging)
        qc = quantization_config(plan, codec, opts)
        write_text_atomic(staging / QUANTIZE_CONFIG_FILE, json.dumps(qc, indent=2) + "\n")
        report = _report(src, config, plan, codec, opts, quantizer, shards, names, copied, calibrator)
        if opts.verify:
            report["verify"] = _verify(staging, plan, quantizer, codec, items)
        seconds = time.perf_counter() - start
        report["seconds"] = round(seconds, 3)
        report["params_per_second"] = round(report["quantized_params"] / max(seconds, 1e-9))
        write_text_atomic(staging / REPORT_FILE, json.dumps(report, indent=2) + "\n")
        if opts.verify and not report["verify"]["ok"]:
            raise GPTQVerifyError(dst, f"--verify failed: {_verify_failure(report['verify'])}; DST was left as it was")
        write_text_atomic(staging / "config.json", json.dumps(_output_config(config, plan, qc), indent=2) + "\n")
        _publish(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report


# -- checks ----------------------------------------------------------------------------------------


def _check_paths(src: Path, dst: Path, opts: GPTQOptions) -> dict[str, Any]:
    if not src.is_dir():
        raise GPTQWriteError(src, "SRC must be a model directory (config.json and safetensors weights)")
    config_file = src / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise GPTQWriteError(config_file, f"cannot read the model config: {exc}") from None
    if not isinstance(config, dict):
        raise GPTQWriteError(config_file, "config.json must hold a JSON object")
    qc = config.get("quantization_config")
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        why = " (desc_act / act-order is not supported either)" if isinstance(qc, dict) and qc.get("desc_act") else ""
        raise GPTQWriteError(
            config_file,
            f"the source is already quantized (quantization_config quant_method {method!r}){why}: "
            "hetmoe gptq needs a full-precision (bf16/fp16/fp32) checkpoint",
        )
    if opts.group_size != -1 and (opts.group_size <= 0 or opts.group_size % 8):
        raise GPTQWriteError(src, f"--group-size must be -1 or a positive multiple of 8, found {opts.group_size}")
    if opts.checkpoint_format not in ("gptq", "gptq_v2"):
        raise GPTQWriteError(src, f"checkpoint format must be gptq or gptq_v2, found {opts.checkpoint_format!r}")
    if not 0.0 < opts.damp < 1.0:
        raise GPTQWriteError(src, f"--damp must lie in (0, 1), found {opts.damp}")
    if opts.calib_samples < 1 or opts.calib_seqlen < 2:
        raise GPTQWriteError(src, "--calib-samples must be >= 1 and --calib-seqlen >= 2")
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or d in s.parents:
        raise GPTQWriteError(dst, f"DST must lie outside SRC ({src}) and not contain it")
    if dst.exists():
        if not dst.is_dir():
            raise GPTQWriteError(dst, "DST exists and is not a directory")
        if any(dst.iterdir()) and not opts.overwrite:
            raise GPTQWriteError(dst, "DST exists and is not empty; pass --overwrite to replace it")
    return config


def _check_specs(plan: LinearPlan, source: TensorSource, codec: GPTQCodec) -> None:
    for spec in plan.quantized():
        info = source.info(spec.source)
        if info.dtype not in _FLOAT_SOURCES:
            raise GPTQWriteError(
                info.file, f"{spec.source}: stored as {info.dtype}; hetmoe gptq quantizes bf16/fp16/fp32 weights"
            )
        codec._check_shape(spec.shape, spec.name)  # FormatError names the tensor and the dimension


def vllm_cpu_issues(plan: LinearPlan, codec: GPTQCodec, config: dict[str, Any]) -> list[str]:
    """Why vLLM's CPU backend would refuse this checkpoint (empty when it loads it)."""
    issues = []
    dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype == "float32":
        issues.append("config dtype float32: vLLM's GPTQ kernels take fp16/bf16 inputs; serve with --dtype bfloat16")
    if not codec.sym:
        issues.append(
            "asymmetric GPTQ: vLLM's CPU backend runs GPTQ only as uint4b8 (sym=true); "
            "this checkpoint loads in vLLM on CUDA and in GPTQModel/transformers"
        )
    if codec.group_size not in VLLM_CPU_GROUP_SIZES:
        issues.append(f"group size {codec.group_size}: vLLM's CPU GPTQ path takes {list(VLLM_CPU_GROUP_SIZES)}")
    odd = [s.name for s in plan.quantized() if s.shape[0] % 32 or s.shape[1] % 32]
    if odd:
        issues.append(f"{len(odd)} projections with N or K not a multiple of 32 (first {odd[0]}): CPU kernel limit")
    if any(s.role == "embedding" for s in plan.quantized()):
        issues.append("a quantized embedding table: vLLM (and transformers) read only full-precision tables")
    return issues


# -- planning --------------------------------------------------------------------------------------


def _items(plan: LinearPlan, source: TensorSource, codec: GPTQCodec, quantizer: _Quantizer) -> list[_Item]:
    """Every output tensor in production order: before the blocks, block by block, then the head."""
    block_re = re.compile(rf"^{re.escape(plan.layers_prefix)}\.(\d+)\.") if plan.layers_prefix else None
    replaced = set(plan.consumed)
    for s in plan.quantized():
        if not s.fused and not (s.role == "lm_head" and s.source != "lm_head.weight"):
            replaced.add(s.source)
    pre: list[_Item] = []
    blocks: dict[int, list[_Item]] = {}
    post: list[_Item] = []
    for name in sorted(k for k in source.keys() if k not in replaced):
        info = source.info(name)
        m = block_re.match(name) if block_re else None
        item = _Item(PlannedTensor(name, info.dtype, info.shape), _loader(source, name))  # type: ignore[arg-type]
        if m:
            item.block = int(m[1])
            blocks.setdefault(item.block, []).append(item)
        else:
            pre.append(item)
    for spec in plan.specs:
        out = _spec_items(spec, source, codec, quantizer)
        if spec.block is not None:
            blocks.setdefault(spec.block, []).extend(out)
        elif spec.role == "embedding":
            pre.extend(out)
        else:
            post.extend(out)
    return pre + [i for b in sorted(blocks) for i in blocks[b]] + post


def _loader(source: TensorSource, name: str) -> Callable[[], torch.Tensor]:
    return lambda: source.get(name)


def _spec_items(spec: LinearSpec, source: TensorSource, codec: GPTQCodec, quantizer: _Quantizer) -> list[_Item]:
    items = []
    a, b = spec.rows
    if spec.quantize:
        for ts in codec.tensor_specs(spec.shape):
            produce = (lambda suffix: lambda: quantizer.quantized(spec).tensors[suffix])(ts.suffix)
            items.append(_Item(PlannedTensor(spec.name + ts.suffix, ts.dtype, ts.shape), produce, spec.block))
    elif spec.fused:
        dtype = source.info(spec.source).dtype
        items.append(
            _Item(
                PlannedTensor(f"{spec.name}.weight", dtype, spec.shape),  # type: ignore[arg-type]
                lambda: source.get(spec.source)[a:b].contiguous(),
                spec.block,
            )
        )
    if spec.fused and spec.bias:
        bias = spec.bias
        dtype = source.info(bias).dtype
        items.append(
            _Item(
                PlannedTensor(f"{spec.name}.bias", dtype, (b - a,)),  # type: ignore[arg-type]
                lambda: source.get(bias)[a:b].contiguous(),
                spec.block,
            )
        )
    return items


def _input_shard_limit(source: TensorSource) -> int:
    """The input's own shard size when it is sharded (its largest file), else transformers' 5 GB."""
    if isinstance(source, MultiFileSource) and len(source.files) > 1:
        return max(f.path.stat().st_size for f in source.files)
    return DEFAULT_MAX_SHARD_BYTES


# -- writing ---------------------------------------------------------------------------------------


def _write_shards(
    directory: Path,
    items: list[_Item],
    shards: list[list[PlannedTensor]],
    names: list[str],
    quantizer: _Quantizer,
    quiet: bool,
) -> None:
    from tqdm import tqdm

    by_name = {i.planned.name: i for i in items}
    with tqdm(total=len(items), unit="tensor", desc="writing", file=sys.stderr, disable=quiet) as bar:
        quantizer.progress.bar = bar
        for shard, file in zip(shards, names, strict=True):
            with open_shard(directory / file, shard) as writer:
                for planned in shard:
                    writer.write(planned.name, by_name[planned.name].produce())
                    bar.update(1)
        quantizer.progress.bar = None


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer, generation config, chat template, license...: every non-weight file of SRC."""
    copied = []
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name in _REWRITTEN or _WEIGHT_FILE.search(f.name) or f.name.startswith("."):
            continue
        shutil.copyfile(f, dst / f.name)
        copied.append(f.name)
    return copied


def quantization_config(plan: LinearPlan, codec: GPTQCodec, opts: GPTQOptions) -> dict[str, Any]:
    """``quantization_config`` as vLLM (gptq / gptq_marlin / cpu), transformers and GPTQModel read it."""
    lm_head = any(s.role == "lm_head" for s in plan.quantized())
    method = "gptq" if opts.calibrate else "rtn"
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": codec.group_size,
        "desc_act": False,
        "sym": codec.sym,
        "lm_head": lm_head,
        "true_sequential": True,
        "static_groups": False,
        "damp_percent": opts.damp,
        "checkpoint_format": codec.checkpoint_format,  # vLLM's and older transformers' key
        "format": codec.checkpoint_format,  # transformers 5 / GPTQModel's key
        "pack_dtype": "int32",
        "modules_in_block_to_quantize": modules_in_block_to_quantize(plan),
        "meta": {"quantizer": [f"hetmoe:{__version__}"], "method": method},
    }


def _output_config(config: dict[str, Any], plan: LinearPlan, qc: dict[str, Any]) -> dict[str, Any]:
    out = dict(config)
    out["quantization_config"] = qc
    if plan.tied and qc["lm_head"]:
        out["tie_word_embeddings"] = False
        if isinstance(out.get("text_config"), dict):
            out["text_config"] = {**out["text_config"], "tie_word_embeddings": False}
    return out


def _report(
    src: Path,
    config: dict[str, Any],
    plan: LinearPlan,
    codec: GPTQCodec,
    opts: GPTQOptions,
    quantizer: _Quantizer,
    shards: list[list[PlannedTensor]],
    names: list[str],
    copied: list[str],
    calibrator: Any,
) -> dict[str, Any]:
    tensors = {s.name: quantizer.records[s.name] for s in plan.quantized()}
    snrs = [t["snr_db"] for t in tensors.values()]
    params = sum(math.prod(s.shape) for s in plan.quantized())
    qbytes = sum(ts.nbytes for s in plan.quantized() for ts in _planned(codec, s))
    worst = min(tensors, key=lambda n: tensors[n]["snr_db"])
    report: dict[str, Any] = {
        "tool": f"hetmoe {__version__} gptq",
        "source": str(src),
        "options": {k: v for k, v in asdict(opts).items() if k not in ("quiet", "overwrite")},
        "convention": {
            "bits": 4,
            "group_size": codec.group_size,
            "sym": codec.sym,
            "checkpoint_format": codec.checkpoint_format,
            "zero_points": "none: w = (q - 8) * s (vLLM uint4b8)"
            if codec.sym
            else ("stored z - 1 (GPTQ v1)" if codec.checkpoint_format == "gptq" else "stored z (GPTQ v2)"),
        },
        "method": "gptq" if calibrator is not None else "rtn",
        "linears_found_by": plan.found_by,
        "tensors": tensors,
        "snr_db": {"mean": sum(snrs) / len(snrs), "min": min(snrs), "min_tensor": worst, "count": len(snrs)},
        "bits_per_weight": 8.0 * qbytes / params,
        "quantized_params": params,
        "kept_full_precision": sorted(s.name for s in plan.specs if not s.quantize),
        "shards": names,
        "bytes_written": sum(t.nbytes for shard in shards for t in shard),
        "copied_files": copied,
        "vllm_cpu_issues": vllm_cpu_issues(plan, codec, config),
        "notes": plan.notes,
    }
    if calibrator is not None:
        cal = [t["calibration"] for t in tensors.values() if "calibration" in t]
        report["calibration"] = {
            "text": opts.calibrate,
            "sequences": len(calibrator.samples),
            "tokens": calibrator.tokens,
            "damp_percent": opts.damp,
            "mean_output_snr_db": sum(c["output_snr_db"] for c in cal) / max(len(cal), 1),
            "mean_rtn_output_snr_db": sum(c["rtn_output_snr_db"] for c in cal) / max(len(cal), 1),
        }
    return report


def _planned(codec: GPTQCodec, spec: LinearSpec) -> list[PlannedTensor]:
    return [PlannedTensor(spec.name + t.suffix, t.dtype, t.shape) for t in codec.tensor_specs(spec.shape)]


def _verify(
    directory: Path, plan: LinearPlan, quantizer: _Quantizer, codec: GPTQCodec, items: list[_Item]
) -> dict[str, Any]:
    """Re-read the staged files: every quantized weight decoded independently, every copy byte-equal."""
    expected = [
        (s.name, (lambda spec: lambda: quantizer.original(spec))(s), quantizer.records[s.name]["snr_db"])
        for s in plan.quantized()
    ]
    problem = ""
    try:
        results = verify_written(
            directory, expected, sym=codec.sym, checkpoint_format=codec.checkpoint_format, group_size=codec.group_size
        )
    except GPTQDecodeError as exc:
        return {"ok": False, "problem": str(exc), "tensors": []}
    quantized_names = {s.name + suffix for s in plan.quantized() for suffix in SUFFIXES}
    get, written = open_written(directory)
    planned = {i.planned.name for i in items}
    if planned != written:
        problem = f"written tensor names differ from the plan: {sorted(planned ^ written)[:5]}"
    for item in items:
        name = item.planned.name
        if name in quantized_names or name not in written:
            continue
        if not torch.equal(get(name), item.produce()):
            problem = f"{name} differs from the source"
            break
    rows = [
        {"name": r.name, "reported_snr_db": r.reported_snr_db, "verified_snr_db": r.verified_snr_db, "ok": r.ok}
        for r in results
    ]
    return {
        "ok": all(r["ok"] for r in rows) and not problem,
        "tolerance_db": 0.01,
        "min_verified_snr_db": min((r["verified_snr_db"] for r in rows), default=math.inf),
        "problem": problem,
        "tensors": rows,
    }


def _verify_failure(verify: dict[str, Any]) -> str:
    bad = [r for r in verify["tensors"] if not r["ok"]]
    parts = []
    if bad:
        worst = ", ".join(f"{r['name']} {r['verified_snr_db']:.2f} dB < {r['reported_snr_db']:.2f} dB" for r in bad[:3])
        parts.append(f"{len(bad)} tensors decode below the SNR the quantizer reported ({worst})")
    if verify.get("problem"):
        parts.append(verify["problem"])
    return "; ".join(parts)


def _publish(staging: Path, dst: Path) -> None:
    """Move the finished staging directory to ``dst``, replacing what is there only at the last step."""
    # Temporary files and directories are private (0600/0700); a model directory is for every reader.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    for f in staging.iterdir():
        os.chmod(f, 0o666 & ~umask)
    backup = None
    if dst.exists():
        backup = dst.parent / f".{dst.name}.old-{os.getpid()}"
        os.replace(dst, backup)
    try:
        os.replace(staging, dst)
    except BaseException:
        if backup is not None:
            os.replace(backup, dst)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    try:
        fd = os.open(dst.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
