"""``hetmoe sft train``: LoRA fine-tuning on chat JSONL with the routed experts in the CPU engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

METHODS = ("bf16", "int8", "int4", "int4-asym", "fp8", "fp8-channel", "gptq", "mxfp4")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sft",
        help="fine-tune an MoE model with LoRA while its routed experts stay in the CPU engine",
        description="Supervised fine-tuning with LoRA; the routed experts' frozen base stays in CPU memory.",
    )
    inner = p.add_subparsers(dest="sft_command", metavar="SUBCOMMAND")
    t = inner.add_parser(
        "train",
        help="train a LoRA adapter on chat-format JSONL",
        description=(
            "Trains LoRA adapters on the routed experts' gate/up/down projections (and, by the same names, shared "
            "experts and dense MLPs) of MODEL, whose routed experts stay in the CPU engine in their stored "
            'precision (or --method). DATA is JSONL, one {"messages": [{"role": ..., "content": ...}]} a '
            "line, rendered with the model's chat template; the loss covers assistant tokens only. Checkpoints "
            "(adapter, optimizer, step, losses) go to OUTPUT/checkpoint, atomically; --resume continues from there "
            "exactly. The final adapter is a PEFT adapter in OUTPUT/adapter.\n\n"
            "Several processes: start the same command under torchrun (or accelerate launch --multi-gpu). Each "
            "rank holds the experts in its own CPU engine, takes its share of every batch (--batch-size is the global "
            "batch) and adds its LoRA gradients to the others' (gloo on the CPU, nccl on GPUs), so the steps "
            "are those of one process on the whole batch. Ranks on one host split its CPUs. Rank 0 writes "
            "the checkpoints and the adapter; --resume works at the same or another number of processes."
        ),
        epilog=(
            "examples:\n"
            "  hetmoe sft train --data data/sft/tiny_chat.jsonl --eval-data data/sft/tiny_chat_eval.jsonl\n"
            "  hetmoe sft train /models/Qwen3-30B-A3B --data chat.jsonl --method int4 --lora-rank 16 --output run1\n"
            "  hetmoe sft train ./tiny --data chat.jsonl --max-steps 200 --save-every 50 --output run1\n"
            "  hetmoe sft train ./tiny --data chat.jsonl --max-steps 400 --output run1 --resume\n"
            "  torchrun --nproc-per-node 2 -m hetmoe sft train ./tiny --data chat.jsonl --batch-size 8\n"
            "  torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr HOST0 --master-port 29500 \\\n"
            "      -m hetmoe sft train /models/Qwen3-30B-A3B --data chat.jsonl --method int4 --output /shared/run1\n"
            "  accelerate launch --multi-gpu --num-processes 2 -m hetmoe sft train ./tiny --data chat.jsonl\n"
            "  (accelerate's --multi-gpu is its multi-process launcher, CPUs included; without it accelerate\n"
            "  starts one process)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("model", nargs="?", metavar="MODEL", help="model directory (default: the embedded default model)")
    t.add_argument("--data", required=True, type=Path, metavar="FILE", help="training conversations (JSONL)")
    t.add_argument("--eval-data", type=Path, metavar="FILE", help="held-out conversations: loss before and after")
    t.add_argument("--method", choices=METHODS, help="convert the experts to this CPU method (default: as stored)")
    t.add_argument("--lora-rank", type=int, default=8, metavar="R", help="LoRA rank (default 8)")
    t.add_argument("--lora-alpha", type=float, default=16.0, metavar="A", help="LoRA alpha; scaling = A/R (default 16)")
    t.add_argument("--lora-dropout", type=float, default=0.0, metavar="P", help="dropout on the LoRA input (default 0)")
    t.add_argument(
        "--target",
        default=None,
        metavar="NAMES",
        help="comma-separated module names to adapt (default: the experts' "
        "gate/up/down projection names, e.g. gate_proj,up_proj,down_proj)",
    )
    t.add_argument("--epochs", type=int, default=1, help="passes over DATA (default 1)")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, constant (default 1e-3)")
    t.add_argument("--max-steps", type=int, default=None, metavar="N", help="stop after N optimizer steps in total")
    t.add_argument(
        "--batch-size", type=int, default=4, metavar="B", help="conversations per step, over all ranks (default 4)"
    )
    t.add_argument("--max-length", type=int, default=512, metavar="T", help="tokens per conversation (default 512)")
    t.add_argument("--output", type=Path, default=Path("sft-output"), metavar="DIR", help="default ./sft-output")
    t.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint")
    t.add_argument("--save-every", type=int, default=0, metavar="N", help="checkpoint every N steps (default: at end)")
    t.add_argument("--seed", type=int, default=0, help="seed for LoRA init, data order and dropout (default 0)")
    t.add_argument("--device", default="cpu", help="where non-expert layers train (cpu, cuda; default cpu)")
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="non-expert dtype")
    t.add_argument("--recompute", action="store_true", help="recompute experts' activations in backward (less memory)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(run=run_train)
    p.set_defaults(run=lambda args: _no_subcommand(p))


def _no_subcommand(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 2


def run_train(args: argparse.Namespace) -> int:
    from ..sft.train import TrainConfig, train

    targets = [t.strip() for t in args.target.split(",") if t.strip()] if args.target else None
    cfg = TrainConfig(
        data=args.data,
        model=Path(args.model) if args.model else None,
        eval_data=args.eval_data,
        method=args.method,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        targets=targets,
        epochs=args.epochs,
        lr=args.lr,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        max_length=args.max_length,
        output=args.output,
        resume=args.resume,
        seed=args.seed,
        save_every=args.save_every,
        device=args.device,
        dtype=args.dtype,
        recompute=args.recompute,
        progress=not args.no_progress,
    )
    from ..runtime.process_group import ranks_from_env

    result = train(cfg)
    if not ranks_from_env().main:
        return 0  # rank 0 reports for the job
    rate = result.tokens / result.seconds if result.seconds else 0.0
    print(f"steps: {result.steps}, tokens: {result.tokens}, {rate:.0f} tokens/s", file=sys.stderr)
    if result.losses:
        print(f"train loss: first {result.losses[0]:.4f}, last {result.losses[-1]:.4f}", file=sys.stderr)
    if result.eval_before is not None:
        print(f"held-out loss: {result.eval_before:.4f} -> {result.eval_after:.4f}", file=sys.stderr)
    print(f"adapter: {result.adapter}")
    return 0
