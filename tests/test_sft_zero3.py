"""DeepSpeed ZeRO-3 for real: two processes under torchrun (gloo on loopback, DeepSpeed's CPU
accelerator), the default model built partitioned, its experts gathered into the CPU engine by
``prepare_model``, LoRA trained by the transformers Trainer through DeepSpeed's engine
(tests/zero3_worker.py is one rank).

- the experts extracted from the partitioned model are bit for bit those extracted from the same
  model unpartitioned (the gather is real: a ZeRO-3 parameter's local data is an empty slice);
- training lowers the loss and changes the routed experts' LoRA;
- the adapter the Trainer saved (ZeRO-3 gathers the partitioned LoRA to save it), put on a
  ``hetmoe.load_model`` model, gives the trained model's logits within 1e-5 relative: the same
  float32 arithmetic but for the engine's inference path against the training path (the bound
  test_sft_train.py holds the one-process adapter to).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_env
from safetensors.torch import load_file

pytest.importorskip("deepspeed")  # a dev dependency; without it this file has nothing to run

WORKER = Path(__file__).resolve().parent / "zero3_worker.py"
TIMEOUT = 600  # seconds: the first run builds DeepSpeed's shared-memory op (JIT, g++)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero3")
    env = child_env()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    done = subprocess.run([*command, str(out)], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_experts_gathered_from_the_partitioned_model(run) -> None:
    from transformers import AutoModelForCausalLM
    from zero3_worker import extracted_experts

    from hetmoe.models.default import default_model_path
    from hetmoe.sft import prepare_model

    got = torch.load(run / "experts.pt")
    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    want = extracted_experts(prepare_model(model, "bf16"))
    assert got.keys() == want.keys() and len(want) == 4 * 8 * 3  # 4 layers, 8 experts, 3 projections
    for key, w in want.items():
        assert torch.equal(got[key], w), key


def test_zero3_training_saves_an_adapter_that_reproduces_it(run) -> None:
    from zero3_worker import IDS

    import hetmoe
    from hetmoe.models.default import default_model_path
    from hetmoe.sft.inference import apply_adapter

    losses = json.loads((run / "losses.json").read_text())
    assert len(losses) == 6 and min(losses[3:]) < losses[0] - 0.3, losses
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    expert_b = [v for k, v in adapter.items() if ".mlp.experts." in k and "lora_B" in k]
    assert len(expert_b) == 4 * 8 * 3 and sum(bool(v.abs().max() > 0) for v in expert_b) > len(expert_b) // 2
    assert all(v.numel() > 0 for v in adapter.values())  # gathered, not a rank's empty slice

    after = torch.load(run / "after.pt")
    model = apply_adapter(hetmoe.load_model(default_model_path(), dtype="float32"), run / "adapter")
    with torch.no_grad():
        got = model(IDS).logits
        base = hetmoe.load_model(default_model_path(), dtype="float32")(IDS).logits
    assert float((after - base).norm() / after.norm()) > 1e-2  # the adapter matters
    assert float((got - after).norm() / after.norm()) < 1e-5
