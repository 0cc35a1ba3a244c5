"""``load_model(..., expert_parallel=N)``: the loading side of runtime/expert_parallel.py.

Every rank of the job (started by torchrun, or any launcher that sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT) calls ``load_model`` with the same arguments. Rank 0 builds the
model as usual but keeps only its share of each layer's experts, behind a ``RemoteExperts``; every
other rank reads only its share of each layer, serves rank 0's MoE calls (``serve_experts``) and,
when rank 0's process ends, leaves: ``load_model`` does not return there (SystemExit(0)), so one
script, or ``hetmoe generate --expert-parallel N``, runs unchanged under the launcher.
"""

from __future__ import annotations

import atexit
import contextlib
from dataclasses import replace
from typing import Any

import torch

from ..checkpoint.experts import LayerExperts
from ..checkpoint.layout import MoELayout
from ..runtime.expert_parallel import ExpertPlacement, select_experts, stop_experts
from ..runtime.process_group import Ranks, join, leave, ranks_from_env, share_cpus

PLACEMENTS = ("id", "load")
# An expert rank waits for rank 0's next layer for as long as a server may sit idle; a dead peer
# still fails the wait at once (its socket closes).
IDLE_TIMEOUT_DAYS = 365


def start_group(
    expert_parallel: int,
    placement: str,
    incompatible: dict[str, Any],
    init_method: str | None = None,
    rank: int | None = None,
) -> Ranks:
    """Checks the request against the launcher's environment (or ``init_method`` and ``rank``, given
    to every process alike but the rank) and joins the group."""
    if expert_parallel < 1:
        raise ValueError(f"expert_parallel must be >= 1, got {expert_parallel}")
    if placement not in PLACEMENTS:
        raise ValueError(f"expert_placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    on = [name for name, value in incompatible.items() if value]
    if on:
        raise ValueError(f"expert_parallel does not combine with {', '.join(on)} (experts stay on the ranks' CPUs)")
    if (init_method is None) != (rank is None):
        raise ValueError("an explicit rendezvous needs both init_method (e.g. tcp://HOST:PORT) and this process's rank")
    if init_method is not None:
        assert rank is not None
        if not 0 <= rank < expert_parallel:
            raise ValueError(f"rank {rank}: expected 0 <= rank < expert_parallel ({expert_parallel})")
        ranks = Ranks(rank=rank, world=expert_parallel)  # one rank a host, as far as CPUs go
    else:
        ranks = ranks_from_env()
    if ranks.world != expert_parallel:
        raise ValueError(
            f"expert_parallel={expert_parallel}, but this process is one of WORLD_SIZE={ranks.world}: start "
            f"{expert_parallel} processes with torchrun --nproc-per-node {expert_parallel} (or --nnodes)"
        )
    from datetime import timedelta

    import torch.distributed as dist

    share_cpus(ranks)  # first: the group's socket threads then start on this rank's CPUs too
    if ranks.distributed and not dist.is_initialized():
        join(ranks, torch.device("cpu"), timeout=timedelta(days=IDLE_TIMEOUT_DAYS), init_method=init_method)
    return ranks


def placements(
    layout: MoELayout, world: int, how: str, frequencies: dict[int, torch.Tensor] | None
) -> dict[int, ExpertPlacement]:
    """Each MoE layer's expert-to-rank map."""
    if how == "load" and frequencies is None:
        raise ValueError("expert_placement='load' needs routing_stats (a file a run with record_routing=PATH wrote)")
    out = {}
    for layer in layout.moe_layers:
        if how == "load":
            assert frequencies is not None
            out[layer] = ExpertPlacement.by_load(frequencies.get(layer, torch.ones(layout.num_experts)), world)
        else:
            out[layer] = ExpertPlacement.by_id(layout.num_experts, world)
    return out


def shard(experts: LayerExperts, placement: ExpertPlacement, rank: int) -> LayerExperts:
    """This rank's experts of a layer (views of the file where they are a contiguous run)."""
    mine = placement.experts_of(rank)
    where = f"layer {experts.layer} experts"
    ids = torch.tensor(mine, dtype=torch.int64)
    biases = {f"{k}_bias": v.index_select(0, ids) for k, v in experts.biases.items()}
    return replace(
        experts,
        gate=select_experts(experts.gate, mine, where + ".gate"),
        up=select_experts(experts.up, mine, where + ".up"),
        down=select_experts(experts.down, mine, where + ".down"),
        **biases,
    )


def stop_at_exit(ranks: Ranks, hidden: int, top_k: int) -> None:
    """Rank 0: when this process ends, the expert ranks are told to return, and the group closes."""

    def stop() -> None:
        with contextlib.suppress(Exception):  # a rank already gone has nothing to stop
            stop_experts(ranks, hidden, top_k)
        leave(ranks)

    atexit.register(stop)
