"""Weights the process builds go on memory marked for transparent huge pages (kernels/huge_pages.py)."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from hetmoe.formats import get_codec
from hetmoe.hw import huge_pages
from hetmoe.kernels.quantize import engine_quantize

linux_thp = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/proc/self/smaps"), reason="Linux THP only"
)


def _vma_flags(addr: int) -> list[str] | None:
    """The VmFlags of the mapping holding ``addr`` in /proc/self/smaps, None where none does."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


@linux_thp
def test_a_large_tensor_starts_on_a_huge_page_marked_for_thp(monkeypatch):
    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    t = huge_pages.empty((3, 1 << 20), torch.int16)  # 6 MiB: three whole huge pages
    assert t.shape == (3, 1 << 20) and t.dtype == torch.int16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert "hg" in _vma_flags(t.data_ptr())  # MADV_HUGEPAGE's VM_HUGEPAGE
    t.copy_(torch.arange(3 << 20, dtype=torch.int32).view(3, 1 << 20).to(torch.int16))
    assert torch.equal(t.flatten()[-4:], torch.arange((3 << 20) - 4, 3 << 20, dtype=torch.int32).to(torch.int16))


@linux_thp
def test_the_mapping_goes_with_the_last_view(monkeypatch):
    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    t = huge_pages.empty((4 << 20,), torch.uint8)
    addr = t.data_ptr()
    view = t[1 << 20 :]
    del t
    gc.collect()
    assert _vma_flags(addr) is not None  # the view still holds it
    del view
    gc.collect()
    assert _vma_flags(addr) is None or "hg" not in _vma_flags(addr)  # unmapped (the address may be reused)


def test_small_tensors_and_the_opt_out_are_plain_torch(monkeypatch):
    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    small = torch.arange(1000, dtype=torch.float32)
    assert huge_pages.copy_to_huge_pages(small) is small
    monkeypatch.setenv("HETMOE_HUGE_PAGES", "0")
    big = torch.ones(1 << 20, dtype=torch.float32)
    assert huge_pages.copy_to_huge_pages(big) is big
    assert not huge_pages.huge_pages_wanted()


@linux_thp
def test_copy_keeps_every_byte(monkeypatch):
    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    src = torch.randint(-(2**15), 2**15, (5, 700_001), dtype=torch.int32)  # not a whole number of pages
    out = huge_pages.copy_to_huge_pages(src)
    assert out.data_ptr() != src.data_ptr() and out.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert torch.equal(out, src)


@linux_thp
def test_experts_quantized_at_load_land_on_huge_pages(monkeypatch):
    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    w = (torch.randn(8, 512, 1024) * 0.02).bfloat16()  # int4 codes 8 x 512 x 512 bytes = 2 MiB
    q = engine_quantize(get_codec("int4", group_size=32), w, "experts.w1")
    if q is None:
        pytest.skip("the engine's quantizer is not available on this CPU")
    codes = q.tensors[".weight"]
    assert codes.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and "hg" in _vma_flags(codes.data_ptr())


@linux_thp
def test_experts_requantized_in_chunks_are_joined_on_huge_pages(monkeypatch):
    from hetmoe.checkpoint.experts import _stacked

    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    chunks = [torch.randint(0, 256, (n, 512, 1024), dtype=torch.uint8) for n in (3, 3, 2)]
    joined = _stacked(chunks)
    assert torch.equal(joined, torch.cat(chunks))
    assert joined.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and "hg" in _vma_flags(joined.data_ptr())


@linux_thp
def test_fused_siblings_are_joined_on_huge_pages(monkeypatch):
    """q/k/v or gate/up fused into one weight: a copy every decode step streams, so on huge pages
    (4-layer DeepSeek-V3- and gpt-oss-shaped bf16 models decoded 2-3% faster with their dense
    weights on huge pages; with this copy there, the rest gained nothing), the members' rows in order."""
    from hetmoe.formats import QuantizedTensor
    from hetmoe.runtime.fused_linears import concat_rows

    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    parts = [torch.randn(n, 2048).bfloat16() for n in (1024, 256, 256)]  # 6 MiB together
    fused = concat_rows([QuantizedTensor("bf16", tuple(p.shape), {".weight": p}, {}) for p in parts])
    joined = fused.tensors[".weight"]
    assert torch.equal(joined, torch.cat(parts)) and fused.shape == (1536, 2048)
    assert joined.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and "hg" in _vma_flags(joined.data_ptr())


@linux_thp
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_a_directorys_per_expert_tensors_are_stacked_onto_huge_pages(monkeypatch, tmp_path, stored):
    """A checkpoint that stores each expert's matrices apart (Qwen3-MoE, DeepSeek, Mixtral, GLM in
    their Hugging Face form) is stacked into one copy at load: that copy is what every decode step
    reads, on huge pages, with the values the files hold (fp16 converted to bf16 as torch rounds)."""
    import json

    from safetensors.torch import save_file

    from hetmoe.checkpoint import open_source
    from hetmoe.checkpoint.config import read_config
    from hetmoe.checkpoint.experts import read_layer_experts
    from hetmoe.checkpoint.layout import moe_layout

    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    experts, hidden, inter = 8, 512, 1024  # 8 MiB a projection in bf16: four whole huge pages
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "moe_intermediate_size": inter, "intermediate_size": 2048, "num_experts": experts,
        "num_experts_per_tok": 2, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "vocab_size": 256,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    state = {
        f"model.layers.0.mlp.experts.{e}.{proj}.weight": torch.randn(shape, generator=g).to(stored)
        for e in range(experts)
        for proj, shape in shapes.items()
    }
    save_file(state, tmp_path / "model.safetensors")
    source = open_source(tmp_path)
    layer = read_layer_experts(source, moe_layout(read_config(tmp_path), source), 0)
    for name, q in (("gate_proj", layer.gate), ("up_proj", layer.up), ("down_proj", layer.down)):
        w = q.tensors[".weight"]
        want = torch.stack([state[f"model.layers.0.mlp.experts.{e}.{name}.weight"] for e in range(experts)])
        assert w.dtype == torch.bfloat16 and torch.equal(w, want.to(torch.bfloat16)), name
        assert w.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and "hg" in _vma_flags(w.data_ptr()), name


@linux_thp
def test_dense_weights_run_from_a_copy_on_huge_pages(monkeypatch):
    """A GGUF's dense weight in its stored blocks is a view of the file's mapping, 4 KiB pages where
    the page cache holds no 2 MiB folio there: the engine runs a copy on huge pages, byte for byte
    (models/dense_engine.py: QuantizedTensor.on_huge_pages)."""
    from torch import nn

    from hetmoe.models.dense_engine import STORED, DenseConverter
    from hetmoe.runtime.cpu_linear import CPULinear

    monkeypatch.delenv("HETMOE_HUGE_PAGES", raising=False)
    model = nn.Sequential(nn.Linear(2048, 1024, bias=False)).to(torch.bfloat16)
    stored = get_codec("gguf:q8_0").quantize(torch.randn(1024, 2048, generator=torch.Generator().manual_seed(0)))
    blocks = next(iter(stored.tensors.values()))
    assert blocks.numel() * blocks.element_size() >= huge_pages.HUGE_PAGE_BYTES  # 2.1 MiB of Q8_0 blocks
    convert = DenseConverter(model, STORED, None, [], [])
    assert convert.take(model[0], "weight", None, stored)
    convert.finish(model)
    assert isinstance(model[0], CPULinear)
    (held,) = model[0].weight_q.tensors.values()
    assert held.data_ptr() != blocks.data_ptr() and torch.equal(held, blocks)
    assert held.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and "hg" in _vma_flags(held.data_ptr())
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(model[0](x), CPULinear(stored)(x))  # the same bytes, the same kernel
