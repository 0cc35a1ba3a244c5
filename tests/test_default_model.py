"""The embedded default model (hetmoe/assets/default_model) and the script that trains it."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from hetmoe.cli.main import main

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_default_model.py"
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "training_report.json",
    "heldout.txt",
)
PROMPT = "def fibonacci(n):\n"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The packaged model; a missing one fails loudly: it is part of the product, not an optional extra."""
    from hetmoe.models.default import default_model_path

    try:
        path = default_model_path()
    except ValueError as exc:
        pytest.fail(f"the embedded default model is not in the package: {exc}")
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        pytest.fail(f"{path} lacks {missing}; rebuild it with python scripts/train_default_model.py")
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_files_are_small_and_report_is_complete(model_dir: Path) -> None:
    total = sum(f.stat().st_size for f in model_dir.iterdir())
    assert total < 10 * 2**20, f"{total} bytes"
    assert (model_dir / "heldout.txt").stat().st_size <= 64 * 1024
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no half-written build left
    report = json.loads((model_dir / "training_report.json").read_text())
    for key in ("seed", "steps", "tokens_seen", "train_seconds", "heldout_loss", "heldout_perplexity", "data"):
        assert key in report, key
    assert report["smoke"] is False
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2
    assert 8 <= config.get("num_experts", config.get("num_local_experts", 0)) <= 16


def test_logits_equal_transformers_forward(model_dir: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    from hetmoe import load_model

    text = (model_dir / "heldout.txt").read_text()[:400]
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :96]
    ours = load_model(model_dir, method="bf16", device="cpu", dtype="float32", cpu_threads=1)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        a = ours(input_ids=ids).logits.float()
        b = ref(input_ids=ids).logits.float()
    rel = float((a - b).abs().max() / b.abs().max())
    assert rel < 1e-3, rel


def test_tokenizer_round_trips_and_renders_chatml(tokenizer) -> None:
    for text in (
        PROMPT + "    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
        "naïve café → ∑ 🐍\t\r\n",
    ):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does `len` do?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat does `len` do?<|im_end|>\n"
    assert rendered == want + "<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == want
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_greedy_generation_equals_transformers(model_dir: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    from hetmoe import load_model

    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    ours = load_model(model_dir, method="bf16", device="cpu", dtype="float32", cpu_threads=1)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    options = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    got = ours.generate(ids, **options)
    want = ref.generate(ids, **options)
    assert got.tolist() == want.tolist()
    completion = tokenizer.decode(got[0, ids.shape[1] :])
    assert completion.strip(), completion  # a trained model continues a def with text, not nothing


def test_generate_cli_uses_the_default_model(model_dir: Path, tokenizer, capsys) -> None:
    from hetmoe import load_model

    argv = ["generate", PROMPT, "--method", "int4", "--max-new-tokens", "8", "--threads", "1"]
    assert main([*argv, "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert str(model_dir) in err and "routed experts int4" in err and "tokens/s" in err
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    model = load_model(model_dir, method="int4", cpu_threads=1)
    want = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.rstrip("\n") == tokenizer.decode(want[0, ids.shape[1] :], skip_special_tokens=True).rstrip("\n")
    # Without --temperature it samples as generation_config.json says, reproducibly with --seed.
    assert main([*argv, "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    torch.manual_seed(3)
    want = model.generate(ids, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id)  # the config's sampling
    assert model.generation_config.do_sample
    assert sampled.rstrip("\n") == tokenizer.decode(want[0, ids.shape[1] :], skip_special_tokens=True).rstrip("\n")

    assert main(["generate", "--chat", "What does `len` do?", "--max-new-tokens", "4", "--threads", "1"]) == 0
    assert "prefill: " in capsys.readouterr().err
    assert main(["generate"]) == 1
    assert "no prompt" in capsys.readouterr().err


def test_generation_config_samples_with_a_repetition_penalty(model_dir: Path) -> None:
    """The defaults `hetmoe generate` and `hetmoe chat` use; the training script writes them."""
    config = json.loads((model_dir / "generation_config.json").read_text())
    want = _load_script().SAMPLING_DEFAULTS
    assert {k: config.get(k) for k in want} == want
    assert config["do_sample"] is True and config["repetition_penalty"] > 1 and 0 < config["min_p"] < 1


def _word_trigram_counts(text: str) -> dict[tuple[str, ...], int]:
    words = text.split()
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - 2):
        key = tuple(words[i : i + 3])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.usefixtures("vector_arithmetic")  # one seeded sample: the same text on every CPU
@pytest.mark.parametrize("method", ["int4", None])  # the README's command, and the stored bf16
def test_readme_command_does_not_repeat_itself(method: str | None, capsys) -> None:
    """The README's main command with its defaults (64 new tokens, generation_config.json's sampling),
    seeded: no word 3-gram occurs more than twice."""
    argv = ["generate", "def fibonacci(n):", "--seed", "0", "--threads", "1"]
    assert main(argv + (["--method", method] if method else [])) == 0
    out, err = capsys.readouterr()
    assert f"routed experts {method or 'bf16'}" in err
    assert "decode: 63 tokens" in err, err  # 64 new tokens: the first comes out of prefill
    worst = max(_word_trigram_counts(out).items(), key=lambda kv: kv[1], default=((), 0))
    assert worst[1] <= 2, (worst, out)


def _heldout_signatures(model_dir: Path, count: int = 5) -> list[str]:
    """The first ``count`` one-line top-level function signatures of heldout.txt (modules never trained on)."""
    text = (model_dir / "heldout.txt").read_text()
    return re.findall(r"^def [^\n]*:$", text, re.M)[:count]


def _function_so_far(signature: str, completion: str, hit_limit: bool) -> str:
    """The signature and its completion up to the first line back at the signature's column (the
    function has ended). A completion that ran out of tokens inside the body loses its last line,
    which the token limit cut, not the model."""
    body: list[str] = []
    for line in completion.removeprefix("\n").split("\n"):
        if line.strip() and not line[0].isspace():
            break
        body.append(line)
    else:
        if hit_limit:
            body = body[:-1]
    return signature + "\n" + "\n".join(body)


def test_function_so_far_cuts_at_the_dedent() -> None:
    got = _function_so_far("def f(x):", "\n    y = x\n    return y\n\ndef g(", hit_limit=False)
    assert got == "def f(x):\n    y = x\n    return y\n"
    assert _function_so_far("def f(x):", "\n    return (x +", hit_limit=True) == "def f(x):\n"


@pytest.mark.parametrize("method", ["int4", None])
def test_greedy_completions_of_heldout_signatures_parse(model_dir: Path, method: str | None, capsys) -> None:
    """Issue 22: `hetmoe generate SIGNATURE --temperature 0` (greedy, with the model's repetition
    penalty and n-gram ban) continues 5 held-out signatures into Python that parses in at least 3."""
    signatures = _heldout_signatures(model_dir)
    assert len(signatures) == 5, signatures
    parsed = []
    for signature in signatures:
        argv = ["generate", signature, "--temperature", "0", "--max-new-tokens", "128", "--threads", "1"]
        assert main(argv + (["--method", method] if method else [])) == 0
        out, err = capsys.readouterr()
        code = _function_so_far(signature, out.rstrip("\n"), hit_limit="decode: 127 tokens" in err)
        try:
            ast.parse(code)
            parsed.append(signature)
        except SyntaxError:
            pass
    assert len(parsed) >= 3, (parsed, signatures)


def _load_script():
    """scripts/ is not a package: import the file by path (registered first, as dataclasses need)."""
    if "train_default_model" in sys.modules:
        return sys.modules["train_default_model"]
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_training_script_is_deterministic(tmp_path: Path, capsys) -> None:
    script = _load_script()
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        out = tmp_path / name
        assert script.main(["--smoke", "--seed", str(seed), "--threads", "1", "--out", str(out)]) == 0
        runs[name] = out
    log = capsys.readouterr().out
    assert "step 4/4" in log and "tokens/s" in log and "held-out: loss" in log
    assert sorted(p.name for p in runs["a"].iterdir()) == sorted(FILES)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp build dirs renamed or removed
    for f in ("model.safetensors", "tokenizer.json", "heldout.txt"):
        assert (runs["a"] / f).read_bytes() == (runs["b"] / f).read_bytes(), f
    assert (runs["a"] / "model.safetensors").read_bytes() != (runs["c"] / "model.safetensors").read_bytes()
    # Stage 2 from a saved stage 1 (--stage1) continues bit for bit what one whole run does.
    common = ["--smoke", "--seed", "0", "--threads", "1"]
    assert script.main([*common, "--polish-steps", "0", "--out", str(tmp_path / "stage1")]) == 0
    assert script.main([*common, "--stage1", str(tmp_path / "stage1"), "--out", str(tmp_path / "resumed")]) == 0
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == (runs["a"] / "model.safetensors").read_bytes()
    report = json.loads((tmp_path / "resumed" / "training_report.json").read_text())
    assert report["stage1"]["steps"] == 4 and report["polish"]["steps"] == 2
    with pytest.raises(SystemExit, match="holds a polished model"):
        script.main([*common, "--stage1", str(runs["a"]), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="not stage 1 of this run"):
        script.main([*common, "--seed", "1", "--stage1", str(tmp_path / "stage1"), "--out", str(tmp_path / "x")])
    report = json.loads((runs["a"] / "training_report.json").read_text())
    assert report["smoke"] is True and report["steps"] == 4 and report["seed"] == 0
    # Writing again over an existing model replaces it whole.
    assert script.main(["--smoke", "--seed", "1", "--threads", "1", "--out", str(runs["a"])]) == 0
    assert (runs["a"] / "model.safetensors").read_bytes() == (runs["c"] / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_chat_examples_render_as_the_template_does(tokenizer) -> None:
    """The script writes chat training text by hand; it must be exactly what the shipped template renders."""
    script = _load_script()
    source = 'def greet(name):\n    """Say hello to NAME, politely."""\n    return "hello there, " + name\n'
    module = script.Module("demo", source)
    convs = script.chat_examples(module)
    assert [c[0]["content"] for c in convs] == [
        "What does `demo.greet` do?",
        "Write a Python function named `greet` that does this: Say hello to NAME, politely.",
    ]
    for conv in convs:
        assert script.render_chat(conv) == tokenizer.apply_chat_template(conv, tokenize=False)
