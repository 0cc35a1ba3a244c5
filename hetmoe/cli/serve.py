"""``hetmoe serve``: an OpenAI-compatible HTTP server for a model with its routed experts in the CPU engine."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from ..models.tokenizer import check_model_path
from .expert_parallel_args import add_expert_parallel_arguments, expert_parallel_options

API_KEY_ENV = "HETMOE_API_KEY"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible API (chat and text completions, streaming, batching)",
        description=(
            "Loads MODEL (default: the embedded default model) with its routed experts in the CPU engine and serves "
            "/v1/models, /v1/chat/completions and /v1/completions (streamed or not), /health, Prometheus "
            "/metrics and its OpenAPI document at /openapi.json. Concurrent requests are decoded together in "
            "one batch (continuous batching). It binds "
            f"127.0.0.1 unless told otherwise; with --api-key (or ${API_KEY_ENV}) every route but /health needs "
            "'Authorization: Bearer KEY'."
        ),
        epilog=(
            "examples:\n"
            "  hetmoe serve\n"
            "  hetmoe serve /models/Qwen3-30B-A3B --method int4 --port 8080 --max-batch 16\n"
            "  hetmoe serve --lora runs/sft/adapter\n"
            "  hetmoe serve /models/Qwen3-30B-A3B-Q4_K_M.gguf\n"
            "  torchrun --nproc-per-node 2 -m hetmoe serve /models/Qwen3-30B-A3B --expert-parallel 2\n"
            "  HETMOE_API_KEY=secret hetmoe serve ./my-model --host 0.0.0.0\n"
            "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            '       -d \'{"model": "hetmoe-default", "messages": [{"role": "user", "content": "Hi"}]}\''
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model", nargs="?", metavar="MODEL", help="model directory or .gguf file (default: the embedded default model)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help=f"require this bearer key (default: ${API_KEY_ENV} if set, else no key)")
    p.add_argument("--model-name", help="the model id clients send (default: the directory's or file's name)")
    p.add_argument(
        "--method",
        help="convert experts to this CPU method on load (bf16, int8, int4, fp8, gguf:q4_k, ...; default: as stored)",
    )
    p.add_argument("--lora", metavar="DIR", help="a LoRA adapter saved by `hetmoe sft train` (PEFT format) to apply")
    p.add_argument("--device", default="cpu", help="where non-expert layers run (cpu, cuda, cuda:1; default cpu)")
    p.add_argument("--gpu-experts", type=int, default=0, metavar="N", help="experts per MoE layer kept on --device")
    add_expert_parallel_arguments(p)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="model dtype (default: the config's)")
    p.add_argument("--threads", type=int, default=None, help="CPU engine threads (default: every usable CPU)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads for the non-expert layers (default: torch's). On a small or busy machine, 1 "
        "(or OMP_WAIT_POLICY=PASSIVE in the environment) keeps OpenMP's spinning threads off the engine's cores",
    )
    p.add_argument("--max-batch", type=int, default=32, metavar="N", help="most requests decoded together (32)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N", help="most requests waiting beyond those (256)")
    p.add_argument(
        "--max-model-len", type=int, default=None, metavar="N", help="prompt + completion token limit (default: config)"
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(run=run)


def resolve_model(model: str | None) -> tuple[Path, str]:
    """The model (directory or .gguf file) and the name it is served under (the default model's, the
    directory's name, or the file's without .gguf)."""
    from ..models.default import DEFAULT_MODEL_NAME, default_model_path

    if model is None:
        return default_model_path(), DEFAULT_MODEL_NAME
    path = check_model_path(model)
    return path, path.resolve().stem if path.is_file() else path.resolve().name


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_batch", "threads", "torch_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if args.gpu_experts < 0:
        raise ValueError(f"--gpu-experts must be >= 0, got {args.gpu_experts}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key is empty")
    path, default_name = resolve_model(args.model)
    import torch
    import uvicorn

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)

    from ..models.loader import pin_mmap_threshold

    pin_mmap_threshold()  # HETMOE_MMAP_THRESHOLD, before the first large block (loader.py)
    from ..serve.app import build_app
    from ..serve.served_model import load_served_model

    served = load_served_model(
        path,
        name=args.model_name or default_name,
        method=args.method,
        device=args.device,
        threads=args.threads,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        gpu_experts=args.gpu_experts,
        **expert_parallel_options(args),
    )
    if args.lora:
        from ..sft.inference import apply_adapter

        apply_adapter(served.model, args.lora)
        print(f"applied LoRA adapter {args.lora}", file=sys.stderr)
    from ..gc_pause import freeze_for_decoding

    freeze_for_decoding()  # this process serves one model until it exits (gc_pause.py)
    runtime = served.model.hetmoe
    print(f"loaded {path} in {runtime.load_seconds:.2f} s: {runtime.summary()}", file=sys.stderr)
    app = build_app(served, api_key=api_key, max_batch=args.max_batch, max_queue=args.max_queue)
    if not app.state.ragged_attention:
        print(
            "note: the model does not use SDPA attention; batched decoding pads with a mask, so a greedy answer "
            "can differ in rare near-ties from the same request run alone",
            file=sys.stderr,
        )
    if not _is_loopback(args.host) and api_key is None:
        print(
            f"warning: serving on {args.host} without an API key: anyone who can reach this port can use it "
            f"(set --api-key or ${API_KEY_ENV})",
            file=sys.stderr,
        )
    print(
        f"serving {served.name!r} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch}, "
        f"max queue {args.max_queue}, max model len {served.max_model_len}"
        f"{', API key required' if api_key else ''})",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
