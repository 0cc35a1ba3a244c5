"""Fine-tuning end to end on a tiny Qwen3-MoE with a chat tokenizer and data/sft's chat data.

- a short run lowers the held-out loss; its adapter, put on a ``hetmoe.load_model`` model with
  ``apply_adapter``, reproduces the trained model's logits, and PEFT itself loading the same files
  onto transformers' own model (its v4 -> v5 conversion of per-expert adapters) agrees too;
- (tests/test_sft_cli.py: the command line, resume, the transformers Trainer.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_sft_support import chat_model

from hetmoe.sft.train import TrainConfig, train

DATA = Path(__file__).resolve().parent.parent / "data" / "sft"
TRAIN, EVAL = DATA / "tiny_chat.jsonl", DATA / "tiny_chat_eval.jsonl"


@pytest.fixture(scope="module")
def model_dir(tiny_cache, tmp_path_factory) -> Path:
    return chat_model(tiny_cache, tmp_path_factory.mktemp("sft") / "chat-qwen3", TRAIN)


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(
        data=TRAIN,
        eval_data=EVAL,
        model=model_dir,
        max_steps=10,
        batch_size=8,
        lr=2e-2,
        max_length=128,
        output=out,
        progress=False,
    )
    return train(cfg)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_short_finetune_lowers_heldout_loss(trained) -> None:
    assert trained.steps == 10
    assert trained.eval_after < trained.eval_before - 0.1, (trained.eval_before, trained.eval_after)
    files = sorted(p.name for p in trained.adapter.iterdir())
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"] or {
        "adapter_config.json",
        "adapter_model.safetensors",
    } <= set(files)
    keys = load_file(str(trained.adapter / "adapter_model.safetensors"))
    # PEFT's key names for per-expert modules.
    assert "base_model.model.model.layers.1.mlp.experts.7.down_proj.lora_B.weight" in keys
    assert keys["base_model.model.model.layers.1.mlp.experts.7.gate_proj.lora_A.weight"].shape == (8, 64)


def test_adapter_reproduces_trained_model(trained, model_dir) -> None:
    import hetmoe
    from hetmoe.sft.inference import apply_adapter

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    model = trained.model.eval()
    with torch.no_grad():
        want = model(ids).logits
        inf = apply_adapter(hetmoe.load_model(model_dir, dtype="float32"), trained.adapter)
        got = inf(ids).logits
        base = hetmoe.load_model(model_dir, dtype="float32")(ids).logits
    assert rel(want, base) > 1e-2  # the adapter changes the model: the comparison below means something
    assert rel(got, want) < 1e-5
    # generate works on the adapted inference model
    out = inf.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 12)


def test_peft_loads_the_adapter_onto_transformers(trained, model_dir) -> None:
    """PEFT converts per-expert adapters onto transformers 5's fused experts: same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(ref, str(trained.adapter)).eval()
    with torch.no_grad():
        want = trained.model.eval()(ids).logits
        got = peft_model(ids).logits
    assert rel(got, want) < 1e-5
