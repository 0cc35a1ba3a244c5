"""``hetmoe convert SRC DST --method M``: write a checkpoint's experts into an expert store."""

from __future__ import annotations

import argparse
import sys

from ..checkpoint.convert import GROUPED_METHODS, STORE_METHODS, convert, format_verify_table
from ..kernels.quantize import engine_quantize

EPILOG = """\
examples:
  hetmoe convert ./DeepSeek-V3 ./dsv3-int4 --method int4 --group-size 32
  hetmoe convert ./Kimi-K2-Thinking ./kimi-int8 --method int8 --verify
  hetmoe convert ./model-Q4_K_M.gguf ./store --method int4
  hetmoe convert ./Qwen3-30B-A3B ./q3-gptq --method gptq --group-size 128 --quiet
  hetmoe convert ./Qwen3-30B-A3B ./q3-gptq --method gptq --group-size 128 --resume   # after an interruption

The store holds config.json and the tokenizer files, hetmoe.json (the manifest, written last),
one experts-LNNN.safetensors per MoE layer and model-rest*.safetensors (every other tensor, as it
was). A store is itself a source: 'hetmoe inspect DST' reads it, and so does the runtime.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint's routed experts to a CPU method, into an expert store",
        description=(
            "Convert the routed experts of a checkpoint (bf16/fp16, fp8 block or per-channel,\n"
            "compressed-tensors int4, GPTQ, mxfp4, GGUF, or another store) to METHOD, one MoE layer at a\n"
            "time with memory bounded by one layer, and write an expert store in DST. Every file is written\n"
            "atomically; an interrupted conversion continues with --resume and ends byte-identical to an\n"
            "uninterrupted one."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="checkpoint directory, safetensors file, index.json, GGUF file or store")
    p.add_argument("dst", metavar="DST", help="the store directory to write (must not exist, see --resume/--overwrite)")
    p.add_argument("--method", required=True, metavar="M", help=f"target method: {', '.join(STORE_METHODS)}")
    p.add_argument(
        "--group-size",
        type=int,
        metavar="G",
        help=f"group size for {', '.join(GROUPED_METHODS)} (default: int4 and int4-asym 32, gptq 128); "
        "must divide the expert dims",
    )
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue an interrupted conversion into DST")
    again.add_argument("--overwrite", action="store_true", help="replace an existing store in DST")
    p.add_argument(
        "--verify",
        action="store_true",
        help="re-read the store and report per-layer SNR against the source (dequantized); kept in hetmoe.json",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary (errors and --verify still print)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    result = convert(
        args.src,
        args.dst,
        args.method,
        args.group_size,
        resume=args.resume,
        overwrite=args.overwrite,
        verify=args.verify,
        progress=not args.quiet,
        log=None if not args.quiet else (lambda msg: None),
        quantize=engine_quantize,
    )
    m = result.manifest
    if not args.quiet:
        reused = f" ({result.layers_reused} already done)" if result.layers_reused else ""
        print(
            f"{result.dst}: {len(m['layers'])} MoE layers in {m['codec']}{reused}; converted "
            f"{result.source_bytes / 2**20:.1f} MiB of source into {result.bytes_written / 2**20:.1f} MiB in "
            f"{result.seconds:.1f} s ({result.mb_per_s:.1f} MB/s)",
            file=sys.stderr,
        )
    if args.verify:
        print(format_verify_table(m))
    return 0
