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
