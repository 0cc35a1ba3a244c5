"""An input embedding that stays in the file's GGUF blocks and decodes only the rows it looks up.

A GGUF stores the token embedding quantized like everything else (Q4_0, Q4_K, Q6_K ...). Decoded
into the model's dtype it would be a full-precision copy of the table: 0.6 GB in bf16 for
Qwen3-30B-A3B's 151,936 x 2048, 1.9 GB for DeepSeek-V3's 129,280 x 7168, resident for the life of
the process although a forward reads a handful of rows. This module keeps the stored bytes (a view
of the memory-mapped file) and decodes the looked-up rows only: with the engine's scalar row
decoders for the common types (csrc/gguf_rows.cpp), else with the block decoder the loader would
have used on the whole table (formats/gguf); both give that table's rows bit for bit.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..formats import QuantizedTensor, get_codec
from ..formats.gguf.blocks import dequantize_blocks
from ..formats.gguf.codec import SUFFIX, GGUFCodec
from ..kernels.dispatch import EngineUnavailableError, engine_module


@functools.cache
def _engine_row_kinds() -> frozenset[str]:
    """The GGUF types the engine decodes rows of (lower-case ggml names); none without the engine."""
    try:
        return frozenset(engine_module().gguf_row_kinds())
    except EngineUnavailableError:
        return frozenset()


class StoredEmbedding(nn.Module):
    """``nn.Embedding``'s forward over a table held as GGUF blocks ``uint8 [vocab, row_bytes]``."""

    def __init__(self, stored: QuantizedTensor, dtype: torch.dtype, name: str = "embed_tokens.weight") -> None:
        super().__init__()
        codec = get_codec(stored.method, **stored.params)
        if not isinstance(codec, GGUFCodec) or len(stored.shape) != 2:
            raise ValueError(f"{name}: a stored embedding needs a 2-D table in GGUF blocks, found {stored.method}")
        codec.validate(stored, name)  # every block's scale finite, once, as a decode of the whole table checks
        self.num_embeddings, self.embedding_dim = (int(d) for d in stored.shape)
        self.ggml_type = codec.ggml_type
        self.method = stored.method
        self.dtype = dtype
        kind = codec.ggml_type.name.lower()
        self._engine_kind = kind if kind in _engine_row_kinds() else None  # None: formats/gguf decodes
        self.register_buffer("blocks", stored.tensors[SUFFIX], persistent=False)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        decoded = self._engine_rows(flat)
        if decoded is None:
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
                self._out_of_range(flat)
            rows = self.blocks.index_select(0, flat.to(self.blocks.device))
            decoded = dequantize_blocks(rows, self.ggml_type, shape=(flat.numel(), self.embedding_dim))
        return decoded.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def _engine_rows(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The looked-up rows decoded by the engine's scalar decoders (csrc/gguf_rows.cpp: the same
        float32 expressions in the same order as formats/gguf's, ~50x faster on a decode step's one
        row); None where it has none for this type, or the table or ids are not on the CPU."""
        kind = self._engine_kind
        if kind is None or self.blocks.device.type != "cpu" or flat.device.type != "cpu":
            return None
        blocks = self.blocks if self.blocks.is_contiguous() else self.blocks.contiguous()
        ids = flat.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.embedding_dim)
        bad = engine_module().gguf_rows(
            kind, blocks.data_ptr(), blocks.shape[1], blocks.shape[0], ids.data_ptr(), ids.numel(),
            self.embedding_dim, out.data_ptr(),
        )  # fmt: skip
        if bad >= 0:
            self._out_of_range(ids)
        return out

    def _out_of_range(self, flat: torch.Tensor) -> None:
        bad = int(flat[(flat < 0) | (flat >= self.num_embeddings)][0])
        raise IndexError(f"token id {bad} is outside the embedding's {self.num_embeddings} rows")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, stored as {self.method}"
