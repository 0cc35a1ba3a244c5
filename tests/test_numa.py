"""NUMA sub-pools: the pool split into node groups, every expert's rows and every dense layer's
rows split across them (csrc/numa.h, csrc/numa_split.h), against the float64 reference.

This machine has one NUMA node, so the split is simulated (HETMOE_NUMA=<count> / set_numa): the
allowed CPUs are divided into groups that the pool and the engine treat exactly as nodes (their own
workers, their own rows of every expert with the pages moved to the node their CPUs are on, their
items claimed first by their own threads). Bounds as in test_engine.py.
"""

import os
import subprocess
import sys

import pytest
import torch

from hetmoe.formats import get_codec
from hetmoe.kernels import moe_forward_reference, set_numa
from hetmoe.kernels.dispatch import engine_module
from hetmoe.runtime import CPUExperts
from hetmoe.runtime.cpu_linear import CPULinear

E, H, I = 6, 512, 768  # noqa: E741 - I: three GGUF superblocks, so K-quants split unevenly
FP32_BOUND, BF16_BOUND = 3e-4, 5e-3

METHODS = [
    ("bf16", {}),
    ("int8", {}),
    ("int4", {"group_size": 32}),
    ("int4", {"group_size": 128, "layout": "compressed-tensors"}),
    ("int4-asym", {"group_size": 64}),
    ("gptq", {"group_size": 128, "sym": False}),
    ("mxfp4", {}),
    ("fp8", {}),
    ("fp8-channel", {}),
    ("gguf:q4_0", {}),
    ("gguf:q5_0", {}),
    ("gguf:q8_0", {}),
    ("gguf:iq4_nl", {}),
    ("gguf:q4_k", {}),
    ("gguf:q5_k", {}),
    ("gguf:q6_k", {}),
    ("gguf:iq4_xs", {}),
]


@pytest.fixture
def numa():
    """set_numa(spec) for the test, then back to the environment's choice."""
    yield set_numa
    set_numa("")


@pytest.fixture(scope="module")
def weights() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*s, generator=g) * 0.05 for s in ((E, I, H), (E, I, H), (E, H, I)))


_QUANTIZED: dict[str, list] = {}


def _quantized(weights, method: str, params: dict) -> list:
    key = f"{method}{sorted(params.items())}"
    if key not in _QUANTIZED:
        codec = get_codec(method, **params)
        _QUANTIZED[key] = [codec.quantize(w) for w in weights]
    return _QUANTIZED[key]


def _reference(qs, x, ids, w, **kw) -> torch.Tensor:
    deq = [get_codec(q.method, **q.params).dequantize(q) for q in qs]
    return moe_forward_reference(x, *deq, ids, w, **kw)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _split(ce: CPUExperts) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    return [(tuple(s["up_rows"]), tuple(s["down_rows"])) for s in ce.numa_split]


def test_split_specs(numa) -> None:
    mod = engine_module()
    allowed = sorted(os.sched_getaffinity(0))
    numa("off")
    info = mod.numa_info()
    assert info["source"] == "single" and info["node_cpus"] == [allowed]
    numa("2")
    info = mod.numa_info()
    assert info["source"] == "split" and len(info["node_cpus"]) == 2
    assert sorted(c for cpus in info["node_cpus"] for c in cpus) == allowed  # every CPU in one group
    assert all(info["node_cpus"]), info  # two CPUs or more: neither group is empty
    if info["libnuma"]:  # each group's memory goes where its CPUs are
        assert all(n >= 0 for n in info["memory_nodes"]), info
    for bad in ("banana", "0", "17", "-1", "2x"):
        with pytest.raises(ValueError, match="HETMOE_NUMA: expected 'auto', 'off' or a node count"):
            numa(bad)
    assert mod.numa_info()["source"] == "split"  # a refused spec changes nothing


def test_bad_environment_is_a_clear_error() -> None:
    code = "from hetmoe.kernels.dispatch import engine_module; engine_module().numa_info()"
    env = {**os.environ, "HETMOE_NUMA": "several"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "HETMOE_NUMA: expected 'auto', 'off' or a node count from 1 to 16, found 'several'" in proc.stderr


@pytest.mark.parametrize(("method", "params"), METHODS, ids=[f"{m}{p.get('group_size', '')}" for m, p in METHODS])
@pytest.mark.usefixtures("vector_arithmetic")  # the split, not the tiles' arithmetic (test_amx.py)
def test_split_layer_matches_reference(weights, numa, method: str, params: dict) -> None:
    """Every method, both paths (GEMV, dequantized-panel GEMM), fp32 and bf16 activations, on two
    groups and on three (one of them without CPUs: its items run on the others' threads)."""
    qs = _quantized(weights, method, params)
    g = torch.Generator().manual_seed(1)
    for spec in ("2", "3"):
        numa(spec)
        for gemv_max in (0, 1000):
            ce = CPUExperts(*qs, gemv_max_tokens=gemv_max, verbose=False)
            split = _split(ce)
            assert len(split) == int(spec), split
            for T, k in ((1, 4), (5, 2), (37, 3)):
                ids = torch.randint(0, E, (T, k), generator=g)
                w = torch.rand(T, k, generator=g)
                x = torch.randn(T, H, generator=g)
                ref = _reference(qs, x, ids, w)
                assert _rel(ce.forward(x, ids, w), ref) < FP32_BOUND, (spec, gemv_max, T)
                yb = ce.forward(x.bfloat16(), ids, w)
                assert _rel(yb, _reference(qs, x.bfloat16().float(), ids, w)) < BF16_BOUND, (spec, gemv_max, T)


@pytest.mark.parametrize(
    ("method", "spec", "i", "h", "bounds"),
    [
        ("int4", "2", 768, 512, [((0, 384), (0, 256)), ((384, 768), (256, 512))]),
        ("gguf:q4_k", "3", 768, 256, [((0, 256), (0, 85)), ((256, 512), (85, 170)), ((512, 768), (170, 256))]),
        # fp8: cut at whole 128-row scale blocks
        ("fp8", "2", 384, 256, [((0, 128), (0, 128)), ((128, 384), (128, 256))]),
    ],
)
def test_every_row_belongs_to_one_node(numa, method: str, spec: str, i: int, h: int, bounds) -> None:
    g = torch.Generator().manual_seed(2)
    codec = get_codec(method)
    qs = [codec.quantize(torch.randn(*s, generator=g) * 0.05) for s in ((2, i, h), (2, i, h), (2, h, i))]
    numa(spec)
    ce = CPUExperts(*qs, verbose=False)
    assert _split(ce) == bounds
    ids = torch.tensor([[0, 1]])
    w = torch.rand(1, 2, generator=g)
    x = torch.randn(1, h, generator=g)
    assert _rel(ce.forward(x, ids, w), _reference(qs, x, ids, w)) < FP32_BOUND
    numa("off")
    assert _split(CPUExperts(*qs, verbose=False)) == [((0, i), (0, h))]


def test_moving_pages_counts_the_pages_that_start_inside() -> None:
    """move_to_node moves the pages whose first byte lies in the range (a page shared with the
    neighbouring range goes with the range holding its start) and counts those that arrived."""
    mod = engine_module()
    page = os.sysconf("SC_PAGE_SIZE")
    buf = torch.ones(64 * page, dtype=torch.uint8)  # touched: every page exists
    node = mod.page_node(buf.data_ptr())
    if node < 0:
        pytest.skip("the kernel does not report page nodes here")
    base = (buf.data_ptr() + page - 1) // page * page  # the first page boundary inside the buffer
    assert mod.move_to_node(base, 10 * page, node) == 10
    assert mod.move_to_node(base + 1, 10 * page - 1, node) == 9  # the first page starts before the range
    assert mod.move_to_node(base + 1, page - 2, node) == 0  # no page starts inside
    assert mod.move_to_node(base - 1, 2, node) == 1
    assert mod.move_to_node(base, 4 * page, 4095) == 0  # no such node: nothing moves, nothing counts
    assert all(mod.page_node(base + i * page) == node for i in range(12))


def test_rows_pages_sit_on_their_node(weights, numa) -> None:
    """Each node's rows of every expert were moved to its memory node (move_pages); get_mempolicy
    reports the node of every whole page inside them."""
    mod = engine_module()
    numa("2")
    info = mod.numa_info()
    if not info["libnuma"]:
        pytest.skip("libnuma is not installed: the groups have no memory node")
    qs = _quantized(weights, "int8", {})
    if mod.page_node(qs[0].tensors[".weight"].data_ptr()) < 0:
        pytest.skip("the kernel does not report page nodes here")
    ce = CPUExperts(*qs, verbose=False)
    page = os.sysconf("SC_PAGE_SIZE")
    checked = 0
    for node, memory_node in zip(ce.numa_split, info["memory_nodes"], strict=True):
        assert node["memory_node"] == memory_node >= 0  # the node its group's CPUs are on
        for q, rows, row_bytes in ((qs[0], node["up_rows"], H), (qs[2], node["down_rows"], I)):
            codes = q.tensors[".weight"]
            for e in range(E):
                start = codes.data_ptr() + e * codes.stride(0) + rows[0] * row_bytes
                end = codes.data_ptr() + e * codes.stride(0) + rows[1] * row_bytes
                for addr in range((start + page - 1) // page * page, end - page + 1, page):
                    assert mod.page_node(addr) == node["memory_node"], (node, e, hex(addr))
                    checked += 1
    assert checked > 100
    # A dense layer's rows too.
    w = get_codec("int8").quantize(torch.randn(512, 1024) * 0.05)
    lin = CPULinear(w)
    codes = w.tensors[".weight"]
    bounds = lin.numa_bounds
    for j, memory_node in enumerate(info["memory_nodes"]):
        start, end = codes.data_ptr() + bounds[j] * 1024, codes.data_ptr() + bounds[j + 1] * 1024
        for addr in range((start + page - 1) // page * page, end - page + 1, page):
            assert mod.page_node(addr) == memory_node, (j, hex(addr))


@pytest.mark.parametrize(
    ("method", "params"),
    [("bf16", {}), ("int8", {}), ("int4", {"group_size": 64}), ("fp8", {}), ("gguf:q4_0", {}), ("gguf:q4_k", {})],
)
def test_split_linear_matches_reference(numa, method: str, params: dict) -> None:
    """A dense layer's output rows split over the groups (fp8: at whole 128-row scale blocks), both
    paths, token counts that split the tokens into chunks too, with a bias, fp32 and bf16."""
    g = torch.Generator().manual_seed(7)
    n, k = 400, 512
    w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    codec = get_codec(method, **params)
    q = codec.quantize(w)
    deq = codec.dequantize(q, torch.float32).double()
    for spec, bounds in (("2", [0, 200, 400]), ("3", [0, 133, 266, 400])):
        numa(spec)
        if method == "fp8":  # 400 rows are 4 blocks of 128 (the last one ragged)
            bounds = {"2": [0, 256, 400], "3": [0, 128, 256, 400]}[spec]
        for gemv_max in (0, 1000):
            lin = CPULinear(q, b, gemv_max_tokens=gemv_max)
            assert lin.numa_bounds == bounds
            for t in (1, 7, 64, 300):
                x = torch.randn(t, k, generator=g)
                ref = x.double() @ deq.T + b.double()
                assert _rel(lin(x), ref) < FP32_BOUND, (spec, gemv_max, t)
                xb = x.bfloat16()
                assert _rel(lin(xb), xb.double() @ deq.T + b.double()) < BF16_BOUND, (spec, gemv_max, t)
    numa("off")
    assert CPULinear(q, b).numa_bounds == [0, n]


def test_split_adversarial_routing_and_biases(weights, numa) -> None:
    """gpt-oss's clamped SwiGLU with gate/up/down biases (down's bias added once, by the node owning
    its rows), every token on one expert, -1 ids, masked experts, no tokens."""
    numa("2")
    g = torch.Generator().manual_seed(4)
    qs = [get_codec("mxfp4").quantize(w * 8) for w in weights]
    biases = {
        "gate_bias": torch.randn(E, I, generator=g),
        "up_bias": torch.randn(E, I, generator=g),
        "down_bias": torch.randn(E, H, generator=g) * 0.1,
    }
    ce = CPUExperts(*qs, activation="swiglu-oai", **biases)
    for T in (1, 21):
        ids = torch.randint(0, E, (T, 3), generator=g)
        w = torch.rand(T, 3, generator=g)
        x = torch.randn(T, H, generator=g)
        ref = _reference(qs, x, ids, w, activation="swiglu-oai", **biases)
        assert _rel(ce.forward(x, ids, w), ref) < 1e-3, T
    ce = CPUExperts(*qs)
    x = torch.randn(45, H, generator=g)
    ids = torch.full((45, 1), 4, dtype=torch.int64)
    w = torch.rand(45, 1, generator=g)
    assert _rel(ce.forward(x, ids, w), _reference(qs, x, ids, w)) < FP32_BOUND
    ids = torch.randint(0, E, (45, 3), generator=g)
    w = torch.rand(45, 3, generator=g)
    ids[::4, 1] = -1
    ids[7] = -1
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[0, 3]] = True
    ce.set_mask(mask)
    y = ce.forward(x, ids, w)
    assert torch.count_nonzero(y[7]) == 0
    assert _rel(y, _reference(qs, x, ids, w, skip=mask)) < FP32_BOUND
    assert ce.forward(x[:0], ids[:0], w[:0]).shape == (0, H)


def test_pool_changed_under_pending_split_jobs(weights, numa) -> None:
    """An engine split for two groups keeps working when the pool is replaced by a one-node pool
    (every node's items then run on its one group) or a pool of one thread, with jobs pending across it."""
    mod = engine_module()
    threads = mod.num_threads()
    numa("2")
    qs = _quantized(weights, "int4", {"group_size": 32})
    ce = CPUExperts(*qs)
    g = torch.Generator().manual_seed(6)
    try:
        for change in (lambda: numa("off"), lambda: mod.set_num_threads(1)):
            jobs = []
            for T in (1, 9, 30):
                ids = torch.randint(0, E, (T, 2), generator=g)
                w = torch.rand(T, 2, generator=g)
                x = torch.randn(T, H, generator=g)
                jobs.append((ce.submit(x, ids, w), x, ids, w))
            change()
            for handle, x, ids, w in reversed(jobs):
                assert _rel(ce.wait(handle), _reference(qs, x, ids, w)) < FP32_BOUND
    finally:
        mod.set_num_threads(threads)
    assert len(_split(ce)) == 2


def test_workers_stay_on_their_groups_cpus(weights, numa) -> None:
    """Each worker (threads named hetmoe-n<group>-<id>) may run only on its group's CPUs."""
    mod = engine_module()
    numa("2")
    ce = CPUExperts(*_quantized(weights, "int8", {}))
    ids = torch.randint(0, E, (3, 2))
    ce.forward(torch.randn(3, H), ids, torch.rand(3, 2))  # starts the pool; workers pin on their first job
    groups = mod.numa_info()["node_cpus"]
    seen = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:  # a thread that just ended
            continue
        if not name.startswith("hetmoe-n"):
            continue
        node = int(name.split("-")[1][1:])
        assert os.sched_getaffinity(int(tid)) <= set(groups[node]), (name, groups)
        seen += 1
    assert seen == mod.num_threads() - 1  # every worker found (the caller is the last participant)


def test_doctor_and_bench_report_the_split(numa) -> None:
    from hetmoe.kernels.dispatch import pool_report

    numa("2")
    pool = pool_report()
    assert pool["source"] == "split" and len(pool["node_cpus"]) == 2 and pool["threads"] >= 1
    numa("off")
    assert pool_report()["source"] == "single"


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_pools_of_other_sizes_split_their_threads(weights, numa, threads: int) -> None:
    """More or fewer threads than CPUs: the workers are spread over the groups in proportion to
    their CPUs (the caller counted where it runs), and the split layer still matches."""
    mod = engine_module()
    before = mod.num_threads()
    try:
        mod.set_num_threads(threads)
        numa("2")
        qs = _quantized(weights, "int4", {"group_size": 32})
        ce = CPUExperts(*qs)
        g = torch.Generator().manual_seed(12)
        for T in (1, 23):
            ids = torch.randint(0, E, (T, 3), generator=g)
            w = torch.rand(T, 3, generator=g)
            x = torch.randn(T, H, generator=g)
            assert _rel(ce.forward(x, ids, w), _reference(qs, x, ids, w)) < FP32_BOUND, T
        per_group = [0, 0]
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            except FileNotFoundError:
                continue
            if name.startswith("hetmoe-n"):
                per_group[int(name.split("-")[1][1:])] += 1
        assert sum(per_group) == threads - 1, per_group
        # Participants (workers and the caller) split as evenly as the count allows, so the workers
        # differ by at most two: one for an odd count, one for the caller's group.
        assert max(per_group) - min(per_group) <= 2, per_group
    finally:
        mod.set_num_threads(before)
