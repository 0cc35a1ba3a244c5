"""``hetmoe eval ppl`` on a tiny Qwen3-MoE, held against transformers' own forward on the same windows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from hetmoe.bench.quality import text_windows
from hetmoe.cli.main import main

CONTEXT = 24
TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "        self.y = y\n\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_cache, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE (bf16) with a one-token-per-character tokenizer over printable ASCII and newline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    # The tiny model's experts (std 0.02) barely move its logits; scaled up they dominate, so a
    # method's rounding shows in perplexity and KL as it would in a trained model.
    path = tmp_path_factory.mktemp("ppl") / "tiny"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_cache.model("qwen3_moe")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(40.0)
    model.save_pretrained(path)
    vocab = {chr(32 + i): i for i in range(95)}
    vocab.update({"\n": 95, "<unk>": 125, "<pad>": 126, "<eos>": 127})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def _transformers_nll(model_dir: Path, windows: list[torch.Tensor]) -> tuple[float, int]:
    """Summed next-token NLL of every window, scored by transformers' model in fp32, window by window."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(input_ids=w.unsqueeze(0)).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += len(w) - 1
    return total, count


def test_eval_ppl_matches_transformers_and_kl_behaves(model_dir: Path, tmp_path: Path, capsys) -> None:
    from transformers import AutoTokenizer

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "q.json"
    argv = ["eval", "ppl", str(model_dir), "--text", str(text), "--methods", "bf16,int8,int4", "--context"]
    argv += [str(CONTEXT), "--dtype", "float32", "--threads", "1", "--batch-size", "3", "--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["bf16", "int8", "int4"] and all(r["error"] is None for r in rows.values())

    ids = AutoTokenizer.from_pretrained(str(model_dir))(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT)  # one token per character: the windows below are the ones it scored
    windows = [torch.tensor(ids[i : i + CONTEXT]) for i in range(0, len(ids), CONTEXT)]
    windows = [w for w in windows if len(w) >= 2]
    total, count = _transformers_nll(model_dir, windows)
    assert report["windows"] == len(windows) and report["predictions"] == count
    assert rows["bf16"]["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-4)

    assert rows["bf16"]["kl_mean"] == 0.0 and rows["bf16"]["top1_agreement"] == 1.0
    assert 0.0 < rows["int8"]["kl_mean"] < 1e-3
    assert rows["int8"]["kl_mean"] < rows["int4"]["kl_mean"]  # fewer bits, further from bf16
    assert rows["int8"]["ppl_ratio"] == pytest.approx(rows["int8"]["perplexity"] / rows["bf16"]["perplexity"])
    for method in rows:
        assert any(line.startswith(method) for line in table.splitlines())


def test_eval_ppl_lists_a_method_the_shapes_exclude_and_exits_1(model_dir: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    report, plot = tmp_path / "q.json", tmp_path / "q.png"
    # --group-size reaches gptq (whose default 128 does not divide the tiny experts' K=32), not bf16.
    argv = ["eval", "ppl", str(model_dir), "--text", str(text), "--methods", "bf16,gptq,q4_k", "--context"]
    argv += ["16", "--group-size", "32", "--max-windows", "1", "--threads", "1", "--json", str(report)]
    assert main([*argv, "--plot", str(plot)]) == 1
    out = capsys.readouterr().out
    assert "gguf:q4_k" in out and "unavailable" in out and "256" in out  # q4_k named gguf:q4_k; its blocks need K % 256
    rows = json.loads(report.read_text())["rows"]
    assert rows[0]["perplexity"] > 1 and rows[1]["perplexity"] > 1 and rows[1]["kl_mean"] > 0
    assert rows[2]["perplexity"] is None and "256" in rows[2]["error"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_ppl_bad_input_is_clear(model_dir: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("a")
    assert main(["eval", "ppl", str(model_dir), "--text", str(text)]) == 1
    assert "at least 2 tokens" in capsys.readouterr().err
    assert main(["eval", "ppl", str(model_dir), "--text", str(tmp_path / "missing.txt")]) == 1
    assert "--text" in capsys.readouterr().err
    text.write_text(TEXT)
    assert main(["eval", "ppl", str(model_dir), "--text", str(text), "--context", "1"]) == 1
    assert "--context must be >= 2" in capsys.readouterr().err
    assert main(["eval", "ppl", str(model_dir), "--text", str(text), "--methods", "bf16,int3"]) == 1
    assert "methods: unknown 'int3'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="context must be >= 2"):
        text_windows([1, 2, 3], 1)
    assert [len(w) for w in text_windows(list(range(10)), 4)] == [4, 4, 2]
    assert [len(w) for w in text_windows(list(range(9)), 4)] == [4, 4]  # a 1-token tail predicts nothing
