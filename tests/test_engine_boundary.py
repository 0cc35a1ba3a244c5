"""The engine's entry points check their arguments in C++ (csrc/bindings.cpp): each bad argument gets
a ValueError naming it, before any kernel runs, where it would otherwise read or write out of bounds.
Also: NaN and Inf activations give NaN outputs (never undefined conversions), the tuning globals can
change while jobs run, and the one-call decode block re-reads a norm weight whose storage changed."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import engine_isas

from hetmoe.formats import get_codec
from hetmoe.kernels import moe_forward_reference, select_isa
from hetmoe.kernels.dispatch import engine_module, int_vector_bits, set_int_vector_bits
from hetmoe.runtime import CPUExperts
from hetmoe.runtime.cpu_linear import CPULinear
from hetmoe.runtime.engine_layout import engine_projection

pytestmark = pytest.mark.usefixtures("keep_isa")
E, H, I = 4, 256, 128  # noqa: E741


def _layer(method: str = "int4", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codec = get_codec(method)
    return [codec.quantize(torch.randn(*s, generator=g) * 0.05) for s in ((E, I, H), (E, I, H), (E, H, I))]


def _descriptors(qs) -> tuple[list, list]:
    projs = [engine_projection(q, n) for q, n in zip(qs, ("gate", "up", "down"), strict=True)]
    return projs, [p.descriptor(*q.shape[1:]) for p, q in zip(projs, qs, strict=True)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, H, I), "experts, hidden and intermediate must be positive"),
        ((E, H + 32, I), r"gate is 128 x 256, expected 128 x 288"),
        ((E, H, I + 32), r"gate is 128 x 256, expected 160 x 256"),
    ],
)
def test_moe_engine_checks_its_shape(args: tuple, message: str) -> None:
    select_isa("auto")
    _, descs = _descriptors(_layer())
    with pytest.raises(ValueError, match=message):
        engine_module().MoEEngine(*args, *descs)


def test_moe_engine_checks_down_and_gemv_max() -> None:
    select_isa("auto")
    qs = _layer()
    _, descs = _descriptors(qs)
    with pytest.raises(ValueError, match="down is 128 x 256, expected 256 x 128"):
        engine_module().MoEEngine(E, H, I, descs[0], descs[1], descs[0])  # gate's shape where down's belongs
    with pytest.raises(ValueError, match="gemv_max_tokens must be >= 0"):
        engine_module().MoEEngine(E, H, I, *descs, gemv_max_tokens=-1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"topk": -1}, r"topk must be in \[1, 4\], got -1"),
        ({"topk": 0}, r"topk must be in \[1, 4\], got 0"),
        ({"topk": 5}, r"topk must be in \[1, 4\], got 5"),
        ({"x_dtype": 7}, "x_dtype must be 0"),
        ({"tokens": -3}, "tokens must be >= 0, got -3"),
        ({"x": 0}, "must not be null"),
        ({"y": 0}, "must not be null"),
        ({"ids": 0}, "must not be null"),
    ],
)
def test_moe_submit_checks_its_arguments(change: dict, message: str) -> None:
    select_isa("auto")
    ce = CPUExperts(*_layer(), verbose=False)
    x = torch.randn(3, H)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.rand(3, 2)
    y = torch.empty(3, H)
    args = {"x": x.data_ptr(), "x_dtype": 0, "tokens": 3, "ids": ids.data_ptr(), "topk": 2,
            "weights": w.data_ptr(), "y": y.data_ptr(), "skip": ce._mask.data_ptr()}  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=message):
        ce._engine.submit(**args)
    assert ce._engine.pending == 0  # refused before a job existed


def _block(dtype: torch.dtype = torch.float32):
    """A DecodeAttentionBlock of 2 heads of 16 over one KV head, hidden 64, and its weights."""
    g = torch.Generator().manual_seed(3)
    heads, kv, d, hidden = 2, 1, 16, 64
    qkv = CPULinear(get_codec("bf16").quantize(torch.randn((heads + 2 * kv) * d, hidden, generator=g) * 0.1))
    o = CPULinear(get_codec("bf16").quantize(torch.randn(hidden, heads * d, generator=g) * 0.1))
    norms = [torch.ones(hidden), torch.ones(d), torch.ones(d), torch.ones(hidden)]
    block = engine_module().DecodeAttentionBlock(
        0, hidden, heads, kv, d, tuple((n.data_ptr(), 1e-6, 0) for n in norms), 0.25, qkv._engine, o._engine, None,
        qk_norm=1, rotary_dim=d, sinks=0,
    )  # fmt: skip
    return block, (qkv, o, norms), (heads, kv, d, hidden)


def test_decode_block_refuses_bad_norms_and_rotary() -> None:
    select_isa("auto")
    _, (qkv, o, norms), (heads, kv, d, hidden) = _block()
    specs = [(n.data_ptr(), 1e-6, 0) for n in norms]
    make = engine_module().DecodeAttentionBlock
    args = (0, hidden, heads, kv, d)
    engines = (qkv._engine, o._engine, None)  # qkv, o_proj, no router
    for qk_norm, rotary_dim, message in (
        (3, d, "qk_norm must be 0"),
        (-1, d, "qk_norm must be 0"),
        (1, d + 2, "rotary_dim must be even"),
        (1, 7, "rotary_dim must be even"),
        (1, 0, "rotary_dim must be even"),
    ):
        with pytest.raises(ValueError, match=message):
            make(*args, tuple(specs), 0.25, *engines, qk_norm=qk_norm, rotary_dim=rotary_dim, sinks=0)
    absent = (0, 0.0, 0)
    with pytest.raises(ValueError, match="norm 1 needs a weight"):  # q/k norms asked for, none given
        make(*args, (specs[0], absent, absent, specs[3]), 0.25, *engines, qk_norm=2, rotary_dim=d, sinks=0)
    with pytest.raises(ValueError, match="norm 3 needs a weight and a mode"):
        make(*args, (*specs[:3], (specs[3][0], 1e-6, 7)), 0.25, *engines, qk_norm=1, rotary_dim=d, sinks=0)
    make(*args, (specs[0], absent, absent, specs[3]), 0.25, *engines, qk_norm=0, rotary_dim=8, sinks=0)
    # q/k/v as three linears: both of k_proj and v_proj, each of its own size
    with pytest.raises(ValueError, match="k_proj and v_proj go together"):
        make(*args, tuple(specs), 0.25, *engines, qk_norm=1, rotary_dim=d, sinks=0, k_proj=qkv._engine)
    with pytest.raises(ValueError, match="q, k_proj, v_proj must map hidden"):  # the fused qkv is no q
        make(*args, tuple(specs), 0.25, *engines, qk_norm=1, rotary_dim=d, sinks=0, k_proj=o._engine, v_proj=o._engine)


@pytest.mark.parametrize("position", [-1, 8, 9, 1 << 40])
def test_decode_block_refuses_a_row_outside_the_cache(position: int) -> None:
    select_isa("auto")
    block, _keep, (_, kv, d, hidden) = _block()
    capacity = 8
    kbuf, vbuf = torch.zeros(1, kv, capacity, d), torch.zeros(1, kv, capacity, d)
    x, cos, sin = torch.randn(1, 1, hidden), torch.ones(1, 1, d), torch.zeros(1, 1, d)
    x_out, h_out = torch.empty(1, 1, hidden), torch.empty(1, hidden)
    args = [x.data_ptr(), cos.data_ptr(), sin.data_ptr(), kbuf.data_ptr(), vbuf.data_ptr(), kbuf.stride(1),
            kbuf.stride(2), vbuf.stride(1), vbuf.stride(2)]  # fmt: skip
    with pytest.raises(ValueError, match=f"position {position} is outside the cache's 8 rows"):
        block.run(*args, position, capacity, x_out.data_ptr(), h_out.data_ptr(), 0)
    with pytest.raises(ValueError, match="cache strides overlap"):
        block.run(*args[:5], d * 4, d, d, d, 0, capacity, x_out.data_ptr(), h_out.data_ptr(), 0)
    with pytest.raises(ValueError, match="a null buffer"):
        block.run(*args, 0, capacity, x_out.data_ptr(), h_out.data_ptr(), x_out.data_ptr())  # logits, no router
    block.run(*args, capacity - 1, capacity, x_out.data_ptr(), h_out.data_ptr(), 0)  # the last row is fine
    # the first row attended (a sliding window's) must lie in [0, position]
    for first in (-1, capacity):
        with pytest.raises(ValueError, match=f"first row {first} is not in"):
            block.run(*args, capacity - 1, capacity, x_out.data_ptr(), h_out.data_ptr(), 0, first)
    assert torch.isfinite(x_out).all() and vbuf[0, :, capacity - 1].abs().sum() > 0


@pytest.mark.parametrize("isa", engine_isas())
@pytest.mark.parametrize("method", ["int4", "int8", "gguf:q4_0", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_activations_give_nan_rows(isa: str, method: str, bad: float) -> None:
    """A token holding a NaN or an Inf gets an all-NaN output row, on the GEMV path and the GEMM path
    (on AMX: the tiles); the other tokens' rows equal a run where that token is finite, bit for bit
    (tokens are independent in every kernel)."""
    select_isa(isa)
    qs = _layer(method, seed=1)
    g = torch.Generator().manual_seed(2)
    T = 24
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    poisoned = x.clone()
    poisoned[5, 17] = bad
    for gemv_max in (0, 1000):  # all GEMM, all GEMV
        ce = CPUExperts(*qs, gemv_max_tokens=gemv_max, verbose=False)
        clean, got = ce.forward(x, ids, w), ce.forward(poisoned, ids, w)
        assert torch.isnan(got[5]).all(), (gemv_max, got[5][:4])
        others = torch.arange(T) != 5
        assert torch.equal(got[others], clean[others]), gemv_max


def test_vector_width_changes_while_jobs_run() -> None:
    """set_int_vector_bits from Python while the pool's workers quantize and multiply (the width is an
    atomic read as each activation row is quantized; the row records its layout and the GEMVs follow
    it). A job may then run its projections at different widths, which differ only in the order of
    fp32 sums: every result stays within the int4 GEMV's bound against float64 (3e-4, as
    tests/test_engine.py states it), where a row read in the other layout would be off by its size."""
    select_isa("auto")
    ce = CPUExperts(*_layer(seed=4), gemv_max_tokens=1000, verbose=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(4)])
    w = torch.rand(4, 2, generator=g)
    deq = [get_codec(q.method, **q.params).dequantize(q) for q in (ce.gate, ce.up, ce.down)]
    ref = moe_forward_reference(x.double(), *(d.double() for d in deq), ids, w.double())
    before = int_vector_bits()
    stop = threading.Event()

    def toggle() -> None:
        while not stop.is_set():
            for bits in (256, 512):
                set_int_vector_bits(bits)

    t = threading.Thread(target=toggle)
    t.start()
    try:
        for _ in range(300):
            y = ce.forward(x, ids, w).double()
            assert float((y - ref).norm() / ref.norm()) < 3e-4
    finally:
        stop.set()
        t.join()
        set_int_vector_bits(before)


def test_job_buffer_cache_lets_idle_blocks_go() -> None:
    """The cache of large job buffers (engine_common.h) keeps a block for the next job of a similar
    size, and gives back one that idle_gets large requests have passed by, so a server's memory does
    not keep the buffers of every batch shape it once saw. Top-2 routing of T tokens over H = 256
    gives an fp32 output buffer of T * 2 * 256 * 4 bytes: 8 MiB at T = 4096, 1 MiB (the smallest size
    cached) at T = 512; a block serves requests of half its size and up, so the 8 MiB one never
    serves the 1 MiB ones. The jobs' other buffers of about that size (since the tiles an AMX prompt
    packs are job buffers too) may serve the output in its place, so what must stay is a block that
    serves it."""
    select_isa("auto")
    ce = CPUExperts(*_layer(seed=6), gemv_max_tokens=0, verbose=False)
    stats = engine_module().buffer_cache_stats

    def run(tokens: int) -> None:
        g = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
        ce.forward(torch.randn(tokens, H, generator=g), ids, torch.rand(tokens, 2, generator=g))

    big, small = 4096 * 2 * H * 4, 512 * 2 * H * 4
    assert small == stats()["min_bytes"]
    run(4096)
    assert big in stats()["blocks"]
    run(4096)  # served from the cache: still one block of that size
    assert stats()["blocks"].count(big) == 1
    for _ in range(stats()["idle_gets"] + 1):
        run(512)
    blocks = stats()["blocks"]
    assert big not in blocks and any(small <= b <= 2 * small for b in blocks), blocks
    assert all(b <= 2 * small for b in blocks), blocks
    assert sum(blocks) <= stats()["max_bytes"]
