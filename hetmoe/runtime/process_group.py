"""This process's place in a torch.distributed job, and the group's calls every part shares.

``torchrun --nproc-per-node N`` (and ``--nnodes``) and ``accelerate launch --multi-gpu`` start
each process with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` in its environment; ``ranks_from_env`` reads them and ``join`` makes the
process group (gloo on the CPU; nccl for CUDA tensors, gloo beside it). Ranks on one host split its
CPUs (``share_cpus``) so that their engines' thread pools do not fight over the same cores.

A peer that dies breaks the group: the next collective on a survivor fails (gloo: the socket is
reset) and ``collective`` turns that into ``RankLostError``, one line that says what to do, instead
of a backend traceback; a peer that hangs fails it after ``TIMEOUT``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch

T = TypeVar("T")
TIMEOUT = timedelta(minutes=10)


class RankLostError(RuntimeError):
    """Another process of the job stopped answering (it died, or the network between them did)."""


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the job; ``Ranks()`` is one process alone."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def main(self) -> bool:
        """The rank that writes checkpoints and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def take(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of ``items`` (sizes differ by at most one)."""
        return contiguous_share(items, self.rank, self.world)


def contiguous_share(items: Sequence[T], index: int, count: int) -> list[T]:
    """Share ``index`` of ``items`` cut into ``count`` contiguous runs whose sizes differ by at most
    one (the batch between ranks, a host's CPUs, a layer's experts)."""
    n = len(items)
    return list(items[index * n // count : (index + 1) * n // count])


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r}: expected an integer (as torchrun sets it)") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={value}: expected >= 0")
    return value


def ranks_from_env(environ: Mapping[str, str] | None = None) -> Ranks:
    """The launcher's ranks from the environment; one process alone where none are set."""
    env = os.environ if environ is None else environ
    world = _env_int(env, "WORLD_SIZE", 1)
    if world < 1:
        raise ValueError("environment variable WORLD_SIZE=0: expected >= 1")
    rank = _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", rank)  # absent: one host
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", world)
    if rank >= world:
        raise ValueError(f"environment variables RANK={rank}, WORLD_SIZE={world}: expected RANK < WORLD_SIZE")
    if local_world < 1 or local_rank >= local_world:
        raise ValueError(
            f"environment variables LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world}: expected "
            "0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"
        )
    return Ranks(rank=rank, world=world, local_rank=local_rank, local_world=local_world)


def join(ranks: Ranks, device: torch.device, timeout: timedelta = TIMEOUT, init_method: str | None = None) -> None:
    """The default process group, from the launcher's environment or ``init_method`` (a URL such as
    ``tcp://HOST:PORT`` every rank is given, with its rank); nothing for one process."""
    import torch.distributed as dist

    if not ranks.distributed or dist.is_initialized():
        return
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if init_method is None and missing:
        raise ValueError(
            f"WORLD_SIZE={ranks.world} but {', '.join(missing)} is not set: start the ranks with torchrun or "
            "accelerate launch (they set the rendezvous), e.g. torchrun --nproc-per-node 2 -m hetmoe ..."
        )
    # With CUDA, tensors on the GPU go over nccl and the few CPU ones (loss sums) over gloo.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else ranks.local_rank)
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=ranks.rank, world_size=ranks.world, timeout=timeout
    )


def leave(ranks: Ranks) -> None:
    import torch.distributed as dist

    if ranks.distributed and dist.is_initialized():
        dist.destroy_process_group()


SHARE_CPUS_ENV = "HETMOE_SHARE_CPUS"  # "0": leave each rank's CPUs as its launcher set them


def cpu_block(cpus: list[int], ranks: Ranks) -> list[int]:
    """``ranks``' contiguous block of ``cpus`` among the ranks of its host (sizes within one); with
    more ranks than CPUs each takes one, shared."""
    if len(cpus) < ranks.local_world:
        return [cpus[ranks.local_rank % len(cpus)]]
    return contiguous_share(cpus, ranks.local_rank, ranks.local_world)


def share_cpus(ranks: Ranks) -> list[int]:
    """This rank's share of the host's usable CPUs (all of them for one process a host).

    Where the launcher gave every local rank the same CPUs, each takes a contiguous block of them
    (``cpu_block``) and pins itself there; the engine's pool and torch's threads then use that
    block only. A launcher that binds each rank to its own CPUs already (numactl, a wrapper)
    should set ``HETMOE_SHARE_CPUS=0``, or each rank would split its own set again. Call it before
    ``join``: the affinity is the calling thread's, which threads started later inherit (the
    process group's socket threads among them).
    """
    cpus = sorted(os.sched_getaffinity(0))
    if ranks.local_world < 2 or os.environ.get(SHARE_CPUS_ENV, "1").strip() in ("0", "off", "false", "no"):
        return cpus
    mine = cpu_block(cpus, ranks)
    os.sched_setaffinity(0, mine)
    from ..kernels import set_num_threads
    from ..kernels.dispatch import set_idle_spin_us

    set_num_threads(len(mine))
    torch.set_num_threads(len(mine))
    if len(mine) == 1:
        # The engine's worker then shares this rank's one CPU with the caller: spinning for the next
        # job would starve the caller (and the sockets' threads) until it sleeps. A rank's isend
        # took 1.3 ms so on 2 vCPUs (bench/bench_expert_parallel.py); sleeping at once costs a wake-up.
        set_idle_spin_us(0)
    return mine


@contextlib.contextmanager
def collective(ranks: Ranks, what: str) -> Iterator[None]:
    """Runs a collective; a broken group becomes ``RankLostError`` naming this rank and ``what``."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, RankLostError):
            raise
        where = f"rank {ranks.rank} of {ranks.world}"
        raise RankLostError(f"{where}: lost the other ranks during {what} ({_cause(exc)})") from exc


def _cause(exc: BaseException) -> str:
    """The backend's message without its source location, first sentence only."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[.../pair.cc:553] "
    return text.split(". ")[0][:200]


def barrier(ranks: Ranks) -> None:
    import torch.distributed as dist

    if ranks.distributed:
        with collective(ranks, "a barrier"):
            dist.barrier()


def broadcast_object(ranks: Ranks, value: object) -> object:
    """Rank 0's ``value`` (any picklable object) on every rank."""
    import torch.distributed as dist

    box = [value]
    with collective(ranks, "a broadcast from rank 0"):
        dist.broadcast_object_list(box, src=0)
    return box[0]
