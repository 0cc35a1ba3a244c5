"""The fine-tuning loop behind ``hetmoe sft train``.

LoRA (PEFT) on the routed experts' projections -- and, through the same names, on shared experts
and dense MLPs -- of a model whose experts stay in the CPU engine (``load_for_training``). AdamW at
a constant learning rate, gradient norm clipped at 1.0, batches drawn in a per-epoch order fixed
by the seed, loss on assistant tokens only (``data.py``): the sum of the batch's token losses over
its number of predicted tokens.

Under torchrun or accelerate launch (``runtime/process_group.py``, ``distributed.py``) every rank
loads the model, takes its slice of each global batch of ``batch_size`` conversations and adds its
gradients to the others': the steps are those of one process on the whole batch. Dropout masks
come from a generator seeded by (seed, step, rank) each step, so a resumed run draws the masks an
unbroken one would (and with dropout, runs at different world sizes draw different masks).

Checkpoints (``OUTPUT/checkpoint``: the adapter in PEFT's format, plus ``trainer_state.pt`` with the
optimizer state, the loss of every step so far and the run's settings) are written by rank 0 into
a temporary directory and renamed into place. ``resume=True`` restores them (rank 0 reads and sends
them to the others, so hosts need not share a filesystem), at the same or another world size, and a
resumed run takes the steps one that never stopped would. The final adapter goes to
``OUTPUT/adapter`` (``adapter_model.safetensors`` + ``adapter_config.json``).
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
from ..runtime.process_group import (
    RankLostError,
    Ranks,
    barrier,
    broadcast_object,
    join,
    leave,
    ranks_from_env,
    share_cpus,
)
from .data import Example, collate, load_chat_dataset
from .distributed import broadcast_parameters, sum_gradients, sum_values
from .load import load_for_training
from .peft_wrap import get_peft_model, host_module_names, per_expert_targets, save_adapter, write_adapter
from .placeholders import placeholders

STATE_FILE = "trainer_state.pt"
ALONE = Ranks()  # one process, no launcher
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


def mean_loss(
    model: Any, examples: list[Example], batch_size: int, pad_id: int, device: torch.device, ranks: Ranks = ALONE
) -> float:
    """Mean loss per predicted assistant token over ``examples`` (no dropout, no gradients); under
    several ranks each scores its share and the sums are added."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    mine = ranks.take(examples)
    with torch.no_grad():
        for start in range(0, len(mine), batch_size):
            chunk = mine[start : start + batch_size]
            n = sum(e.predicted_tokens for e in chunk)
            if n:
                batch = {k: v.to(device) for k, v in collate(chunk, pad_id).items()}
                total += float(model(**batch, num_items_in_batch=1).loss)  # the chunk's sum of token losses
                count += n
    if ranks.distributed:
        total, count = sum_values(ranks, [total, count])
    model.train(was_training)
    return total / max(count, 1)


def _order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()


def _step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one rank's dropout masks at ``step`` (independent of how the run got there)."""
    return (seed * 1_000_003 + step) * 4099 + rank


def save_checkpoint(
    model: Any, optimizer: torch.optim.Optimizer, losses: list[float], cfg: TrainConfig, where: Path
) -> None:
    """Adapter + optimizer + step + the loss of every step so far + settings into ``where``,
    atomically (temp dir, rename)."""
    state = {"step": len(losses), "losses": list(losses), "optimizer": optimizer.state_dict(), "fixed": cfg.fixed()}
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


def load_checkpoint(
    model: Any, optimizer: torch.optim.Optimizer, cfg: TrainConfig, where: Path, ranks: Ranks = ALONE
) -> list[float]:
    """Restores the adapter and optimizer of ``where``; returns its steps' losses (as many as the
    steps it has taken). Rank 0 reads the files."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    payload: Any = None
    if ranks.main:
        payload = (read_checkpoint_state(cfg, where), load_file(str(where / "adapter_model.safetensors")))
    if ranks.distributed:
        payload = broadcast_object(ranks, payload)
    state, adapter = payload
    with per_expert_targets():
        result = set_peft_model_state_dict(model, adapter)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"--resume: the checkpoint's adapter has keys this model lacks: {unexpected[:3]}")
    optimizer.load_state_dict(state["optimizer"])
    # Checkpoints written before the losses were kept (stop 36 and earlier) give their step count.
    return [float(x) for x in state.get("losses", [float("nan")] * int(state["step"]))]


def train(cfg: TrainConfig) -> TrainResult:
    """Fine-tune as configured (module docstring); returns losses, eval losses and the adapter path.

    Under a launcher (torchrun, accelerate launch) this is one rank's part: every rank returns the
    same losses and model; only rank 0 writes files.
    """
    ranks = ranks_from_env()
    _check(cfg)
    if cfg.batch_size < ranks.world:
        raise ValueError(
            f"batch-size {cfg.batch_size} is the global batch (conversations a step over all ranks); with "
            f"{ranks.world} processes it must be at least {ranks.world}"
        )
    device = torch.device(cfg.device)
    if ranks.main and cfg.resume:
        read_checkpoint_state(cfg, Path(cfg.output) / "checkpoint")  # fail before the slow part
    if device.type == "cpu":
        share_cpus(ranks)  # before the group: its socket threads then start on this rank's CPUs too
    join(ranks, device)
    try:
        return _train(cfg, ranks, device)
    except RankLostError as exc:
        where = Path(cfg.output) / "checkpoint"
        raise RankLostError(f"{exc}; the job stops. Start it again with --resume (from {where})") from exc
    finally:
        leave(ranks)


def _train(cfg: TrainConfig, ranks: Ranks, device: torch.device) -> TrainResult:
    from peft import LoraConfig
    from transformers import AutoTokenizer

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

    torch.manual_seed(cfg.seed)  # the same LoRA initialisation on every rank
    model = load_for_training(model_dir, cfg.method, device=device, dtype=cfg.dtype, recompute=cfg.recompute)
    targets = cfg.targets or list(host_module_names(model))
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets)
    model = get_peft_model(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    if ranks.distributed:
        broadcast_parameters(ranks, params)  # rank 0's, whatever another rank's RNG did
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

    per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * per_epoch
    out = Path(cfg.output)
    ckpt = out / "checkpoint"
    history = load_checkpoint(model, optimizer, cfg, ckpt, ranks) if cfg.resume else []
    step = len(history)
    result = TrainResult(steps=step)
    if eval_set:
        result.eval_before = mean_loss(model, eval_set, cfg.batch_size, pad_id, device, ranks)

    from tqdm import tqdm

    show = cfg.progress and ranks.main
    bar = tqdm(total=total, initial=step, desc="sft", unit="step", file=sys.stderr, disable=not show)
    model.train()
    started = time.perf_counter()
    while step < total:
        epoch, index = divmod(step, per_epoch)
        order = _order(len(train_set), cfg.seed, epoch)
        chosen = [train_set[i] for i in order[index * cfg.batch_size : (index + 1) * cfg.batch_size]]
        predicted = sum(e.predicted_tokens for e in chosen)  # over the global batch: the loss's divisor
        mine = ranks.take(chosen)
        t0 = time.perf_counter()
        torch.manual_seed(_step_seed(cfg.seed, step, ranks.rank))
        loss_value, tokens = 0.0, 0
        if mine:
            batch = {k: v.to(device) for k, v in collate(mine, pad_id).items()}
            loss = model(**batch, num_items_in_batch=max(predicted, 1)).loss
            loss.backward()
            loss_value, tokens = float(loss.detach()), int(batch["attention_mask"].sum())
        if ranks.distributed:
            sum_gradients(ranks, params)
            loss_value, tokens = sum_values(ranks, [loss_value, tokens])
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        result.tokens += int(tokens)
        result.losses.append(loss_value)
        history.append(loss_value)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            _save(model, optimizer, history, cfg, ckpt, ranks)
    bar.close()
    result.seconds = time.perf_counter() - started
    placeholders(model)  # nothing re-materialised the experts during training
    _save(model, optimizer, history, cfg, ckpt, ranks)
    result.adapter = out / "adapter"
    if ranks.main:
        save_adapter(model, result.adapter)
    barrier(ranks)
    if eval_set:
        result.eval_after = mean_loss(model, eval_set, cfg.batch_size, pad_id, device, ranks)
    result.steps = step
    result.model = model
    return result


def _save(
    model: Any, optimizer: torch.optim.Optimizer, losses: list[float], cfg: TrainConfig, where: Path, ranks: Ranks
) -> None:
    """Rank 0 writes the checkpoint (every rank holds the same adapter and optimizer state); the
    others wait, so that no rank runs ahead of a checkpoint that may be the one a resume reads."""
    if ranks.main:
        save_checkpoint(model, optimizer, losses, cfg, where)
    barrier(ranks)
