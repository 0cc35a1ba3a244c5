"""The engine's GGUF row decoders (csrc/gguf_rows.cpp, an embedding lookup's path) against the gguf
package's dequantize and formats/gguf's decoders: bit for bit, every type they list."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hetmoe.formats import QuantizedTensor
from hetmoe.formats.gguf import GGML_TYPES
from hetmoe.formats.gguf.blocks import dequantize_blocks
from hetmoe.kernels.dispatch import engine_module
from hetmoe.runtime.stored_embedding import StoredEmbedding

KINDS = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]
# byte offsets of each block's fp16 fields (d, and m / dmin where the type has one)
F16_FIELDS = {
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q8_0": (0,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}


def _table(kind: str, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random blocks whose fp16 fields are finite and span the range: normal values of both signs,
    subnormals, zero and the largest half."""
    t = GGML_TYPES[kind.upper()]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(rows, t.row_bytes(k)), dtype=np.uint8)
    blocks = raw.reshape(-1, t.block_bytes)
    special = np.array([0.0, -0.0, 6.0e-8, -3.0e-6, 65504.0, -1.0e-4], dtype=np.float16)
    for off in F16_FIELDS[kind]:
        values = (g.standard_normal(blocks.shape[0]) * 0.02).astype(np.float16)
        values[: len(special)] = special
        blocks[:, off : off + 2] = values.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw)


def test_the_engine_lists_exactly_these_types():
    assert sorted(engine_module().gguf_row_kinds()) == sorted(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_decode_bit_for_bit_as_gguf_and_formats(kind: str):
    rows, k = 9, 512
    table = _table(kind, rows, k)
    ids = torch.tensor([4, 0, 8, 4, 1], dtype=torch.int64)
    out = torch.empty(len(ids), k)
    bad = engine_module().gguf_rows(
        kind, table.data_ptr(), table.shape[1], rows, ids.data_ptr(), len(ids), k, out.data_ptr()
    )
    assert bad == -1
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    reference = torch.from_numpy(gguf.quants.dequantize(table[ids].numpy(), qtype).reshape(len(ids), k).copy())
    ours = dequantize_blocks(table[ids], GGML_TYPES[kind.upper()], shape=(len(ids), k))
    # compared as bits: -0.0 and 0.0 differ, and so would any rounding
    assert torch.equal(out.view(torch.int32), reference.view(torch.int32))
    assert torch.equal(out.view(torch.int32), ours.view(torch.int32))


def test_an_id_outside_the_table_is_reported_and_nothing_written():
    table = _table("q4_0", 4, 64)
    ids = torch.tensor([1, 4, 2], dtype=torch.int64)
    out = torch.full((3, 64), 7.0)
    rows = engine_module().gguf_rows
    assert rows("q4_0", table.data_ptr(), table.shape[1], 4, ids.data_ptr(), 3, 64, out.data_ptr()) == 1
    assert bool((out == 7.0).all())
    with pytest.raises(ValueError, match="no row decoder for ggml type 'iq2_xs'"):
        rows("iq2_xs", table.data_ptr(), table.shape[1], 4, ids.data_ptr(), 3, 64, out.data_ptr())
    with pytest.raises(ValueError, match="q4_0 rows of 64 weights are not 30 bytes"):
        rows("q4_0", table.data_ptr(), 30, 4, ids.data_ptr(), 3, 64, out.data_ptr())


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "iq4_nl"])
def test_stored_embedding_takes_the_engine_where_it_decodes_the_type(kind: str, monkeypatch):
    """The same rows through the engine and through formats/gguf (iq4_nl: the engine has no decoder
    for it, so both are the torch path); an id out of range is an IndexError either way."""
    rows, k = 6, 256
    table = _table(kind, rows, k, seed=1) if kind != "iq4_nl" else _iq4nl_table(rows, k)
    stored = QuantizedTensor(f"gguf:{kind}", (rows, k), {".weight": table}, {"ggml_type": kind.upper()})
    emb = StoredEmbedding(stored, torch.bfloat16)
    ids = torch.tensor([[5, 0, 3]])
    want = dequantize_blocks(table[ids[0]], GGML_TYPES[kind.upper()], shape=(3, k)).bfloat16().view(1, 3, k)
    assert torch.equal(emb(ids), want)
    with pytest.raises(IndexError, match=f"token id {rows} is outside the embedding's {rows} rows"):
        emb(torch.tensor([[1, rows]]))


def _iq4nl_table(rows: int, k: int) -> torch.Tensor:
    raw = np.random.default_rng(2).integers(0, 256, size=(rows, k // 32 * 18), dtype=np.uint8)
    blocks = raw.reshape(-1, 18)
    blocks[:, 0:2] = (
        (np.random.default_rng(3).standard_normal(blocks.shape[0]) * 0.02)
        .astype(np.float16)
        .view(np.uint8)
        .reshape(-1, 2)
    )
    return torch.from_numpy(raw)
