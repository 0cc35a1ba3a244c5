"""CPUExperts: one MoE layer's routed experts, held in a codec's layout and run by the CPU engine.

``submit(x, topk_ids, topk_weights) -> handle`` starts the layer on the engine's worker threads and
returns at once (the GIL is released), so the caller can run the device's share meanwhile;
``wait(handle) -> y`` collects the result; ``forward`` does both. Everything the C++ side is given
is checked here first: dtypes, shapes, contiguity, id ranges. A bad call is a ValueError, never a
crash.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..formats import FormatError, QuantizedTensor, get_codec
from ..kernels.dispatch import engine_module

# Method ids of the compiled engine (csrc/kernels.h) and the tensor holding codes / scales.
ENGINE_METHODS = {"bf16": 0, "int8": 1, "int4": 2}
_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass
class _Pending:
    tensors: tuple[torch.Tensor, ...]  # kept alive while the engine reads or writes them
    y: torch.Tensor


def _as_quantized(w: torch.Tensor | QuantizedTensor, method: str, group_size: int, name: str) -> QuantizedTensor:
    if isinstance(w, QuantizedTensor):
        return w
    if not isinstance(w, torch.Tensor):
        raise FormatError(name, "a torch.Tensor [E, N, K] or a QuantizedTensor", type(w).__name__)
    params = {"group_size": group_size} if method == "int4" else {}
    return get_codec(method, **params).quantize(w.detach().cpu(), name)


def _codes_and_scales(q: QuantizedTensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The engine's view of a quantized projection: codes ``[E, N, bytes]``, scales, group size."""
    if q.method == "bf16":
        return q.tensors[".weight"], None, 0
    if q.method == "int8":
        return q.tensors[".weight"], q.tensors[".weight_scale"], 0
    if q.method == "int4":
        group = int(q.params.get("group_size", 0))
        if q.params.get("layout", "bytes") == "compressed-tensors":
            # int32 words hold 8 nibbles low-first: on a little-endian host their bytes are exactly
            # the byte layout (two codes a byte, low nibble first), so the checkpoint runs as stored.
            return q.tensors[".weight_packed"].view(torch.uint8), q.tensors[".weight_scale"], group
        return q.tensors[".weight"], q.tensors[".weight_scale"], group
    raise FormatError(name, f"a method the CPU engine runs: {sorted(ENGINE_METHODS)}", f"method {q.method!r}")


def _descriptor(q: QuantizedTensor, name: str) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    codec = get_codec(q.method, **q.params)
    codec.validate(q, name)
    if len(q.shape) != 3:
        raise FormatError(name, "stacked experts [E, N, K]", f"shape {list(q.shape)}")
    _, n, k = q.shape
    if k % 32:
        raise FormatError(name, "K (input features) a multiple of 32 for the CPU engine", f"K={k}")
    w, s, group = _codes_and_scales(q, name)
    if q.method == "int4" and (group < 32 or group % 32 or (group // 32) & (group // 32 - 1)):
        raise FormatError(name, "an int4 group size of 32, 64, 128 or 256 for the CPU engine", f"group_size={group}")
    keep = [w] if s is None else [w, s]
    for t, what in zip(keep, ("codes", "scales"), strict=False):
        if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(-2) != t.shape[-1]):
            raise FormatError(f"{name} {what}", "rows contiguous in memory", f"strides {list(t.stride())}")
    ew, es = w.element_size(), (s.element_size() if s is not None else 0)
    desc = (
        w.data_ptr(),
        s.data_ptr() if s is not None else 0,
        w.stride(0) * ew,
        w.stride(1) * ew,
        s.stride(0) * es if s is not None else 0,
        s.stride(1) * es if s is not None else 0,
        n,
        k,
        group,
        ENGINE_METHODS[q.method],
    )
    return desc, keep


class CPUExperts:
    """One layer's routed experts on the CPU.

    ``gate``, ``up``: ``[E, I, H]``; ``down``: ``[E, H, I]``; each a ``QuantizedTensor`` in a
    method the engine runs (bf16, int8, int4 in either layout), or a float tensor that is
    quantized to ``method`` here. ``mask`` (bool ``[E]``) marks experts computed elsewhere (on a
    GPU): they are skipped.
    """

    def __init__(
        self,
        gate: torch.Tensor | QuantizedTensor,
        up: torch.Tensor | QuantizedTensor,
        down: torch.Tensor | QuantizedTensor,
        method: str | None = None,
        *,
        group_size: int = 32,
        gemv_max_tokens: int = 4,
        mask: torch.Tensor | None = None,
    ) -> None:
        fallback = method or "bf16"
        if method is not None and method not in ENGINE_METHODS:
            raise FormatError("method", f"one of {sorted(ENGINE_METHODS)}", repr(method))
        qs = [_as_quantized(w, fallback, group_size, n) for w, n in ((gate, "gate"), (up, "up"), (down, "down"))]
        if method is not None:
            for q, n in zip(qs, ("gate", "up", "down"), strict=True):
                if q.method != method:
                    raise FormatError(n, f"weights in method {method!r}", f"method {q.method!r}")
        self.gate, self.up, self.down = qs
        e, i, h = self.gate.shape
        if tuple(self.up.shape) != (e, i, h):
            raise FormatError("up", f"shape {[e, i, h]} like gate", f"shape {list(self.up.shape)}")
        if tuple(self.down.shape) != (e, h, i):
            raise FormatError("down", f"shape {[e, h, i]} (experts, hidden, intermediate)", f"{list(self.down.shape)}")
        self.experts, self.intermediate, self.hidden = e, i, h
        self.method = self.gate.method if len({q.method for q in qs}) == 1 else "mixed"
        descs, self._keep = [], []
        for q, n in zip(qs, ("gate", "up", "down"), strict=True):
            d, keep = _descriptor(q, n)
            descs.append(d)
            self._keep += keep
        mod = engine_module()
        self._engine = mod.MoEEngine(e, h, i, *descs, gemv_max_tokens=max(0, int(gemv_max_tokens)))
        self._mask = torch.zeros(e, dtype=torch.uint8)
        if mask is not None:
            self.set_mask(mask)
        self._pending: dict[int, _Pending] = {}

    @property
    def isa(self) -> str:
        return self._engine.isa

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
        if ids.numel():
            bad = (ids < -1) | (ids >= self.experts)
            if bool(bad.any()):
                where = bad.nonzero()[0].tolist()
                raise ValueError(
                    f"topk_ids: expected ids in [-1, {self.experts}), found {int(ids[tuple(where)])} at {where}"
                )

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
        """Start the layer; returns a handle for ``wait``. The inputs must not change until then."""
        self._check(x, topk_ids, topk_weights)
        y = torch.empty_like(x)
        handle = self._engine.submit(
            x.data_ptr(),
            _X_DTYPES[x.dtype],
            x.shape[0],
            topk_ids.data_ptr(),
            topk_ids.shape[1],
            topk_weights.data_ptr(),
            y.data_ptr(),
            self._mask.data_ptr(),
        )
        self._pending[handle] = _Pending((x, topk_ids, topk_weights), y)
        return handle

    def wait(self, handle: int) -> torch.Tensor:
        """The layer's output ``[T, H]`` in x's dtype."""
        if handle not in self._pending:
            raise ValueError(f"handle {handle!r} is not pending on this CPUExperts (already waited on, or foreign)")
        self._engine.wait(handle)
        return self._pending.pop(handle).y

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.wait(self.submit(x, topk_ids, topk_weights))

    __call__ = forward

    def __del__(self) -> None:
        # Never free tensors the engine may still be writing: finish outstanding jobs first.
        for handle in list(getattr(self, "_pending", {})):
            with contextlib.suppress(Exception):
                self._engine.wait(handle)
