"""``hetmoe bench moe``: benchmark one MoE layer's experts; see hetmoe/bench/moe.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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
    p = sub.add_parser(
        "bench",
        help="benchmarks: 'hetmoe bench moe' times one MoE layer's experts, 'hetmoe bench model' a whole model, "
        "'hetmoe bench defaults' the default configuration against the tuner's candidates",
    )
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
        "  hetmoe bench moe --shape deepseek-v3 --experts 32 --plot roofline.png\n"
        "  HETMOE_NUMA=2 hetmoe bench moe --no-baseline   # the experts split over 2 groups of CPUs as NUMA nodes",
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
    _add_model_parser(bsub)
    _add_defaults_parser(bsub)
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def _add_model_parser(bsub: argparse._SubParsersAction) -> None:
    from ..bench.arch_models import ARCHS
    from ..bench.model import DEFAULT_VARIANTS
    from ..bench.model_build import DEFAULT_CACHE
    from ..bench.model_write import SOURCES

    m = bsub.add_parser(
        "model",
        help="a whole Qwen3-30B-A3B-shaped model on the CPU: load, decode and prefill tokens/s, time per part",
        description=(
            "Builds (once, into --cache-dir) a random Qwen3-MoE with Qwen3-30B-A3B's layer shape and --layers "
            "layers, written as --source: a bf16 safetensors directory, or directly (never through bf16, so 48 "
            "layers fit the disk) a pure-Q4_0 GGUF as llama.cpp writes it or a compressed-tensors int4 g32 "
            "directory as Kimi-K2 ships. It loads the model CPU-only per VARIANT (EXPERTS/DENSE: the experts' "
            "engine method or 'stored' as the file holds them, and the dense layers' engine method, 'torch' for "
            "torch bf16 Linears or 'default' for what load_model does with no flags) and measures the load "
            "(seconds, against a plain read of the files just before it, and peak RSS), decode tokens/s after "
            "--context prompt tokens and prefill tokens/s, the time split over attention linears, attention "
            "core, router, CPU experts, lm_head and the rest, and the same parts each run alone. With "
            "--llama-bench, llama.cpp's llama-bench runs in the same run on the Q4_0 GGUF source itself or on "
            "the --llama-gguf files (for a bf16 source, made with llama.cpp's convert_hf_to_gguf.py and "
            "llama-quantize, ../shared/peers/README.md); --json writes every number."
        ),
        epilog=(
            "examples:\n"
            "  hetmoe bench model --threads 2 --json docs/bench-model.json\n"
            "  hetmoe bench model --variants int4/int8 --torch-threads 1,2 --repeats 1 --steps 8\n"
            "  hetmoe bench model --layers 2 --variants bf16/bf16,gguf:q4_0/gguf:q4_0\n"
            "  hetmoe bench model --llama-bench llama.cpp/bin/llama-bench --llama-gguf m-Q4_0.gguf,m-Q4_K_M.gguf\n"
            "  hetmoe bench model --layers 48 --source q4_0-gguf --llama-bench llama.cpp/bin/llama-bench --cold\n"
            "  hetmoe bench model --layers 48 --source int4-ct --repeats 1\n"
            "  hetmoe bench model --arch deepseek_v3 --llama-bench llama.cpp/bin/llama-bench --json ds.json\n"
            "  hetmoe bench model --arch mixtral --experts 4 --rounds 1"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m.add_argument(
        "--source",
        default="bf16",
        choices=SOURCES,
        help="how the model is written (default bf16; q4_0-gguf and int4-ct are written directly)",
    )
    m.add_argument(
        "--variants",
        type=_csv(str),
        help=f"comma-separated EXPERTS/DENSE (default {','.join(DEFAULT_VARIANTS)} for a bf16 source, "
        "stored/default for the others)",
    )
    m.add_argument("--threads", type=int, default=0, help="engine threads (default: all usable CPUs)")
    m.add_argument("--torch-threads", type=_csv(int), default=(1,), help="torch intra-op threads to try (default 1)")
    m.add_argument("--layers", type=int, default=4, help="decoder layers (default 4; Qwen3-30B-A3B has 48)")
    m.add_argument(
        "--vocab", type=int, help="vocabulary size (default 8192, with --arch 32000; Qwen3-30B-A3B has 151936)"
    )
    m.add_argument("--context", type=int, default=128, help="prompt tokens before decoding (default 128)")
    m.add_argument("--steps", type=int, default=32, help="decode steps per repeat (default 32)")
    m.add_argument("--prefill", type=_csv(int), help="prefill token counts (default 128,512; with --arch 512)")
    m.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default 3)")
    m.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where models are built (default {DEFAULT_CACHE})"
    )
    m.add_argument("--isa", default="auto", help="kernel variant: auto, avx2, avx512, amx")
    m.add_argument("--llama-bench", type=Path, metavar="BIN", help="llama.cpp's llama-bench, run in this run")
    m.add_argument(
        "--llama-gguf", type=_csv(Path), default=(), metavar="FILES", help="GGUF files of this model for llama-bench"
    )
    m.add_argument(
        "--cold", action="store_true", help="drop the page cache before the plain read and before each load (root)"
    )
    m.add_argument("--json", metavar="FILE", help="write the records as JSON")
    arch = m.add_argument_group(
        "one architecture beside llama.cpp (--arch)",
        "A random model of ARCH at a released model's layer shape (Qwen3-30B-A3B, DeepSeek-V2-Lite with "
        "q_lora 1536, gpt-oss-20b, GLM-4.5-Air, Mixtral-8x7B, MiniMax-M2), --layers layers, as a bf16 "
        "safetensors directory; with --llama-bench DIR/bin/llama-bench, also as llama.cpp's converter and "
        "llama-quantize make it (BF16, then Q4_0, Q4_K_M, Q8_0 GGUF files; DIR as build_llama_cpp.sh lays "
        "it out). Each round measures hetmoe with no flags on each file, then llama-bench on the same "
        "file, and prints the medians' ratios beside issue 18's targets. Uses --layers, --vocab, "
        "--threads (llama-bench gets the same), --steps, --prefill (default 512 here), --cache-dir, --isa, --json.",
    )
    arch.add_argument("--arch", choices=sorted(ARCHS), help="the architecture to build and measure")
    arch.add_argument(
        "--experts", type=int, help="routed experts a layer (default the released model's; fewer where RAM demands)"
    )
    arch.add_argument("--rounds", type=int, default=2, help="rounds of hetmoe then llama.cpp per file (default 2)")
    m.set_defaults(run=run_model)


def run_arch(args: argparse.Namespace) -> int:
    from ..bench import arch_bench
    from ..bench.arch_models import ArchModel
    from ..kernels import select_isa

    for flag, value in (("--variants", args.variants), ("--llama-gguf", args.llama_gguf)):
        if value:
            raise ValueError(f"{flag} does not apply with --arch (it measures the defaults on the files it builds)")
    if args.source != "bf16":
        raise ValueError("--source does not apply with --arch (it builds a bf16 directory and llama.cpp's GGUF files)")
    if args.rounds < 1 or args.steps < 1 or args.threads < 0 or any(t < 1 for t in args.prefill or ()):
        raise ValueError("--rounds and --steps must be >= 1, --threads >= 0 and every --prefill count >= 1")
    select_isa(args.isa)
    cfg = arch_bench.ArchBenchConfig(
        model=ArchModel(args.arch, layers=args.layers, vocab=args.vocab or 32000, experts=args.experts),
        threads=args.threads or len(os.sched_getaffinity(0)),  # llama-bench gets the same count
        steps=args.steps,
        prefill=args.prefill or (512,),
        rounds=args.rounds,
        cache_dir=args.cache_dir,
        llama_bench=args.llama_bench,
    )
    result = arch_bench.run_arch_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(arch_bench.format_table(result))
    if args.json:
        arch_bench.write_json(result, args.json)
    return 0


def _add_defaults_parser(bsub: argparse._SubParsersAction) -> None:
    d = bsub.add_parser(
        "defaults",
        help="the default configuration against every configuration the tuner chooses between",
        description=(
            "For each method and token count, one Qwen3-30B-A3B-shaped MoE layer (128 experts of 2048 x 768, top-8, "
            "routing drawn at random each run) runs under every candidate of the tuner's choices: the kernel variant "
            "(AMX tiles or AVX-512, where the CPU has both), the integer GEMVs' width (256 or 512 bits), the weights' "
            "prefetch (t0, t1, nta or none) and the GEMV/GEMM switch (each count of the tuner's grid). The candidates "
            "alternate, caches evicted before each run; the fastest of them then runs head to head with the default "
            "(--confirm rounds, alternating) and their medians are compared. The default is what load_model runs "
            "with: the tuned choices, measured on first use."
        ),
        epilog="examples:\n  hetmoe bench defaults\n"
        "  hetmoe bench defaults --methods int4 --tokens 1,512 --reps 9 --json d.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument("--methods", type=_csv(str), default=("bf16", "int8", "int4"), help="comma-separated methods")
    d.add_argument("--tokens", type=_csv(int), default=DEFAULT_TOKENS, help="comma-separated token counts")
    d.add_argument("--threads", type=int, default=0, help="engine threads (default: all usable CPUs)")
    d.add_argument("--reps", type=int, default=5, help="runs of each configuration (default 5)")
    d.add_argument(
        "--confirm",
        type=int,
        default=15,
        help="rounds of the default against the fastest candidate, head to head, that give the ratio (default 15; "
        "0: the sweep's medians)",
    )
    d.add_argument("--json", metavar="FILE", help="write the records as JSON")
    d.set_defaults(run=run_defaults)


def run_defaults(args: argparse.Namespace) -> int:
    from ..bench import defaults

    if args.reps < 1 or args.confirm < 0 or args.threads < 0 or any(t < 1 for t in args.tokens):
        raise ValueError("--reps must be >= 1, --confirm >= 0, --threads >= 0 and every --tokens count >= 1")
    cfg = defaults.DefaultsConfig(
        methods=args.methods, tokens=args.tokens, threads=args.threads, reps=args.reps, confirm=args.confirm
    )
    result = defaults.run_defaults(cfg, log=lambda line: print(line, file=sys.stderr))
    print(defaults.format_table(result))
    if args.json:
        defaults.write_json(result, args.json)
    return 0


def run_model(args: argparse.Namespace) -> int:
    from ..bench import model as bench_model
    from ..bench.model_build import ModelShape

    if args.arch:
        return run_arch(args)
    if args.experts is not None:
        raise ValueError("--experts applies with --arch only")
    for name in ("layers", "context", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.threads < 0 or any(t < 1 for t in args.prefill or ()):
        raise ValueError("--threads must be >= 0 and every --prefill count >= 1")
    variants = args.variants or (bench_model.DEFAULT_VARIANTS if args.source == "bf16" else ("stored/default",))
    cfg = bench_model.ModelBenchConfig(
        shape=ModelShape(layers=args.layers, vocab=args.vocab or 8192),
        source=args.source,
        cold=args.cold,
        variants=variants,
        threads=args.threads,
        torch_threads=args.torch_threads,
        context=args.context,
        steps=args.steps,
        prefill=args.prefill or (128, 512),
        repeats=args.repeats,
        cache_dir=args.cache_dir,
        isa=args.isa,
        llama_bench=args.llama_bench,
        llama_gguf=tuple(args.llama_gguf),
    )
    result = bench_model.run_bench(cfg, log=lambda line: print(line, file=sys.stderr))
    print(bench_model.format_table(result))
    if args.json:
        bench_model.write_json(result, args.json)
    return 0


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
