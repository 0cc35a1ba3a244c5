"""The I-quant lattice codebooks and the ``ksigns`` table, as cached torch tensors.

These tables (``iq2xxs_grid``, ``iq2xs_grid``, ``iq2s_grid``, ``iq3xxs_grid``, ``iq3s_grid``,
``iq1s_grid``, ``ksigns_iq2xs``) are constants of the GGUF format defined by ggml. Rather than
pasting thousands of table entries here, they are loaded on first use from the installed ``gguf``
package (a declared dependency), whose ``quants`` module carries them in packed hex form and
unpacks them with ``init_grid()``. The result is cached per (table, device).
"""

from __future__ import annotations

import functools

import torch

# hetmoe name -> name of the gguf.quants class that holds the grid
_GRID_CLASS = {
    "iq2xxs": "IQ2_XXS",  # 256 x 8, values {8, 25, 43}
    "iq2xs": "IQ2_XS",  # 512 x 8
    "iq2s": "IQ2_S",  # 1024 x 8
    "iq3xxs": "IQ3_XXS",  # 256 x 4, values {4, 12, ..., 62}
    "iq3s": "IQ3_S",  # 512 x 4, odd values 1..15
    "iq1s": "IQ1_S",  # 2048 x 8, values {-1, 0, 1} (IQ1_M shares it)
}


@functools.cache
def grid(name: str, device: torch.device) -> torch.Tensor:
    """Float32 codebook ``[entries, 4 or 8]`` for ``name`` in :data:`_GRID_CLASS`, on ``device``."""
    from gguf import quants  # deferred: only the I-quant decoders need it

    cls = getattr(quants, _GRID_CLASS[name])
    cls.init_grid()
    rows, width = cls.grid_shape
    table = torch.from_numpy(cls.grid.reshape(rows, width).copy()).to(torch.float32)
    return table.to(device)


@functools.cache
def sign_table(device: torch.device) -> torch.Tensor:
    """``[128, 8]`` float32 of +-1: row ``i`` is the 8 signs encoded by ``ksigns_iq2xs[i]``.

    ggml stores 7 sign bits per group of 8 weights; the 8th sign is implied by even parity, and
    ``ksigns`` maps the 7-bit index to the full sign byte (bit ``j`` set -> weight ``j`` negative).
    """
    from gguf import quants

    ksigns = torch.tensor(list(quants.IQ2_XXS.ksigns), dtype=torch.int32)
    bits = (ksigns.unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)


@functools.cache
def bit_sign_table(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` float32 of +-1 for a plain sign byte (IQ2_S/IQ3_S store all 8 bits)."""
    bits = (torch.arange(256, dtype=torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)
