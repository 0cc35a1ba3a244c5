"""Expert parallelism: one MoE layer's routed experts split over the processes of a torch.distributed job.

Rank 0 runs the model (attention, routers, dense layers, sampling, the server) and its own share of
each layer's experts; every other rank holds only its share and runs ``serve_experts``. A MoE layer
on rank 0 (``RemoteExperts``, the CPU backend its HybridMoE calls) then:

1. sends each rank that has work, asynchronously, the rows of the tokens routed to at least one of
   its experts: a header (the layer, the row count, the top-k), then per row the hidden state in
   float32, the top-k ids renumbered to the rank's own experts (-1 for another rank's) and the
   top-k weights. A decode step's row travels in the header's message: one message out;
2. starts its own share in its engine while the others compute theirs (the same row layout);
3. receives each rank's weighted sums over its experts (float32, one message back) and adds the
   rows into its own.

Point-to-point messages rather than collectives: a rank with no token in a call hears nothing,
and a decode step costs one message each way per rank (gloo's collectives took three round trips
and 0.85 ms a layer on loopback, bench/bench_expert_parallel.py).

The partial sums travel in float32 and are added before the one rounding to the model's dtype, so
the layer's output differs from one process's by the order of a float32 sum only.

Placement (``ExpertPlacement``) is by expert id (contiguous blocks) or by recorded routing
frequency (each rank's experts carrying about the same share of the tokens). A rank that dies
breaks the group; the next collective on a survivor raises ``RankLostError``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..formats.base import QuantizedTensor
from .process_group import Ranks, collective, contiguous_share

OP_MOE, OP_STOP = 1, 2
_HEADER = 4  # op, layer, rows, top_k (float32: exact below 2**24)
# Rows a call's first message carries: a decode step's one token goes in one message each way;
# more rows follow in a second message whose size the header gives.
FIRST_ROWS = 1


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
        return cls.from_lists([contiguous_share(range(num_experts), r, world) for r in range(world)], num_experts)

    @classmethod
    def by_load(cls, counts: torch.Tensor, world: int) -> ExpertPlacement:
        """Experts dealt to ranks so that each carries about the same share of the routed tokens:
        heaviest first, each to the least-loaded rank that still has room (every rank holds
        ``E / world`` experts, within one, so memory stays even too)."""
        n = int(counts.numel())
        room = [len(contiguous_share(range(n), r, world)) for r in range(world)]  # by_id's counts
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


@dataclass
class TransferStats:
    """What one layer's calls to the other ranks cost on rank 0 (``RemoteExperts.transfer``)."""

    calls: int = 0
    dispatch_s: float = 0.0  # packing and posting the rows out (the sends themselves are asynchronous)
    collect_s: float = 0.0  # waiting for the partial sums after rank 0's own share was done
    bytes_sent: int = 0
    bytes_received: int = 0


def _first_size(hidden: int, top_k: int) -> int:
    """Floats in a call's first message: the header and FIRST_ROWS rows (a rank is sent a call only
    when it has at least one row)."""
    return _HEADER + FIRST_ROWS * (hidden + 2 * top_k)


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
        self._pending: dict[int, _Call] = {}
        self._next = 0
        self.transfer = TransferStats()

    @property
    def nbytes(self) -> int:
        return int(getattr(self.local, "nbytes", 0))

    def set_mask(self, mask: torch.Tensor) -> None:
        if bool(mask.any()):
            raise ValueError("expert parallelism keeps no expert on a device: gpu_experts must be 0")

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
        import torch.distributed as dist

        started = time.perf_counter()
        k = topk_ids.shape[1]
        x32 = x.float().contiguous()
        hidden = x32.shape[1]
        width = hidden + 2 * k
        safe = topk_ids.clamp(min=0)
        owner = torch.where(topk_ids >= 0, self.placement.owner[safe], -1)
        local_ids = self.placement.local[safe]
        # Every row once as the ranks receive it (x, ids, weights); each rank's copy then marks the
        # ids of other ranks' experts -1. Few torch calls: a decode step's submit is pure overhead.
        packed = torch.cat([x32, local_ids.to(torch.float32), topk_weights], dim=1)
        call = _Call(dtype=x.dtype)
        stats = self.transfer
        with collective(self.ranks, f"layer {self.layer}'s expert dispatch"):
            for r in range(1, self.ranks.world):
                mask = owner == r
                rows = mask.any(1).nonzero().flatten()
                n = int(rows.numel())
                if n == 0:
                    continue  # nothing for rank r in this call: it hears nothing
                mine = packed[rows]
                mine[:, hidden : hidden + k].masked_fill_(~mask[rows], -1.0)
                flat = mine.flatten()
                header = torch.tensor([OP_MOE, self.layer, n, k], dtype=torch.float32)
                first = torch.cat([header, flat[:width]])  # FIRST_ROWS = 1: exactly the header and one row
                messages = [first] if n == 1 else [first, flat[width:]]
                call.sends += [dist.isend(m, r) for m in messages]
                call.keep += messages
                back = torch.empty(n, hidden)
                call.receives.append((r, rows, back, dist.irecv(back, r)))
                stats.bytes_sent += (first.numel() + (flat.numel() - width)) * 4
                stats.bytes_received += back.numel() * 4
        own = torch.where(owner == 0, local_ids, -1).contiguous()
        call.local = self.local.submit(x32, own, topk_weights.contiguous())  # it keeps its inputs
        stats.calls += 1
        stats.dispatch_s += time.perf_counter() - started
        key = self._next
        self._next += 1
        self._pending[key] = call
        return key

    def wait(self, handle: int) -> torch.Tensor:
        if handle not in self._pending:
            raise ValueError(f"handle {handle!r} is not pending on this layer's experts")
        call = self._pending.pop(handle)
        y = self.local.wait(call.local)
        started = time.perf_counter()
        with collective(self.ranks, f"layer {self.layer}'s expert results"):
            for work in call.sends:
                work.wait()
            for _rank, rows, back, work in call.receives:
                work.wait()
                y.index_add_(0, rows, back)
        self.transfer.collect_s += time.perf_counter() - started
        return y.to(call.dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.wait(self.submit(x, topk_ids, topk_weights))

    __call__ = forward


@dataclass
class _Call:
    """One submitted layer call on rank 0: its local job, the messages in flight and what they need."""

    dtype: torch.dtype
    local: int = -1
    sends: list[Any] = field(default_factory=list)
    receives: list[tuple[int, torch.Tensor, torch.Tensor, Any]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)  # buffers the asynchronous sends read


def stop_experts(ranks: Ranks, hidden: int, top_k: int) -> None:
    """Tells every other rank's ``serve_experts`` to return (rank 0, once, at the end)."""
    import torch.distributed as dist

    message = torch.zeros(_first_size(hidden, top_k))
    message[0] = OP_STOP
    with collective(ranks, "the expert ranks' stop"):
        for r in range(1, ranks.world):
            dist.send(message, r)


def serve_experts(ranks: Ranks, shards: dict[int, Any], hidden: int, top_k: int) -> int:
    """A non-zero rank's loop: run its share of whichever layer rank 0 names, until told to stop.
    Returns the number of layer calls served."""
    import torch.distributed as dist

    served = 0
    first = torch.empty(_first_size(hidden, top_k))
    while True:
        with collective(ranks, "the wait for rank 0's next layer"):
            dist.recv(first, 0)
        op, layer, n, k = (int(v) for v in first[:_HEADER])
        if op == OP_STOP:
            return served
        if op != OP_MOE or layer not in shards or k != top_k or n < 1:
            raise RuntimeError(
                f"rank {ranks.rank}: rank 0 sent op {op} for layer {layer} ({n} rows, top-{k}); this rank holds "
                f"layers {sorted(shards)} at top-{top_k}"
            )
        width = hidden + 2 * k
        head = min(n, FIRST_ROWS) * width
        rows = first[_HEADER : _HEADER + head]
        if n > FIRST_ROWS:
            rest = torch.empty((n - FIRST_ROWS) * width)
            with collective(ranks, f"layer {layer}'s expert dispatch"):
                dist.recv(rest, 0)
            rows = torch.cat([rows, rest])
        rows = rows.view(n, width)
        x = rows[:, :hidden].contiguous()
        ids = rows[:, hidden : hidden + k].to(torch.int64).contiguous()
        weights = rows[:, hidden + k :].contiguous()
        y = shards[layer](x, ids, weights)
        with collective(ranks, f"layer {layer}'s expert results"):
            dist.send(y.contiguous(), 0)
        served += 1
