"""The fine-tuning loop behind ``hetmoe sft train``.

LoRA (PEFT) on the routed experts' projections -- and, through the same names, on shared experts
and dense MLPs -- of a model whose experts stay in the CPU engine (``load_for_training``). AdamW at
a constant learning rate, gradient norm clipped at 1.0, batches drawn in a per-epoch order fixed
by the seed, loss on assistant tokens only (``data.py``).

Checkpoints (``OUTPUT/checkpoint``: the adapter in PEFT's format, plus ``trainer_state.pt`` with the
optimizer state, the step, torch's RNG state and the run's settings) are written into a temporary
directory and renamed into place. ``resume=True`` restores all of it, so a resumed run takes the
same steps, with the same data and dropout masks, as one that never stopped. The final adapter
goes to ``OUTPUT/adapter`` (``adapter_model.safetensors`` + ``adapter_config.json``).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.atomic import atomic_dir
from .data import Example, collate, load_chat_dataset
from .load import load_for_training
from .peft_wrap import get_peft_model, host_module_names, per_expert_targets, save_adapter, write_adapter
from .placeholders import placeholders

STATE_FILE = "trainer_state.pt"
# Settings that must not change between a run and its resumption (they change what a step does).
RESUME_FIXED = (
    "data",
    "method",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "targets",
    "lr",
    "batch_size",
    "max_length",
    "seed",
    "dtype",
)


@dataclass
class TrainConfig:
    data: Path
    model: Path | None = None
    eval_data: Path | None = None
    method: str | None = None
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    targets: list[str] | None = None  # default: the experts' projection names (gate_proj, up_proj, down_proj)
    epochs: int = 1
    lr: float = 1e-3
    max_steps: int | None = None
    batch_size: int = 4
    max_length: int = 512
    output: Path = Path("sft-output")
    resume: bool = False
    seed: int = 0
    save_every: int = 0  # steps between checkpoints (0: only at the end)
    device: str = "cpu"
    dtype: str = "float32"
    recompute: bool = False
    progress: bool = True

    def fixed(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: str(d[k]) if isinstance(d[k], Path) else d[k] for k in RESUME_FIXED}


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    eval_before: float | None = None
    eval_after: float | None = None
    adapter: Path | None = None
    tokens: int = 0
    seconds: float = 0.0
    model: Any = None  # the trained PEFT model, for callers that keep going in-process


def _check(cfg: TrainConfig) -> None:
    for name in ("lora_rank", "epochs", "batch_size", "max_length"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ValueError(f"max-steps must be >= 1, got {cfg.max_steps}")
    if not cfg.lr > 0:
        raise ValueError(f"lr must be > 0, got {cfg.lr}")
    if not 0 <= cfg.lora_dropout < 1:
        raise ValueError(f"lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")


def mean_loss(model: Any, examples: list[Example], batch_size: int, pad_id: int, device: torch.device) -> float:
    """Mean loss per assistant token over ``examples`` (no dropout, no gradients)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = {k: v.to(device) for k, v in collate(examples[start : start + batch_size], pad_id).items()}
            n = int((batch["labels"][:, 1:] != -100).sum())
            if n:
                total += float(model(**batch).loss) * n
                count += n
    model.train(was_training)
    return total / max(count, 1)


def _order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()


def save_checkpoint(model: Any, optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig, where: Path) -> None:
    """Adapter + optimizer + step + RNG + settings into ``where``, atomically (temp dir, rename)."""
    state = {"step": step, "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(), "fixed": cfg.fixed()}
    with atomic_dir(where) as tmp:
        write_adapter(model, tmp)
        torch.save(state, tmp / STATE_FILE)


def read_checkpoint_state(cfg: TrainConfig, where: Path) -> dict[str, Any]:
    """The checkpoint's trainer state, its settings checked against ``cfg`` (before any loading)."""
    if not (where / STATE_FILE).is_file():
        raise ValueError(f"--resume: no checkpoint at {where} (expected {STATE_FILE} from an earlier run)")
    state = torch.load(where / STATE_FILE, weights_only=False)
    for key, value in cfg.fixed().items():
        if state["fixed"].get(key) != value:
            raise ValueError(
                f"--resume: {key} was {state['fixed'].get(key)!r} in the checkpoint, now {value!r}; resume with the "
                "same settings (or start a new --output)"
            )
    return state


def load_checkpoint(model: Any, optimizer: torch.optim.Optimizer, cfg: TrainConfig, where: Path) -> int:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = read_checkpoint_state(cfg, where)
    with per_expert_targets():
        result = set_peft_model_state_dict(model, load_file(str(where / "adapter_model.safetensors")))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"--resume: the checkpoint's adapter has keys this model lacks: {unexpected[:3]}")
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def train(cfg: TrainConfig) -> TrainResult:
    """Fine-tune as configured (module docstring); returns losses, eval losses and the adapter path."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    _check(cfg)
    if cfg.resume:
        read_checkpoint_state(cfg, Path(cfg.output) / "checkpoint")  # fail before the slow part
    if cfg.model is None:
        from ..models.default import default_model_path

        model_dir = default_model_path()
    else:
        model_dir = Path(cfg.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a model directory (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{model_dir}: no usable tokenizer ({exc})") from None
    train_set = load_chat_dataset(cfg.data, tokenizer, cfg.max_length)
    eval_set = load_chat_dataset(cfg.eval_data, tokenizer, cfg.max_length) if cfg.eval_data else None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(f"{model_dir}: the tokenizer has neither a pad nor an eos token to pad batches with")

    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    model = load_for_training(model_dir, cfg.method, device=device, dtype=cfg.dtype, recompute=cfg.recompute)
    targets = cfg.targets or list(host_module_names(model))
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets)
    model = get_peft_model(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

    per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * per_epoch
    out = Path(cfg.output)
    ckpt = out / "checkpoint"
    step = load_checkpoint(model, optimizer, cfg, ckpt) if cfg.resume else 0
    result = TrainResult(steps=step)
    if eval_set:
        result.eval_before = mean_loss(model, eval_set, cfg.batch_size, pad_id, device)

    from tqdm import tqdm

    bar = tqdm(total=total, initial=step, desc="sft", unit="step", file=sys.stderr, disable=not cfg.progress)
    model.train()
    started = time.perf_counter()
    while step < total:
        epoch, index = divmod(step, per_epoch)
        order = _order(len(train_set), cfg.seed, epoch)
        chosen = [train_set[i] for i in order[index * cfg.batch_size : (index + 1) * cfg.batch_size]]
        batch = {k: v.to(device) for k, v in collate(chosen, pad_id).items()}
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens = int(batch["attention_mask"].sum())
        result.tokens += tokens
        result.losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{result.losses[-1]:.4f}", tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            save_checkpoint(model, optimizer, step, cfg, ckpt)
    bar.close()
    result.seconds = time.perf_counter() - started
    placeholders(model)  # nothing re-materialised the experts during training
    save_checkpoint(model, optimizer, step, cfg, ckpt)
    result.adapter = save_adapter(model, out / "adapter")
    if eval_set:
        result.eval_after = mean_loss(model, eval_set, cfg.batch_size, pad_id, device)
    result.steps = step
    result.model = model
    return result
