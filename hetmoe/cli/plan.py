"""``hetmoe plan``: what a model needs in RAM and on the device, before loading it; see models/planner.py."""

from __future__ import annotations

import argparse

from ..models.planner import DEFAULT_CONTEXT, plan_memory


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="memory plan: bytes of experts, non-expert weights and KV cache; what fits on the device and in RAM",
        description=(
            "Reads MODEL's config.json and tensor headers (no weights) and prints what loading it would take: bytes "
            "per expert and per MoE layer in the CPU method, the non-expert weights (in --dense-method when given), "
            "the KV cache per token, how many experts per layer fit on the device and how many tokens of KV cache it "
            "holds. RAM and free device memory are measured unless given. Exits 1 when the plan does not fit."
        ),
        epilog=(
            "examples:\n"
            "  hetmoe plan /models/Qwen3-30B-A3B --method int4\n"
            "  hetmoe plan /models/Qwen3-30B-A3B --method int4 --dense-method int8 --ram 24GiB --context 8192\n"
            "  hetmoe plan /models/DeepSeek-V3 --device cuda --device-memory 24GiB --gpu-experts 4\n"
            "  hetmoe plan /models/Kimi-K2 --expert-parallel 4 --ram 256GiB    # rank 0's share and needs\n"
            "  hetmoe plan /models/Kimi-K2 --expert-parallel 4 --rank 1 --ram 256GiB"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="model directory (config.json + safetensors)")
    p.add_argument("--method", help="CPU method the experts are converted to (default: as stored)")
    p.add_argument("--group-size", type=int, help="group size of --method int4/int4-asym/gptq (default 32)")
    p.add_argument("--dense-method", help="CPU method of the non-expert Linear layers (CPU-only mode)")
    p.add_argument("--device", default="cpu", help="where non-expert layers run (cpu, cuda, cuda:1; default cpu)")
    p.add_argument("--device-memory", metavar="SIZE", help="usable device memory, e.g. 24GiB (default: measured free)")
    p.add_argument("--ram", metavar="SIZE", help="usable RAM, e.g. 64GiB (default: MemAvailable)")
    p.add_argument("--gpu-experts", type=int, default=0, metavar="N", help="experts per MoE layer kept on --device")
    p.add_argument(
        "--expert-parallel",
        type=int,
        default=1,
        metavar="N",
        help="the experts split over N processes (load_model's expert_parallel): each rank's share and RAM",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=0,
        metavar="R",
        help="with --expert-parallel: whose RAM to check (default 0, the rank that also runs the model)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=DEFAULT_CONTEXT,
        metavar="N",
        help=f"tokens of KV cache to plan for (default {DEFAULT_CONTEXT})",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_memory(
        args.model,
        args.method,
        args.dense_method,
        device=args.device,
        gpu_experts=args.gpu_experts,
        context=args.context,
        device_memory=args.device_memory,
        ram=args.ram,
        group_size=args.group_size,
        expert_parallel=args.expert_parallel,
        rank=args.rank,
    )
    print(plan.table())
    return 0 if not plan.problems() else 1
