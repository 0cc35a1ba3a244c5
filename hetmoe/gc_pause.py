"""Keeping Python's cyclic garbage collector off the model's objects.

Building a model and converting its layers allocates hundreds of thousands of Python objects that
live on, so the collector runs its full passes over them again and again: measured at 0.35 s of a
6 s conversion and 1 s of an 8 s load on 2 vCPUs. Nothing those steps build is cyclic garbage that
must go early (tensors are freed by reference counting), so the collector waits until they end.

After a load the same objects cost the decode: a full pass over a loaded model's objects took
210-240 ms (and a middle-generation one ~100 ms) once every ~200 decode steps of a 4-layer model on
2 vCPUs: a visible stall, and 15-20% of the mean step (docs/benchmarks.md).
``freeze_for_decoding`` moves everything alive after a load into the collector's permanent
generation, for the processes that decode with one model until they exit.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block; the collector's state before it is restored after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_for_decoding() -> None:
    """Exempts every object alive now from later collections (``gc.freeze``; module docstring).

    For processes that load one model and then decode until they exit (``hetmoe serve``,
    ``hetmoe generate``, an expert rank), called after the load: SGLang does the same after its
    warm-up. Not done by ``load_model`` itself: a loaded model holds reference cycles, so a model a
    program drops would then never be collected, and a second load would not get its memory back.
    """
    gc.freeze()
