"""doctor and bench moe: they run, report the documented fields, and their numbers are sane.

Speed is never asserted here (benchmarks print it); only structure and accuracy.
"""

import json
from pathlib import Path

import pytest
import torch

from hetmoe.cli.doctor import estimate
from hetmoe.cli.main import main


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["engine"]["available"] and r["engine"]["best"] in ("avx2", "avx512", "amx")
    assert r["measured"]["read_gb_per_s"] > 0.5 and r["measured"]["fma_gflop_per_s"] > 1
    assert {row["method"] for row in r["estimate"]["rows"]} == {"bf16", "fp8", "int8", "int4"}
    assert r["verdict"]


def test_decode_estimate_scales_with_bits() -> None:
    rows = {r["method"]: r for r in estimate("qwen3-30b-a3b", 20.0)}
    assert (
        rows["int4"]["decode_tokens_per_s"] > rows["int8"]["decode_tokens_per_s"] > rows["bf16"]["decode_tokens_per_s"]
    )
    assert rows["int4"]["bits_per_weight"] == pytest.approx(4.5)


def test_bench_moe_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "moe", "--experts", "8", "--tokens", "1,9", "--min-seconds", "0", "--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "GB/s" in table and "torch" in table
    result = json.loads(out.read_text())
    assert {"read_gb_per_s", "fma_gflop_per_s"} <= result["machine"].keys()
    recs = result["records"]
    now = result["read_now_gb_per_s"]
    assert now["samples"] == 2 * len(recs) and now["min"] <= now["median"] <= now["max"]
    assert f"this run's {now['samples']} samples" in table
    assert {(r["impl"], r["method"], r["tokens"]) for r in recs} == {
        (i, m, t) for i in ("hetmoe", "torch") for m in ("bf16", "int8", "int4") for t in (1, 9)
    }
    for r in recs:
        assert {"impl", "method", "tokens", "threads", "ms", "gb_per_s", "gflop_per_s", "rel_err"} <= r.keys()
        assert r["ms"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"]
        # the read bandwidth sampled beside each row, and the row's fraction of it
        assert r["read_gb_per_s_now"] > 0.5
        assert r["bw_fraction_now"] == pytest.approx(r["gb_per_s"] / r["read_gb_per_s_now"], abs=1e-3)
        # decode rows of the engine also time a plain read of their bytes, interleaved
        assert ("plain_read_fraction" in r) == (r["impl"] == "hetmoe" and r["tokens"] == 1), r
        if "plain_read_fraction" in r:
            assert r["plain_read_gb_per_s"] > 0.5
        # bf16 output rounding bounds both implementations' error against the float64 reference
        assert r["rel_err"] < 1e-2, r


def test_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "moe", "--tokens", "1,x"])
    assert main(["bench", "moe", "--experts", "4", "--tokens", "1", "--min-seconds", "0"]) == 1
    assert "below the shape's top-k" in capsys.readouterr().err


def test_bench_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "roofline.png"
    argv = [
        "bench",
        "moe",
        "--experts",
        "8",
        "--tokens",
        "1",
        "--methods",
        "int4",
        "--no-baseline",
        "--min-seconds",
        "0",
        "--plot",
        str(png),
    ]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_read_bandwidth_sample() -> None:
    """The sample benchmarks take beside each row: a plausible figure, and a bad buffer is refused."""
    from hetmoe.kernels.dispatch import engine_module
    from hetmoe.kernels.machine import read_bandwidth_now

    assert 0.5 < read_bandwidth_now(1) < 10_000
    with pytest.raises(ValueError, match="expected a buffer"):
        engine_module().measure_read_bandwidth_of(0, 1 << 20, 1, 1)


def test_plain_read_of_a_decode_step() -> None:
    """The plain read a decode row is held against: a plausible rate, and bad arguments refused."""
    from hetmoe.kernels.dispatch import engine_module
    from hetmoe.kernels.machine import plain_read_gb_per_s

    assert 0.5 < plain_read_gb_per_s(4 << 20, reps=3) < 10_000
    buf = torch.ones(1 << 18, dtype=torch.int64)  # 2 MiB
    mod = engine_module()
    assert mod.measure_chunked_read(buf.data_ptr(), buf.numel() * 8, 1 << 20, 1 << 20, 2) > 0
    for bad in ((0, 2 << 20, 1 << 20, 1 << 20), (buf.data_ptr(), 2 << 20, 100, 1 << 20),
                (buf.data_ptr(), 1 << 19, 1 << 20, 1 << 20)):  # fmt: skip
        with pytest.raises(ValueError, match="measure_chunked_read"):
            mod.measure_chunked_read(*bad, 1)


def test_timed_run_follows_an_idle_run_after_the_eviction() -> None:
    """bench moe times a layer with its weights evicted but its code in cache, as inside a model: after
    each eviction the idle arguments (no token routed) run, then the timed call, and only it is timed."""
    from hetmoe.bench.moe import _time

    calls: list[str] = []

    def fn(tag: str) -> None:
        calls.append(tag)

    times, plain = _time(fn, lambda: ("step",), reps=3, min_seconds=0, flush=lambda: calls.append("evict"),
                         idle=("idle",))  # fmt: skip
    assert len(times) == 3 and plain == []
    assert calls == ["step"] + ["evict", "idle", "step"] * 3


def test_plain_read_follows_the_same_eviction_and_idle_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain read beside each decode row (%read's reference) sees the machine as the timed call
    does: evicted, then the idle run, which also wakes the pool's threads (a read on a sleeping pool
    pays their wake-up inside its clock)."""
    import hetmoe.bench.moe as bench

    calls: list[str] = []

    def plain_read(nbytes: float, reps: int, seed: int) -> float:
        calls.append("plain")
        return 10.0

    monkeypatch.setattr(bench, "plain_read_gb_per_s", plain_read)
    times, plain = bench._time(lambda tag: calls.append(tag), lambda: ("step",), reps=2, min_seconds=0,
                               flush=lambda: calls.append("evict"), plain_bytes=1 << 20, idle=("idle",))  # fmt: skip
    assert len(times) == 2 and plain == [10.0, 10.0]
    assert calls == ["step"] + ["evict", "idle", "step", "evict", "idle", "plain"] * 2
