"""``hetmoe convert``: every source kind to every store method, streaming, atomic, resumable, deterministic.

Fidelity is measured the way users would: the store is opened with ``open_source`` like any
checkpoint and each layer's experts are compared with the source's own experts, dequantized, against
the codec SNR floors. Memory is measured in a child process over a model with many layers; the
interruption test kills a real ``hetmoe convert`` process with SIGKILL and resumes it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers")

from tiny_models import _quantize_experts, build_tiny, compressed_tensors_int4_config, load_state

from hetmoe.checkpoint import CheckpointError, open_source
from hetmoe.checkpoint import convert as convert_module
from hetmoe.checkpoint.config import read_config
from hetmoe.checkpoint.convert import PAUSE_ENV, convert, format_verify_table
from hetmoe.checkpoint.experts import PROJECTIONS, LayerExperts, codec_of, read_layer_experts
from hetmoe.checkpoint.layout import moe_layout
from hetmoe.checkpoint.store import JOURNAL, MANIFEST, ExpertStore, layer_file_name
from hetmoe.cli.main import main
from hetmoe.formats import get_codec, snr_db
from hetmoe.formats.packing import unpack_nibbles

REPO = Path(__file__).resolve().parents[1]
# Children run on one torch thread for the reason the one_torch_thread fixture (conftest.py) gives.
CHILD_ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
# target method -> (group size to ask for, SNR floor in dB against the dequantized source)
TARGETS: dict[str, tuple[int | None, float]] = {
    "bf16": (None, 45),
    "fp8": (None, 25),
    "fp8-channel": (None, 25),
    "int8": (None, 38),
    "int4": (32, 19),
    "int4-asym": (32, 20),
    "gptq": (32, 17),  # 128 does not divide the tiny dims (64, 32): the largest group that does
    "mxfp4": (None, 14),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _experts(path: Path) -> dict[int, LayerExperts]:
    source = open_source(path)
    layout = moe_layout(read_config(path), source)
    return {layer: read_layer_experts(source, layout, layer) for layer in layout.moe_layers}


def _deq(q: Any) -> torch.Tensor:
    return codec_of(q).dequantize(q)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**CHILD_ENV, **(env or {})}
    cmd = [sys.executable, "-m", "hetmoe.cli.main", "convert", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=full_env, timeout=300)


def build_many_layers(dst: Path, layers: int, experts: int, inter: int, hidden: int, seed: int = 0) -> Path:
    """A Qwen3-MoE-shaped bf16 checkpoint with ``layers`` MoE layers, one shard per layer (+ index).

    Written directly (not through transformers) so that a model with many, not-so-tiny layers is
    built in well under a second.
    """
    dst.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}

    def shard(i: int, state: dict[str, torch.Tensor]) -> None:
        name = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(state, dst / name)
        weight_map.update(dict.fromkeys(state, name))

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    for layer in range(layers):
        lp = f"model.layers.{layer}."
        state = {
            lp + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            lp + "mlp.gate.weight": rand(experts, hidden),
        }
        for e in range(experts):
            state[f"{lp}mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
            state[f"{lp}mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden)
            state[f"{lp}mlp.experts.{e}.down_proj.weight"] = rand(hidden, inter)
        shard(layer, state)
    shard(layers, {"model.embed_tokens.weight": rand(64, hidden), "lm_head.weight": rand(64, hidden)})
    config = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": 4 * inter,
        "moe_intermediate_size": inter,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "vocab_size": 64,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


# --- fidelity: the two quantized source conventions to every method ------------------------------------


@pytest.mark.parametrize("method", list(TARGETS))
@pytest.mark.parametrize("source_kind", ["fp8-deepseek", "int4-kimi"])
def test_quantized_sources_round_trip_within_the_floors(
    tiny_cache, tmp_path: Path, source_kind: str, method: str
) -> None:
    src = tiny_cache.fp8() if source_kind == "fp8-deepseek" else tiny_cache.int4()
    group, floor = TARGETS[method]
    result = convert(src, tmp_path / "store", method, group, verify=True, progress=False)
    reference, written = _experts(src), _experts(tmp_path / "store")
    assert sorted(written) == sorted(reference) == [1, 2]
    verified = {rec["layer"]: rec["snr_db"] for rec in result.manifest["layers"]}
    for layer, experts in written.items():
        for proj in PROJECTIONS:
            q = experts.projections[proj]
            assert q.method == method and (group is None or q.params["group_size"] == group)
            snr = snr_db(_deq(reference[layer].projections[proj]), _deq(q))
            assert snr >= floor, (layer, proj, snr)
            recorded = verified[layer][proj]
            assert recorded == "inf" if snr == float("inf") else abs(recorded - snr) < 0.02, (recorded, snr)


def test_kimi_int4_to_an_int4_store_moves_the_codes_without_requantizing(
    tiny_cache, tmp_path: Path, monkeypatch
) -> None:
    """int4 g32 in compressed-tensors' int32 words and in the store's bytes are the same codes and
    scales: the store holds the source's nibbles (unpacked by the published rule) and scales exactly,
    and nothing is quantized on the way (re-quantizing would be lossy and, at full size, minutes)."""
    from hetmoe.formats.int4 import Int4Codec

    src = tiny_cache.int4()  # built (by quantizing) before the quantizer is watched
    original, shapes = Int4Codec.quantize, []

    def watched(self, weight, name="weight"):
        shapes.append(tuple(weight.shape))
        return original(self, weight, name)

    monkeypatch.setattr(Int4Codec, "quantize", watched)
    convert(src, tmp_path / "store", "int4", progress=False)
    assert shapes and all(s[0] == 1 for s in shapes), shapes  # only the plan's dimension check, no experts
    reference, written = _experts(src), _experts(tmp_path / "store")
    ct = get_codec("int4", group_size=32, layout="compressed-tensors")
    for layer, experts in written.items():
        for proj in PROJECTIONS:
            q, ref = experts.projections[proj], reference[layer].projections[proj]
            assert q.params == {"group_size": 32, "layout": "bytes"}
            assert torch.equal(unpack_nibbles(q.tensors[".weight"]), ct.codes(ref)), (layer, proj)
            assert torch.equal(q.tensors[".weight_scale"], ref.tensors[".weight_scale"]), (layer, proj)


# --- other sources ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "fused"), [("qwen3_moe", None), ("mixtral", None), ("gpt_oss", None), ("olmoe", True)]
)
def test_bf16_sources_are_quantized_exactly_like_the_codec_does(
    tiny_cache, tmp_path: Path, model_type: str, fused: bool | None
) -> None:
    src = tiny_cache.copy(tiny_cache.model(model_type, fused), tmp_path / "src")
    (src / "tokenizer.json").write_text('{"model": "tiny"}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "README.md").write_text("not copied")
    convert(src, tmp_path / "store", "int4", 32, progress=False)
    store = tmp_path / "store"
    codec = get_codec("int4", group_size=32)
    for layer, ref in _experts(src).items():
        got = ExpertStore(store).layer(layer)
        for proj in PROJECTIONS:
            expected = codec.quantize(_deq(ref.projections[proj]))
            for suffix, t in got.projections[proj].tensors.items():
                assert torch.equal(t, expected.tensors[suffix]), (layer, proj, suffix)
        assert sorted(got.biases) == sorted(ref.biases)  # gpt-oss keeps its biases, unchanged
        assert all(torch.equal(got.biases[p], ref.biases[p]) for p in ref.biases)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (store / name).read_bytes() == (src / name).read_bytes(), name
    assert not (store / "README.md").exists()
    manifest = json.loads((store / MANIFEST).read_text())
    assert manifest["copied"] == ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json"]
    assert manifest["unconverted_expert_tensors"] == []


def test_fp16_and_fp8_channel_sources(tiny_cache, tmp_path: Path) -> None:
    fp16 = build_tiny("qwen3_moe", tmp_path / "fp16", dtype=torch.float16)
    bf16 = tiny_cache.model("qwen3_moe")
    qc = compressed_tensors_int4_config(list(load_state(bf16)))
    qc["format"] = "float-quantized"
    qc["config_groups"]["group_0"]["weights"] = {
        "num_bits": 8,
        "type": "float",
        "strategy": "channel",
        "symmetric": True,
    }
    channel = _quantize_experts(bf16, tmp_path / "fp8ch", "fp8-channel", {}, qc)
    for src, method, floor in ((fp16, "int8", 38), (channel, "int4-asym", 20)):
        dst = tmp_path / f"store-{src.name}"
        convert(src, dst, method, progress=False)
        manifest = json.loads((dst / MANIFEST).read_text())
        assert manifest["source"]["experts"] == ("bf16" if src is fp16 else "fp8-channel")
        reference, written = _experts(src), _experts(dst)
        for layer in reference:
            for proj in PROJECTIONS:
                assert snr_db(_deq(reference[layer].projections[proj]), _deq(written[layer].projections[proj])) >= floor


def test_gguf_source_keeps_its_other_tensors_as_gguf(tiny_cache, tmp_path: Path) -> None:
    src = tiny_cache.gguf()
    dst = tmp_path / "store"
    convert(src, dst, "int8", progress=False)
    manifest = json.loads((dst / MANIFEST).read_text())
    assert manifest["config_from_gguf"] and manifest["source"]["format"] == "gguf"
    assert manifest["source"]["experts"] == "gguf (Q4_K, Q5_K, Q6_K, Q8_0)"
    assert read_config(dst)["hidden_size"] == 256
    reference, written = _experts(src), _experts(dst)
    for layer in reference:
        for proj in PROJECTIONS:
            assert snr_db(_deq(reference[layer].projections[proj]), _deq(written[layer].projections[proj])) >= 38
            assert torch.equal(reference[layer].biases[proj], written[layer].biases[proj])
    source, store = open_source(src), open_source(dst)
    rest = [k for k in source.keys() if "_exps." not in k]
    assert rest and sorted(rest) == sorted(k for k in store.keys() if ".experts." not in k)
    for name in rest:  # raw ggml bytes, described exactly as the GGUF reader describes them
        assert store.info(name).dtype == source.info(name).dtype == "F32"
        assert store.info(name).shape == source.info(name).shape
        assert torch.equal(store.get(name), source.get(name))


def test_a_store_converts_to_another_store(tiny_cache, tmp_path: Path) -> None:
    first, second = tmp_path / "int8", tmp_path / "int4"
    convert(tiny_cache.fp8(), first, "int8", progress=False)
    convert(first, second, "int4", 32, progress=False)
    assert json.loads((second / MANIFEST).read_text())["source"]["format"] == "hetmoe-store"
    reference, written = _experts(first), _experts(second)
    for layer in reference:
        for proj in PROJECTIONS:
            assert snr_db(_deq(reference[layer].projections[proj]), _deq(written[layer].projections[proj])) >= 19
    a, b = open_source(first), open_source(second)
    assert sorted(k for k in a.keys() if ".experts." not in k) == sorted(k for k in b.keys() if ".experts." not in k)


def test_big_non_expert_parts_are_sharded(tiny_cache, tmp_path: Path) -> None:
    convert(tiny_cache.fp8(), tmp_path / "store", "int8", progress=False, shard_bytes=40_000)
    names = sorted(p.name for p in (tmp_path / "store").glob("model-rest*"))
    assert len(names) > 2 and names[0] == f"model-rest-00001-of-{len(names):05d}.safetensors"
    store, source = open_source(tmp_path / "store"), open_source(tiny_cache.fp8())
    assert sorted(k for k in store.keys() if ".experts." not in k) == sorted(
        k for k in source.keys() if ".mlp.experts." not in k
    )


# --- determinism, atomicity, resume ------------------------------------------------------------------------


def test_same_input_gives_the_same_bytes(tiny_cache, tmp_path: Path) -> None:
    convert(tiny_cache.int4(), tmp_path / "a", "gptq", 32, verify=True, progress=False)
    convert(tiny_cache.int4(), tmp_path / "b", "gptq", 32, verify=True, progress=False)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_resume_after_an_interruption_redoes_only_what_is_missing(tiny_cache, tmp_path: Path, monkeypatch) -> None:
    src = build_many_layers(tmp_path / "src", layers=6, experts=4, inter=32, hidden=64)
    convert(src, tmp_path / "clean", "int4", progress=False)
    real = convert_module._convert_layer
    calls: list[int] = []

    def interrupted(plan, dst, layer, *rest):  # type: ignore[no-untyped-def]
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(layer)
        return real(plan, dst, layer, *rest)

    monkeypatch.setattr(convert_module, "_convert_layer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "st", "int4", progress=False)
    with open(tmp_path / "st" / layer_file_name(1), "r+b") as f:  # a finished file damaged afterwards
        f.truncate(64)
    calls.clear()
    monkeypatch.setattr(convert_module, "_convert_layer", real)
    said: list[str] = []
    result = convert(src, tmp_path / "st", "int4", resume=True, progress=False, log=said.append)
    assert result.layers_converted == 4 and result.layers_reused == 2  # layers 1, 3, 4, 5 done now
    assert any("redoing experts-L001.safetensors" in s for s in said)
    assert _files(tmp_path / "st") == _files(tmp_path / "clean")
    again = convert(src, tmp_path / "st", "int4", resume=True, progress=False)  # complete: nothing to do
    assert again.layers_converted == 0 and _files(tmp_path / "st") == _files(tmp_path / "clean")


def test_resume_with_other_settings_is_refused(tiny_cache, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(convert_module, "_convert_layer", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_cache.fp8(), tmp_path / "st", "int4", progress=False)
    before = _files(tmp_path / "st")
    with pytest.raises(CheckpointError, match=r"other settings \(method: 'int4' then, 'int8' now.*--overwrite"):
        convert(tiny_cache.fp8(), tmp_path / "st", "int8", resume=True, progress=False)
    assert _files(tmp_path / "st") == before


def test_overwrite_replaces_a_store_but_nothing_else(tiny_cache, tmp_path: Path) -> None:
    dst = tmp_path / "st"
    convert(tiny_cache.fp8(), dst, "int8", progress=False)
    (dst / "notes.txt").write_text("mine")
    convert(tiny_cache.fp8(), dst, "int4", progress=False, overwrite=True)
    assert json.loads((dst / MANIFEST).read_text())["method"] == "int4" and (dst / "notes.txt").exists()
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_text("meow")
    with pytest.raises(CheckpointError, match="is not a hetmoe expert store: refusing to overwrite"):
        convert(tiny_cache.fp8(), other, "int8", progress=False, overwrite=True)
    assert _files(other) == {"cat.jpg": b"meow"}


def test_kill_9_then_resume_is_byte_identical(tmp_path: Path, capsys) -> None:
    src = build_many_layers(tmp_path / "src", layers=12, experts=8, inter=64, hidden=128)
    clean = tmp_path / "clean"
    convert(src, clean, "int4", progress=False)
    dst = tmp_path / "killed"
    kill_after = random.Random().randint(2, 9)  # layer files that must exist before the kill
    env = {**CHILD_ENV, PAUSE_ENV: "0.1"}
    cmd = [sys.executable, "-m", "hetmoe.cli.main", "convert", str(src), str(dst), "--method", "int4", "--quiet"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(dst.glob("experts-L*.safetensors"))) < kill_after:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (dst / MANIFEST).exists() and (dst / JOURNAL).exists()
    with pytest.raises(CheckpointError, match=r"incomplete hetmoe expert store.*missing layers"):
        open_source(dst)
    assert main(["convert", str(src), str(dst), "--method", "int4", "--resume", "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")  # --quiet: not a word on success
    assert _files(dst) == _files(clean), f"killed after {kill_after} layers"


# --- memory -------------------------------------------------------------------------------------------------

_RSS_CHILD = """
import json, sys
import psutil
from hetmoe.checkpoint.convert import convert

def high_water_mark():
    # VmHWM, not ru_maxrss: a vfork+exec child inherits its parent's ru_maxrss, so a large pytest
    # process would be measured instead of the conversion.
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

base = psutil.Process().memory_info().rss
convert(sys.argv[1], sys.argv[2], "int8", progress=False)
print(json.dumps({"growth": high_water_mark() - base}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units and mmap accounting as on Linux")
def test_peak_memory_is_bounded_by_one_layer_not_the_model(tmp_path: Path) -> None:
    pytest.importorskip("psutil")
    layers, experts, inter, hidden = 24, 16, 128, 512
    src = build_many_layers(tmp_path / "src", layers, experts, inter, hidden)
    layer_fp32 = experts * 3 * inter * hidden * 4  # 12.6 MB
    model_fp32 = layers * layer_fp32  # 302 MB
    # Imports done lazily during the run, torch's thread pools, allocator slack: measured ~10 MB on a
    # two-layer model. Not streaming (one source kept open for the whole run) measures ~185 MB here.
    allowance = 40 << 20
    bound = 4 * layer_fp32 + allowance
    assert model_fp32 > 3 * bound
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(src), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=CHILD_ENV,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    growth = json.loads(proc.stdout)["growth"]
    assert growth < bound, f"peak RSS grew {growth / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"
    assert ExpertStore(tmp_path / "store").layer(layers - 1).down.shape == (experts, hidden, inter)


# --- the command line ---------------------------------------------------------------------------------------


def test_cli_converts_verifies_and_prints_the_table(tiny_cache, tmp_path: Path, capsys) -> None:
    assert main(["convert", str(tiny_cache.fp8()), str(tmp_path / "st"), "--method", "int8", "--verify"]) == 0
    out, err = capsys.readouterr()
    manifest = json.loads((tmp_path / "st" / MANIFEST).read_text())
    assert out.strip() == format_verify_table(manifest)
    assert "layer dB" in out and manifest["verify"]["snr_db"] >= 38
    # The progress bar (bytes, ETA, layers) and the summary line.
    assert "convert" in err and "B/s" in err and "<" in err and "layers 2/2" in err and "MB/s)" in err


def test_cli_help_has_examples(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "examples:" in out and "--resume" in out and "--group-size" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "int5"], "--method: expected one of bf16, fp8, fp8-channel, int8, int4, int4-asym, gptq, mxfp4"),
        (["--method", "gguf:iq1_s"], "'gguf:iq1_s', a decode-only format"),
        (["--method", "gguf:q4_k"], "expected an expert store method"),
        (["--method", "int8", "--group-size", "32"], "--group-size: expected no group size for int8"),
        (["--method", "int4", "--group-size", "12"], "group_size: expected a positive multiple of 8"),
        (
            ["--method", "int4", "--group-size", "128"],
            "K divisible by 128, found K=64 (choose a --group-size that divides 64 and 32, e.g. 32)",
        ),
        (["--method", "gptq"], "gptq g128 sym gptq for the gate/up projections [N=32, K=64]"),
    ],
)
def test_cli_bad_input_is_a_clear_error(tiny_cache, tmp_path: Path, capsys, args: list[str], message: str) -> None:
    dst = tmp_path / "st"
    source = tiny_cache.fp8()
    capsys.readouterr()  # what building the tiny model printed, where this test is the first to ask for it
    assert main(["convert", str(source), str(dst), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hetmoe convert: error: ") and message in err, err
    assert not dst.exists()  # nothing was written


def test_cli_existing_dst_is_left_as_it_was(tiny_cache, tmp_path: Path, capsys) -> None:
    dst = tmp_path / "st"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    assert main(["convert", str(tiny_cache.fp8()), str(dst), "--method", "int8"]) == 1
    assert "already exists; pass --resume" in capsys.readouterr().err
    assert _files(dst) == {"keep.txt": b"x"}
    assert main(["convert", str(tiny_cache.fp8()), str(dst), "--method", "int8", "--resume"]) == 1
    assert "holds no hetmoe conversion to resume" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse: the two flags exclude each other
        main(["convert", str(tiny_cache.fp8()), str(dst), "--method", "int8", "--resume", "--overwrite"])
    assert exc.value.code == 2
    assert _files(dst) == {"keep.txt": b"x"}


def test_cli_missing_source(tmp_path: Path) -> None:
    proc = _cli(str(tmp_path / "nope"), str(tmp_path / "st"), "--method", "int4")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("hetmoe convert: error: ") and "nope: no such file or directory" in proc.stderr
    assert not (tmp_path / "st").exists()


def test_store_inside_its_source_is_refused(tiny_cache, tmp_path: Path) -> None:
    src = tiny_cache.copy(tiny_cache.fp8(), tmp_path / "src")
    with pytest.raises(CheckpointError, match="must not be written into the source"):
        convert(src, src / "store", "int8", progress=False)
    assert not (src / "store").exists()
    shutil.rmtree(src)
