"""``hetmoe sft train`` on a tiny Qwen3-MoE with a chat tokenizer: stopped and resumed it gives
bit-identical adapters to an uninterrupted run; bad input gives one clear line; and the
transformers Trainer runs unchanged on the wrapped model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_sft_support import chat_model

from hetmoe.cli.main import main

DATA = Path(__file__).resolve().parent.parent / "data" / "sft"


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """The first 24 training conversations (tokenizing all of them per run would only cost time)."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    path.write_text("".join((DATA / "tiny_chat.jsonl").read_text().splitlines(keepends=True)[:24]))
    return path


@pytest.fixture(scope="module")
def model_dir(tiny_cache, tmp_path_factory) -> Path:
    return chat_model(tiny_cache, tmp_path_factory.mktemp("sft") / "chat-qwen3", DATA / "tiny_chat.jsonl")


def _run(model_dir: Path, small_data: Path, out: Path, steps: int, *extra: str) -> int:
    return main(
        [
            "sft",
            "train",
            str(model_dir),
            "--data",
            str(small_data),
            "--max-steps",
            str(steps),
            "--batch-size",
            "2",
            "--max-length",
            "64",
            "--lora-rank",
            "4",
            "--lora-dropout",
            "0.1",
            "--lr",
            "1e-2",
            "--output",
            str(out),
            "--no-progress",
            *extra,
        ]
    )


def test_cli_resume_is_exact(model_dir, small_data, tmp_path, capsys) -> None:
    assert _run(model_dir, small_data, tmp_path / "straight", 4) == 0
    assert _run(model_dir, small_data, tmp_path / "stopped", 2) == 0
    state = torch.load(tmp_path / "stopped" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2
    assert _run(model_dir, small_data, tmp_path / "stopped", 4, "--resume") == 0
    a = load_file(str(tmp_path / "straight" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "stopped" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # and the run did train: B starts at zero in PEFT's init
    assert any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a)
    config = json.loads((tmp_path / "straight" / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "up_proj"]
    # a resume with a different setting is refused, naming it
    capsys.readouterr()
    assert _run(model_dir, small_data, tmp_path / "stopped", 6, "--resume", "--seed", "3") == 1
    assert "seed" in capsys.readouterr().err


def test_cli_errors_and_help(model_dir, small_data, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["sft", "train", "--help"])
    assert "examples:" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]})
        + "\n{not json\n"
    )
    assert main(["sft", "train", str(model_dir), "--data", str(bad), "--output", str(tmp_path / "o")]) == 1
    assert f"{bad}:2: invalid JSON" in capsys.readouterr().err
    assert (
        main(["sft", "train", str(model_dir), "--data", str(small_data), "--output", str(tmp_path / "o"), "--resume"])
        == 1
    )
    assert "no checkpoint" in capsys.readouterr().err
    assert (
        main(
            [
                "sft",
                "train",
                str(model_dir),
                "--data",
                str(small_data),
                "--target",
                "nope",
                "--output",
                str(tmp_path / "o"),
            ]
        )
        == 1
    )
    assert "match no module" in capsys.readouterr().err


def test_transformers_trainer_runs_unchanged(model_dir, small_data, tmp_path) -> None:
    from peft import LoraConfig
    from transformers import AutoTokenizer, Trainer, TrainingArguments

    from hetmoe.sft import load_for_training, placeholders
    from hetmoe.sft.data import collate, load_chat_dataset
    from hetmoe.sft.peft_wrap import get_peft_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = load_chat_dataset(small_data, tok, 64)[:8]
    model = get_peft_model(
        load_for_training(model_dir, dtype="float32"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=examples, data_collator=lambda batch: collate(batch, tok.pad_token_id)
    )
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any(".experts." in n for n in changed)
    assert placeholders(model)  # still in place, still empty


def test_serve_runs_a_trained_adapter(model_dir, small_data, tmp_path) -> None:
    """``hetmoe serve --lora DIR`` answers with the adapted model: its greedy completion equals
    load_model + apply_adapter + transformers' generate on the same prompt."""
    import openai
    from serve_process import serve_process
    from transformers import AutoTokenizer

    import hetmoe
    from hetmoe.sft import apply_adapter

    assert _run(model_dir, small_data, tmp_path / "run", 3) == 0
    adapter = tmp_path / "run" / "adapter"
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("def main", return_tensors="pt").input_ids
    with torch.no_grad():
        plain = hetmoe.load_model(model_dir, cpu_threads=1)(ids).logits
    model = apply_adapter(hetmoe.load_model(model_dir, cpu_threads=1), adapter)
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, plain, atol=1e-4)  # the adapter does change the model
    out = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    # as the server decodes a completion (serve/stops.py): special tokens left out
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    args = [str(model_dir), "--lora", str(adapter), "--threads", "1", "--torch-threads", "1"]
    with serve_process([*args, "--log-level", "warning"]) as srv:
        cli = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = cli.completions.create(
            model=model_dir.name, prompt="def main", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
    assert "applied LoRA adapter" in srv.stderr
    assert r.choices[0].text == want
