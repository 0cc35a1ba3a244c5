"""``hetmoe bench model --arch``: the random models it writes (bench/arch_models.py) against what
transformers' save_pretrained writes, the llama.cpp tool plumbing, and the run and its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import _COMMON, ARCH_CONFIGS

from hetmoe.bench.arch_bench import ArchBenchConfig, format_table, medians, run_arch_bench, write_json
from hetmoe.bench.arch_models import ARCHS, ArchModel, build_arch_model
from hetmoe.cli.main import main

BENCH_ARCHS = ("qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "mixtral")


def _tiny(arch: str, vocab: int = 600) -> ArchModel:
    """``arch`` with tests/tiny_models' small dimensions (its expert count, 2 layers)."""
    fields = {**_COMMON, **ARCH_CONFIGS[arch]}
    experts = int(fields.pop(ARCHS[arch].experts_field))
    for key in ("num_hidden_layers", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        fields.pop(key, None)
    if "qk_rope_head_dim" in fields:
        fields["head_dim"] = fields["qk_rope_head_dim"]  # as tiny_models.tiny_config sizes MLA's rotary
    return ArchModel(arch, layers=2, vocab=vocab, experts=experts, overrides=fields)


def _header(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from safetensors import safe_open

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                out[name] = (t.get_dtype(), tuple(t.get_shape()))
    return out


@pytest.mark.parametrize("arch", BENCH_ARCHS)
def test_written_as_save_pretrained_writes_it(tmp_path, arch: str) -> None:
    """The streamed checkpoint has exactly the tensors (names, dtypes, shapes) transformers'
    save_pretrained writes for the same config, loads into transformers with nothing missing or left
    over, and carries a tokenizer of exactly the vocabulary's size that round-trips text and has
    the added tokens llama.cpp's converter looks up."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = _tiny(arch)
    directory = build_arch_model(spec, tmp_path / "cache", log=lambda line: None)
    assert build_arch_model(spec, tmp_path / "cache", log=lambda line: None) == directory  # cached
    reference = AutoModelForCausalLM.from_config(spec.config(), dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path / "reference")
    assert _header(directory) == _header(tmp_path / "reference")
    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert json.loads((directory / "config.json").read_text())["architectures"] == [type(model).__name__]
    tok = AutoTokenizer.from_pretrained(directory)
    assert len(tok) == spec.vocab == model.config.vocab_size
    text = "def f(x):\n    return x + 1  # ✅ ünïcode"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert {"[gMASK]", "<|user|>", "<|observation|>", "<|endoftext|>", "<|im_end|>"} <= set(tok.get_added_vocab())


def test_the_released_shapes() -> None:
    """The shapes are the released models' (meta tensors only: nothing is allocated)."""
    counts = {}
    for arch in BENCH_ARCHS:
        last = [t for t in ArchModel(arch, layers=4).tensors() if ".layers.3." in t.name and ".experts." in t.name]
        fused = [t for t in last if t.name.endswith("experts.gate_up_proj")]  # gpt-oss: [experts, hidden, 2 x width]
        per_expert = {t.name.split(".experts.")[1].split(".")[0] for t in last}
        counts[arch] = fused[0].shape[0] if fused else len(per_expert)
    assert counts == {"qwen3_moe": 128, "deepseek_v3": 64, "gpt_oss": 32, "glm4_moe": 128, "mixtral": 8}
    assert ArchModel("gpt_oss").config().layer_types == ["sliding_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="fewer than its top-k"):
        ArchModel("qwen3_moe", experts=4)
    with pytest.raises(ValueError, match="expected one of"):
        ArchModel("llama")


def test_llama_tools_are_checked_and_the_converter_told_the_pre_tokenizer(tmp_path) -> None:
    """tools_dir names what build_llama_cpp.sh should have put beside llama-bench; the converter runs
    with its pre-tokenizer lookup answering GPT-2's (what write_tokenizer's tokenizer splits with) and
    its own arguments; a failing converter is one ValueError with the end of its message."""
    from hetmoe.bench.llama_cpp import convert_to_gguf, tools_dir

    root = tmp_path / "llama"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-bench").write_text("")
    with pytest.raises(ValueError, match="llama-quantize: not there"):
        tools_dir(root / "bin" / "llama-bench")
    (root / "bin" / "llama-quantize").write_text("")
    (root / "gguf-py").mkdir()
    (root / "conversion").mkdir()
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text(
        "class TextModel:\n    def get_vocab_base_pre(self, tokenizer):\n        raise NotImplementedError('unknown')\n"
    )
    (root / "convert_hf_to_gguf.py").write_text(
        "import sys\nfrom conversion.base import TextModel\n"
        "def main():\n"
        "    out = sys.argv[sys.argv.index('--outfile') + 1]\n"
        "    if 'fail' in sys.argv[1]:\n        raise SystemExit('no such model: ' + sys.argv[1])\n"
        "    open(out, 'w').write(TextModel().get_vocab_base_pre(None) + ' ' + ' '.join(sys.argv[1:]))\n"
    )
    assert tools_dir(root / "bin" / "llama-bench") == root
    model_dir = tmp_path / "model"
    out = convert_to_gguf(root, model_dir, tmp_path / "m-BF16.gguf", log=lambda line: None)
    written = out.read_text()
    assert written.startswith("gpt-2 ") and f"{model_dir} --outtype bf16 --outfile" in written
    with pytest.raises(ValueError, match="exited 1: no such model"):
        convert_to_gguf(root, tmp_path / "fail", tmp_path / "bad.gguf", log=lambda line: None)
    assert not (tmp_path / "bad.gguf").exists()  # nothing half-written is left under the name


def test_llama_bench_runs_in_the_users_environment_not_hetmoes(tmp_path) -> None:
    """Importing hetmoe sets OMP_WAIT_POLICY=PASSIVE in its own process (for torch's OpenMP workers);
    llama-bench must not inherit it (its OpenMP threads then sleep between its parallel regions and
    its decode measured 1.4-1.6x slower), while a value the user set reaches it. A stand-in llama-bench
    reports what it was given, in child processes that import hetmoe as the benchmark does."""
    import subprocess
    import sys

    from conftest import child_env

    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport json, os\n"
        "seen = os.environ.get('OMP_WAIT_POLICY')\n"
        "print(json.dumps([{'n_gen': 8, 'n_prompt': 0, 'avg_ts': 2.0 if seen == 'PASSIVE' else 1.0}]))\n"
    )
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    run = (
        "import os, sys; from hetmoe.bench.llama_cpp import llama_bench; "
        "assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE'; "
        f"print(llama_bench({str(fake)!r}, {str(gguf)!r}, 2, 8, ())['decode'])"
    )
    env = {k: v for k, v in child_env().items() if k != "OMP_WAIT_POLICY"}
    for user, seen in ((None, "1.0"), ("PASSIVE", "2.0")):
        done = subprocess.run(
            [sys.executable, "-c", run],
            env=env if user is None else {**env, "OMP_WAIT_POLICY": user},
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-500:]
        assert done.stdout.strip() == seen, (user, done.stdout)


def test_run_without_llama_cpp_and_the_table(tmp_path) -> None:
    """Without llama.cpp only hetmoe on the directory is measured and no peer figure is printed; with
    peer records the medians carry the ratios and prefill against the better 4-bit peer."""
    cfg = ArchBenchConfig(model=_tiny("qwen3_moe"), steps=2, prefill=(8,), rounds=1, cache_dir=tmp_path)
    result = run_arch_bench(cfg, log=lambda line: None)
    assert [r["label"] for r in result["records"]] == ["bf16 dir"]
    ours = result["records"][0]["hetmoe"]
    assert "llama_cpp" not in result["records"][0] and ours["decode"] > 0
    # the faster of two decode runs, each with its slowest step (a stall shows there)
    assert len(ours["decode_runs"]) == 2 and ours["decode"] == pytest.approx(max(ours["decode_runs"]), rel=1e-3)
    assert all(ms > 0 for ms in ours["slowest_step_ms"])
    table = format_table(result)
    assert "no llama.cpp figures" in table and "llama.cpp" not in table.split("\n")[-2]
    write_json(result, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["arch"] == "qwen3_moe"

    def rec(label: str, r: int, ours: float, theirs: float) -> dict:
        speeds = {"decode": ours, "prefill 512": 4 * ours, "notes": [], "load_s": 1.0}
        return {
            "round": r,
            "label": label,
            "hetmoe": speeds,
            "llama_cpp": {"decode": theirs, "prefill 512": 3 * theirs},
        }

    records = [rec("Q4_0", 0, 30, 20), rec("Q4_0", 1, 40, 20), rec("Q4_K_M", 0, 30, 30), rec("Q4_K_M", 1, 30, 30)]
    m = medians(records, (512,))
    assert m["Q4_0"]["decode"] == {"hetmoe": 35, "llama_cpp": 20, "ratio": 1.75}
    # llama.cpp's best 4-bit prefill: Q4_K_M's 90 tokens/s; hetmoe's Q4_0 median 140
    assert m["Q4_0"]["prefill 512"]["vs_best_llama_4bit"] == pytest.approx(140 / 90)


def test_cli_refuses_what_does_not_apply(tmp_path) -> None:
    base = ["bench", "model", "--arch", "qwen3_moe", "--cache-dir", str(tmp_path)]
    assert main([*base, "--variants", "int4/int8"]) == 1
    assert main([*base, "--source", "q4_0-gguf"]) == 1
    assert main([*base, "--experts", "2"]) == 1  # fewer than Qwen3-30B-A3B's top-8
    assert main(["bench", "model", "--experts", "8"]) == 1  # --experts without --arch
    assert not any(tmp_path.iterdir())  # nothing built


def test_each_program_measured_with_the_other_files_out_of_the_page_cache(tmp_path) -> None:
    """release_page_cache leaves the measured file's pages and drops every other file of the run
    (a directory's files included), as util-linux's fincore (mincore(2)) reports residency; files
    just written (dirty pages, which DONTNEED alone leaves) are written back first and dropped too."""
    import shutil
    import subprocess

    from hetmoe.bench.arch_bench import release_page_cache

    if shutil.which("fincore") is None:
        pytest.skip("no fincore to read page-cache residency")
    if (
        subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
        == "tmpfs"
    ):
        pytest.skip("tmpfs pages are not page cache that POSIX_FADV_DONTNEED drops")
    directory = tmp_path / "model"
    directory.mkdir()
    paths = [directory / "a.safetensors", directory / "config.json", tmp_path / "m-BF16.gguf", tmp_path / "m-Q4_0.gguf"]
    for p in paths:
        p.write_bytes(b"\1" * (1 << 20))  # dirty pages, as the run's freshly converted files are

    def resident(p: Path) -> int:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(p)], capture_output=True, text=True
        )
        return int(out.stdout.strip())

    assert all(resident(p) == 1 << 20 for p in paths)
    files = [("bf16 dir", directory, paths[2]), ("Q4_0", paths[3], paths[3])]
    release_page_cache(paths[3], files)
    assert [resident(p) for p in paths] == [0, 0, 0, 1 << 20]
    for p in paths:
        p.read_bytes()
    release_page_cache(directory, files)
    assert [resident(p) for p in paths] == [1 << 20, 1 << 20, 0, 0]
