"""DeepSpeed ZeRO-3: partitioned parameters and how to gather them for extraction.

Under ZeRO-3 every rank holds a slice of each parameter; the module's ``param`` is an empty local
tensor carrying ``ds_id``, ``ds_status`` and ``ds_shape`` (the logical shape). Reading experts needs
the whole tensor, so extraction gathers the parameters of one expert module at a time with
``deepspeed.zero.GatheredParameters`` (read-only: ``modifier_rank=None``). A caller (or a test) may
pass its own ``gather`` context factory instead; without deepspeed and without one, a partitioned
parameter is a clear error rather than a silent read of an empty slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

# A context manager factory: given parameters, makes their full values readable inside the block.
GatherFn = Callable[[Sequence[torch.Tensor]], contextlib.AbstractContextManager[Any]]


def is_partitioned(p: torch.Tensor) -> bool:
    """True for a ZeRO-3 partitioned parameter (its attributes, whatever its local storage)."""
    return all(hasattr(p, a) for a in ("ds_id", "ds_status", "ds_shape"))


def logical_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(p.ds_shape) if is_partitioned(p) else tuple(p.shape)  # type: ignore[attr-defined]


def deepspeed_gather() -> GatherFn | None:
    """``deepspeed.zero.GatheredParameters`` when deepspeed is installed, else None."""
    try:
        import deepspeed  # type: ignore[import-not-found]
    except ImportError:
        return None

    def gather(params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)

    return gather


@contextlib.contextmanager
def gathered(params: Sequence[tuple[str, torch.Tensor]], gather: GatherFn | None = None) -> Iterator[None]:
    """Inside the block every parameter of ``params`` (``(name, param)``) holds its full value.

    Nothing happens for ordinary parameters. Partitioned ones are gathered with ``gather`` (or
    deepspeed's); with neither, a ValueError names the first partitioned parameter.
    """
    parts = [(n, p) for n, p in params if is_partitioned(p)]
    if not parts:
        yield
        return
    fn = gather or deepspeed_gather()
    if fn is None:
        name, p = parts[0]
        raise ValueError(
            f"{name}: partitioned by DeepSpeed ZeRO-3 (ds_id={getattr(p, 'ds_id', '?')}, logical shape "
            f"{list(logical_shape(p))}, local {list(p.shape)}), and deepspeed is not installed to gather it; "
            "install deepspeed or pass gather= (a GatheredParameters-like context factory)"
        )
    with fn([p for _, p in parts]):
        for name, p in parts:
            if tuple(p.shape) != logical_shape(p):
                raise ValueError(
                    f"{name}: still partitioned after gathering (shape {list(p.shape)}, expected "
                    f"{list(logical_shape(p))})"
                )
        yield
