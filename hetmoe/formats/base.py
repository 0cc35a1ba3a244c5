"""The contract every precision implements: errors, tensor specs, the quantized container, fidelity.

A codec turns a full-precision weight ``[..., N, K]`` (N output rows, K input columns; leading
dimensions stack experts) into the tensors its source convention stores on disk, and back. The
names, dtypes and shapes of those tensors are the codec's ``tensor_specs``: readers validate
against them and writers emit exactly them, so a checkpoint made by hetmoe loads in the tool the
convention came from, and a checkpoint from that tool loads in hetmoe.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..hw import huge_pages


class FormatError(ValueError):
    """A tensor does not match what its format requires.

    The message always names the tensor, what was expected and what was found, so a user with a
    broken checkpoint knows which file entry to look at.
    """

    def __init__(self, tensor: str, expected: str, found: str, hint: str = "") -> None:
        self.tensor = tensor
        self.expected = expected
        self.found = found
        message = f"{tensor}: expected {expected}, found {found}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


@dataclass(frozen=True)
class TensorSpec:
    """One on-disk tensor of a format: ``key = prefix + suffix`` (suffix carries its separator)."""

    suffix: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def key(self, prefix: str) -> str:
        return prefix + self.suffix


@dataclass
class QuantizedTensor:
    """A weight in a codec's on-disk layout.

    ``tensors`` is keyed by the spec suffix (``".weight"``, ``".weight_scale_inv"``, ``"_blocks"``),
    ``shape`` is the logical full-precision shape ``[..., N, K]`` and ``params`` the codec
    parameters needed to read it back (group size, ggml type, ...).
    """

    method: str
    shape: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    params: dict[str, Any] = field(default_factory=dict)
    # Set by a reader once ``validate`` passed on exactly these tensors, so later layers (the
    # engine) need not scan gigabytes again; anything that builds new tensors starts unvalidated.
    validated: bool = field(default=False, compare=False, repr=False)

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors under their checkpoint names for a module ``prefix``."""
        return {prefix + suffix: t for suffix, t in self.tensors.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def on_huge_pages(self) -> QuantizedTensor:
        """The same bytes copied onto 2 MiB pages (hw/huge_pages.py: the tensors smaller than one stay
        plain), for weights a decode step streams; new tensors, so unvalidated."""
        tensors = {k: huge_pages.copy_to_huge_pages(t) for k, t in self.tensors.items()}
        return QuantizedTensor(self.method, self.shape, tensors, self.params)


def snr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-noise ratio ``20*log10(||w|| / ||w - w_hat||)`` in dB (inf when exact)."""
    ref = reference.double()
    err = torch.linalg.vector_norm(ref - approximation.double()).item()
    sig = torch.linalg.vector_norm(ref).item()
    if err == 0.0:
        return math.inf
    if sig == 0.0:
        return -math.inf
    return 20.0 * math.log10(sig / err)


def check_weight(weight: torch.Tensor, name: str, min_dims: int = 2) -> None:
    """Reject inputs no codec can quantize meaningfully: non-float, too few dims, NaN or Inf."""
    if not isinstance(weight, torch.Tensor):
        raise FormatError(name, "a torch.Tensor", type(weight).__name__)
    if not weight.is_floating_point():
        raise FormatError(name, "a floating-point weight to quantize", f"dtype {weight.dtype}")
    if weight.dim() < min_dims:
        raise FormatError(name, f"at least {min_dims} dimensions [..., N, K]", f"shape {list(weight.shape)}")
    check_finite(weight, name)


def check_finite(t: torch.Tensor, name: str) -> None:
    if not t.is_floating_point():
        return
    if t.dtype == torch.float8_e4m3fn:
        # e4m3fn has no Inf; its NaNs are the bytes x1111111 (torch.isfinite does not take fp8).
        bad = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    elif t.numel() == 0:
        return
    else:
        # One reduction first (min and max carry any NaN or Inf): a full isfinite mask of a layer's
        # bf16 experts took ~0.2 s per projection; it is only built to count once something is wrong.
        lo, hi = torch.aminmax(t if t.element_size() > 1 else t.float())
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return
        bad = int((~torch.isfinite(t.float() if t.element_size() == 1 else t)).sum())
    if bad:
        raise FormatError(name, "finite values", f"{bad} NaN/Inf entries")


def check_divisible(k: int, group: int, name: str, what: str = "K") -> None:
    if group <= 0 or k % group:
        raise FormatError(name, f"{what} divisible by {group}", f"{what}={k}")


class Codec(ABC):
    """One precision: quantize, dequantize, the on-disk specs, validation and bits per weight."""

    method: ClassVar[str]
    convention: ClassVar[str]
    can_quantize: ClassVar[bool] = True

    @abstractmethod
    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        """The on-disk tensors for a logical weight of ``shape`` = ``[..., N, K]``."""

    @abstractmethod
    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        """Quantize ``weight [..., N, K]`` (any float dtype) into this codec's layout."""

    @abstractmethod
    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rebuild ``[..., N, K]`` from the stored tensors, by the source convention alone."""

    @property
    def params(self) -> dict[str, Any]:
        return {}

    def repacked(self, q: QuantizedTensor, target: Codec) -> QuantizedTensor | None:
        """``q`` (this codec's) as ``target`` stores it, where the two hold the same values: ``q`` itself
        for this very codec and parameters; a codec whose layouts differ only in how the same codes and
        scales are laid out moves them (nothing re-quantized). None where ``target`` is another precision."""
        return q if type(target) is type(self) and target.params == self.params else None

    def label(self) -> str:
        """Human-readable name with parameters, e.g. ``int4 g32``."""
        extra = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.method} {extra}".strip()

    def bits_per_weight(self, shape: tuple[int, ...] = (1024, 1024)) -> float:
        """Stored bits per logical weight, everything included (scales, zero points)."""
        total = sum(math.prod(s.shape) * _itemsize(s.dtype) for s in self.tensor_specs(tuple(shape)))
        return 8.0 * total / math.prod(shape)

    def validate(self, q: QuantizedTensor, name: str = "weight") -> None:
        """Check every stored tensor against the specs: presence, dtype, shape, finite scales."""
        if len(q.shape) < 2:
            raise FormatError(name, "a logical shape [..., N, K]", f"shape {list(q.shape)}")
        specs = {s.suffix: s for s in self.tensor_specs(tuple(q.shape))}
        missing = [name + s for s in specs if s not in q.tensors]
        if missing:
            raise FormatError(name, f"tensors {sorted(specs)} for {self.label()}", f"missing {missing}")
        extra = [s for s in q.tensors if s not in specs]
        if extra:
            raise FormatError(
                name + extra[0],
                f"only the tensors of {self.label()}: {sorted(specs)}",
                f"unexpected {extra}",
                "a zero point or scale this format does not have" if "zero" in extra[0] else "",
            )
        for suffix, spec in specs.items():
            t = q.tensors[suffix]
            if t.dtype != spec.dtype:
                raise FormatError(name + suffix, f"dtype {spec.dtype}", f"dtype {t.dtype}")
            if tuple(t.shape) != spec.shape:
                raise FormatError(name + suffix, f"shape {list(spec.shape)}", f"shape {list(t.shape)}")
            check_finite(t, name + suffix)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
