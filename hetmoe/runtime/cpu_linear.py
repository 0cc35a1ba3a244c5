"""CPULinear: a plain ``y = x W^T (+ bias)`` with ``W`` in any engine method, run by the CPU engine.

A dense layer is a MoE layer with one expert and k = 1: the same per-method kernels (int16
activations against the stored codes for few tokens; dequantized panels and the fp32 panel GEMM
for many) and the same thread pool, split over the output rows. ``load_model(dense_method=...)``
puts attention projections, dense MLPs, shared experts and the lm_head here.

Everything handed to the C++ side is checked first (dtype, device, the last dimension); a bad call
is a ValueError. The weight is validated by its codec and described by ``engine_projection`` as a
stack of one expert, so every method CPUExperts runs runs here too.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..formats import FormatError, QuantizedTensor, get_codec
from ..formats.gguf import GGML_TYPES
from ..kernels.dispatch import engine_module
from ..kernels.quantize import engine_quantize
from .engine_layout import ENGINE_METHODS, GEMV_ALL_TOKENS, engine_projection, gemv_is_wide
from .tuning import tuned_gemv_max

_ENGINE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_GROUPED = ("int4", "int4-asym", "gptq")


def codec_params(method: str, group_size: int | None) -> dict[str, int]:
    """The codec parameters a method takes from ``group_size`` (only the grouped 4-bit ones do)."""
    return {"group_size": group_size or 32} if method in _GROUPED else {}


def unsupported_reason(method: str, in_features: int, group_size: int | None = None) -> str | None:
    """Why the engine cannot run a ``[*, in_features]`` weight in ``method``; None when it can."""
    if in_features % 32:
        return f"in_features {in_features} is not a multiple of 32"
    if method in _GROUPED and in_features % (group_size or 32):
        return f"in_features {in_features} is not a multiple of the group size {group_size or 32}"
    if method.startswith("gguf:"):
        info = GGML_TYPES.get(method.split(":", 1)[1].upper())
        block = info.block_elements if info is not None else 32
        if in_features % block:
            return f"in_features {in_features} is not a multiple of {method}'s {block}-weight blocks"
    return None


def check_method(method: str, name: str = "method") -> None:
    """A method the engine runs (its codec must exist: ``gguf:q4_0`` yes, ``gguf:nonsense`` no)."""
    if not isinstance(method, str) or (method not in ENGINE_METHODS and not method.startswith("gguf:")):
        raise FormatError(name, f"one of {list(ENGINE_METHODS)}", repr(method))
    get_codec(method)  # an unknown GGUF type is an UnknownMethodError (a ValueError) naming the known ones


def quantize_weight(
    weight: torch.Tensor, method: str, group_size: int | None = None, name: str = "weight"
) -> QuantizedTensor:
    """``weight [N, K]`` (any float dtype) in ``method``'s stored layout."""
    check_method(method)
    codec = get_codec(method, **codec_params(method, group_size))
    weight = weight.detach().cpu()
    fast = engine_quantize(codec, weight, name)  # the codec's bytes, on the engine's threads
    return fast if fast is not None else codec.quantize(weight, name)


def _stacked(q: QuantizedTensor) -> QuantizedTensor:
    """``q [N, K]`` as a stack of one expert ``[1, N, K]`` (views: no copy)."""
    tensors = {suffix: t.unsqueeze(0) for suffix, t in q.tensors.items()}
    return QuantizedTensor(q.method, (1, *q.shape), tensors, q.params, validated=q.validated)


class CPULinear(nn.Module):
    """``nn.Linear``'s forward with the weight in a CPU engine method.

    ``weight``: a ``QuantizedTensor [N, K]`` in a method the engine runs, or a float tensor
    ``[N, K]`` quantized here to ``method`` (default bf16; ``group_size`` for int4/int4-asym/gptq).
    ``bias``: ``[N]`` or None (kept in fp32). ``gemv_max_tokens``: up to this many tokens stream the
    weight with the GEMV kernels; more take the panel GEMM (None: 4, or every count where the 512-bit
    GEMV runs the weight, engine_layout.gemv_is_wide). Inference only: x must not need grad.
    Accepts ``x [..., K]`` in bf16 or fp32 (fp16 is computed in fp32) and returns x's dtype.
    """

    def __init__(
        self,
        weight: torch.Tensor | QuantizedTensor,
        bias: torch.Tensor | None = None,
        method: str | None = None,
        *,
        group_size: int | None = None,
        gemv_max_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(weight, QuantizedTensor):
            if method is not None and weight.method != method:
                raise FormatError("weight", f"weights in method {method!r}", f"method {weight.method!r}")
            q = weight
        elif isinstance(weight, torch.Tensor):
            if weight.dim() != 2:
                raise FormatError("weight", "a 2-D weight [out_features, in_features]", f"shape {list(weight.shape)}")
            q = quantize_weight(weight, method or "bf16", group_size)
        else:
            raise FormatError("weight", "a torch.Tensor [N, K] or a QuantizedTensor", type(weight).__name__)
        if len(q.shape) != 2:
            raise FormatError("weight", "a 2-D weight [out_features, in_features]", f"shape {list(q.shape)}")
        self.out_features, self.in_features = (int(d) for d in q.shape)
        self.method = q.method
        self.weight_q = q
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.out_features,):
                found = list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
                raise FormatError("bias", f"a tensor [{self.out_features}]", f"{found}")
            bias = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
        self.bias_f32 = bias
        if gemv_max_tokens is None:
            tuned = tuned_gemv_max(q.method)  # measured on this machine (runtime/tuning.py)
            gemv_max_tokens = tuned if tuned is not None else GEMV_ALL_TOKENS if gemv_is_wide([q]) else 4
        if gemv_max_tokens < 0:
            raise ValueError(f"gemv_max_tokens: expected >= 0, found {gemv_max_tokens}")
        self.gemv_max_tokens = int(gemv_max_tokens)
        proj = engine_projection(_stacked(q), "weight")
        self.note = proj.note  # a GGUF type without a native kernel is transcoded: what to and at what SNR
        # Everything the engine holds a pointer to must outlive it.
        self._keep = [t for t in (proj.codes, proj.scales, proj.zeros, bias) if t is not None]
        self._engine = engine_module().LinearEngine(
            proj.descriptor(self.out_features, self.in_features),
            bias=bias.data_ptr() if bias is not None else 0,
            gemv_max_tokens=int(gemv_max_tokens),
        )
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Size, torch.dtype]] = {}

    @property
    def isa(self) -> str:
        return self._engine.isa

    @property
    def numa_bounds(self) -> list[int]:
        """Where the output rows are cut per NUMA node of the engine's pool: node j owns rows
        ``[bounds[j], bounds[j + 1])``, their pages moved to it; ``[0, N]`` on one node."""
        return list(self._engine.node_bounds)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (codes and scales) and bias."""
        return self.weight_q.nbytes + (self.bias_f32.numel() * 4 if self.bias_f32 is not None else 0)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` as the codec decodes it (the reference the engine is tested against)."""
        return get_codec(self.method, **self.weight_q.params).dequantize(self.weight_q, dtype)

    def _prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Size, torch.dtype]:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x: expected a torch.Tensor, found {type(x).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"x: expected a CPU tensor, found device {x.device}")
        if not x.is_floating_point() or x.dtype not in (*_ENGINE_DTYPES, torch.float16):
            raise ValueError(f"x: expected dtype bfloat16, float32 or float16, found {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected shape [..., {self.in_features}], found {list(x.shape)}")
        if torch.is_grad_enabled() and x.requires_grad:
            # The engine has no backward: a gradient would silently stop here.
            raise ValueError("x requires grad: CPULinear is inference-only (run under torch.no_grad())")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.dtype not in _ENGINE_DTYPES:
            flat = flat.float()
        return flat.contiguous(), lead, x.dtype

    def submit(self, x: torch.Tensor) -> int:
        """Start ``x @ W^T + b``; returns a handle for ``wait``. ``x`` must not change until then."""
        flat, lead, dtype = self._prepare(x)
        y = torch.empty(flat.shape[0], self.out_features, dtype=flat.dtype)
        code = _ENGINE_DTYPES[flat.dtype]
        handle = self._engine.submit(flat.data_ptr(), code, flat.shape[0], y.data_ptr(), code)
        self._pending[handle] = (flat, y, lead, dtype)
        return handle

    def wait(self, handle: int) -> torch.Tensor:
        if handle not in self._pending:
            raise ValueError(f"handle {handle!r} is not pending on this CPULinear (already waited on, or foreign)")
        self._engine.wait(handle)
        _, y, lead, dtype = self._pending.pop(handle)
        return y.reshape(*lead, self.out_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            isinstance(x, torch.Tensor)
            and x.dtype in _ENGINE_DTYPES
            and x.dim() >= 1
            and x.device.type == "cpu"
            and x.shape[-1] == self.in_features
            and x.is_contiguous()
            and not (x.requires_grad and torch.is_grad_enabled())
        ):
            # The common case, a decode step's one row among them, without a reshape or a cast:
            # each eager torch call costs about a microsecond, and a decode step makes a dozen here.
            return self.rows(x)
        flat, lead, dtype = self._prepare(x)
        return self.rows(flat).reshape(*lead, self.out_features).to(dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` for a contiguous CPU ``x [..., in_features]`` in bf16 or fp32, in x's dtype
        and shape; the caller has checked that (``forward`` checks it)."""
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)
        tokens = x.numel() // self.in_features
        if tokens:
            code = _ENGINE_DTYPES[x.dtype]
            self._engine.forward(x.data_ptr(), code, tokens, y.data_ptr(), code)
        return y

    def extra_repr(self) -> str:
        bits = 8 * self.weight_q.nbytes / max(1, math.prod(self.weight_q.shape))
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias_f32 is not None}, "
            f"method={self.method} ({bits:.2f} bits/weight)"
        )

    def __del__(self) -> None:
        # Never free tensors the engine may still be writing: finish outstanding jobs first.
        for handle in list(getattr(self, "_pending", {})):
            with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to report to
                self._engine.wait(handle)
