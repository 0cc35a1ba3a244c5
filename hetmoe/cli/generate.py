"""``hetmoe generate``: one prompt through a model with its routed experts in the CPU engine.

With one positional argument that is not a directory, the prompt goes to the embedded default
model (``hetmoe.models.default``), so a fresh clone generates without a download.

Tokens stream to stdout as they are produced; then stderr gets the prefill and decode speeds and
where the time went: the MoE layers' CPU-expert time (from submit to result, measured inside each
HybridMoE), the part of it the caller spent blocked waiting for the CPU, and everything else
(attention, router, shared and device experts, sampling: "device / non-expert").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..models.tokenizer import check_model_path, is_model_path
from .expert_parallel_args import add_expert_parallel_arguments, expert_parallel_options

NO_PROMPT = 'no prompt: hetmoe generate "your prompt" (the embedded default model) or hetmoe generate MODEL "prompt"'
CPU_METHODS = ("bf16", "int8", "int4", "int4-asym", "gptq", "mxfp4", "fp8", "fp8-channel")


def _method(text: str) -> str:
    if text in CPU_METHODS or (text.startswith("gguf:") and len(text) > 5):
        return text
    choices = ", ".join(CPU_METHODS)
    raise argparse.ArgumentTypeError(f"expected one of {choices} or a GGUF type (gguf:q4_0), got {text!r}")


def _dense_method(text: str) -> str:
    if text in ("stored", "torch"):
        return text
    try:
        return _method(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected stored, torch, one of {', '.join(CPU_METHODS)} or a GGUF type (gguf:q4_0), got {text!r}"
        ) from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt, experts on the CPU; prints tokens/s and where time went",
        description=(
            "Loads MODEL (a transformers MoE checkpoint directory or a llama.cpp .gguf file; without it, the "
            "small default model that ships inside hetmoe) with its routed experts in the CPU engine (stored "
            "precision, or --method to convert while loading), everything else on --device, and streams the "
            "continuation of PROMPT "
            "(with --chat: the reply to PROMPT as a user message, through the tokenizer's chat template). "
            "Afterwards it prints prefill and decode tokens/s and the split of the time between CPU experts and "
            "the rest."
        ),
        epilog=(
            "examples:\n"
            '  hetmoe generate "def fibonacci(n):"                      # the embedded default model\n'
            '  hetmoe generate --method int4 --chat "What does `json.dumps` do?"\n'
            '  torchrun --nproc-per-node 2 -m hetmoe generate MODEL --expert-parallel 2 "def f(x):"\n'
            '  hetmoe generate /models/Qwen3-30B-A3B "The capital of France is"\n'
            '  hetmoe generate /models/Qwen3-30B-A3B-Q4_K_M.gguf "The capital of France is"\n'
            '  hetmoe generate /models/DeepSeek-V3 "Hi" --method int4 --device cuda --gpu-experts 8\n'
            '  hetmoe generate /models/Qwen3-30B-A3B "Hi" --method int4 --dense-method int8 --threads 2\n'
            '  hetmoe generate /models/Qwen3-30B-A3B "$(cat long.txt)" --device cuda --prefill-threshold 512 '
            "--defer-experts 1\n"
            '  hetmoe generate ./tiny "abc" --max-new-tokens 16 --temperature 0.7 --top-p 0.9 --seed 1\n'
            '  hetmoe generate "def fibonacci(n):" --temperature 0            # greedy'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model", nargs="?", metavar="MODEL", help="model directory or .gguf file (default: the embedded model)"
    )
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="the text to continue")
    p.add_argument(
        "--method",
        type=_method,
        metavar="METHOD",
        help=f"convert experts to this CPU method on load ({', '.join(CPU_METHODS)}, gguf:TYPE)",
    )
    p.add_argument(
        "--dense-method",
        type=_dense_method,
        metavar="METHOD",
        help=(
            "CPU only: attention, dense MLPs, shared experts and lm_head in the CPU engine in this method "
            "(int8, int4, gguf:q4_0, ...). Default 'stored': in the engine in the precision the file holds "
            "(bf16, fp8, a GGUF's own block types) where the engine runs it; 'torch' keeps torch Linears"
        ),
    )
    p.add_argument("--chat", action="store_true", help="send PROMPT as a user message through the chat template")
    p.add_argument("--device", default="cpu", help="where non-expert layers run (cpu, cuda, cuda:1; default cpu)")
    p.add_argument("--gpu-experts", type=int, default=0, metavar="N", help="experts per MoE layer kept on --device")
    add_expert_parallel_arguments(p)
    p.add_argument(
        "--prefill-threshold",
        type=int,
        default=None,
        metavar="N",
        help="prompts of more than N tokens: stream each layer's CPU experts to --device and compute them there",
    )
    p.add_argument(
        "--defer-experts",
        type=int,
        default=0,
        metavar="K",
        help="each token's K lowest-scored CPU experts finish during the next MoE layer (approximate; default 0)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help=(
            "0 = greedy (the most likely token after the repetition penalty and n-gram ban); > 0 samples. "
            "Default: the model's generation_config.json (the embedded model samples at 0.9 with top-k 40, "
            "top-p 0.95, min-p 0.05, a repetition penalty of 1.1 and no repeated 4-token run), greedy where it has none"
        ),
    )
    p.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens (0 = all)"
    )
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass, in (0, 1]")
    p.add_argument(
        "--min-p", type=float, default=None, metavar="P", help="drop tokens under P times the top one's probability"
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        metavar="R",
        help="make tokens already in the text less likely: scores divided by R if positive, times R if negative "
        "(> 1 discourages repeats; 1 = off)",
    )
    p.add_argument(
        "--no-repeat-ngram-size",
        type=int,
        default=None,
        metavar="N",
        help="never repeat N tokens in a row that the text already holds (0 = off; the embedded model: 4)",
    )
    p.add_argument(
        "--seed", type=int, default=None, metavar="N", help="seed for sampling (the same seed, the same text)"
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="after loading, name the path each layer runs (attention, linears, MLP, lm_head) and its precision",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU engine threads (default: every usable CPU)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="model dtype (default: the config's)")
    p.set_defaults(run=run)


def _check_args(args: argparse.Namespace) -> tuple[Path, str]:
    if args.model is None:
        raise ValueError(NO_PROMPT)
    if args.prompt is None:
        if is_model_path(Path(args.model)):
            raise ValueError(f'no prompt: hetmoe generate {args.model} "your prompt"')
        from ..models.default import default_model_path

        # One argument that is not a model directory: it is the prompt, for the default model.
        args.model, args.prompt = str(default_model_path()), args.model
    model = check_model_path(args.model)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {args.top_k}")
    if args.no_repeat_ngram_size is not None and args.no_repeat_ngram_size < 0:
        raise ValueError(f"--no-repeat-ngram-size must be >= 0, got {args.no_repeat_ngram_size}")
    from ..models.generation_config import field_problem

    for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
        problem = field_problem(key, getattr(args, key))  # the ranges a generation_config.json may hold
        if problem:
            raise ValueError(f"--{key.replace('_', '-')} {problem}, got {getattr(args, key)}")
    if args.gpu_experts < 0:
        raise ValueError(f"--gpu-experts must be >= 0, got {args.gpu_experts}")
    if args.prefill_threshold is not None and args.prefill_threshold < 0:
        raise ValueError(f"--prefill-threshold must be >= 0, got {args.prefill_threshold}")
    if args.defer_experts < 0:
        raise ValueError(f"--defer-experts must be >= 0, got {args.defer_experts}")
    return model, args.prompt


def _sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """What the flags change in the model's generation config (the loader read generation_config.json
    into it; transformers' defaults, greedy, where there is none). ``--temperature 0`` is greedy, the
    model's repetition penalty and n-gram ban still applied as transformers applies them; a temperature, top-k,
    top-p or min-p given otherwise turns sampling on."""
    sampling: dict[str, Any] = {}
    for key in ("repetition_penalty", "no_repeat_ngram_size"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    if args.temperature == 0:
        return {**sampling, "do_sample": False}
    for key in ("temperature", "top_k", "top_p", "min_p"):
        if getattr(args, key) is not None:
            sampling.update({key: getattr(args, key), "do_sample": True})
    return sampling


def _streamer(tokenizer: Any, runtime: Any) -> Any:
    """A TextStreamer that also notes when the first new token arrives (the end of prefill)."""
    from transformers import TextStreamer

    class TimedStreamer(TextStreamer):
        first_at: float | None = None
        at_first: Any = None
        new_tokens = 0

        def put(self, value: Any) -> None:
            if self.next_tokens_are_prompt:
                super().put(value)
                return
            if self.first_at is None:
                self.first_at = time.perf_counter()
                self.at_first = runtime.timing.snapshot()
            self.new_tokens += int(value.numel())
            super().put(value)

    return TimedStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _phase_line(name: str, tokens: int, seconds: float, cpu_s: float, wait_s: float) -> str:
    rate = tokens / seconds if seconds > 0 else float("inf")
    other = max(0.0, seconds - wait_s)

    def pct(x: float) -> str:
        return f"{100 * x / seconds:.0f}%" if seconds > 0 else "-"

    return (
        f"{name}: {tokens} tokens in {seconds:.3f} s = {rate:.2f} tokens/s | "
        f"CPU experts {cpu_s:.3f} s ({pct(cpu_s)}), waiting for them {wait_s:.3f} s ({pct(wait_s)}), "
        f"device / non-expert {other:.3f} s ({pct(other)})"
    )


def run(args: argparse.Namespace) -> int:
    model_dir, prompt = _check_args(args)
    import torch

    from ..gc_pause import freeze_for_decoding
    from ..models.loader import load_model
    from ..models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir, "generate")
    if args.device == "cpu" and args.dense_method != "torch":
        # CPU-only mode: the engine's workers use every core for the linears and experts; torch is left
        # the small ops between them, which a second thread only slows (it must be woken, and competes
        # with the workers): hetmoe bench model measured decode 2-18% slower with torch at 2 threads.
        torch.set_num_threads(1)
    model = load_model(
        model_dir,
        method=args.method,
        device=args.device,
        gpu_experts=args.gpu_experts,
        cpu_threads=args.threads,
        dtype=args.dtype,
        prefill_threshold=args.prefill_threshold,
        defer_experts=args.defer_experts,
        dense_method=args.dense_method,
        **expert_parallel_options(args),
    )
    freeze_for_decoding()  # the collector's full passes then skip the model (gc_pause.py)
    runtime = model.hetmoe
    print(f"loaded {model_dir} in {runtime.load_seconds:.2f} s: {runtime.summary(args.verbose)}", file=sys.stderr)
    for note in runtime.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{model_dir}: --chat needs a chat template in the tokenizer config, and it has none")
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    # A chat-rendered prompt already carries its special tokens; a raw one gets what the tokenizer adds.
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not args.chat).to(args.device)
    prompt_tokens = int(inputs["input_ids"].shape[1])
    if prompt_tokens == 0:
        raise ValueError(f"{model_dir}: the tokenizer turned the prompt {prompt!r} into no tokens")
    sampling = _sampling_overrides(args)
    from ..runtime.kv_cache import growing_cache

    streamer = _streamer(tokenizer, runtime)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runtime.reset_timing()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            streamer=streamer,
            pad_token_id=pad,
            cache=growing_cache(model.config),  # appends in place (runtime/kv_cache.py)
            **sampling,
        )
    end = time.perf_counter()
    sys.stdout.flush()
    first = streamer.first_at or end
    at_first = streamer.at_first or runtime.timing.snapshot()
    decode = runtime.timing - at_first
    print(file=sys.stderr)
    print(_phase_line("prefill", prompt_tokens, first - start, at_first.cpu_s, at_first.wait_s), file=sys.stderr)
    decoded = max(0, streamer.new_tokens - 1)  # the first new token came out of prefill
    print(_phase_line("decode", decoded, end - first, decode.cpu_s, decode.wait_s), file=sys.stderr)
    return 0
