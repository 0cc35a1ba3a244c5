"""Gradients of hetmoe's routed-expert autograd function against independent references.

Model level: tiny random Qwen3-MoE, DeepSeek-V3 and Mixtral. The reference is transformers' own
model in float32 with the same LoRA applied as a pure-torch parametrization of its fused expert
weights (``W + scaling * B @ A``; PEFT's ``target_parameters`` would share one A between gate and
up, which is a different adapter, so it cannot serve). hetmoe's copy is prepared (experts in the
CPU engine, bf16 base = the same values) and gets the LoRA through PEFT on its per-expert hosts.
Input, router and LoRA gradients must agree within relative L2 1e-3 and cosine 0.999.

Function level: ``routed_experts`` against plain torch autograd on dequantized weights (dropout,
recompute, engine forward, gpt-oss activation with biases), and int8 / int4 bases against the same
computation on their dequantized weights (tight) and against the bf16 base (loose).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_sft_support import runnable
from torch import nn
from torch.nn.utils import parametrize

from hetmoe.sft import ExpertLoRA, FrozenExperts, LoRAFactors, prepare_model, routed_experts
from hetmoe.sft.frozen import engine_for, quantize_stacked
from hetmoe.sft.peft_wrap import get_peft_model

R, ALPHA = 4, 8.0
SCALE = ALPHA / R


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def assert_close_grad(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-3, cos: float = 0.999) -> None:
    assert ref.abs().sum() > 0, f"{name}: the reference gradient is zero (the test would prove nothing)"
    r, c = rel_l2(ours, ref), cosine(ours, ref)
    assert r <= tol and c >= cos, f"{name}: relative L2 {r:.2e} (<= {tol}), cosine {c:.6f} (>= {cos})"


class _Delta(nn.Module):
    """Parametrization ``W + delta()`` for a fused expert weight."""

    def __init__(self, delta: object) -> None:
        super().__init__()
        self.delta = delta

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.delta()


def _lora_factors(e: int, i: int, h: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    dims = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    out = {}
    for proj, (o, inp) in dims.items():
        a = (torch.randn(e, R, inp, generator=gen) * 0.3).requires_grad_()
        b = (torch.randn(e, o, R, generator=gen) * 0.3).requires_grad_()
        out[proj] = (a, b)
    return out


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_model_gradients_match_transformers(tiny_cache, model_type: str) -> None:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(runnable(tiny_cache, model_type), dtype=torch.float32)
    ours = copy.deepcopy(ref)
    prepare_model(ours, "bf16")
    names = ours.model.layers[-1].mlp.experts.proj_names
    target = rf".*\.experts\.\d+\.({'|'.join(names)})"
    ours = get_peft_model(ours, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=target))

    gen = torch.Generator().manual_seed(1)
    loras: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, mod in ref.named_modules():
        if type(mod).__name__.endswith("Experts"):
            e, two_i, h = mod.gate_up_proj.shape
            f = _lora_factors(e, two_i // 2, h, gen)
            loras[name] = f

            def gu(f: dict = f) -> torch.Tensor:
                up = [torch.bmm(f[p][1], f[p][0]) for p in ("gate", "up")]
                return SCALE * torch.cat(up, dim=1)

            parametrize.register_parametrization(mod, "gate_up_proj", _Delta(gu))
            parametrize.register_parametrization(
                mod, "down_proj", _Delta(lambda f=f: SCALE * torch.bmm(f["down"][1], f["down"][0]))
            )
            # The same values into PEFT's per-expert LoRA layers of hetmoe's copy.
            layer = ours.base_model.model.get_submodule(name)
            for ex_id, ex in enumerate(layer):
                for proj, host in zip(("gate", "up", "down"), names, strict=True):
                    lora_layer = getattr(ex, host)
                    with torch.no_grad():
                        lora_layer.lora_A["default"].weight.copy_(f[proj][0][ex_id])
                        lora_layer.lora_B["default"].weight.copy_(f[proj][1][ex_id])
    assert loras, "no experts module found in the reference"
    routers = [n for n, _ in ours.base_model.model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers
    for n in routers:
        ours.base_model.model.get_parameter(n).requires_grad_(True)

    ids = torch.randint(0, 128, (2, 9), generator=gen)
    probe = torch.randn(2, 9, 128, generator=gen)
    emb_ref = ref.get_input_embeddings()(ids).detach().requires_grad_()
    emb_ours = emb_ref.detach().clone().requires_grad_()
    (ref(inputs_embeds=emb_ref).logits * probe).sum().backward()
    (ours(inputs_embeds=emb_ours).logits * probe).sum().backward()

    assert_close_grad("inputs_embeds", emb_ours.grad, emb_ref.grad)
    for n in routers:
        assert_close_grad(n, ours.base_model.model.get_parameter(n).grad, ref.get_parameter(n).grad)
    for name, f in loras.items():
        layer = ours.base_model.model.get_submodule(name)
        for proj, host in zip(("gate", "up", "down"), names, strict=True):
            ga = torch.stack([getattr(ex, host).lora_A["default"].weight.grad for ex in layer])
            gb = torch.stack([getattr(ex, host).lora_B["default"].weight.grad for ex in layer])
            assert_close_grad(f"{name} {proj} A", ga, f[proj][0].grad)
            assert_close_grad(f"{name} {proj} B", gb, f[proj][1].grad)


# --- function level ----------------------------------------------------------------------------

E, H, INTER, T, K = 6, 64, 32, 11, 2


def _base(method: str, gen: torch.Generator, *, biases: bool = False, activation: str = "silu") -> FrozenExperts:
    from hetmoe.models.adapters.gpt_oss import clamped_swiglu

    w = {
        p: torch.randn(E, *s, generator=gen) * 0.1
        for p, s in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER)))
    }
    qs = {p: quantize_stacked(t, method, 32 if method == "int4" else None, p) for p, t in w.items()}
    act = (lambda g, u: F.silu(g) * u) if activation == "silu" else (lambda g, u: clamped_swiglu(g, u, 1.702, 7.0))
    b = {
        "gate": torch.randn(E, INTER, generator=gen),
        "up": torch.randn(E, INTER, generator=gen),
        "down": torch.randn(E, H, generator=gen),
    }
    return FrozenExperts(qs["gate"], qs["up"], qs["down"], act, activation, b if biases else {})


def _reference(x, ids, w, base: FrozenExperts, lora: dict | None, masks: dict | None, p: float) -> torch.Tensor:
    """Plain torch autograd, every expert dequantized (the whole layer: fine for a test)."""
    y = torch.zeros(x.shape[0], H)
    k = ids.shape[1]
    for e in range(E):
        rows = (ids.reshape(-1) == e).nonzero().flatten()
        if rows.numel() == 0:
            continue
        wg, wu, wd = base.expert(e)
        xe = x[rows // k]

        def proj(
            name: str, z: torch.Tensor, weight: torch.Tensor, e: int = e, rows: torch.Tensor = rows
        ) -> torch.Tensor:
            out = z @ weight.T
            if name in base.biases:
                out = out + base.biases[name][e]
            if lora and name in lora:
                a, b = lora[name]
                zd = z * masks[name][rows] / (1 - p) if masks and name in masks else z
                out = out + SCALE * (zd @ a[e].T) @ b[e].T
            return out

        h = base.activation(proj("gate", xe, wg), proj("up", xe, wu))
        o = proj("down", h, wd)
        y = y.index_add(0, rows // k, o * w.reshape(-1)[rows].unsqueeze(1))
    return y


def _inputs(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    ids[3, 1] = -1  # a skipped slot
    w = torch.rand(T, K, generator=gen)
    return x, ids, w


def _grads(fn, x, w, lora):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    la = {p: (a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()) for p, (a, b) in lora.items()}
    y = fn(xs, ws, la)
    probe = torch.linspace(-1, 1, y.numel()).view_as(y)
    (y * probe).sum().backward()
    out = {"y": y.detach(), "x": xs.grad, "w": ws.grad}
    for p, (a, b) in la.items():
        out[f"{p}.A"], out[f"{p}.B"] = a.grad, b.grad
    return out


def _lora_arg(la: dict, p: float) -> ExpertLoRA:
    return ExpertLoRA(**{k: LoRAFactors(a, b, SCALE, p) for k, (a, b) in la.items()})


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_function_matches_autograd(recompute: bool, dropout: float) -> None:
    gen = torch.Generator().manual_seed(3)
    base = _base("bf16", gen)
    x, ids, w = _inputs(gen)
    lora = {
        p: (torch.randn(E, R, i, generator=gen) * 0.2, torch.randn(E, o, R, generator=gen) * 0.2)
        for p, (o, i) in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER)))
    }
    masks = None
    if dropout:
        torch.manual_seed(5)
        masks = {p: torch.rand(T * K, lora[p][0].shape[2]) >= dropout for p in lora}
    ours = _grads(
        lambda xs, ws, la: routed_experts(xs, ids, ws, base, _lora_arg(la, dropout), recompute=recompute, masks=masks),
        x,
        w,
        lora,
    )
    ref = _grads(lambda xs, ws, la: _reference(xs, ids, ws, base, la, masks, dropout), x, w, lora)
    for key in ref:
        assert_close_grad(key, ours[key], ref[key], tol=1e-5, cos=0.99999)


def test_engine_forward_without_adapters() -> None:
    """No expert LoRA: the compiled engine gives the forward; backward is the per-expert torch path."""
    gen = torch.Generator().manual_seed(4)
    base = _base("bf16", gen)
    base.engine = engine_for(base.gate, base.up, base.down, _SiluAdapter(), {})
    assert base.engine is not None
    x, ids, w = _inputs(gen)
    for recompute in (False, True):
        ours = _grads(lambda xs, ws, la, r=recompute: routed_experts(xs, ids, ws, base, None, recompute=r), x, w, {})
        ref = _grads(lambda xs, ws, la: _reference(xs, ids, ws, base, None, None, 0.0), x, w, {})
        for key in ref:
            assert_close_grad(f"{key} (engine, recompute={recompute})", ours[key], ref[key], tol=1e-4, cos=0.99999)


class _SiluAdapter:
    def engine_activation(self) -> dict:
        return {}


def test_gpt_oss_activation_and_biases() -> None:
    """The clamped SwiGLU's derivative (by autograd inside backward) and expert biases."""
    gen = torch.Generator().manual_seed(6)
    base = _base("bf16", gen, biases=True, activation="swiglu-oai")
    x, ids, w = _inputs(gen)
    x = x * 20  # drive some pre-activations past the clamp limit
    lora = {"gate": (torch.randn(E, R, H, generator=gen) * 0.2, torch.randn(E, INTER, R, generator=gen) * 0.2)}
    ours = _grads(lambda xs, ws, la: routed_experts(xs, ids, ws, base, _lora_arg(la, 0.0)), x, w, lora)
    ref = _grads(lambda xs, ws, la: _reference(xs, ids, ws, base, la, None, 0.0), x, w, lora)
    for key in ref:
        assert_close_grad(key, ours[key], ref[key], tol=1e-5, cos=0.99999)


# Quantized bases vs bf16, measured on this data: int8 rel L2 7.5e-3 (cos 0.99997), int4 g32 9.5e-2 (cos 0.9957).
QUANT_BOUNDS = {"int8": (0.03, 0.999), "int4": (0.25, 0.97)}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_base(method: str) -> None:
    gen = torch.Generator().manual_seed(7)
    w = {
        p: torch.randn(E, *s, generator=gen) * 0.1
        for p, s in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER)))
    }
    act = lambda g, u: F.silu(g) * u  # noqa: E731

    def base(m: str) -> FrozenExperts:
        qs = {p: quantize_stacked(t, m, 32 if m == "int4" else None, p) for p, t in w.items()}
        return FrozenExperts(qs["gate"], qs["up"], qs["down"], act, "silu")

    quant, bf16 = base(method), base("bf16")
    x, ids, wts = _inputs(gen)
    lora = {
        p: (torch.randn(E, R, i, generator=gen) * 0.2, torch.randn(E, o, R, generator=gen) * 0.2)
        for p, (o, i) in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER)))
    }
    ours = _grads(lambda xs, ws, la: routed_experts(xs, ids, ws, quant, _lora_arg(la, 0.0)), x, wts, lora)
    deq = _grads(lambda xs, ws, la: _reference(xs, ids, ws, quant, la, None, 0.0), x, wts, lora)
    full = _grads(lambda xs, ws, la: _reference(xs, ids, ws, bf16, la, None, 0.0), x, wts, lora)
    tol, cos = QUANT_BOUNDS[method]
    for key in deq:
        assert_close_grad(f"{method} {key} vs dequantized", ours[key], deq[key], tol=1e-5, cos=0.99999)
        assert_close_grad(f"{method} {key} vs bf16", ours[key], full[key], tol=tol, cos=cos)
