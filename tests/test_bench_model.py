"""The whole-model benchmark's code on a tiny shape (seconds): the streamed checkpoint is the one
transformers writes and loads, and a run produces consistent records, table and JSON."""

import json

import pytest
import torch

from hetmoe.bench.model import ModelBenchConfig, format_table, parse_variant, run_bench, write_json
from hetmoe.bench.model_build import ModelShape, build_model
from hetmoe.checkpoint import open_source
from hetmoe.cli.main import main

TINY = ModelShape(layers=2, hidden=64, experts=8, intermediate=32, top_k=2, heads=4, kv_heads=2, head_dim=16, vocab=128)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("bench-models")
    return cache, build_model(TINY, cache, log=lambda _: None)


def test_streamed_checkpoint_is_what_transformers_writes_and_loads(built, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from hetmoe import load_model

    _, path = built
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(TINY.config(), dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path / "saved")
    ours, theirs = open_source(path), open_source(tmp_path / "saved")
    assert {k: ours.info(k).shape for k in ours.keys()} == {k: theirs.info(k).shape for k in theirs.keys()}
    assert build_model(TINY, path.parent, log=lambda _: None) == path  # cached: not rebuilt
    # transformers' own forward on the streamed file against hetmoe's load of it
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = torch.randint(0, TINY.vocab, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits.float()
        got = load_model(path)(ids).logits.float()
    assert float((got - expected).norm() / expected.norm()) < 2e-2  # bf16 model, two summation orders


def test_run_produces_consistent_records(built, tmp_path) -> None:
    cache, _ = built
    cfg = ModelBenchConfig(
        shape=TINY,
        variants=("int4/int8", "bf16/torch"),
        context=8,
        steps=2,
        prefill=(16,),
        repeats=1,
        cache_dir=cache,
        flush_bytes=1 << 20,
    )
    result = run_bench(cfg, log=lambda _: None)
    assert [r["variant"] for r in result["records"]] == ["int4/int8", "bf16/torch"]
    engine, torch_dense = result["records"]
    assert engine["dense"] == "int8" and engine["dense_engine_bytes"] > 0
    assert torch_dense["dense"] == "torch bf16" and torch_dense["dense_engine_bytes"] == 0
    # int4 experts take about 4.5/16 of the bf16 bytes
    assert 0.25 < engine["expert_bytes"] / torch_dense["expert_bytes"] < 0.32
    for r in result["records"]:
        d = r["decode"]
        assert d["tokens_per_s"] > 0 and d["ms_min"] <= d["ms_per_token"] <= d["ms_max"]
        for phase in (d, r["prefill"]["16"]):
            split = phase["split_ms"]
            parts = sum(v for k, v in split.items() if k != "total")
            assert parts == pytest.approx(split["total"], abs=0.01)
            assert min(v for k, v in split.items() if k not in ("other", "router_glue")) >= 0
            alone = phase["parts_alone_ms"]
            assert alone["sum"] == pytest.approx(sum(v for k, v in alone.items() if k != "sum"), abs=0.01)
    table = format_table(result)
    assert "int4/int8" in table and "pf16" in table
    assert "llama.cpp not run" in table  # nothing stored is printed: llama.cpp only when it ran here
    write_json(result, tmp_path / "bench.json")
    assert json.loads((tmp_path / "bench.json").read_text())["records"][0]["variant"] == "int4/int8"


def test_bad_input() -> None:
    assert parse_variant("int4/torch") == ("int4", "torch")  # load_model's explicit opt-out
    assert parse_variant("gguf:q4_0/gguf:q4_0") == ("gguf:q4_0", "gguf:q4_0")
    with pytest.raises(ValueError, match="expected EXPERTS/DENSE"):
        parse_variant("int4")
    assert main(["bench", "model", "--layers", "0"]) == 1
    assert main(["bench", "model", "--variants", "int4", "--cache-dir", "/nonexistent/never-built"]) == 1


def test_llama_bench_failures_are_one_clear_line(tmp_path) -> None:
    from hetmoe.bench.llama_cpp import llama_bench

    with pytest.raises(ValueError, match="no llama-bench binary there"):
        llama_bench(tmp_path / "llama-bench", tmp_path / "m.gguf", 2, 8, (16,))
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    fake.chmod(0o755)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"m\.gguf exited 1: error: failed to load model"):
        llama_bench(fake, tmp_path / "m.gguf", 2, 8, (16,))


def test_llama_bench_output_is_read_as_measured(tmp_path) -> None:
    """llama-bench's JSON (one record per test) becomes decode and prefill tokens/s."""
    from hetmoe.bench.llama_cpp import llama_bench

    fake = tmp_path / "llama-bench"
    runs = '[{"n_prompt": 16, "n_gen": 0, "avg_ts": 120.5}, {"n_prompt": 0, "n_gen": 8, "avg_ts": 30.25}]'
    fake.write_text(f"#!/bin/sh\necho '{runs}'\n")
    fake.chmod(0o755)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert llama_bench(fake, tmp_path / "m.gguf", 2, 8, (16,)) == {"prefill 16": 120.5, "decode": 30.25}


def test_llama_bench_takes_the_faster_repacking_and_runs_without_it_where_it_fails(tmp_path) -> None:
    """llama.cpp at its best: each test the faster of --repack 0 and 1; where the repacked run dies
    (AMX CPUs), the run with --repack 0 alone."""
    from hetmoe.bench.llama_cpp import llama_bench

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    both = (
        '[{"n_prompt": 16, "n_gen": 0, "avg_ts": 90.0}, {"n_prompt": 0, "n_gen": 8, "avg_ts": 40.0},'
        ' {"n_prompt": 16, "n_gen": 0, "avg_ts": 60.0}, {"n_prompt": 0, "n_gen": 8, "avg_ts": 50.0}]'
    )
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\necho '{both}'\n")
    fake.chmod(0o755)
    assert llama_bench(fake, tmp_path / "m.gguf", 2, 8, (16,)) == {"prefill 16": 90.0, "decode": 50.0}
    plain = '[{"n_prompt": 16, "n_gen": 0, "avg_ts": 70.0}, {"n_prompt": 0, "n_gen": 8, "avg_ts": 30.0}]'
    fake.write_text(  # dies like the AMX repack when asked for "0,1"
        f'#!/bin/sh\ncase "$*" in *"--repack 0,1"*) kill -ILL $$;; esac\necho \'{plain}\'\n'
    )
    assert llama_bench(fake, tmp_path / "m.gguf", 2, 8, (16,)) == {"prefill 16": 70.0, "decode": 30.0}
