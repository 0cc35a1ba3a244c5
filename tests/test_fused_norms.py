"""The fused CPU RMSNorm against each transformers family's own norm module (fused_norms.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from hetmoe.models.fused_norms import NORM_MODES, fuse_rms_norms

_MODULES = {
    "Qwen3MoeRMSNorm": "qwen3_moe",
    "Qwen2MoeRMSNorm": "qwen2_moe",
    "MixtralRMSNorm": "mixtral",
    "DeepseekV3RMSNorm": "deepseek_v3",
    "DeepseekV2RMSNorm": "deepseek_v2",
    "Glm4MoeRMSNorm": "glm4_moe",
    "MiniMaxM2RMSNorm": "minimax_m2",
    "OlmoeRMSNorm": "olmoe",
    "GptOssRMSNorm": "gpt_oss",
    "Qwen3NextRMSNorm": "qwen3_next",
}


def _norm(cls_name: str, dim: int, dtype: torch.dtype) -> torch.nn.Module:
    module = importlib.import_module(f"transformers.models.{_MODULES[cls_name]}.modeling_{_MODULES[cls_name]}")
    norm = getattr(module, cls_name)(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(1)) * 0.3 + 1.0)
    return norm.to(dtype)


def test_every_family_is_covered() -> None:
    assert set(_MODULES) == set(NORM_MODES)


@pytest.mark.parametrize("cls_name", sorted(_MODULES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_equals_the_module(cls_name: str, dtype: torch.dtype) -> None:
    dim = 200  # not a multiple of the 8 partial sums
    norm = _norm(cls_name, dim, dtype)
    x = (torch.randn(3, 5, dim, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    with torch.no_grad():
        expected = norm(x)
        assert fuse_rms_norms(norm) == 1
        got = norm(x)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    else:
        # Same rounding points; only the fp32 sum of squares is ordered differently, which may move
        # a value sitting on a bf16 rounding boundary by one ulp.
        diff = (got.float() - expected.float()).abs()
        ulp = expected.float().abs() * 2**-7
        assert bool((diff <= ulp + 1e-30).all())
        assert (diff > 0).float().mean() < 0.01


def test_falls_back_for_what_it_does_not_run() -> None:
    norm = _norm("Qwen3MoeRMSNorm", 64, torch.bfloat16)
    fuse_rms_norms(norm)
    x16 = torch.randn(2, 64).half()  # fp16: the module's own forward
    with torch.no_grad():
        assert torch.equal(norm(x16), type(norm).forward(norm, x16))
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    norm.requires_grad_(True)
    norm(x).float().sum().backward()  # grads flow through the module's own forward
    assert x.grad is not None and norm.weight.grad is not None
    strided = torch.randn(64, 4, dtype=torch.bfloat16).t()  # non-contiguous rows
    with torch.no_grad():
        expected = type(norm).forward(norm, strided)
        torch.testing.assert_close(norm(strided), expected, rtol=0, atol=expected.abs().max().item() * 2**-7)
