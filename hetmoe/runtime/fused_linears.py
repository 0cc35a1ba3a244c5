"""Sibling linears that read the same input, run as one engine call: q/k/v, gate/up.

An attention layer calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` on the same ``x``; in the
CPU engine that is three jobs, each paying a dispatch and a phase of activation quantization, and
the small ``k``/``v`` ones (512 rows at Qwen3-30B-A3B's shape) cost several times their bytes. Here
their weights are concatenated along the output rows into one ``CPULinear``; each former module
becomes a ``FusedSlice`` that returns its rows of the shared output. The first member called with
an input computes every member's rows; the others, called with the same tensor (same object, not
modified since: ``_version``), take their slice of it. A member called with any other input
recomputes, so the result is always that of the member's own weights, whatever order or inputs the
architecture's forward uses; only the speed depends on them calling the siblings on one tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import QuantizedTensor
from ..hw import huge_pages
from .cpu_linear import CPULinear

# (the members, in order; the fused module's name on their parent)
SIBLING_GROUPS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "fused_qkv_proj"),
    (("gate_proj", "up_proj"), "fused_gate_up_proj"),
    (("q_a_proj", "kv_a_proj_with_mqa"), "fused_q_kv_a_proj"),  # DeepSeek's MLA down-projections
)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor | None:
    """``[N_i, K]`` weights of one method stacked along N into ``[sum N_i, K]``; None where the
    layout cannot be (GPTQ and compressed-tensors pack along N; fp8 block scales would straddle)."""
    first = parts[0]
    if any(p.method != first.method or p.params != first.params or len(p.shape) != 2 for p in parts):
        return None
    if any(p.shape[1] != first.shape[1] or p.tensors.keys() != first.tensors.keys() for p in parts):
        return None
    method = first.method
    if method == "gptq" or (method == "int4-asym" and first.params.get("layout") == "compressed-tensors"):
        return None
    rows = sum(int(p.shape[0]) for p in parts)
    tensors: dict[str, torch.Tensor] = {}
    for suffix in first.tensors:
        if suffix == ".weight_shape":
            fixed = first.tensors[suffix].clone()
            fixed[..., 0] = rows
            tensors[suffix] = fixed
            continue
        if suffix == ".weight_scale_inv":  # fp8 scales per block of rows: every part but the last whole
            block = int(first.params.get("block_size", [128, 128])[0])
            if any(int(p.shape[0]) % block for p in parts[:-1]):
                return None
        members = [p.tensors[suffix] for p in parts]
        # a decode step streams these bytes: on huge pages, as a model file's are mapped (huge_pages.py)
        out = huge_pages.empty((sum(t.shape[0] for t in members), *members[0].shape[1:]), members[0].dtype)
        tensors[suffix] = torch.cat(members, dim=0, out=out)
    return QuantizedTensor(method, (rows, int(first.shape[1])), tensors, first.params)


class FusedLinears(nn.Module):
    """One CPULinear over the members' rows, and the last input's output until every member took it."""

    def __init__(self, linear: CPULinear, sizes: list[int]) -> None:
        super().__init__()
        self.linear = linear
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self._x: torch.Tensor | None = None
        self._version = -1
        self._y: torch.Tensor | None = None
        self._untaken: set[int] = set()

    def rows_of(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s output for ``x`` (a view of the shared output)."""
        if self._x is not x or self._version != _version(x) or self._y is None:
            self._y = self.linear(x)
            self._x, self._version = x, _version(x)
            self._untaken = set(range(len(self.bounds) - 1))
        y = self._y
        assert y is not None
        self._untaken.discard(member)
        if not self._untaken:  # everyone has it: hold no tensors between steps
            self._x = self._y = None
        return y[..., self.bounds[member] : self.bounds[member + 1]]


def _version(x: torch.Tensor) -> int:
    # Inference tensors keep no version counter: there, the same object is taken as the same input
    # (no architecture modifies its hidden states in place between the sibling projections).
    return -1 if x.is_inference() else x._version


class FusedSlice(nn.Module):
    """Stands where one member Linear stood; its rows of the group's output."""

    def __init__(self, group: FusedLinears, member: int) -> None:
        super().__init__()
        self._group = [group]  # a list: the parent owns the group as a child, this only points to it
        self.member = member
        self.in_features = group.linear.in_features
        self.out_features = group.bounds[member + 1] - group.bounds[member]

    @property
    def method(self) -> str:
        return self._group[0].linear.method

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This member's rows ``[out_features, in_features]`` of the fused weight, as the codec decodes them."""
        g = self._group[0]
        return g.linear.dequantized(dtype)[g.bounds[self.member] : g.bounds[self.member + 1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group[0].rows_of(self.member, x)

    def extra_repr(self) -> str:
        g = self._group[0]
        return f"rows {g.bounds[self.member]}..{g.bounds[self.member + 1]} of the fused {g.linear.method} linear"


def _bias_or_zeros(linear: CPULinear) -> torch.Tensor:
    return linear.bias_f32 if linear.bias_f32 is not None else torch.zeros(linear.out_features)


def fuse_siblings(model: nn.Module) -> int:
    """Replace every set of sibling CPULinears in SIBLING_GROUPS by one fused call; returns how many
    sets were fused. Members must share a method and input width (and any layout that concatenates)."""
    fused = 0
    for parent in list(model.modules()):
        for names, fused_name in SIBLING_GROUPS:
            found = [getattr(parent, n, None) for n in names]
            members = [m for m in found if isinstance(m, CPULinear)]
            if len(members) != len(names) or len({m.in_features for m in members}) != 1:
                continue
            weight = concat_rows([m.weight_q for m in members])
            if weight is None:
                continue
            bias = None
            if any(m.bias_f32 is not None for m in members):
                zeros = [torch.zeros(m.out_features) for m in members]
                bias = torch.cat(
                    [m.bias_f32 if m.bias_f32 is not None else z for m, z in zip(members, zeros, strict=True)]
                )
            linear = CPULinear(weight, bias, gemv_max_tokens=members[0].gemv_max_tokens)
            group = FusedLinears(linear, [m.out_features for m in members])
            parent.add_module(fused_name, group)
            for i, name in enumerate(names):
                setattr(parent, name, FusedSlice(group, i))
            fused += 1
    return fused
