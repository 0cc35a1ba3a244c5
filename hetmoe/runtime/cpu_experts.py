"""CPUExperts: one MoE layer's routed experts, held in a codec's layout and run by the CPU engine.

``submit(x, topk_ids, topk_weights) -> handle`` starts the layer on the engine's worker threads and
returns at once (the GIL is released), so the caller can run the device's share meanwhile;
``wait(handle) -> y`` collects the result; ``forward`` does both. Everything the C++ side is given
is checked here first: dtypes, shapes, contiguity, id ranges. A bad call is a ValueError, never a
crash.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from ..formats import FormatError, QuantizedTensor, get_codec
from ..kernels.dispatch import engine_module
from ..kernels.quantize import engine_quantize
from .engine_layout import ENGINE_METHODS, GEMV_ALL_TOKENS, engine_projection, gemv_is_wide
from .tuning import tuned_gemv_max

_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ACTIVATIONS = {"silu": 0, "swiglu-oai": 1}


@dataclass
class _Pending:
    tensors: tuple[torch.Tensor, ...]  # kept alive while the engine reads or writes them
    y: torch.Tensor


def _as_quantized(w: torch.Tensor | QuantizedTensor, method: str, group_size: int, name: str) -> QuantizedTensor:
    if isinstance(w, QuantizedTensor):
        return w
    if not isinstance(w, torch.Tensor):
        raise FormatError(name, "a torch.Tensor [E, N, K] or a QuantizedTensor", type(w).__name__)
    params = {"group_size": group_size} if method in ("int4", "int4-asym", "gptq") else {}
    codec = get_codec(method, **params)
    w = w.detach().cpu()
    fast = engine_quantize(codec, w, name)  # the codec's bytes, on the engine's threads
    return fast if fast is not None else codec.quantize(w, name)


def _bias(b: torch.Tensor | None, shape: tuple[int, int], name: str) -> torch.Tensor | None:
    if b is None:
        return None
    if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape:
        found = list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
        raise FormatError(name, f"a bias tensor {list(shape)}", f"{found}")
    return b.detach().float().contiguous()


# An expert with at most this many tokens streams its weights through the GEMV kernels (four
# tokens a pass, the rows staying in cache between passes); more tokens dequantize panels for the
# fp32 GEMM. Integer formats pay for dequantizing to fp32, so they stay on their integer dot
# products longer. Measured on one Qwen3-30B-A3B layer (2 threads, from DRAM), 4 -> 32: int4 at
# 128 tokens 107 -> 73 ms (the torch baseline: 112), int8 133 -> 86; at 512 tokens int4 349 -> 318,
# int8 348 -> 331; bf16 gains at 128 tokens (130 -> 102 at 16) but loses at 512 (342 -> 383), so
# float formats keep 4.
GEMV_MAX_FLOAT, GEMV_MAX_INTEGER = 4, 32
_FLOAT_METHODS = ("bf16", "fp8", "fp8-channel")


def default_gemv_max(projections: list[QuantizedTensor]) -> int:
    """The GEMV/GEMM switch point for experts stored in these projections' methods: the one the tuner
    measured on this machine for their families (runtime/tuning.py), else the built-in rule (none
    where the 512-bit GEMVs run them: engine_layout.gemv_is_wide)."""
    tuned = [tuned_gemv_max(q.method) for q in projections]
    if all(t is not None for t in tuned):
        return min(t for t in tuned if t is not None)
    if gemv_is_wide(projections):
        return GEMV_ALL_TOKENS
    return GEMV_MAX_FLOAT if any(q.method in _FLOAT_METHODS for q in projections) else GEMV_MAX_INTEGER


class CPUExperts:
    """One layer's routed experts on the CPU.

    ``gate``, ``up``: ``[E, I, H]``; ``down``: ``[E, H, I]``; each a ``QuantizedTensor`` in a
    method the engine runs (``engine_layout.ENGINE_METHODS``: bf16, int8, int4 in either layout,
    int4-asym, gptq, mxfp4, fp8, fp8-channel), or a float tensor that is quantized to ``method``
    here. ``mask`` (bool ``[E]``) marks experts computed elsewhere (on a GPU): they are skipped.
    ``activation="swiglu-oai"`` with ``alpha``/``limit`` and the optional biases gives gpt-oss's
    expert MLP; the default is ``silu(gate) * up``.
    """

    def __init__(
        self,
        gate: torch.Tensor | QuantizedTensor,
        up: torch.Tensor | QuantizedTensor,
        down: torch.Tensor | QuantizedTensor,
        method: str | None = None,
        *,
        group_size: int = 32,
        gemv_max_tokens: int | None = None,
        mask: torch.Tensor | None = None,
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
        gate_bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        verbose: bool = True,
    ) -> None:
        fallback = method or "bf16"
        if method is not None and method not in ENGINE_METHODS and not method.startswith("gguf:"):
            raise FormatError("method", f"one of {list(ENGINE_METHODS)}", repr(method))
        if activation not in ACTIVATIONS:
            raise FormatError("activation", f"one of {sorted(ACTIVATIONS)}", repr(activation))
        qs = [_as_quantized(w, fallback, group_size, n) for w, n in ((gate, "gate"), (up, "up"), (down, "down"))]
        if method is not None:
            for q, n in zip(qs, ("gate", "up", "down"), strict=True):
                if q.method != method:
                    raise FormatError(n, f"weights in method {method!r}", f"method {q.method!r}")
        self.gate, self.up, self.down = qs
        if len(self.gate.shape) != 3:
            raise FormatError("gate", "stacked experts [E, I, H]", f"shape {list(self.gate.shape)}")
        e, i, h = self.gate.shape
        if tuple(self.up.shape) != (e, i, h):
            raise FormatError("up", f"shape {[e, i, h]} like gate", f"shape {list(self.up.shape)}")
        if tuple(self.down.shape) != (e, h, i):
            raise FormatError("down", f"shape {[e, h, i]} (experts, hidden, intermediate)", f"{list(self.down.shape)}")
        self.experts, self.intermediate, self.hidden = e, i, h
        self.method = self.gate.method if len({q.method for q in qs}) == 1 else "mixed"
        self.activation = activation
        biases = (
            _bias(gate_bias, (e, i), "gate_bias"),
            _bias(up_bias, (e, i), "up_bias"),
            _bias(down_bias, (e, h), "down_bias"),
        )
        projs = [engine_projection(q, n) for q, n in zip(qs, ("gate", "up", "down"), strict=True)]
        self.repacked_bytes = sum(p.repacked_bytes for p in projs)
        # GGUF types without a native kernel are transcoded at load; say so, with the SNR.
        self.notes = [f"{n}: {p.note}" for p, n in zip(projs, ("gate", "up", "down"), strict=True) if p.note]
        if self.notes and verbose:
            print(f"hetmoe: GGUF experts {'; '.join(self.notes)}", file=sys.stderr)
        # Everything the engine holds a pointer to must outlive it.
        self._keep = [t for p in projs for t in (p.codes, p.scales, p.zeros) if t is not None]
        self._keep += [b for b in biases if b is not None]
        descs = [p.descriptor(*q.shape[1:]) for p, q in zip(projs, qs, strict=True)]
        self._engine = engine_module().MoEEngine(
            e,
            h,
            i,
            *descs,
            gemv_max_tokens=max(0, int(gemv_max_tokens if gemv_max_tokens is not None else default_gemv_max(qs))),
            activation=ACTIVATIONS[activation],
            alpha=float(alpha),
            limit=float(limit),
            gate_bias=biases[0].data_ptr() if biases[0] is not None else 0,
            up_bias=biases[1].data_ptr() if biases[1] is not None else 0,
            down_bias=biases[2].data_ptr() if biases[2] is not None else 0,
        )
        self._mask = torch.zeros(e, dtype=torch.uint8)
        self._mask_ptr = self._mask.data_ptr()  # set_mask copies into it: the address stays
        if mask is not None:
            self.set_mask(mask)
        self._pending: dict[int, _Pending] = {}

    @property
    def isa(self) -> str:
        return self._engine.isa

    @property
    def numa_split(self) -> list[dict]:
        """The rows of every expert each NUMA node of the engine's pool owns: ``up_rows`` (of gate
        and up), ``down_rows`` and the ``memory_node`` their pages were moved to; one entry holding
        every row on a one-node pool (csrc/numa_split.h)."""
        return list(self._engine.split)

    @property
    def nbytes(self) -> int:
        """Bytes of expert weights held (codes and scales)."""
        return sum(q.nbytes for q in (self.gate, self.up, self.down))

    @property
    def mask(self) -> torch.Tensor:
        return self._mask.bool()

    def set_mask(self, mask: torch.Tensor) -> None:
        """Experts to skip (computed elsewhere); read at each submit."""
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (self.experts,):
            found = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask: expected a bool tensor [{self.experts}], found {found}")
        self._mask.copy_(mask.to(torch.uint8).cpu())

    def _check(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        # The usual call in few tensor operations: a decode step meets this code cold (the layer before
        # streamed its weights through the caches), where each one costs microseconds; anything else
        # goes to _explain, which names what is wrong.
        if (
            type(x) is torch.Tensor
            and type(ids) is torch.Tensor
            and type(weights) is torch.Tensor
            and x.is_cpu
            and ids.is_cpu
            and weights.is_cpu
            and x.dtype in _X_DTYPES
            and ids.dtype is torch.int64
            and weights.dtype is torch.float32
            and x.is_contiguous()
            and ids.is_contiguous()
            and weights.is_contiguous()
        ):
            xs, s = x.shape, ids.shape
            if len(xs) == 2 and xs[1] == self.hidden and len(s) == 2 and s[0] == xs[0] and weights.shape == s:
                return
        self._explain(x, ids, weights)

    def _explain(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        for t, name in ((x, "x"), (ids, "topk_ids"), (weights, "topk_weights")):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, found {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"{name}: expected a CPU tensor, found device {t.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor, found strides {list(t.stride())}")
        if x.dtype not in _X_DTYPES:
            raise ValueError(f"x: expected dtype bfloat16 or float32, found {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x: expected shape [T, {self.hidden}], found {list(x.shape)}")
        if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(f"topk_ids: expected int64 [{x.shape[0]}, k], found {ids.dtype} {list(ids.shape)}")
        if weights.dtype != torch.float32 or tuple(weights.shape) != tuple(ids.shape):
            raise ValueError(
                f"topk_weights: expected float32 {list(ids.shape)}, found {weights.dtype} {list(weights.shape)}"
            )
        # ids in [-1, experts) are checked by the engine's submit and forward (a ValueError naming the first bad one)

    def _pointers(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, y: torch.Tensor) -> tuple:
        """The engine's submit/forward arguments for checked inputs."""
        return (
            x.data_ptr(),
            _X_DTYPES[x.dtype],
            x.shape[0],
            ids.data_ptr(),
            ids.shape[1],
            weights.data_ptr(),
            y.data_ptr(),
            self._mask_ptr,
        )

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
        """Start the layer; returns a handle for ``wait``. The inputs must not change until then."""
        self._check(x, topk_ids, topk_weights)
        y = torch.empty_like(x)
        handle = self._engine.submit(*self._pointers(x, topk_ids, topk_weights, y))
        self._pending[handle] = _Pending((x, topk_ids, topk_weights), y)
        return handle

    def wait(self, handle: int) -> torch.Tensor:
        """The layer's output ``[T, H]`` in x's dtype."""
        if handle not in self._pending:
            raise ValueError(f"handle {handle!r} is not pending on this CPUExperts (already waited on, or foreign)")
        self._engine.wait(handle)
        return self._pending.pop(handle).y

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The layer's output ``[T, H]`` in x's dtype: ``submit`` and ``wait`` in one engine call, with
        no handle kept (a decode step pays for every Python operation; see _check)."""
        self._check(x, topk_ids, topk_weights)
        y = torch.empty_like(x)
        self._engine.forward(*self._pointers(x, topk_ids, topk_weights, y))
        return y

    __call__ = forward

    def __del__(self) -> None:
        # Never free tensors the engine may still be writing: finish outstanding jobs first.
        for handle in list(getattr(self, "_pending", {})):
            with contextlib.suppress(Exception):
                self._engine.wait(handle)
