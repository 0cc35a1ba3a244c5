"""``hetmoe bench defaults`` (hetmoe/bench/defaults.py): the candidates it compares the default with,
and a run on a small layer."""

from __future__ import annotations

import pytest

from hetmoe.bench.defaults import BOUND, Config, DefaultsConfig, candidates, format_table, run_defaults
from hetmoe.kernels.dispatch import engine_module, int_vector_widths, weight_prefetches
from hetmoe.runtime.engine_layout import GEMV_ALL_TOKENS
from hetmoe.runtime.tuning import TOKENS_PER_EXPERT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_candidates_are_the_tuners_choices_once_each() -> None:
    default = Config("avx512", 0, "nta", 32)  # the tuned widths (0), prefetch and switch
    got = candidates("int4", default, ("avx512",), 512)
    assert got[0] == default and len(set(got)) == len(got)
    switches = {c.gemv_max for c in got}
    assert switches == {0, GEMV_ALL_TOKENS, *TOKENS_PER_EXPERT[1:]}  # every count of the grid, both paths alone
    for switch in switches - {0}:  # where a GEMV runs: the tuned widths and each width alone, each prefetch
        assert {(c.bits, c.prefetch) for c in got if c.gemv_max == switch} == {
            (b, p) for b in (0, 256, 512) for p in ("nta", "t0", "t1", "none")
        }
    assert {c.bits for c in got if c.gemv_max == 0} == {0}  # no GEMV runs: its width changes nothing
    # bf16's VDPBF16PS GEMV has a width of its own, fp8's GEMV one width; AVX-512 beside AMX tiles
    bf16 = candidates("bf16", Config("amx", 0, "t0", 4), ("amx", "avx512"), 512)
    assert {c.bits for c in bf16} == {0, 256, 512} and {c.isa for c in bf16} == {"amx", "avx512"}
    assert {c.bits for c in candidates("fp8", Config("amx", 0, "t0", 4), ("amx", "avx512"), 512)} == {0}


def test_switches_at_or_above_the_token_count_are_one_candidate() -> None:
    """At 8 tokens no expert gets more than 8: the switches 8 .. 64 and "every count" all run every
    expert on the GEMV, so they are one candidate, and the default's 32 is that one."""
    default = Config("avx512", 0, "nta", 32)
    got = candidates("int8", default, ("avx512",), 8)
    assert {c.gemv_max for c in got[1:]} == {0, 2, 4, GEMV_ALL_TOKENS}
    assert Config("avx512", 0, "nta", GEMV_ALL_TOKENS) not in got  # the default already runs it
    # decode: the GEMV at the tuned widths and at each width, each of 4 prefetches; or the GEMM, each prefetch
    assert len(candidates("int8", default, ("avx512",), 1)) == 3 * 4 + 4


@pytest.mark.skipif(not engine_module().cpu_features()["can_avx512"], reason="the 256/512-bit choice is AVX-512's")
def test_run_times_every_candidate_and_leaves_the_settings(keep_isa) -> None:
    mod = engine_module()
    before = (int_vector_widths(), weight_prefetches(), mod.selected_isa())
    cfg = DefaultsConfig(
        methods=("int4", "bf16"), tokens=(1, 6), reps=2, confirm=3, experts=8, hidden=256, intermediate=128, top_k=2
    )
    result = run_defaults(cfg, log=lambda _line: None)
    assert [(r["method"], r["tokens"]) for r in result["records"]] == [
        ("int4", 1),
        ("int4", 6),
        ("bf16", 1),
        ("bf16", 6),
    ]
    for r in result["records"]:
        times = r["candidates"]
        assert r["default"] in times and times[r["best"]] == min(times.values())
        # The times and the ratios (taken before the times were rounded) are kept to four significant
        # digits, each within 5e-4 relative: so the ratio of the kept times is within ~1.5e-3 of the
        # kept ratio, whatever the ratio (head to head it can lie far from 1).
        assert r["sweep_ratio"] == pytest.approx(times[r["default"]] / times[r["best"]], rel=2e-3)
        assert r["ratio"] == pytest.approx(r["default_ms"] / r["best_ms"], rel=2e-3)
        # the default against the sweep's fastest head to head where that is another configuration
        assert r["confirm_rounds"] == (0 if r["best"] == r["default"] else cfg.confirm)
        if r["confirm_rounds"] == 0:
            assert r["ratio"] == r["sweep_ratio"] == 1.0
        assert r["default_spread"] >= 1.0
    assert (int_vector_widths(), weight_prefetches(), mod.selected_isa()) == before  # as it found them
    table = format_table(result)
    assert "worst default/best" in table and f"bound {BOUND}" in table
