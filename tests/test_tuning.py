"""The tuner (hetmoe/runtime/tuning.py): what it measures, caches and applies, on a small layer."""

import json

import pytest
import torch

from hetmoe.formats import get_codec
from hetmoe.kernels.dispatch import (
    PREFETCH_CHOICES,
    PREFETCH_FAMILIES,
    WIDTH_FAMILIES,
    WIDTH_REGIMES,
    int_vector_bits,
    int_vector_widths,
    set_int_vector_bits,
    set_weight_prefetch,
    weight_prefetches,
)
from hetmoe.runtime import CPUExperts, tuning
from hetmoe.runtime.cpu_experts import default_gemv_max
from hetmoe.runtime.engine_layout import GEMV_ALL_TOKENS


@pytest.fixture
def small_tuner(monkeypatch, tmp_path):
    """Tuning on a 16-expert layer of 256 x 128 projections (caches not evicted), cached under
    tmp_path; the module's state, the GEMV width and the prefetch hint are put back afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    monkeypatch.delenv("HETMOE_INT_VECTOR_BITS", raising=False)
    monkeypatch.delenv("HETMOE_WEIGHT_PREFETCH", raising=False)
    monkeypatch.setattr(tuning, "EXPERTS", 16)
    monkeypatch.setattr(tuning, "HIDDEN", 256)
    monkeypatch.setattr(tuning, "_flush", lambda: None)  # tiny layers: evicting 2x the LLC would dominate
    monkeypatch.setattr(tuning, "INTERMEDIATE", 256)  # whole 256-weight blocks of the K-quants
    monkeypatch.setattr(tuning, "TOKENS_PER_EXPERT", (1, 2, 4))
    monkeypatch.setattr(tuning, "_choices", None)
    widths = int_vector_widths()
    yield tmp_path
    tuning.apply_widths(widths)
    set_weight_prefetch("default")
    tuning._choices = None


def test_tune_measures_caches_and_applies(small_tuner) -> None:
    record = tuning.tune()
    widths = record["int_vector_bits"]  # a width for each family of GEMVs in each regime
    assert set(widths) == set(WIDTH_FAMILIES) and all(set(r) == set(WIDTH_REGIMES) for r in widths.values())
    assert all(b in (256, 512) for r in widths.values() for b in r.values())
    # a weight prefetch for each family of GEMVs, each candidate timed on its family's method, applied
    assert set(record["weight_prefetch"]) == set(PREFETCH_FAMILIES)
    assert all(hint in PREFETCH_CHOICES for hint in record["weight_prefetch"].values())
    for family in PREFETCH_FAMILIES:
        times = record["timings_ms"][f"{family} decode prefetch"]
        assert set(times) == set(PREFETCH_CHOICES)
        assert times[record["weight_prefetch"][family]] == min(times.values())  # (rounding keeps the order)
    assert weight_prefetches() == record["weight_prefetch"]
    for family in WIDTH_FAMILIES:  # measured apart, decode and 8 tokens an expert
        assert {f"{family} gemv decode", f"{family} gemv 8 tokens/expert"} <= set(record["timings_ms"]) or (
            record["isa"] == "avx2"
        )
    assert set(record["gemv_max"]) == {tuning.FAMILIES[m] for m in tuning.TUNED_METHODS}
    for value in record["gemv_max"].values():
        assert value in (1, 2, 3, GEMV_ALL_TOKENS)  # GEMV at 1 always; then the crossing, or every count
    assert "int4 2 tokens/expert" in record["timings_ms"]
    assert int_vector_widths() == widths or record["isa"] == "avx2"  # applied
    # cached beside the doctor's figures, and read back by a later process (here: the module afresh)
    on_disk = json.loads((small_tuner / "hetmoe" / "tuning.json").read_text())
    assert next(iter(on_disk.values()))["gemv_max"] == record["gemv_max"]
    tuning._choices = None
    assert tuning.cached()["gemv_max"] == record["gemv_max"]
    # a family shares its measurement; an explicit switch still wins
    assert tuning.tuned_gemv_max("gptq") == record["gemv_max"]["int4"]
    assert tuning.tuned_gemv_max("fp8-channel") == record["gemv_max"]["fp8"]
    assert tuning.tuned_gemv_max("gguf:q6_k") == record["gemv_max"]["q4_k"]  # a Q4_K_M file's down
    w = torch.randn(16, 128, 256) * 0.05
    qs = [get_codec("int8").quantize(t) for t in (w, w, w.transpose(1, 2).contiguous())]
    assert default_gemv_max(qs) == record["gemv_max"]["int8"]
    assert CPUExperts(*qs, gemv_max_tokens=3)._engine is not None


def test_tune_off_and_overrides(small_tuner, monkeypatch) -> None:
    record = tuning.tune()
    monkeypatch.setenv(tuning.TUNE_ENV, "0")
    assert tuning.choices() is None and tuning.tuned_gemv_max("int4") is None  # the built-in defaults
    monkeypatch.setenv(tuning.TUNE_ENV, "1")
    if record["isa"] != "avx2":  # HETMOE_INT_VECTOR_BITS (applied when the engine loads) outranks the record
        other = 256 if record["int_vector_bits"]["int4"]["prompt"] == 512 else 512
        monkeypatch.setenv("HETMOE_INT_VECTOR_BITS", str(other))
        set_int_vector_bits(other)
        tuning.apply(record)
        assert int_vector_bits("int4", "prompt") == other
    # HETMOE_WEIGHT_PREFETCH outranks the record's hints, for the process that tunes too
    hint = next(h for h in PREFETCH_CHOICES if h != record["weight_prefetch"]["int4"])
    monkeypatch.setenv("HETMOE_WEIGHT_PREFETCH", hint)
    set_weight_prefetch(hint)
    tuning.apply(record)
    assert weight_prefetches() == dict.fromkeys(PREFETCH_FAMILIES, hint)
    record = tuning.tune()
    assert weight_prefetches() == dict.fromkeys(PREFETCH_FAMILIES, hint)
    monkeypatch.delenv("HETMOE_WEIGHT_PREFETCH")
    tuning.apply(record)  # without it, the record's hint for each family
    assert weight_prefetches() == record["weight_prefetch"]
    tuning.apply({**record, "weight_prefetch": {"int4": "l2", "fp4": "t0"}})  # an untrusted file's entries: skipped
    assert weight_prefetches() == record["weight_prefetch"]


def test_tuning_keeps_the_width_the_environment_sets(small_tuner, monkeypatch) -> None:
    """HETMOE_INT_VECTOR_BITS outranks the measured widths for the process that tunes, too (the
    switch points are then measured at that width)."""
    monkeypatch.setenv("HETMOE_INT_VECTOR_BITS", "256")
    set_int_vector_bits(256)
    record = tuning.tune()
    assert set(record["int_vector_bits"]) == set(WIDTH_FAMILIES)  # measured and recorded all the same
    assert all(b == 256 for r in int_vector_widths().values() for b in r.values())


def test_crossing_interpolates_between_the_grid_counts() -> None:
    # GEMV 1 ms a token an expert, GEMM 20 ms flat: they cross at 20 tokens, between 16 and 24
    assert tuning._crossing(16, {"gemv": 16.0, "gemm": 20.0}, 24, {"gemv": 24.0, "gemm": 20.0}) == 20
    # a GEMV that does not grow faster than the GEMM: the last count it won
    assert tuning._crossing(16, {"gemv": 16.0, "gemm": 20.0}, 24, {"gemv": 16.0, "gemm": 20.0}) == 16


def test_unreadable_cache_is_no_record(small_tuner) -> None:
    path = small_tuner / "hetmoe" / "tuning.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert tuning.cached() is None
    path.write_text(json.dumps({"x": {"gemv_max": 3}}))
    assert tuning.cached() is None
