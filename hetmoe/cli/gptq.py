"""``hetmoe gptq SRC DST``: a 4-bit GPTQ checkpoint of a dense model, for vLLM (CPU backend included)."""

from __future__ import annotations

import argparse
import math
import re
import signal
import sys
import threading
from types import FrameType
from typing import Any

from ..checkpoint.gptq_writer import GPTQOptions, write_gptq

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}

DESC_ACT_REASON = (
    "--desc-act (act-order) is not supported: it permutes the input columns (a non-monotonic g_idx), "
    "which vLLM's CPU GPTQ kernel and hetmoe's readers do not take and which costs a gather per group "
    "everywhere else; GPTQ with --calibrate recovers most of its accuracy gain without it"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gptq",
        help="write a 4-bit GPTQ checkpoint of a dense model that vLLM loads",
        description=(
            "Quantize every linear projection of the attention and MLP blocks of a dense model (Llama, "
            "Qwen2/Qwen3, Mistral, Gemma, Phi, ...) to 4-bit GPTQ: qweight int32 [K/8,N], qzeros int32 "
            "[K/g,N/8], scales fp16 [K/g,N], g_idx. Fused qkv_proj / gate_up_proj are split into "
            "q/k/v and gate/up first. Without --calibrate weights are rounded to nearest (streamed tensor "
            "by tensor); with it, GPTQ compensates rounding errors using Hessians from the calibration "
            "text, one decoder block at a time. DST gets the shards, config.json with quantization_config, "
            "quantize_config.json, the tokenizer and generation files and quantization_report.json "
            "(per-tensor SNR). Writes are atomic: on any error DST is left as it was."
        ),
        epilog=(
            "examples:\n"
            "  hetmoe gptq ./Qwen3-8B ./Qwen3-8B-GPTQ --verify\n"
            "  hetmoe gptq ./Llama-3.1-8B ./out --calibrate wiki.txt --calib-samples 128 --calib-seqlen 512\n"
            "  hetmoe gptq ./model ./out --group-size 32 --asym --skip 'layers\\.0\\.' --skip down_proj\n"
            "  hetmoe gptq ./gemma ./out --quantize-lm-head --overwrite --max-shard-size 2GB\n"
            "\n"
            "vLLM's CPU backend loads symmetric checkpoints (the default) with group size -1, 32, 64 or "
            "128 and N, K multiples of 32; --asym checkpoints (GPTQ v1 zero points) load in vLLM on CUDA "
            "and in GPTQModel/transformers."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="model directory: config.json and safetensors weights (bf16/fp16/fp32)")
    p.add_argument("dst", metavar="DST", help="output directory (absent or empty, or any with --overwrite)")
    p.add_argument(
        "--group-size", type=int, default=128, help="input columns per scale, a multiple of 8 or -1 (default 128)"
    )
    p.add_argument(
        "--asym",
        action="store_true",
        help="per-group zero points from each group's min/max instead of a grid symmetric about code 8",
    )
    p.add_argument(
        "--checkpoint-format",
        choices=("gptq", "gptq_v2"),
        default="gptq",
        help="zero-point storage for --asym: gptq = v1, z-1 (every loader; default), gptq_v2 = z",
    )
    p.add_argument("--quantize-embedding", action="store_true", help="also quantize the token embedding table")
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="also quantize the output head (a tied head is untied: the table stays full precision)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="REGEX",
        help="keep linears whose name matches at full precision (repeatable), e.g. 'layers\\.0\\.' or 'down_proj'",
    )
    p.add_argument("--calibrate", metavar="FILE", help="text file for GPTQ calibration (default: round to nearest)")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--damp", type=float, default=0.01, help="Hessian dampening, fraction of its mean diagonal")
    p.add_argument("--verify", action="store_true", help="re-read the written files, decode independently, check SNR")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST (only once the new one is done)")
    p.add_argument("--max-shard-size", metavar="SIZE", help="shard size limit, e.g. 2GB (default: the input's, or 5GB)")
    p.add_argument("--desc-act", action="store_true", help="rejected: act-order is not supported (see the reason)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    p.set_defaults(run=run)


def parse_size(text: str) -> int:
    """``"2GB"`` -> 2_000_000_000, ``"512MiB"`` -> 536_870_912, ``"1000"`` -> 1000."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB)")
    unit = m[2].lower()
    base = _UNITS[unit[:1] if unit[:1] in "kmgt" and unit else ""]
    if "i" in unit:
        base = 1024 ** " kmgt".index(unit[0])
    return int(float(m[1]) * base)


def run(args: argparse.Namespace) -> int:
    if args.desc_act:
        print(f"hetmoe gptq: error: {DESC_ACT_REASON}", file=sys.stderr)
        return 2
    try:
        max_shard = parse_size(args.max_shard_size) if args.max_shard_size else None
    except ValueError as exc:
        print(f"hetmoe gptq: error: --max-shard-size: {exc}", file=sys.stderr)
        return 2
    options = GPTQOptions(
        group_size=args.group_size,
        sym=not args.asym,
        checkpoint_format=args.checkpoint_format,
        quantize_embedding=args.quantize_embedding,
        quantize_lm_head=args.quantize_lm_head,
        skip=tuple(args.skip),
        calibrate=args.calibrate,
        calib_samples=args.calib_samples,
        calib_seqlen=args.calib_seqlen,
        damp=args.damp,
        verify=args.verify,
        overwrite=args.overwrite,
        max_shard_size=max_shard,
        quiet=args.quiet,
    )
    # A plain kill (SIGTERM) unwinds like Ctrl-C, so the staging directory beside DST is removed.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        report = write_gptq(args.src, args.dst, options)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    elif not args.quiet:
        print(summary(report, args.dst))
    return 0


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def summary(report: dict[str, Any], dst: str) -> str:
    snr = report["snr_db"]
    lines = [
        f"wrote {dst}: {snr['count']} linears, {report['method']}, {report['convention']['checkpoint_format']} "
        f"g{report['convention']['group_size']} {'sym' if report['convention']['sym'] else 'asym'}, "
        f"{report['bits_per_weight']:.3f} bits/weight, {len(report['shards'])} shard(s), {report['seconds']:.1f} s",
        f"SNR dB: mean {snr['mean']:.2f}, min {snr['min']:.2f} ({snr['min_tensor']})",
    ]
    cal = report.get("calibration")
    if cal:
        lines.append(
            f"calibration ({cal['sequences']} seqs, {cal['tokens']} tokens): output SNR mean "
            f"{cal['mean_output_snr_db']:.2f} dB GPTQ vs {cal['mean_rtn_output_snr_db']:.2f} dB round-to-nearest"
        )
    verify = report.get("verify")
    if verify:
        low = verify["min_verified_snr_db"]
        lines.append(f"verify: ok, min decoded SNR {low:.2f} dB" if math.isfinite(low) else "verify: ok")
    for issue in report["vllm_cpu_issues"]:
        lines.append(f"note: vLLM CPU: {issue}")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
