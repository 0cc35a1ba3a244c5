"""``hetmoe bench moe``: benchmark one MoE layer's experts; see hetmoe/bench/moe.py."""

from __future__ import annotations

import argparse
import sys

from ..bench.moe import DEFAULT_TOKENS, BenchConfig, format_table, plot_roofline, run_bench, write_json
from ..models.shapes import SHAPES


def _csv(kind: type) -> object:
    """argparse type: a comma-separated list of ``kind``."""

    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, found {text!r}") from None

    return parse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: 'hetmoe bench moe' times one MoE layer's experts")
    bsub = p.add_subparsers(dest="bench", metavar="WHAT")
    m = bsub.add_parser(
        "moe",
        help="one MoE layer's routed experts per method and token count, against the torch baseline",
        description=(
            "Builds one MoE layer of a real model's shape with random weights in each method's stored layout, routes "
            "tokens uniformly at random over all experts (redrawn each repetition, so decode reads DRAM, not cache) "
            "and times hetmoe's engine and a torch loop over experts in the same run. Prints median/min/max ms, GB/s "
            "of expert bytes touched, GFLOP/s, relative error against the float64 reference, and the fraction of the "
            "machine's measured bandwidth and FMA peak."
        ),
        epilog="examples:\n  hetmoe bench moe\n  hetmoe bench moe --methods int4 --tokens 1,512 --json out.json\n"
        "  hetmoe bench moe --shape deepseek-v3 --experts 32 --plot roofline.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument(
        "--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES), help="model shape (default qwen3-30b-a3b)"
    )
    m.add_argument("--methods", type=_csv(str), default=("bf16", "int8", "int4"), help="comma-separated methods")
    m.add_argument("--tokens", type=_csv(int), default=DEFAULT_TOKENS, help="comma-separated token counts")
    m.add_argument("--threads", type=int, default=0, help="engine threads (default: all usable CPUs)")
    m.add_argument("--experts", type=int, help="use fewer experts than the shape has, to fit memory")
    m.add_argument("--group-size", type=int, default=32, help="int4 group size (default 32)")
    m.add_argument("--isa", default="auto", help="kernel variant: auto, avx2, avx512, amx")
    m.add_argument("--no-baseline", action="store_true", help="skip the torch baseline")
    m.add_argument("--min-seconds", type=float, default=1.0, help="minimum time per measurement (default 1)")
    m.add_argument("--json", metavar="FILE", help="write the records as JSON")
    m.add_argument("--plot", metavar="FILE.png", help="draw the roofline picture (needs matplotlib)")
    m.set_defaults(run=run)
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def run(args: argparse.Namespace) -> int:
    cfg = BenchConfig(
        shape=args.shape,
        methods=args.methods,
        tokens=args.tokens,
        threads=args.threads,
        experts=args.experts,
        group_size=args.group_size,
        baseline=not args.no_baseline,
        isa=args.isa,
        min_seconds=args.min_seconds,
    )
    result = run_bench(cfg, log=lambda line: print(line, file=sys.stderr))
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot_roofline(result, args.plot)
    return 0
