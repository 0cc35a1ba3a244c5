"""An input embedding that stays in the file's GGUF blocks and decodes only the rows it looks up.

A GGUF stores the token embedding quantized like everything else (Q4_0, Q4_K, Q6_K ...). Decoded
into the model's dtype it would be a full-precision copy of the table: 0.6 GB in bf16 for
Qwen3-30B-A3B's 151,936 x 2048, 1.9 GB for DeepSeek-V3's 129,280 x 7168, resident for the life of
the process although a forward reads a handful of rows. This module keeps the stored bytes (a view
of the memory-mapped file) and decodes the looked-up rows with the same block decoder the loader
would have used on the whole table, so its output is bit-identical to that table's rows.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import QuantizedTensor, get_codec
from ..formats.gguf.blocks import dequantize_blocks
from ..formats.gguf.codec import SUFFIX, GGUFCodec


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
        self.register_buffer("blocks", stored.tensors[SUFFIX], persistent=False)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            bad = int(flat[(flat < 0) | (flat >= self.num_embeddings)][0])
            raise IndexError(f"token id {bad} is outside the embedding's {self.num_embeddings} rows")
        rows = self.blocks.index_select(0, flat.to(self.blocks.device))
        out = dequantize_blocks(rows, self.ggml_type, shape=(flat.numel(), self.embedding_dim))
        return out.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, stored as {self.method}"
