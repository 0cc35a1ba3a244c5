"""The readers under mutation fuzzing, bounded for CI (tests/fuzzing.py; scripts/fuzz.py runs it longer).

Each target runs for FUZZ_SECONDS from a fixed seed: every case must read, or be refused with one
line naming the file. The classifier itself is tested first, so a harness that could not fail would
show here.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import fuzzing

FUZZ_SECONDS = float(os.environ.get("HETMOE_FUZZ_SECONDS", "18"))  # five targets: about 2 minutes in all


def test_classifier_flags_what_a_user_would_see_as_a_failure() -> None:
    named = ("/data/model.gguf",)
    assert fuzzing.classify(None, named) is None
    assert fuzzing.classify(ValueError("/data/model.gguf: truncated"), named) is None
    assert fuzzing.classify(TypeError("'int' object is not iterable"), named) == "crash"
    assert fuzzing.classify(RecursionError(), named) == "crash"
    assert fuzzing.classify(ValueError("/data/model.gguf: bad\nsecond line"), named) == "multi-line"
    assert fuzzing.classify(ValueError("invalid literal for int()"), named) == "unnamed"
    assert fuzzing.classify(fuzzing.Hang(), named) == "hang"


def test_the_loop_reports_a_reader_that_fails(tmp_path: Path) -> None:
    def fragile(path: Path) -> None:
        if path.read_bytes()[:1] != b"{":
            raise KeyError("boom")  # what a careless reader raises

    target = fuzzing.Target(
        "fragile", [fuzzing.Seed(b'{"a": 1}')], lambda s, r: fuzzing.mutate_bytes(s.data, r, len(s.data)),
        fuzzing._file_layout(".json"), fragile,
    )  # fmt: skip
    report = fuzzing.fuzz(target, tmp_path, cases=300, seed=0, save=tmp_path / "saved")
    assert report.failures and {f.kind for f in report.failures} == {"crash"}
    assert report.failures[0].saved is not None and report.failures[0].saved.exists()


def test_mutators_change_inputs_and_leave_the_seed_alone() -> None:
    rng = random.Random(0)
    seed = b'{"num_experts": 8, "layers": [1, 2], "name": "x"}'
    outs = {fuzzing.mutate_json_bytes(seed, rng) for _ in range(200)} | {
        fuzzing.mutate_bytes(seed, rng, 8) for _ in range(200)
    }
    assert len(outs) > 300 and seed == b'{"num_experts": 8, "layers": [1, 2], "name": "x"}'
    deep = fuzzing.dump_json({"a": fuzzing._DEEP + "5"}, rng)
    assert b"[[[[[]]]]]" in deep
    assert fuzzing.INTERESTING_JSON[fuzzing.INTERESTING_JSON.index([1, 2])] == [1, 2]


@pytest.mark.parametrize("name", ["safetensors", "gguf", "config", "manifest", "chat"])
def test_reader_survives_bounded_fuzzing(name: str, tiny_cache, tmp_path: Path) -> None:
    target = fuzzing.build_targets(tiny_cache, tmp_path / "seeds")[name]()
    report = fuzzing.fuzz(target, tmp_path, seconds=FUZZ_SECONDS, seed=1, save=tmp_path / "failures")
    print(report.line())
    assert report.cases > 0 and report.accepted + report.rejected == report.cases - len(report.failures)
    assert not report.failures, (
        report.line() + "\n" + "\n".join(f"{f.kind} at case {f.case}: {f.message}" for f in report.failures[:5])
    )
