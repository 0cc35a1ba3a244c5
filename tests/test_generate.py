"""``hetmoe generate`` on a tiny model with a character-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from conftest import devices

from hetmoe.cli.main import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_cache, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with a tokenizer: one token per printable ASCII character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tiny_cache.copy(tiny_cache.model("qwen3_moe"), tmp_path_factory.mktemp("gen") / "tiny")
    vocab = {chr(32 + i): i for i in range(95)}
    vocab.update({"<unk>": 125, "<pad>": 126, "<eos>": 127})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def test_generate_streams_greedy_text_and_reports_timing(model_dir: Path, capsys) -> None:
    from transformers import AutoTokenizer

    from hetmoe import load_model

    assert main(["generate", str(model_dir), "Hello", "--max-new-tokens", "10", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok("Hello", return_tensors="pt")["input_ids"]
    want = load_model(model_dir).generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=126)
    assert out.rstrip("\n") == tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True)
    assert "loaded" in err and "routed experts bf16 in CPU memory" in err
    prefill = next(line for line in err.splitlines() if line.startswith("prefill:"))
    decode = next(line for line in err.splitlines() if line.startswith("decode:"))
    assert "5 tokens in" in prefill and "9 tokens in" in decode
    for line in (prefill, decode):
        assert "tokens/s" in line and "CPU experts" in line and "device / non-expert" in line


@pytest.mark.parametrize("device", devices())
def test_generate_samples_reproducibly_with_device_experts(model_dir: Path, device: str, capsys) -> None:
    argv = ["generate", str(model_dir), "abc", "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9"]
    argv += ["--seed", "3", "--gpu-experts", "2", "--method", "int8", "--device", device]
    assert main(argv) == 0
    first, err = capsys.readouterr()
    assert "routed experts int8" in err and f"4 of them also on {device}" in err
    assert main(argv) == 0
    assert capsys.readouterr().out == first


def test_generate_without_a_prompt_is_a_clear_error(capsys) -> None:
    """No arguments: the default model would be used, but there is nothing to complete."""
    assert main(["generate"]) == 1
    err = capsys.readouterr().err
    assert "no prompt" in err and "Traceback" not in err


def test_generate_bad_arguments_are_clear(model_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["generate", str(model_dir)]) == 1
    assert "no prompt" in capsys.readouterr().err
    assert main(["generate", str(model_dir), "x", "--max-new-tokens", "0"]) == 1
    assert "--max-new-tokens" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", str(tmp_path), "x"]) == 1
    assert "error:" in capsys.readouterr().err


def test_generate_without_tokenizer_is_a_clear_error(tiny_cache, capsys) -> None:
    from hetmoe.cli.main import main

    model = tiny_cache.model("qwen3_moe")  # save_pretrained of a bare model: no tokenizer files
    assert main(["generate", str(model), "hello", "--max-new-tokens", "2"]) == 1
    assert "no tokenizer files" in capsys.readouterr().err


def test_generate_takes_options_between_model_and_prompt(model_dir: Path, capsys) -> None:
    """`hetmoe generate MODEL --max-new-tokens N PROMPT` (options between the two positionals) runs as
    the same command with the options last does, to the same text."""
    assert main(["generate", str(model_dir), "--max-new-tokens", "4", "--threads", "1", "Hello"]) == 0
    between = capsys.readouterr().out
    assert main(["generate", str(model_dir), "Hello", "--max-new-tokens", "4", "--threads", "1"]) == 0
    assert capsys.readouterr().out == between and between.strip()
    with pytest.raises(SystemExit):  # an unknown option is still argparse's error
        main(["generate", str(model_dir), "--no-such-flag", "Hello"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
        (["--temperature", "inf"], "--temperature must be finite, got inf"),
        (["--min-p", "nan"], "--min-p must be finite, got nan"),
        (["--top-k", "-2"], "--top-k must be >= 0, got -2"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--min-p", "1.5"], "--min-p must be in [0, 1], got 1.5"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be in [0.01, 10], got 0.0"),
        (["--no-repeat-ngram-size", "-1"], "--no-repeat-ngram-size must be >= 0, got -1"),
    ],
)
def test_generate_bad_sampling_flags_are_one_line(model_dir: Path, flags: list[str], message: str, capsys) -> None:
    assert main(["generate", str(model_dir), "x", *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_generate_sampling_flags_act_as_transformers_generate(model_dir: Path, capsys) -> None:
    """The tiny model has no generation_config.json, so it decodes greedily; --top-k alone turns
    sampling on (with --seed: the tokens generate draws after torch.manual_seed), and
    --repetition-penalty applies to greedy decoding, as generate's processor does."""
    import torch
    from transformers import AutoTokenizer

    from hetmoe import load_model

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok("abcabc", return_tensors="pt")["input_ids"]
    model = load_model(model_dir, cpu_threads=1)
    base = ["generate", str(model_dir), "abcabc", "--max-new-tokens", "12", "--threads", "1"]

    def expect(**options) -> str:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=12, pad_token_id=126, **options)
        return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    assert main([*base, "--top-k", "20", "--seed", "4"]) == 0
    sampled = capsys.readouterr().out.rstrip("\n")
    torch.manual_seed(4)
    assert sampled == expect(do_sample=True, top_k=20)
    assert sampled != expect(do_sample=False)  # it did sample
    assert main([*base, "--temperature", "0", "--repetition-penalty", "3"]) == 0
    penalized = capsys.readouterr().out.rstrip("\n")
    assert penalized == expect(do_sample=False, repetition_penalty=3.0) != expect(do_sample=False)
    assert main([*base, "--temperature", "0", "--no-repeat-ngram-size", "2"]) == 0
    banned = capsys.readouterr().out.rstrip("\n")
    assert banned == expect(do_sample=False, no_repeat_ngram_size=2) != expect(do_sample=False)
