"""``hetmoe eval ppl``: perplexity and KL to the bf16 model, per expert method, on a text file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..bench.quality import DEFAULT_METHODS, evaluate_methods, format_table, plot_quality, write_json
from ..models.tokenizer import check_model_path


def _methods(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of methods, found {text!r}")
    return names


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="measure what a method costs in model quality (perplexity, KL to bf16)",
        description="Quality evaluations of a model's expert methods.",
    )
    evals = p.add_subparsers(dest="eval_command", metavar="EVAL")
    ppl = evals.add_parser(
        "ppl",
        help="perplexity and KL divergence to the bf16 model, per method, on a text file",
        description=(
            "Cuts the tokenized text into non-overlapping windows of --context tokens and scores every window "
            "with the model loaded once per method (experts converted while loading, everything else as stored) "
            "and with the bf16 reference. Prints, per method: perplexity, its change against bf16, the mean "
            "KL(bf16 || method) of the next-token distributions in nats per token, and how often the two "
            "models' top-1 tokens agree. A method that cannot run on the model's shapes is listed with the "
            "reason, and the exit status is then 1. MODEL defaults to the embedded default model."
        ),
        epilog=(
            "examples:\n"
            "  hetmoe eval ppl --text hetmoe/assets/default_model/heldout.txt\n"
            "  hetmoe eval ppl --text heldout.txt --methods bf16,fp8,int8,int4,int4-asym,gguf:q4_0 --json q.json\n"
            "  hetmoe eval ppl /models/Qwen3-30B-A3B --text wiki.txt --context 512 --max-windows 40 --plot q.png"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ppl.add_argument(
        "model", nargs="?", metavar="MODEL", help="model directory or .gguf file (default: the embedded model)"
    )
    ppl.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    ppl.add_argument(
        "--methods",
        type=_methods,
        default=DEFAULT_METHODS,
        metavar="M1,M2",
        help=f"expert methods to compare (default {','.join(DEFAULT_METHODS)}; GGUF types as q4_0 or gguf:q4_0)",
    )
    ppl.add_argument("--context", type=int, default=256, metavar="N", help="tokens per window (default 256)")
    ppl.add_argument("--max-windows", type=int, default=None, metavar="N", help="score only the first N windows")
    ppl.add_argument("--batch-size", type=int, default=8, metavar="N", help="windows per forward pass (default 8)")
    ppl.add_argument("--group-size", type=int, default=None, metavar="G", help="int4, int4-asym, gptq group size")
    ppl.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="model dtype (default: the config's)")
    ppl.add_argument("--threads", type=int, default=None, help="CPU engine threads (default: every usable CPU)")
    ppl.add_argument("--json", metavar="FILE", help="write the table as JSON")
    ppl.add_argument("--plot", metavar="FILE.png", help="draw perplexity and KL per method (needs matplotlib)")
    ppl.set_defaults(run=run_ppl)
    p.set_defaults(run=lambda args: _no_eval(p))


def _no_eval(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _gguf_shorthand(methods: tuple[str, ...]) -> tuple[str, ...]:
    """``q4_k`` for ``gguf:q4_k``: block types are unambiguous, and that is how people name them."""
    from ..formats.registry import methods as known_methods

    known = set(known_methods())
    return tuple(f"gguf:{m}" if m not in known and f"gguf:{m}" in known else m for m in methods)


def run_ppl(args: argparse.Namespace) -> int:
    from ..models.default import default_model_path

    model = check_model_path(args.model) if args.model else default_model_path()
    text_path = Path(args.text)
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--text {text_path}: cannot read UTF-8 text ({exc})") from None
    if args.context < 2:
        raise ValueError(f"--context must be >= 2, got {args.context}")
    report = evaluate_methods(
        model,
        text,
        _gguf_shorthand(args.methods),
        args.context,
        batch_size=args.batch_size,
        max_windows=args.max_windows,
        dtype=args.dtype,
        cpu_threads=args.threads,
        group_size=args.group_size,
        text_name=str(text_path),
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot_quality(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if any(r.error for r in report.rows) else 0
