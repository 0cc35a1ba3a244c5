"""The autograd function of one MoE layer's routed experts with LoRA on gate, up and down.

``routed_experts(x, topk_ids, topk_weights, base, lora)`` returns ``y [T, H]`` where

    y[t] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t])
    expert_e(x) = down_e(act(gate_e(x), up_e(x)))
    proj_e(z)   = W_e z (+ b_e) + scaling * B_e A_e dropout(z)      (A [E, r, in], B [E, out, r])

with the base ``W`` frozen in any stored method (``FrozenExperts``). Gradients flow to ``x``, to
``topk_weights`` (so the router trains through its softmax / top-k weights) and to every ``A`` and
``B``. All of it runs on the CPU in float32:

- forward, no adapter on the layer: the compiled engine computes each (token, slot) pair's expert
  output (``FrozenExperts.engine_pairs``); the weighted sum is taken here.
- forward with adapters (the engine cannot add a low-rank term inside the MLP): torch, expert by
  expert, each expert's three weights dequantized from the stored precision just for it.
- backward, always torch, expert by expert from the dequantized weights: ``dW_routing[t,j] =
  <dy[t], out[t,j]>``, ``dh = do @ Wd``, ``(dg, du) = act'(g, u) dh``, ``dx = dg @ Wg + du @ Wu``
  plus the LoRA terms. The gate/up pre-activations are saved by a torch forward
  (``recompute=False``) or recomputed (``recompute=True``, saving only x, ids, weights, masks);
  after an engine forward they are always recomputed, because the engine does not expose them.

Never more than one expert's weights exist in full precision at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .frozen import PROJECTIONS, FrozenExperts


@dataclass
class LoRAFactors:
    """LoRA of one projection for all experts: ``A [E, r, in]``, ``B [E, out, r]``."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    dropout: float = 0.0


@dataclass
class ExpertLoRA:
    """The routed experts' adapters of one layer; any projection may have none."""

    gate: LoRAFactors | None = None
    up: LoRAFactors | None = None
    down: LoRAFactors | None = None

    def get(self, proj: str) -> LoRAFactors | None:
        return getattr(self, proj)

    def __bool__(self) -> bool:
        return any(self.get(p) is not None for p in PROJECTIONS)


@dataclass
class _Plan:
    """What the function needs besides its tensor inputs (autograd passes it through untouched)."""

    base: FrozenExperts
    scaling: dict[str, float]
    keep: dict[str, torch.Tensor | None]  # dropout keep-masks per projection: bool [T*k, in] or None
    keep_scale: dict[str, float]  # 1 / (1 - p)
    recompute: bool
    use_engine: bool
    saved: dict[str, torch.Tensor] = field(default_factory=dict)
    engine_forward: bool = False


def check_lora(base: FrozenExperts, lora: ExpertLoRA | None) -> None:
    """Every adapter's shapes against the base: A ``[E, r, in]``, B ``[E, out, r]``."""
    if not lora:
        return
    e, i, h = base.gate.shape
    dims = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    for proj in PROJECTIONS:
        f = lora.get(proj)
        if f is None:
            continue
        out, inp = dims[proj]
        r = f.a.shape[1] if f.a.dim() == 3 else -1
        if f.a.dim() != 3 or tuple(f.a.shape) != (e, r, inp):
            raise ValueError(f"lora {proj}.A: expected shape [{e}, r, {inp}], found {list(f.a.shape)}")
        if tuple(f.b.shape) != (e, out, r):
            raise ValueError(f"lora {proj}.B: expected shape [{e}, {out}, {r}] (rank of A), found {list(f.b.shape)}")
        if not 0.0 <= f.dropout < 1.0:
            raise ValueError(f"lora {proj}.dropout: expected a probability in [0, 1), found {f.dropout}")


def dropout_masks(lora: ExpertLoRA | None, pairs: int, base: FrozenExperts, training: bool) -> dict[str, torch.Tensor]:
    """Keep-masks ``bool [T*k, in]`` for the projections whose LoRA has dropout (training only),
    drawn from torch's global RNG (so a checkpoint's RNG state reproduces them)."""
    out: dict[str, torch.Tensor] = {}
    if not lora or not training:
        return out
    width = {"gate": base.hidden, "up": base.hidden, "down": base.intermediate}
    for proj in PROJECTIONS:
        f = lora.get(proj)
        if f is not None and f.dropout > 0:
            out[proj] = torch.empty(pairs, width[proj]).bernoulli_(1.0 - f.dropout).bool()
    return out


def _act_and_grad(base: FrozenExperts, g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(dg, du)`` for ``h = act(g, u)``: closed form for SiLU, autograd otherwise (gpt-oss clamps)."""
    if base.activation_name == "silu":
        s = torch.sigmoid(g)
        silu = g * s
        return dh * u * s * (1 + g * (1 - s)), dh * silu
    with torch.enable_grad():
        gg, uu = g.detach().requires_grad_(), u.detach().requires_grad_()
        h = base.activation(gg, uu)
        dg, du = torch.autograd.grad(h, (gg, uu), dh)
    return dg, du


class _Expert:
    """One expert's forward pieces for a set of (token, slot) pairs."""

    def __init__(self, plan: _Plan, e: int, w: tuple[torch.Tensor, ...], lora: dict[str, Any], rows: torch.Tensor):
        self.plan, self.e, self.w, self.lora, self.rows = plan, e, w, lora, rows

    def _lora_in(self, proj: str, z: torch.Tensor) -> torch.Tensor:
        keep = self.plan.keep.get(proj)
        if keep is None:
            return z
        return z * keep[self.rows] * self.plan.keep_scale[proj]

    def project(self, proj: str, z: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``z @ W^T (+ b) + s * (drop(z) @ A^T) @ B^T`` and the LoRA intermediate ``drop(z) @ A^T``."""
        out = z @ weight.T
        bias = self.plan.base.bias(proj, self.e)
        if bias is not None:
            out = out + bias
        ab = self.lora.get(proj)
        if ab is None:
            return out, None
        za = self._lora_in(proj, z) @ ab[0][self.e].T
        return out + self.plan.scaling[proj] * (za @ ab[1][self.e].T), za

    def gate_up(self, xe: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g, ga = self.project("gate", xe, self.w[0])
        u, ua = self.project("up", xe, self.w[1])
        return g, u, ga, ua


def _lora_inputs(tensors: tuple[torch.Tensor | None, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for i, proj in enumerate(PROJECTIONS):
        a, b = tensors[2 * i], tensors[2 * i + 1]
        if a is not None:
            out[proj] = (a.detach().float(), b.detach().float())
    return out


def _groups(ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(expert, pair rows)`` in ascending expert order; pairs are ``t * k + j``; -1 is skipped."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    out, start = [], 0
    for e, n in zip(experts.tolist(), counts.tolist(), strict=True):
        if e >= 0:
            out.append((e, order[start : start + n]))
        start += n
    return out


class _RoutedExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        plan: _Plan,
        *lora_tensors: torch.Tensor | None,
    ) -> torch.Tensor:
        base = plan.base
        t, k = ids.shape
        x32 = x.detach().float()
        lora = _lora_inputs(lora_tensors)
        if not lora and plan.use_engine and base.engine is not None:
            out = base.engine_pairs(x32, ids).reshape(t * k, -1)
            plan.engine_forward = True
        else:
            out = _torch_forward(plan, x32, ids, lora, save=not plan.recompute)
        y = (out.view(t, k, -1) * weights.detach().float().unsqueeze(-1)).sum(1)
        if not plan.recompute:
            plan.saved["out"] = out
        ctx.plan = plan
        ctx.save_for_backward(x, weights, ids, *[a for a in lora_tensors])
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        plan: _Plan = ctx.plan
        x, weights, ids, *lora_tensors = ctx.saved_tensors
        grads = _backward(plan, x.float(), weights.float(), ids, _lora_inputs(tuple(lora_tensors)), dy.float())
        dx, dw, dlora = grads
        out: list[torch.Tensor | None] = [
            dx.to(x.dtype) if ctx.needs_input_grad[0] else None,
            dw.to(weights.dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
        ]
        for i, proj in enumerate(PROJECTIONS):
            for j, t in enumerate(lora_tensors[2 * i : 2 * i + 2]):
                need = ctx.needs_input_grad[4 + 2 * i + j]
                out.append(dlora[proj][j].to(t.dtype) if (need and proj in dlora) else None)
        plan.saved.clear()
        return tuple(out)


def _torch_forward(
    plan: _Plan, x: torch.Tensor, ids: torch.Tensor, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], save: bool
) -> torch.Tensor:
    """Unweighted outputs ``[T*k, H]`` of every pair, expert by expert; with ``save`` the gate/up
    pre-activations and LoRA intermediates go into ``plan.saved`` for the backward."""
    base = plan.base
    k = ids.shape[1]
    pairs = ids.numel()
    out = torch.zeros(pairs, base.hidden)
    if save:
        plan.saved["g"] = torch.zeros(pairs, base.intermediate)
        plan.saved["u"] = torch.zeros(pairs, base.intermediate)
        for proj, (a, _) in lora.items():
            plan.saved[f"{proj}_a"] = torch.zeros(pairs, a.shape[1])
    for e, rows in _groups(ids):
        ex = _Expert(plan, e, base.expert(e), lora, rows)
        xe = x[rows // k]
        g, u, ga, ua = ex.gate_up(xe)
        h = base.activation(g, u)
        o, da = ex.project("down", h, ex.w[2])
        out[rows] = o
        if save:
            plan.saved["g"][rows], plan.saved["u"][rows] = g, u
            for proj, za in (("gate", ga), ("up", ua), ("down", da)):
                if za is not None:
                    plan.saved[f"{proj}_a"][rows] = za
        del ex  # this expert's dequantized weights go before the next expert's are made
    return out


def _backward(
    plan: _Plan,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]],
    dy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    base = plan.base
    t, k = ids.shape
    saved = plan.saved
    have_gu = "g" in saved  # a torch forward that saved: no recompute of gate/up
    dx = torch.zeros_like(x)
    dw = torch.zeros(t * k)
    wflat = weights.reshape(-1)
    dlora = {p: (torch.zeros_like(a), torch.zeros_like(b)) for p, (a, b) in lora.items()}
    for e, rows in _groups(ids):
        ex = _Expert(plan, e, base.expert(e), lora, rows)
        tok = rows // k
        xe = x[tok]
        if have_gu:
            g, u = saved["g"][rows], saved["u"][rows]
            ga = saved["gate_a"][rows] if "gate" in lora else None
            ua = saved["up_a"][rows] if "up" in lora else None
        else:
            g, u, ga, ua = ex.gate_up(xe)
        h = base.activation(g, u)
        if "out" in saved:
            o, da = saved["out"][rows], saved["down_a"][rows] if "down_a" in saved else None
            if "down" in lora and da is None:
                da = ex._lora_in("down", h) @ lora["down"][0][e].T
        else:
            o, da = ex.project("down", h, ex.w[2])
        dye = dy[tok]
        dw[rows] = (dye * o).sum(-1)
        do = dye * wflat[rows].unsqueeze(1)
        dh = do @ ex.w[2]
        if "down" in lora:
            dh = dh + _lora_grads(plan, ex, "down", h, da, do, dlora)
        dg, du = _act_and_grad(base, g, u, dh)
        dxe = dg @ ex.w[0] + du @ ex.w[1]
        if "gate" in lora:
            dxe = dxe + _lora_grads(plan, ex, "gate", xe, ga, dg, dlora)
        if "up" in lora:
            dxe = dxe + _lora_grads(plan, ex, "up", xe, ua, du, dlora)
        dx.index_add_(0, tok, dxe)
        del ex  # as in the forward: one expert in full precision at a time
    return dx, dw.view(t, k), dlora


def _lora_grads(
    plan: _Plan,
    ex: _Expert,
    proj: str,
    z: torch.Tensor,
    za: torch.Tensor | None,
    dout: torch.Tensor,
    dlora: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Accumulates dA, dB of expert ``ex.e`` for ``proj`` and returns the LoRA path's gradient to ``z``."""
    a, b = ex.lora[proj][0][ex.e], ex.lora[proj][1][ex.e]
    s = plan.scaling[proj]
    zd = ex._lora_in(proj, z)
    if za is None:
        za = zd @ a.T
    dlora[proj][1][ex.e] += s * (dout.T @ za)  # dB [out, r]
    dza = s * (dout @ b)  # [n, r]
    dlora[proj][0][ex.e] += dza.T @ zd  # dA [r, in]
    return ex._lora_in(proj, dza @ a)  # dropout's mask and scale again on the way back


def routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    base: FrozenExperts,
    lora: ExpertLoRA | None = None,
    *,
    recompute: bool = False,
    use_engine: bool = True,
    masks: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The layer's routed-expert output ``[T, H]`` (float32, CPU), differentiable (module docstring).

    ``x [T, H]`` and ``topk_weights [T, k]`` on the CPU (any float dtype; math is float32),
    ``topk_ids [T, k]`` int64 (-1 skips a slot). ``masks``: dropout keep-masks per projection
    (``bool [T*k, in]``, from ``dropout_masks``); without them no dropout is applied.
    """
    if x.dim() != 2 or x.shape[1] != base.hidden:
        raise ValueError(f"x: expected shape [T, {base.hidden}], found {list(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids: expected int64 [{x.shape[0]}, k], found {topk_ids.dtype} {list(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {list(topk_ids.shape)}, found {list(topk_weights.shape)}")
    if topk_ids.numel() and (int(topk_ids.max()) >= base.num_experts or int(topk_ids.min()) < -1):
        raise ValueError(
            f"topk_ids: expected ids in [-1, {base.num_experts}), found {topk_ids.min()}..{topk_ids.max()}"
        )
    check_lora(base, lora)
    masks = dict(masks or {})
    scaling, keep_scale, tensors = {}, {}, []
    for proj in PROJECTIONS:
        f = lora.get(proj) if lora else None
        tensors += [f.a, f.b] if f is not None else [None, None]
        scaling[proj] = f.scaling if f is not None else 0.0
        keep_scale[proj] = 1.0 / (1.0 - f.dropout) if f is not None else 1.0
        m = masks.get(proj)
        if m is not None and (f is None or tuple(m.shape) != (topk_ids.numel(), f.a.shape[2])):
            raise ValueError(f"masks[{proj!r}]: expected bool [{topk_ids.numel()}, in] for a projection with LoRA")
    plan = _Plan(base, scaling, {p: masks.get(p) for p in PROJECTIONS}, keep_scale, recompute, use_engine)
    return _RoutedExpertsFn.apply(x, topk_weights, topk_ids, plan, *tensors)
