"""``hetmoe gptq``: 4-bit GPTQ checkpoints of dense models, held against transformers and the published rule.

Tiny random Llama, Qwen3 and Phi-3 (fused qkv_proj / gate_up_proj) models are built offline and
saved with ``save_pretrained``. What is checked:

* logits of the dequantized checkpoint loaded back into transformers stay within a bound set by
  the reported SNR (see ``logit_bound``);
* the written tensors decoded by a numpy bit-loop decoder written here from the AutoGPTQ / vLLM
  rule equal hetmoe's dequantizer and ``--verify``'s independent decoder;
* fused projections are split exactly (parts equal the quantized rows of the fused weight);
* ``--calibrate`` (GPTQ) beats round-to-nearest on every layer's held-out outputs for a model
  whose activations are far from isotropic;
* bad input fails with a clear message and leaves DST as it was.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hetmoe.checkpoint.gptq_solver import gptq_quantize
from hetmoe.checkpoint.gptq_verify import decode_gptq
from hetmoe.checkpoint.gptq_writer import GPTQOptions, write_gptq
from hetmoe.cli.main import main
from hetmoe.formats import QuantizedTensor, get_codec

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GROUP = 32  # divides every K of the tiny models (64, 128)
SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
_WORDS = ("the", "model", "weights", "quantize", "cpu", "token", "layer", "of", "and", "is", "GPTQ", "vLLM", "42")


# -- tiny models ---------------------------------------------------------------------------------


def _config(model_type: str, **overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_position_embeddings": 256,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    fields.update(overrides)
    return transformers.CONFIG_MAPPING[model_type](**fields)


def _save_tokenizer(out: Path) -> None:
    """A character-level tokenizer (ids < 128) so calibration text can be tokenized offline."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def _build(out: Path, model_type: str, scale_channels: float = 1.0, **overrides: Any) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(model_type, **overrides), dtype=torch.float32)
    if scale_channels != 1.0:
        # A few embedding channels far larger than the rest: every layer then sees inputs whose
        # covariance is dominated by a few directions, the case GPTQ's Hessian weighting is for.
        with torch.no_grad():
            model.get_input_embeddings().weight[:, :4] *= scale_channels
    model.to(torch.bfloat16).save_pretrained(out)
    _save_tokenizer(out)
    return out


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gptq_models")
    return {
        "llama": _build(root / "llama", "llama"),
        "qwen3": _build(root / "qwen3", "qwen3"),
        "phi3": _build(root / "phi3", "phi3"),
        "llama_tied": _build(root / "llama_tied", "llama", tie_word_embeddings=True),
        "aniso": _build(root / "aniso", "llama", scale_channels=30.0),
    }


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gptq_text")
    (root / "calib.txt").write_text(_text(0, 1500))
    (root / "heldout.txt").write_text(_text(1, 400))
    return {"calib": root / "calib.txt", "heldout": root / "heldout.txt"}


def _write(src: Path, dst: Path, **options: Any) -> dict[str, Any]:
    options.setdefault("group_size", GROUP)
    options.setdefault("quiet", True)
    return write_gptq(src, dst, GPTQOptions(**options))


def _state(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(directory / f))
    return state


def _modules(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k.removesuffix(".qweight") for k in state if k.endswith(".qweight"))


def _project_dequantize(state: dict[str, torch.Tensor], module: str, qc: dict[str, Any]) -> torch.Tensor:
    codec = get_codec("gptq", group_size=qc["group_size"], sym=qc["sym"], checkpoint_format=qc["checkpoint_format"])
    k8, n = state[module + ".qweight"].shape
    q = QuantizedTensor("gptq", (n, 8 * k8), {s: state[module + s] for s in SUFFIXES}, codec.params)
    codec.validate(q, module)
    return codec.dequantize(q)


def _dequantized_model_state(directory: Path, model: Any) -> dict[str, torch.Tensor]:
    """The written checkpoint as a full-precision state dict for ``model`` (split parts fused back for Phi-3)."""
    state = _state(directory)
    qc = json.loads((directory / "config.json").read_text())["quantization_config"]
    out = {k: v.float() for k, v in state.items() if not k.endswith(SUFFIXES)}
    for m in _modules(state):
        out[m + ".weight"] = _project_dequantize(state, m, qc)
    wanted = model.state_dict()
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        for key in [k for k in out if k.endswith(f".{parts[0]}.weight")]:
            target = key.replace(parts[0], fused)
            if target in wanted:
                out[target] = torch.cat([out.pop(key.replace(parts[0], p)) for p in parts])
    return out


def logit_bound(min_snr_db: float, quantized_linears: int) -> float:
    """Largest relative logit error ``||dz|| / ||z||`` accepted for a checkpoint of minimum weight SNR ``min_snr_db``.

    A weight with relative error ``eps = 10^(-SNR/20)`` moves its layer's output by about ``eps``
    relative (rounding noise is uncorrelated with the inputs). In these pre-norm residual models
    each layer's output reaches the logits with a gain of at most about one, and the m layers'
    errors are independent, so they add in quadrature: ``||dz|| / ||z|| <= sqrt(m) * eps_max``.
    So ``c = sqrt(m)`` (3.7 for 14 linears); measured ratios are 0.9-1.3 here, a wrong decoder gives
    errors of order 1.
    """
    return math.sqrt(quantized_linears) * 10 ** (-min_snr_db / 20)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _load(src: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _tree(directory: Path) -> dict[str, bytes] | None:
    if not directory.exists():
        return None
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# -- the written checkpoint against transformers ---------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_dequantized_checkpoint_gives_logits_within_snr_bound(
    arch: str, models: dict[str, Path], tmp_path: Path
) -> None:
    src, dst = models[arch], tmp_path / "out"
    report = _write(src, dst, verify=True)
    model = _load(src)
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    want = _logits(model, ids)
    missing, unexpected = model.load_state_dict(_dequantized_model_state(dst, model), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # a tied head is the table itself
    got = _logits(model, ids)
    rel = float((got - want).norm() / want.norm())
    bound = logit_bound(report["snr_db"]["min"], report["snr_db"]["count"])
    assert 0 < rel <= bound, f"relative logit error {rel:.4f} above {bound:.4f}"

    # the report, the config vLLM reads, and the side files
    assert report["snr_db"]["count"] == 14 and len(report["tensors"]) == 14
    assert report["snr_db"]["min"] == min(t["snr_db"] for t in report["tensors"].values()) > 17
    assert report["snr_db"]["mean"] >= report["snr_db"]["min"]
    assert report["bits_per_weight"] == pytest.approx(4 + 16 / 32 + 4 / 32 + 32 / 64, abs=0.6)
    assert report["verify"]["ok"] and report["verify"]["min_verified_snr_db"] >= report["snr_db"]["min"] - 0.01
    assert report["vllm_cpu_issues"] == []
    on_disk = json.loads((dst / "quantization_report.json").read_text())
    assert on_disk["snr_db"] == report["snr_db"] and on_disk["options"]["group_size"] == GROUP
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc == json.loads((dst / "quantize_config.json").read_text())
    assert {
        k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "lm_head")
    } == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
        "lm_head": False,
    }
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in dst.iterdir()}
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(".")], "staging directory left behind"


def test_written_tensors_follow_the_published_rule(models: dict[str, Path], tmp_path: Path) -> None:
    """A numpy bit-loop decoder from the AutoGPTQ / vLLM rule equals hetmoe's two decoders, sym and asym."""
    for sym, fmt in ((True, "gptq"), (False, "gptq"), (False, "gptq_v2")):
        dst = tmp_path / f"out_{sym}_{fmt}"
        _write(models["qwen3"], dst, sym=sym, checkpoint_format=fmt, verify=True)
        state = _state(dst)
        qc = json.loads((dst / "config.json").read_text())["quantization_config"]
        assert (qc["sym"], qc["checkpoint_format"]) == (sym, fmt)
        for module in _modules(state):
            t = {s: state[module + s] for s in SUFFIXES}
            assert [t[s].dtype for s in SUFFIXES] == [torch.int32, torch.int32, torch.float16, torch.int32]
            reference = numpy_gptq_decode(*(t[s].numpy() for s in SUFFIXES), sym=sym, v1=fmt == "gptq")
            project = _project_dequantize(state, module, qc).double().numpy()
            independent = decode_gptq(*t.values(), sym=sym, checkpoint_format=fmt, group_size=GROUP, name=module)
            np.testing.assert_array_equal(project, reference)
            np.testing.assert_array_equal(independent.double().numpy(), reference)
            if sym:  # the classic constant qzeros: 0x77777777 in v1
                assert bool((t[".qzeros"] == 0x77777777).all())


def numpy_gptq_decode(
    qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray, *, sym: bool, v1: bool
) -> np.ndarray:
    """``W [N, K]`` from GPTQ tensors, written from the published rule with explicit bit loops.

    qweight int32 [K/8, N]: code of input k is bits 4*(k%8).. of word [k//8, n]; qzeros int32
    [G, N/8]: zero of output n is bits 4*(n%8).. of word [g, n//8], plus one in v1 ("gptq");
    w = (code - zero[g_idx[k]]) * scale[g_idx[k]]; symmetric (vLLM uint4b8): zero = 8.
    """
    words = qweight.view(np.uint32)
    k, n = words.shape[0] * 8, words.shape[1]
    codes = np.zeros((k, n), dtype=np.int64)
    for row in range(words.shape[0]):
        for i in range(8):
            codes[8 * row + i] = (words[row] >> np.uint32(4 * i)) & np.uint32(0xF)
    zwords = qzeros.view(np.uint32)
    zeros = np.zeros((zwords.shape[0], n), dtype=np.int64)
    for col in range(zwords.shape[1]):
        for i in range(8):
            zeros[:, 8 * col + i] = (zwords[:, col] >> np.uint32(4 * i)) & np.uint32(0xF)
    if v1:
        zeros += 1
    if sym:
        assert (zeros == 8).all()
        zeros[:] = 8
    w = np.empty((k, n), dtype=np.float64)
    for kk in range(k):
        g = int(g_idx[kk])
        w[kk] = (codes[kk] - zeros[g]) * scales[g].astype(np.float64)
    return w.T


def test_fused_projections_are_split_exactly(models: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src, dst = models["phi3"], tmp_path / "out"
    _write(src, dst)
    state = _state(dst)
    source = load_file(src / "model.safetensors")
    assert not [k for k in state if "qkv_proj" in k or "gate_up_proj" in k]
    codec = get_codec("gptq", group_size=GROUP)
    for layer in range(2):
        for fused, parts in (("self_attn.qkv_proj", ("q", "k", "v")), ("mlp.gate_up_proj", ("gate", "up"))):
            whole = codec.quantize(source[f"model.layers.{layer}.{fused}.weight"].float())
            parent = fused.split(".")[0]
            names = [f"model.layers.{layer}.{parent}.{p}_proj" for p in parts]
            for suffix in (".qweight", ".scales", ".qzeros"):
                assert torch.equal(torch.cat([state[n + suffix] for n in names], dim=1), whole.tensors[suffix])
    rows = [state[f"model.layers.0.self_attn.{p}_proj.qweight"].shape[1] for p in "qkv"]
    assert rows == [4 * 16, 2 * 16, 2 * 16]  # num_heads*head_dim, num_kv_heads*head_dim from the config
    assert [state[f"model.layers.0.mlp.{p}_proj.qweight"].shape[1] for p in ("gate", "up")] == [128, 128]
    # vLLM's Phi-3 keeps a fused qkv_proj layer: the fused name must count as quantized too
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert {"self_attn.qkv_proj", "self_attn.q_proj", "mlp.gate_up_proj"} <= set(qc["modules_in_block_to_quantize"][0])


def test_calibrated_gptq_beats_round_to_nearest_on_every_layer(
    models: dict[str, Path], texts: dict[str, Path], tmp_path: Path
) -> None:
    src = models["aniso"]
    _write(src, tmp_path / "rtn")
    report = _write(
        src, tmp_path / "gptq", calibrate=str(texts["calib"]), calib_samples=8, calib_seqlen=128, verify=True
    )
    assert report["method"] == "gptq" and report["calibration"]["tokens"] == 8 * 128
    for entry in report["tensors"].values():
        cal = entry["calibration"]
        assert cal["output_snr_db"] > cal["rtn_output_snr_db"]

    # held-out activations of the original model, every block linear
    from transformers import AutoTokenizer

    model = _load(src)
    ids = torch.tensor(AutoTokenizer.from_pretrained(src)(texts["heldout"].read_text())["input_ids"][:512])
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        mod.register_forward_hook(lambda _m, i, _o, n=n: inputs.__setitem__(n, i[0].reshape(-1, i[0].shape[-1])))
        for n, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and ".layers." in n
    ]
    with torch.no_grad():
        model(ids.view(4, 128))
    for h in hooks:
        h.remove()
    weights = {n: p.detach() for n, p in model.named_parameters()}
    rtn, gptq = _state(tmp_path / "rtn"), _state(tmp_path / "gptq")
    qc = json.loads((tmp_path / "rtn" / "config.json").read_text())["quantization_config"]
    assert len(inputs) == 14
    for name, x in inputs.items():
        ref = x @ weights[name + ".weight"].T
        err_rtn = float((x @ _project_dequantize(rtn, name, qc).T - ref).norm() / ref.norm())
        err_gptq = float((x @ _project_dequantize(gptq, name, qc).T - ref).norm() / ref.norm())
        assert err_gptq < err_rtn, f"{name}: GPTQ {err_gptq:.4f} not below round-to-nearest {err_rtn:.4f}"


def test_quantize_lm_head_unties_a_tied_head(models: dict[str, Path], tmp_path: Path) -> None:
    src, dst = models["llama_tied"], tmp_path / "out"
    report = _write(src, dst, quantize_lm_head=True, verify=True)
    state = _state(dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["lm_head"] is True
    assert "lm_head" in config["quantization_config"]["modules_in_block_to_quantize"][0]
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16  # the table stays for lookups
    assert "lm_head.qweight" in state and "lm_head.weight" not in state
    assert report["tensors"]["lm_head"]["role"] == "lm_head" and any("untied" in n for n in report["notes"])
    model = _load(src)
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie in memory
    model.load_state_dict(_dequantized_model_state(dst, model))
    rel = float((_logits(model, ids) - want).norm() / want.norm())
    assert rel <= logit_bound(report["snr_db"]["min"], report["snr_db"]["count"])


def test_quantize_embedding_and_skip(models: dict[str, Path], tmp_path: Path) -> None:
    src = models["llama"]
    report = _write(src, tmp_path / "emb", quantize_embedding=True, verify=True)
    assert "model.embed_tokens.qweight" in _state(tmp_path / "emb")
    assert any("embedding" in issue for issue in report["vllm_cpu_issues"])

    report = _write(src, tmp_path / "skip", skip=(r"layers\.0\.mlp\.",))
    state = _state(tmp_path / "skip")
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.down_proj.qweight" in state and report["snr_db"]["count"] == 11
    assert report["kept_full_precision"] == [f"model.layers.0.mlp.{p}_proj" for p in ("down", "gate", "up")]
    names = json.loads((tmp_path / "skip" / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.down_proj" in names["modules_in_block_to_quantize"][0]  # full names: blocks differ


def test_sharded_output_and_overwrite(models: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "stale.txt").write_text("old")
    report = _write(models["llama"], dst, max_shard_size=20_000, overwrite=True, verify=True)
    assert len(report["shards"]) > 2 and not (dst / "stale.txt").exists()
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(report["shards"])
    assert set(index["weight_map"]) == set(_state(dst))
    assert (dst / "model.safetensors.index.json").stat().st_mode & 0o044  # readable by others, unlike temp files


def test_unknown_architecture_found_by_names(tmp_path: Path) -> None:
    """No transformers class for it: the block linears are still found, from the tensor names."""
    g = torch.Generator().manual_seed(0)
    tensors = {"tok.embed_tokens.weight": torch.randn(64, 64, generator=g)}
    for i in range(2):
        tensors[f"net.blocks.{i}.mix.wqkv.weight"] = torch.randn(96, 64, generator=g)
        tensors[f"net.blocks.{i}.mix.out.weight"] = torch.randn(64, 32, generator=g)
        tensors[f"net.blocks.{i}.ln_1.weight"] = torch.ones(64)
    src = _bad_dir(tmp_path / "src", "no_such_arch", tensors)
    report = _write(src, tmp_path / "out", verify=True)
    assert report["linears_found_by"] == "names" and report["snr_db"]["count"] == 4
    assert sorted(report["tensors"]) == [f"net.blocks.{i}.mix.{p}" for i in range(2) for p in ("out", "wqkv")]
    assert torch.equal(_state(tmp_path / "out")["net.blocks.0.ln_1.weight"], torch.ones(64))


# -- the command line and bad input ----------------------------------------------------------------


def test_cli_writes_and_reports(models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "out"
    rc = main(["gptq", str(models["llama"]), str(dst), "--group-size", "32", "--verify", "--asym"])
    out = capsys.readouterr()
    assert rc == 0
    assert "SNR dB: mean" in out.out and "verify: ok" in out.out and "asymmetric" in out.out  # vLLM CPU note
    assert "writing" in out.err  # the progress bar is on stderr
    rc = main(["gptq", str(models["llama"]), str(tmp_path / "q"), "--group-size", "32", "--quiet"])
    assert rc == 0 and capsys.readouterr() == ("", "")


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["gptq", "--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and "--calibrate" in text and "--desc-act" in text


def _bad_dir(root: Path, model_type: str, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    from safetensors.torch import save_file

    root.mkdir()
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    return root


def test_bad_input_is_refused_and_dst_left_as_it_was(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    llama = str(models["llama"])
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    for f in models["llama"].iterdir():
        (quantized / f.name).write_bytes(f.read_bytes())
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "desc_act": True}
    (quantized / "config.json").write_text(json.dumps(config))
    unknown = _bad_dir(tmp_path / "unknown", "no_such_arch", {"proj.weight": torch.randn(8, 8)})
    moe = _bad_dir(tmp_path / "moe", "no_such_moe", {"model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(8, 8)})
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    cases = [
        ("K not divisible", [llama, "--group-size", "48"], "divisible by 48"),
        ("no linear layers", [str(unknown), "--group-size", "8"], "no linear layers found"),
        ("MoE", [str(moe)], "Mixture-of-Experts"),
        ("desc_act flag", [llama, "--desc-act"], "act-order"),
        ("desc_act config", [str(quantized)], "already quantized"),
        ("partial stacked skip", [llama, "--group-size", "32", "--skip", "k_proj"], "share a precision"),
        ("bad regex", [llama, "--skip", "("], "not a valid regular expression"),
        ("missing calibration text", [llama, "--group-size", "32", "--calibrate", str(tmp_path / "nope.txt")], "nope"),
    ]
    for label, args, message in cases:
        dst = tmp_path / f"dst_{label.replace(' ', '_')}"
        rc = main(["gptq", args[0], str(dst), *args[1:]])
        err = capsys.readouterr().err
        assert rc != 0, label
        assert message in err, f"{label}: {err}"
        assert not dst.exists(), label
    before = _tree(occupied)
    rc = main(["gptq", llama, str(occupied), "--group-size", "32"])
    assert rc == 1 and "--overwrite" in capsys.readouterr().err
    assert _tree(occupied) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directory left behind"


def test_verify_fails_loudly_on_a_wrong_decode(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A writer bug that changes codes after the SNR was measured must fail --verify, not ship."""
    from hetmoe.checkpoint import gptq_writer

    real = gptq_writer._Quantizer._rtn

    def corrupting(self: Any, spec: Any) -> None:
        real(self, spec)
        if spec.name.endswith("layers.1.mlp.up_proj"):
            qweight = self._cache[spec.name].tensors[".qweight"]
            qweight ^= 0x11111111  # flip one bit of every code

    monkeypatch.setattr(gptq_writer._Quantizer, "_rtn", corrupting)
    dst = tmp_path / "out"
    rc = main(["gptq", str(models["llama"]), str(dst), "--group-size", "32", "--verify", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "--verify failed" in err and "layers.1.mlp.up_proj" in err
    assert not dst.exists()


# -- the solver ------------------------------------------------------------------------------------


def test_gptq_with_a_diagonal_hessian_is_round_to_nearest() -> None:
    """No correlation between inputs, no error to spread: GPTQ must reduce to RTN bit for bit."""
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    for sym in (True, False):
        codec = get_codec("gptq", group_size=32, sym=sym)
        q, stats = gptq_quantize(w, torch.diag(torch.rand(128) + 0.5), codec)
        rtn = codec.quantize(w)
        assert all(torch.equal(q.tensors[s], rtn.tensors[s]) for s in SUFFIXES)
        assert stats.output_snr_db == pytest.approx(stats.rtn_output_snr_db)


def test_gptqmodel_loads_the_checkpoint(models: dict[str, Path], tmp_path: Path) -> None:
    """transformers' own GPTQ loader (optimum + gptqmodel, CPU path), where installable without a new torch."""
    pytest.importorskip("optimum")
    pytest.importorskip("gptqmodel")
    from transformers import AutoModelForCausalLM

    src, dst = models["llama"], tmp_path / "out"
    report = _write(src, dst)
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    want = _logits(_load(src), ids)
    loaded = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float16, device_map="cpu").eval()
    got = _logits(loaded, ids)
    rel = float((got - want).norm() / want.norm())
    assert rel <= logit_bound(report["snr_db"]["min"], report["snr_db"]["count"]) + 0.02  # + fp16 compute
