"""Expert parallelism: one MoE layer's routed experts split over the processes of a torch.distributed job.

Rank 0 runs the model (attention, routers, dense layers, sampling, the server) and its own share of
each layer's experts; every other rank holds only its share and runs ``serve_experts``. A MoE layer
on rank 0 (``RemoteExperts``, the CPU backend its HybridMoE calls) then:

1. broadcasts a header: the layer, the token count, the top-k and how many token rows each rank gets;
2. sends each rank, in one all-to-all, the rows of the tokens routed to at least one of its experts:
   the hidden state in float32, the top-k ids renumbered to the rank's own experts (-1 for another
   rank's) and the top-k weights;
3. starts its own share in its engine while the others compute theirs (the same row layout);
4. collects, in a second all-to-all, each rank's weighted sum over its experts (float32) and adds
   the rows into its own.

The partial sums travel in float32 and are added before the one rounding to the model's dtype, so
the layer's output differs from one process's by the order of a float32 sum only.

Placement (``ExpertPlacement``) is by expert id (contiguous blocks) or by recorded routing
frequency (each rank's experts carrying about the same share of the tokens). A rank that dies
breaks the group; the next collective on a survivor raises ``RankLostError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..formats.base import QuantizedTensor
from .process_group import Ranks, collective

OP_MOE, OP_STOP = 1, 2
_HEADER = 5  # op, layer, tokens, top_k, then one row count per rank


@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank owns each expert of a layer, and its index among that rank's experts."""

    owner: torch.Tensor  # [E] int64
    local: torch.Tensor  # [E] int64

    @property
    def num_experts(self) -> int:
        return int(self.owner.numel())

    def experts_of(self, rank: int) -> list[int]:
        """The experts ``rank`` holds, in the order of its local indices."""
        mine = (self.owner == rank).nonzero().flatten()
        return mine[torch.argsort(self.local[mine])].tolist()

    @classmethod
    def from_lists(cls, shares: list[list[int]], num_experts: int) -> ExpertPlacement:
        owner = torch.full((num_experts,), -1, dtype=torch.int64)
        local = torch.zeros(num_experts, dtype=torch.int64)
        for rank, experts in enumerate(shares):
            for i, e in enumerate(experts):
                owner[e], local[e] = rank, i
        if bool((owner < 0).any()):
            raise ValueError(f"expert placement: experts {(owner < 0).nonzero().flatten().tolist()[:8]} have no rank")
        return cls(owner, local)

    @classmethod
    def by_id(cls, num_experts: int, world: int) -> ExpertPlacement:
        """Contiguous blocks of expert ids (sizes within one of each other)."""
        bounds = [r * num_experts // world for r in range(world + 1)]
        return cls.from_lists([list(range(bounds[r], bounds[r + 1])) for r in range(world)], num_experts)

    @classmethod
    def by_load(cls, counts: torch.Tensor, world: int) -> ExpertPlacement:
        """Experts dealt to ranks so that each carries about the same share of the routed tokens:
        heaviest first, each to the least-loaded rank that still has room (every rank holds
        ``E / world`` experts, within one, so memory stays even too)."""
        n = int(counts.numel())
        room = [(r + 1) * n // world - r * n // world for r in range(world)]
        load = [0.0] * world
        shares: list[list[int]] = [[] for _ in range(world)]
        for e in torch.argsort(counts.double(), descending=True, stable=True).tolist():
            rank = min((r for r in range(world) if len(shares[r]) < room[r]), key=lambda r: (load[r], r))
            shares[rank].append(e)
            load[rank] += float(counts[e])
        return cls.from_lists([sorted(s) for s in shares], n)


def select_experts(q: QuantizedTensor, experts: list[int], where: str) -> QuantizedTensor:
    """``q``'s experts ``experts`` (a view where they are one contiguous run of ids)."""
    e = q.shape[0]
    run = experts == list(range(experts[0], experts[0] + len(experts))) if experts else True
    picked = {}
    for suffix, t in q.tensors.items():
        if t.dim() == 0 or t.shape[0] != e:
            raise ValueError(f"{where}{suffix}: expected {e} experts stacked on dimension 0, found {list(t.shape)}")
        picked[suffix] = t[experts[0] : experts[0] + len(experts)] if run and experts else t[experts]
    return QuantizedTensor(q.method, (len(experts), *q.shape[1:]), picked, dict(q.params), validated=q.validated)


class RemoteExperts:
    """Rank 0's CPU backend for one MoE layer whose experts are spread over the group (module docstring)."""

    def __init__(self, ranks: Ranks, layer: int, placement: ExpertPlacement, local: Any) -> None:
        self.ranks = ranks
        self.layer = layer
        self.placement = placement
        self.local = local  # this rank's share: a CPUExperts over placement.experts_of(0)
        self.experts = placement.num_experts
        # HybridMoE copies device experts from these; expert parallelism keeps none on a device.
        self.gate, self.up, self.down = local.gate, local.up, local.down
        self._pending: dict[int, tuple[int, Any, list[torch.Tensor], torch.dtype, Any]] = {}
        self._next = 0

    @property
    def nbytes(self) -> int:
        return int(getattr(self.local, "nbytes", 0))

    def set_mask(self, mask: torch.Tensor) -> None:
        if bool(mask.any()):
            raise ValueError("expert parallelism keeps no expert on a device: gpu_experts must be 0")

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
        import torch.distributed as dist

        t, k = topk_ids.shape
        world = self.ranks.world
        x32 = x.float().contiguous()
        valid = topk_ids >= 0
        safe = topk_ids.clamp(min=0)
        owner = torch.where(valid, self.placement.owner[safe], -1)
        local_ids = self.placement.local[safe]
        rows = [(owner == r).any(1).nonzero().flatten() for r in range(world)]
        counts = [int(r.numel()) for r in rows]
        header = torch.tensor([OP_MOE, self.layer, t, k, *counts], dtype=torch.int64)
        payloads = [torch.empty(0)]
        for r in range(1, world):
            ids_r = torch.where(owner[rows[r]] == r, local_ids[rows[r]], -1).to(torch.float32)
            payloads.append(torch.cat([x32[rows[r]], ids_r, topk_weights[rows[r]]], dim=1).flatten())
        width = x32.shape[1] + 2 * k
        with collective(self.ranks, f"layer {self.layer}'s expert dispatch"):
            dist.broadcast(header, src=0)
            dist.all_to_all_single(
                torch.empty(0),
                torch.cat(payloads),
                output_split_sizes=[0] * world,
                input_split_sizes=[0, *(n * width for n in counts[1:])],
            )
        own = torch.where(owner == 0, local_ids, -1).contiguous()
        handle = self.local.submit(x32, own, topk_weights.contiguous())
        key = self._next
        self._next += 1
        self._pending[key] = (handle, (own, x32), rows, x.dtype, counts)
        return key

    def wait(self, handle: int) -> torch.Tensor:
        import torch.distributed as dist

        if handle not in self._pending:
            raise ValueError(f"handle {handle!r} is not pending on this layer's experts")
        local_handle, _keep, rows, dtype, counts = self._pending.pop(handle)
        y = self.local.wait(local_handle)
        hidden = y.shape[1]
        back = torch.empty(sum(counts[1:]) * hidden)
        with collective(self.ranks, f"layer {self.layer}'s expert results"):
            dist.all_to_all_single(
                back,
                torch.empty(0),
                output_split_sizes=[0, *(n * hidden for n in counts[1:])],
                input_split_sizes=[0] * self.ranks.world,
            )
        offset = 0
        for r in range(1, self.ranks.world):
            n = counts[r]
            if n:
                y.index_add_(0, rows[r], back[offset : offset + n * hidden].view(n, hidden))
            offset += n * hidden
        return y.to(dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.wait(self.submit(x, topk_ids, topk_weights))

    __call__ = forward


def stop_experts(ranks: Ranks) -> None:
    """Tells every other rank's ``serve_experts`` to return (rank 0, once, at the end)."""
    import torch.distributed as dist

    header = torch.zeros(_HEADER - 1 + ranks.world, dtype=torch.int64)
    header[0] = OP_STOP
    with collective(ranks, "the expert ranks' stop"):
        dist.broadcast(header, src=0)


def serve_experts(ranks: Ranks, shards: dict[int, Any], hidden: int) -> int:
    """A non-zero rank's loop: run its share of whichever layer rank 0 names, until told to stop.
    Returns the number of layer calls served."""
    import torch.distributed as dist

    world = ranks.world
    served = 0
    while True:
        header = torch.empty(_HEADER - 1 + world, dtype=torch.int64)
        with collective(ranks, "the wait for rank 0's next layer"):
            dist.broadcast(header, src=0)
        op, layer, _tokens, k = (int(v) for v in header[:4])
        if op == OP_STOP:
            return served
        if op != OP_MOE or layer not in shards:
            raise RuntimeError(f"rank {ranks.rank}: rank 0 sent op {op} for layer {layer}, a layer this rank lacks")
        n = int(header[4 + ranks.rank])
        width = hidden + 2 * k
        rows = torch.empty(n * width)
        split = [0] * world
        with collective(ranks, f"layer {layer}'s expert dispatch"):
            dist.all_to_all_single(
                rows, torch.empty(0), output_split_sizes=[n * width, *split[1:]], input_split_sizes=split
            )
        rows = rows.view(n, width)
        x = rows[:, :hidden].contiguous()
        ids = rows[:, hidden : hidden + k].to(torch.int64).contiguous()
        weights = rows[:, hidden + k :].contiguous()
        y = shards[layer](x, ids, weights) if n else torch.empty(0, hidden)
        with collective(ranks, f"layer {layer}'s expert results"):
            dist.all_to_all_single(
                torch.empty(0), y.flatten(), output_split_sizes=split, input_split_sizes=[n * hidden, *split[1:]]
            )
        served += 1
