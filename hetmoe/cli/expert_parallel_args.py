"""The command-line options that split a model's experts over processes (load_model's expert_parallel),
shared by ``hetmoe generate`` and ``hetmoe serve``."""

from __future__ import annotations

import argparse
from typing import Any


def add_expert_parallel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expert-parallel",
        type=int,
        default=None,
        metavar="N",
        help="split each layer's routed experts over the N processes this command runs in, started by "
        "torchrun --nproc-per-node N (or --nnodes): rank 0 runs the model, the others only their experts",
    )
    p.add_argument(
        "--expert-placement",
        choices=("id", "load"),
        default="id",
        help="with --expert-parallel: experts to ranks by id blocks, or balanced by --routing-stats' counts",
    )
    p.add_argument("--routing-stats", metavar="FILE", help="routing counts recorded by an earlier run (for load)")
    p.add_argument(
        "--dist-init",
        metavar="URL",
        help="with --expert-parallel, without torchrun: the rendezvous every process is given (tcp://HOST:PORT)",
    )
    p.add_argument("--dist-rank", type=int, metavar="R", help="with --dist-init: this rank (0 runs the model)")


def expert_parallel_options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_model``'s keyword arguments for what the options say."""
    return {
        "expert_parallel": args.expert_parallel,
        "expert_placement": args.expert_placement,
        "routing_stats": args.routing_stats,
        "dist_init_method": args.dist_init,
        "dist_rank": args.dist_rank,
    }
