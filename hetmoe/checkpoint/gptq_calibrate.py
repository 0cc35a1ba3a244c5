"""Calibration for GPTQ: run text through the model one decoder block at a time, collecting Hessians.

Memory stays bounded by one block: the model is built on the meta device, only the parts before
the blocks (embedding, rotary tables) and the final norm are materialised, and each block is
loaded from the memory-mapped checkpoint when its turn comes, then released. The inputs of the
current block (one hidden-state tensor per calibration sequence) are all that is kept between
blocks.

Inside a block the linears are quantized in the order the block runs them, stage by stage
("true sequential"): projections fed by the same tensor (q/k/v, gate/up) form one stage, and a
later stage's Hessian is collected with the earlier stages already quantized, so each layer
compensates for the error actually upstream of it. The block's outputs, computed with all of
its layers quantized, are the next block's inputs, as in the GPTQ paper.

The keyword arguments each block receives (rotary cos/sin, attention masks, which differ per
block in models mixing sliding and full attention) are captured by running the model forward
once per sequence with every block replaced by a recorder, so no architecture-specific code is
needed. Everything runs in float32 on the CPU; transformers is imported only here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .gptq_linears import build_meta_model, decoder_layers
from .source import TensorSource

DEFAULT_SAMPLES = 128
DEFAULT_SEQLEN = 512
# Sequences of one length run through a block together, up to this many tokens per forward: one
# call per batch instead of per sequence, with activations of a few hundred MB at most.
BATCH_TOKENS = 4096
_FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_norm")

QuantizeFn = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


class _Stop(Exception):
    """Raised by the recorder of the last block: the model forward has nothing more to give."""


def calibration_samples(src_dir: Path, text_file: Path, samples: int, seqlen: int) -> list[torch.Tensor]:
    """Token windows ``[1, seqlen]`` (at most ``samples``) of ``text_file``, tokenized by ``src_dir``'s tokenizer."""
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(text_file, f"cannot read the calibration text: {exc}") from None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(src_dir), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(src_dir, f"--calibrate needs the model's tokenizer; it failed to load: {exc}") from None
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if ids.numel() < 2:
        raise CheckpointError(text_file, f"the calibration text gives {ids.numel()} tokens; at least 2 are needed")
    windows = [ids[i : i + seqlen] for i in range(0, ids.numel() - seqlen + 1, seqlen)] or [ids]
    return [w.unsqueeze(0) for w in windows[:samples]]


class LayerwiseCalibrator:
    """Runs calibration sequences block by block and hands each linear's Hessian to a quantizer."""

    def __init__(
        self, src_dir: Path, source: TensorSource, samples: list[torch.Tensor], batch_tokens: int = BATCH_TOKENS
    ) -> None:
        self.source = source
        self.samples = samples
        self.batches: list[torch.Tensor] = []
        for s in samples:
            last = self.batches[-1] if self.batches else None
            if last is not None and last.shape[1] == s.shape[1] and (last.shape[0] + 1) * s.shape[1] <= batch_tokens:
                self.batches[-1] = torch.cat([last, s])
            else:
                self.batches.append(s)
        try:
            self.model = build_meta_model(src_dir)
        except Exception as exc:
            raise CheckpointError(src_dir, f"--calibrate needs transformers to build this model: {exc}") from None
        self.decoder, self.layers_prefix, self.layers = decoder_layers(self.model)
        if self.layers is None:
            raise CheckpointError(src_dir, "--calibrate: cannot find the decoder's block list in this model")
        names = {id(m): n for n, m in self.model.named_modules()}
        self.decoder_prefix = names[id(self.decoder)]
        self.tokens = sum(s.numel() for s in samples)
        self._inputs: list[torch.Tensor] = []
        self._block_args: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = []
        self._next_block = 0

    # -- loading --------------------------------------------------------------------------------

    def _load(self, module: torch.nn.Module, prefix: str) -> None:
        """Materialise ``module`` on the CPU in float32 from the checkpoint (buffers it lacks are computed)."""
        module.to_empty(device="cpu")
        for sub in module.modules():
            self.model._init_weights(sub)  # recomputes non-persistent buffers such as rotary tables
        keys = set(self.source.keys())
        with torch.no_grad():
            for name, param in module.named_parameters():
                key = f"{prefix}.{name}" if prefix else name
                if key not in keys:
                    raise CheckpointError(self.source.path, f"--calibrate: the checkpoint has no tensor {key}")
                param.copy_(self.source.get(key).float())
            for name, buf in module.named_buffers():
                key = f"{prefix}.{name}" if prefix else name
                if key in keys:
                    buf.copy_(self.source.get(key).to(buf.dtype))

    def prepare(self) -> None:
        """Load the parts before the blocks and capture every block's call arguments for every batch."""
        for name, child in self.decoder.named_children():
            if child is not self.layers:
                self._load(child, f"{self.decoder_prefix}.{name}" if self.decoder_prefix else name)
        records: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = [[] for _ in self.layers]
        last = len(self.layers) - 1

        def recorder(index: int) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                hidden = args[0] if args else kwargs.pop("hidden_states")
                records[index].append((args[1:], kwargs))
                if index == 0:
                    self._inputs.append(hidden.detach().float())
                if index == last:
                    raise _Stop
                return hidden

            return forward

        for i, block in enumerate(self.layers):
            block.forward = recorder(i)
        try:
            with torch.no_grad():
                for ids in self.batches:
                    with contextlib.suppress(_Stop):
                        self.model(input_ids=ids, use_cache=False)
        finally:
            for block in self.layers:
                del block.forward
        self._block_args = records

    # -- blocks ---------------------------------------------------------------------------------

    def _run(self, block: torch.nn.Module, index: int, batch: int) -> torch.Tensor:
        args, kwargs = self._block_args[index][batch]
        out = block(self._inputs[batch], *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def _stages(self, block: torch.nn.Module, index: int, targets: dict[str, torch.nn.Linear]) -> list[list[str]]:
        """Target linears grouped by the input they share, in the order the block runs them."""
        # The input tensors themselves are kept (not their ids) so no two can share an address.
        calls: list[tuple[str, torch.Tensor]] = []
        hooks = [
            lin.register_forward_hook(lambda _m, inp, _out, name=name: calls.append((name, inp[0])))
            for name, lin in targets.items()
        ]
        try:
            with torch.no_grad():
                self._run(block, index, 0)
        finally:
            for h in hooks:
                h.remove()
        stages: list[list[str]] = []
        seen: set[str] = set()
        last_input = None
        for name, inp in calls:
            if name in seen:
                continue
            seen.add(name)
            if stages and inp is last_input:
                stages[-1].append(name)
            else:
                stages.append([name])
            last_input = inp
        stages += [[n] for n in targets if n not in seen]  # never called on these inputs: zero Hessian
        return stages

    def _hessians(
        self, block: torch.nn.Module, index: int, modules: dict[str, torch.nn.Linear]
    ) -> dict[str, torch.Tensor]:
        """``2 X^T X / n`` of each module's inputs over all calibration tokens."""
        sums = {n: torch.zeros(m.in_features, m.in_features) for n, m in modules.items()}
        counts = dict.fromkeys(modules, 0)

        def hook(name: str) -> Callable[..., None]:
            def accumulate(_m: torch.nn.Module, inp: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
                x = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
                sums[name].addmm_(x.t(), x)
                counts[name] += x.shape[0]

            return accumulate

        hooks = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
        try:
            with torch.no_grad():
                for s in range(len(self._inputs)):
                    self._run(block, index, s)
        finally:
            for h in hooks:
                h.remove()
        return {n: sums[n] * (2.0 / max(counts[n], 1)) for n in modules}

    def run_block(self, index: int, targets: set[str], quantize: QuantizeFn) -> None:
        """Quantize ``targets`` (module names) of block ``index`` with ``quantize(name, W, H) -> W_hat``."""
        if index != self._next_block:
            raise RuntimeError(f"blocks must be calibrated in order: expected {self._next_block}, got {index}")
        if not self._block_args:
            self.prepare()
        block = self.layers[index]
        prefix = f"{self.layers_prefix}.{index}"
        self._load(block, prefix)
        linears = {f"{prefix}.{n}": m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
        wanted = {n: linears[n] for n in targets if n in linears}
        unknown = sorted(targets - set(linears))
        if unknown:
            raise CheckpointError(self.source.path, f"--calibrate: block {index} has no linear module {unknown[0]}")
        for stage in self._stages(block, index, wanted):
            hessians = self._hessians(block, index, {n: wanted[n] for n in stage})
            with torch.no_grad():
                for name in stage:
                    lin = wanted[name]
                    lin.weight.copy_(quantize(name, lin.weight.detach().clone(), hessians.pop(name)))
        with torch.no_grad():
            self._inputs = [self._run(block, index, s).detach() for s in range(len(self._inputs))]
        block.to_empty(device="meta")  # release the block's memory
        self._next_block += 1

    def head_hessian(self) -> torch.Tensor | None:
        """Hessian of the output head's input (final norm of the last block's outputs); None without a norm."""
        if self._next_block != len(self.layers):
            raise RuntimeError("head_hessian() comes after every block was calibrated")
        norm = next((getattr(self.decoder, n) for n in _FINAL_NORMS if hasattr(self.decoder, n)), None)
        if not isinstance(norm, torch.nn.Module):
            return None
        total, count = None, 0
        with torch.no_grad():
            for hidden in self._inputs:
                x = norm(hidden).reshape(-1, hidden.shape[-1]).float()
                total = x.t() @ x if total is None else total.addmm_(x.t(), x)
                count += x.shape[0]
        return None if total is None else total * (2.0 / max(count, 1))
