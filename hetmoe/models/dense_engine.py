"""Dense layers in the CPU engine: ``load_model(dense_method=...)``.

Every ``nn.Linear`` of the model outside the routed experts (attention projections, dense MLP
layers, shared experts, the lm_head) becomes a ``CPULinear`` holding its weight in an engine method
(int8, int4 g32, bf16, a GGUF block type ...). Not converted: the routers (and Qwen's shared-expert
gate), which are the Linear children of a MoE block and whose scores choose the experts; norms and
embeddings, which are not Linear; the linears an attention family reads as weights rather than
calls (MLA's kv_b_proj); and a layer the engine cannot run in that method (e.g. an input width that
is not a multiple of 32), which stays a torch Linear and is named in the load notes.

``STORED`` (the default of a CPU load) keeps each weight in the precision the file holds it in,
where the engine runs that precision: a GGUF's own block types (Q4_K, Q6_K, Q8_0 ...: the stored
bytes, never dequantized), fp8 with its scales, and bf16 in a bf16 model. A weight stored otherwise
(fp32, fp16, a GGUF type without a kernel) or loaded into a model of another dtype stays in torch,
so the arithmetic the user chose (``dtype=float32``) is the arithmetic that runs.

Every weight the engine runs is a copy on 2 MiB pages (``QuantizedTensor.on_huge_pages``). A stored
weight is a view of the model file's mapping, which the page cache maps 2 MiB at a time only where
it happens to hold 2 MiB folios: 47% of a 1.6 GB GGUF llama-quantize had just written (kernel 6.18,
ext4); a weight quantized or rounded at load is plain torch memory. On 4 KiB pages a dense GEMV
streams far slower: on the AMX Xeon (2 threads, bench/bench_dense_gemv.py, 102400 x 2048) Q4_K 16.7
against 25.5 GB/s, Q6_K 17.3 against 26.7. The dense weights are a few percent of a MoE model's
bytes but ~40% of what its decode step reads (Qwen3-30B-A3B); a 4-layer Qwen3-MoE Q4_K_M file
decoded 84.7-87.7 -> 86.1-92.3 tokens/s (alternating; bf16 directory unchanged). The loader then
releases the file's pages of the weight (``source.release``), so they are not held twice. The
experts stay views of the file: a copy of them would double a load's time.

Conversion happens while the non-expert weights are read: each weight is quantized as soon as it
is read and its full-precision value dropped, so only one layer's weight ever exists in full
precision (a tied lm_head is quantized from the embedding once loading is done).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..formats import QuantizedTensor, get_codec
from ..runtime.cpu_experts import ENGINE_METHODS
from ..runtime.cpu_linear import CPULinear, check_method, quantize_weight, unsupported_reason
from ..runtime.engine_activations import install_engine_activations
from ..runtime.fused_linears import fuse_siblings
from ..runtime.gguf_transcode import native_id

STORED = "stored"  # dense_method: each weight in its stored precision where the engine runs it
TORCH = "torch"  # dense_method: every dense Linear stays a torch Linear


def resolve_dense_method(dense_method: str | None, device: torch.device) -> str | None:
    """What ``load_model(dense_method=...)`` converts the dense Linears to: None keeps torch Linears."""
    if dense_method is None:
        return STORED if device.type == "cpu" else None
    if dense_method == TORCH:
        return None
    if device.type != "cpu":
        raise ValueError(f"dense_method runs the non-expert layers in the CPU engine: needs device='cpu', not {device}")
    if dense_method != STORED:
        check_method(dense_method, "dense_method")
    return dense_method


class DenseConverter:
    """Chooses the model's dense Linears, quantizes their weights as they are read, swaps them in."""

    def __init__(
        self,
        model: nn.Module,
        method: str,
        group_size: int | None,
        moe_blocks: list[nn.Module],
        keep_fp32: list[re.Pattern[str]],
        gemv_max_tokens: int | None = None,
        fuse: bool = True,
        keep_torch: tuple[str, ...] = (),
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if method != STORED:
            check_method(method, "dense_method")
        self.method, self.group_size, self.gemv_max_tokens = method, group_size, gemv_max_tokens
        self.dtype = dtype  # the model's: STORED runs bf16 weights in the engine only in a bf16 model
        self.fuse = fuse  # sibling projections (q/k/v, gate/up) as one engine call: fused_linears.py
        routers = {id(child) for block in moe_blocks for child in block.children() if isinstance(child, nn.Linear)}
        self.targets: dict[str, nn.Linear] = {}
        self.skipped: dict[str, str] = {}
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear) or id(mod) in routers or any(p.search(name) for p in keep_fp32):
                continue
            if name.rpartition(".")[2] in keep_torch:
                continue
            reason = unsupported_reason(method if method != STORED else "bf16", mod.in_features, group_size)
            if reason is None:
                self.targets[name] = mod
            else:
                self.skipped[name] = reason
        self._by_owner = {id(mod): name for name, mod in self.targets.items()}
        self._quantized: dict[str, QuantizedTensor] = {}
        self.stored_as: dict[str, int] = {}  # STORED: how many weights run in each stored method

    def wants(self, owner: nn.Module, local: str) -> bool:
        """Whether the tensor about to be read is a target's weight (``take`` will be offered it)."""
        return local == "weight" and id(owner) in self._by_owner

    def take(
        self, owner: nn.Module, local: str, value: torch.Tensor | None, stored: QuantizedTensor | None = None
    ) -> bool:
        """Called for each tensor read: a target's weight is quantized and kept here (True), so it
        is never placed in the model in full precision; anything else is left to the caller (False).
        What is kept is a copy on huge pages (module docstring): on True the caller may release the
        file's pages it was read from.
        ``stored``: the weight as the file holds it, where that is an engine method (a GGUF block
        type, fp8 with its scales); ``value`` may then be None (it was not decoded)."""
        name = self._by_owner.get(id(owner))
        if name is None or local != "weight":
            return False
        if self.method == STORED:
            q = self._stored(value, stored, f"{name}.weight")
            if q is None:
                return False
            self.stored_as[q.method] = self.stored_as.get(q.method, 0) + 1
            self._quantized[name] = q.on_huge_pages()
            return True
        if value is None:
            assert stored is not None
            value = get_codec(stored.method, **stored.params).dequantize(stored, torch.float32)
        self._quantized[name] = quantize_weight(value, self.method, self.group_size, f"{name}.weight").on_huge_pages()
        return True

    def _stored(self, value: torch.Tensor | None, stored: QuantizedTensor | None, name: str) -> QuantizedTensor | None:
        if stored is not None:
            native = stored.method in ENGINE_METHODS or native_id(str(stored.params.get("ggml_type", ""))) is not None
            return stored if native else None
        if value is not None and value.dtype == torch.bfloat16 and self.dtype == torch.bfloat16:
            return quantize_weight(value, "bf16", None, name)  # bf16 -> bf16: the same values
        return None

    def finish(self, model: nn.Module) -> list[str]:
        """Swap every target for its CPULinear; returns notes for the load summary."""
        for name, mod in self.targets.items():
            q = self._quantized.pop(name, None)
            if q is None and self.method == STORED:  # tied, or stored in a precision the engine does not run
                if mod.weight.is_meta or mod.weight.dtype != torch.bfloat16 or self.dtype != torch.bfloat16:
                    continue  # left in torch
                # a bf16 model holds it in bf16 now (tied, or rounded there when read): the same values
                q = quantize_weight(mod.weight, "bf16", None, f"{name}.weight").on_huge_pages()
                self.stored_as["bf16"] = self.stored_as.get("bf16", 0) + 1
            if q is None:  # a tied weight (lm_head = embeddings): loaded by tie_weights, quantized now
                if mod.weight.is_meta:
                    raise ValueError(f"{name}.weight: neither read from the checkpoint nor tied to a loaded tensor")
                q = quantize_weight(mod.weight, self.method, self.group_size, f"{name}.weight").on_huge_pages()
            linear = CPULinear(q, mod.bias, gemv_max_tokens=self.gemv_max_tokens)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
        notes = []
        if self.stored_as:
            kinds = ", ".join(f"{n} in {m}" for m, n in sorted(self.stored_as.items()))
            notes.append(f"dense layers in the CPU engine as stored: {kinds}")
        if self.fuse:
            fused = fuse_siblings(model)
            if fused:
                notes.append(f"dense layers: {fused} sets of sibling projections (q/k/v, gate/up) run as one call each")
        install_engine_activations(model)  # after the fusing: the MLPs' gate/up are then fused slices
        if self.skipped:
            first = next(iter(self.skipped.items()))
            notes.append(
                f"dense layers: {len(self.skipped)} Linear layers stay in torch ({self.method} cannot run them), "
                f"e.g. {first[0]}: {first[1]}"
            )
        transcoded = {m.note for m in model.modules() if isinstance(m, CPULinear) and m.note}
        notes += [f"dense layers: {note}" for note in sorted(transcoded)]
        return notes


def dense_linears(model: nn.Module) -> list[CPULinear]:
    return [m for m in model.modules() if isinstance(m, CPULinear)]
