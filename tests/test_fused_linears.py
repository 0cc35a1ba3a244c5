"""Sibling projections as one engine call (runtime/fused_linears.py) against the separate linears."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetmoe.runtime.cpu_linear import CPULinear, quantize_weight
from hetmoe.runtime.fused_linears import FusedSlice, concat_rows, fuse_siblings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 256


class _Attention(nn.Module):
    """The call pattern of every transformers attention: q, k, v of one hidden state."""

    def __init__(self, method: str, bias: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, rows in (("q_proj", 128), ("k_proj", 128), ("v_proj", 64)):
            w = torch.randn(rows, K, generator=g) * 0.05
            b = torch.randn(rows, generator=g) if bias and name != "k_proj" else None  # a missing bias too
            setattr(self, name, CPULinear(w, b, method=method))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


@pytest.mark.parametrize("method", ["bf16", "int8", "int4", "fp8", "fp8-channel", "mxfp4", "gguf:q4_0", "gguf:q4_k"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_fused_outputs_equal_the_separate_linears(method: str, tokens: int) -> None:
    attn = _Attention(method, bias=True)
    x = torch.randn(1, tokens, K, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = attn(x)
        assert fuse_siblings(attn) == 1
        assert all(isinstance(getattr(attn, n), FusedSlice) for n in ("q_proj", "k_proj", "v_proj"))
        got = attn(x)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        # one GEMV over the concatenated rows does each row's arithmetic exactly as before
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_one_engine_call_per_input_and_recompute_on_another() -> None:
    attn = _Attention("int8", bias=False)
    fuse_siblings(attn)
    calls = []
    fused = attn.fused_qkv_proj.linear
    fused.register_forward_hook(lambda *args: calls.append(1))
    x, other = torch.randn(2, K), torch.randn(2, K)
    with torch.no_grad():
        attn(x)
        assert len(calls) == 1
        q_other = attn.q_proj(other)  # another input: computed for it, not taken from x's output
        k_x = attn.k_proj(x)
        assert len(calls) == 3
        torch.testing.assert_close(q_other, other @ attn.q_proj.dequantized().T, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(k_x, x @ attn.k_proj.dequantized().T, rtol=1e-2, atol=1e-2)
        q = attn.q_proj(x)
        x.mul_(2)  # the same tensor changed in place: its version moved, so k is computed again
        k = attn.k_proj(x)
        assert len(calls) == 4  # q(x) was taken from the cached output of k(x)
        torch.testing.assert_close(k, x @ attn.k_proj.dequantized().T, rtol=1e-2, atol=1e-2)
        assert q.shape == (2, 128)


def test_layouts_that_cannot_be_concatenated_stay_separate() -> None:
    g = torch.Generator().manual_seed(0)
    parts = [quantize_weight(torch.randn(rows, K, generator=g), "gptq", 32) for rows in (64, 64)]
    assert concat_rows(parts) is None  # GPTQ packs along N
    fp8 = [quantize_weight(torch.randn(rows, K, generator=g), "fp8") for rows in (96, 128)]
    assert concat_rows(fp8) is None  # a 128-row scale block would straddle the first part's end
    assert concat_rows(list(reversed(fp8))) is not None  # 128 first: whole blocks, then a ragged last
    mixed = [quantize_weight(torch.randn(32, K, generator=g), m) for m in ("int8", "int4")]
    assert concat_rows(mixed) is None


def test_concat_rows_decodes_to_the_stacked_weights() -> None:
    from hetmoe.formats import get_codec

    g = torch.Generator().manual_seed(2)
    for method in ("int4", "fp8", "gguf:q6_k", "mxfp4"):
        ws = [torch.randn(rows, K, generator=g) for rows in (128, 128, 32)]
        parts = [quantize_weight(w, method) for w in ws]
        fused = concat_rows(parts)
        assert fused is not None and fused.shape == (288, K)
        codec = get_codec(method, **parts[0].params)
        expected = torch.cat([codec.dequantize(p, torch.float32) for p in parts])
        assert torch.equal(codec.dequantize(fused, torch.float32), expected), method
