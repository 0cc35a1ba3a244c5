"""One rank of a real DeepSpeed ZeRO-3 fine-tuning run, started by tests/test_sft_zero3.py under
torchrun: the default model is built partitioned (``deepspeed.zero.Init`` through the Trainer's
DeepSpeed config), ``prepare_model`` gathers each expert module to extract the experts into the
CPU engine, and the transformers Trainer trains LoRA on them through DeepSpeed's engine.

Rank 0 writes into OUT: ``experts.pt`` (every layer's extracted experts, as the engine holds
them), ``after.pt`` (logits of fixed ids after training; every rank computes them, ZeRO-3's
forward needs all), ``losses.json`` and the adapter (``adapter/``, through ``Trainer.save_model``,
which gathers the partitioned LoRA).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from hetmoe.models.default import default_model_path
from hetmoe.sft import prepare_model
from hetmoe.sft.data import collate, load_chat_dataset
from hetmoe.sft.peft_wrap import get_peft_model
from hetmoe.sft.zero3 import is_partitioned

DATA = Path(__file__).resolve().parent.parent / "data" / "sft" / "tiny_chat.jsonl"
STEPS = 6
IDS = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))


def extracted_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every SFTMoE's frozen experts, expert by expert, as the engine holds them."""
    from hetmoe.sft import SFTMoE

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, SFTMoE):
            for e in range(m.base.num_experts):
                for proj, w in zip(("gate", "up", "down"), m.base.expert(e), strict=True):
                    out[f"{name}.{e}.{proj}"] = w.clone()
    return out


def main(out: Path) -> None:
    path = default_model_path()
    ds = {
        # Every parameter partitioned, however small (the default keeps those under 1e5 elements whole).
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
    }
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
        remove_unused_columns=False,
        deepspeed=ds,  # before from_pretrained: the model is then built under deepspeed.zero.Init
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert experts and all(is_partitioned(p) and p.numel() < p.ds_numel for p in experts), "not partitioned"
    prepare_model(model, "bf16")
    rank = torch.distributed.get_rank()
    if rank == 0:
        torch.save(extracted_experts(model), out / "experts.pt")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]))
    tok = AutoTokenizer.from_pretrained(path)
    examples = load_chat_dataset(DATA, tok, 64)[:64]
    pad = tok.pad_token_id
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=lambda b: collate(b, pad))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(str(out / "adapter"))
    engine_model = trainer.model_wrapped
    engine_model.eval()
    with torch.no_grad():
        after = engine_model(input_ids=IDS).logits
    if rank == 0:
        torch.save(after, out / "after.pt")
        (out / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
