"""Load the compiled engine and choose its instruction-set variant.

The variant is chosen once per process from CPUID (best of amx > avx512 > avx2), or forced with
``HETMOE_ISA=avx2|avx512|amx``; forcing one the CPU (or OS) lacks raises a ValueError that says
what is missing, it never executes an illegal instruction.

Within the AVX-512 variant the integer GEMVs and the bf16 GEMV on bf16 activations (VDPBF16PS) run
256 or 512 bits wide, chosen apart for the 4-bit ones, the int16-code ones (int8, Q8_0) and bf16:
before tuning 512 on AMD (Zen 5 runs 512-bit integer ops at full width), 256 elsewhere (on Intel they
streamed rows no faster, and the bf16 GEMV slower, measured); the tuner measures each family for
decode and for prompts (runtime/tuning.py); ``HETMOE_INT_VECTOR_BITS=256|512`` (all of them) or
:func:`set_int_vector_bits` chooses.

The GEMVs prefetch the weight rows they stream ahead of use: before tuning non-temporally on AMD (a
row read once a step then stops evicting what the step reuses: measured faster on Zen 5) and into
every cache level (T0) elsewhere; the tuner measures T0, T1 (into L2, not L1: the faster one on an
AMX Xeon), NTA and none (the hardware's prefetchers alone) for each family of GEMVs;
``HETMOE_WEIGHT_PREFETCH=t0|t1|nta|none`` (all of them) or :func:`set_weight_prefetch` chooses.

The 4- to 6-bit GEMVs' activations are int16-level codes (two int8 digits a code); int8 codes as
llama.cpp's, half the products, are an explicit lower-accuracy choice:
``HETMOE_ACTIVATION_BITS=8`` or :func:`set_activation_bits`.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

ISA_ENV = "HETMOE_ISA"
INT_VECTOR_BITS_ENV = "HETMOE_INT_VECTOR_BITS"
WEIGHT_PREFETCH_ENV = "HETMOE_WEIGHT_PREFETCH"
ACTIVATION_BITS_ENV = "HETMOE_ACTIVATION_BITS"
_PREFETCH_HINTS = {"t0": 0, "nta": 1, "t1": 2, "none": 3, "default": -1}  # the engine's WeightPrefetch (kernels.h)
PREFETCH_CHOICES = ("t0", "t1", "nta", "none")
# The engine's PrefetchFamily (kernels.h), named after the method the tuner measures each by: the 4- to
# 6-bit GEMVs, int8's and Q8_0's, bf16's and fp8's.
PREFETCH_FAMILIES = {"int4": 0, "int8": 1, "bf16": 2}
_PREFETCH_NAMES = {_PREFETCH_HINTS[c]: c for c in PREFETCH_CHOICES}  # the engine's value -> its name
_module: ModuleType | None = None


class EngineUnavailableError(RuntimeError):
    pass


def engine_module() -> ModuleType:
    """``hetmoe._C`` with a variant selected; a clear error if it was not built or cannot run."""
    global _module
    if _module is None:
        try:
            from .. import _C
        except ImportError as exc:
            raise EngineUnavailableError(
                f"hetmoe's compiled engine is not available ({exc}); reinstall with `pip install -e .` "
                "(needs a C++17 compiler) on an x86-64 machine"
            ) from None
        requested = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
        _C.select_isa(requested)
        bits = os.environ.get(INT_VECTOR_BITS_ENV, "").strip()
        if bits:
            if bits not in ("256", "512"):
                raise ValueError(f"{INT_VECTOR_BITS_ENV}={bits!r}: expected 256 or 512")
            _C.set_int_vector_bits(int(bits), -1, -1)  # every family and regime
        hint = os.environ.get(WEIGHT_PREFETCH_ENV, "").strip().lower()
        if hint:
            if hint not in _PREFETCH_HINTS:
                raise ValueError(f"{WEIGHT_PREFETCH_ENV}={hint!r}: expected one of {sorted(_PREFETCH_HINTS)}")
            _C.set_weight_prefetch(_PREFETCH_HINTS[hint], -1)  # every family
        act_bits = os.environ.get(ACTIVATION_BITS_ENV, "").strip()
        if act_bits:
            if act_bits not in ("8", "16"):
                raise ValueError(f"{ACTIVATION_BITS_ENV}={act_bits!r}: expected 8 or 16")
            _C.set_activation_bits(int(act_bits))
        _module = _C
    return _module


def select_isa(isa: str) -> str:
    """Select ``avx2``, ``avx512``, ``amx`` or ``auto`` for engines created from now on. ``auto`` is
    ``HETMOE_ISA`` where it is set, else the best variant. (``amx-emu``, the AMX kernels on emulated
    tiles, exists for tests: it is slow and never chosen by ``auto``.)"""
    if isa.strip().lower() == "auto":
        isa = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    return engine_module().select_isa(isa)


_method_ids: dict[str, int] | None = None


def engine_method_id(name: str) -> int:
    """The engine's id of a stored layout (``"bf16"``, ``"int4"``, ``"gguf:q4_k"``, ...), from its traits
    table (csrc/method_traits.h, ``_C.methods()``); a KeyError for a layout it has no row for."""
    global _method_ids
    if _method_ids is None:
        _method_ids = {row["name"]: int(row["id"]) for row in engine_module().methods()}
    return _method_ids[name]


def selected_isa() -> str:
    return engine_module().selected_isa()


def set_num_threads(threads: int) -> None:
    """Worker threads of the engine's pool (0 = one per usable CPU); takes effect for the next job."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    engine_module().set_num_threads(threads)


def set_numa(spec: str) -> None:
    """How the engine's next pool splits into NUMA groups: ``"auto"`` (libnuma's nodes), ``"off"``
    (one group), a count N (the CPUs in N groups taken for nodes) or ``""`` (``HETMOE_NUMA``).
    Layers built afterwards split their experts' rows that way; a bad spec is a ValueError."""
    engine_module().set_numa(spec)


def set_idle_spin_us(us: int) -> None:
    """How long (microseconds) the engine's workers spin for the next job before sleeping; default
    500 (or ``HETMOE_IDLE_SPIN_US``), 0 to sleep at once. Spinning is off the caller's CPU."""
    if not 0 <= us <= 1_000_000:
        raise ValueError(f"idle spin must be in [0, 1000000] microseconds, got {us}")
    engine_module().set_idle_spin_us(int(us))


# The GEMVs' width is chosen apart per family (csrc/kernels.h IntWidthFamily): "int4", the 4-bit
# digit GEMVs (int4, gptq, mxfp4, GGUF's 4-6-bit types), "int8", the int16-code ones (int8, Q8_0), and
# "bf16", the bf16 GEMV on bf16 activations (VDPBF16PS, where the CPU has AVX512-BF16; the fp32-activation
# GEMVs of bf16 and fp8 run the variant's full width); each layout's family is in its traits row
# (``gemv_width``). And per regime (IntWidthRegime): "decode", a job whose every GEMV call is one pass
# (at most 4 tokens an expert), and "prompt".
WIDTH_FAMILIES = PREFETCH_FAMILIES  # the same three (csrc/kernels.h: one static_assert)
WIDTH_REGIMES = {"decode": 0, "prompt": 1}


def _width_index(table: dict[str, int], what: str, key: str | None) -> int:
    if key is None:
        return -1
    if key not in table:
        raise ValueError(f"GEMV width {what}: expected one of {sorted(table)}, got {key!r}")
    return table[key]


def set_int_vector_bits(bits: int, family: str | None = None, regime: str | None = None) -> None:
    """Width of the AVX-512 variant's GEMVs: 256, 512, or 0 for this CPU's default, for one family
    (``"int4"``, ``"int8"``, ``"bf16"``) and regime (``"decode"``, ``"prompt"``), or all of them (None);
    applies from the next engine call (the AVX2 variant is always 256). The name is older than the
    bf16 family."""
    engine_module().set_int_vector_bits(
        int(bits), _width_index(WIDTH_FAMILIES, "family", family), _width_index(WIDTH_REGIMES, "regime", regime)
    )


def int_vector_bits(family: str = "int4", regime: str = "prompt") -> int:
    """The width ``family``'s GEMVs run at in ``regime`` (see set_int_vector_bits)."""
    f = _width_index(WIDTH_FAMILIES, "family", family)
    r = _width_index(WIDTH_REGIMES, "regime", regime)
    return int(engine_module().int_vector_bits(f, r))


def int_vector_widths() -> dict[str, dict[str, int]]:
    """Every family's width in every regime, as set now: ``{"int4": {"decode": 512, ...}, ...}``."""
    return {f: {r: int_vector_bits(f, r) for r in WIDTH_REGIMES} for f in WIDTH_FAMILIES}


_width_families: dict[str, str] | None = None


def gemv_width_family(layout: str) -> str:
    """The GEMV family of a stored layout (``"int8"``, ``"gguf:q4_k"``, ...) from its traits row: "int4",
    "int8" or "bf16" (WIDTH_FAMILIES); a KeyError for a layout without a row."""
    global _width_families
    if _width_families is None:
        _width_families = {row["name"]: row["gemv_width"] for row in engine_module().methods()}
    return _width_families[layout]


def set_weight_prefetch(hint: str, family: str | None = None) -> None:
    """How the GEMVs prefetch weight rows: ``t0`` (into every cache level), ``t1`` (into L2 and
    outward, not L1), ``nta`` (non-temporal), ``none`` (the hardware's prefetchers alone) or
    ``default`` (nta on AMD, t0 elsewhere), for one family of GEMVs (``PREFETCH_FAMILIES``: ``"int4"``,
    ``"int8"``, ``"bf16"``; engine_layout.prefetch_family names a method's) or all of them (None); applies from
    the next engine call. Results do not change, only which caches the streamed weights pass through."""
    if hint not in _PREFETCH_HINTS:
        raise ValueError(f"weight prefetch: expected one of {sorted(_PREFETCH_HINTS)}, got {hint!r}")
    index = -1 if family is None else PREFETCH_FAMILIES.get(family)
    if index is None:
        raise ValueError(f"weight prefetch family: expected one of {sorted(PREFETCH_FAMILIES)}, got {family!r}")
    engine_module().set_weight_prefetch(_PREFETCH_HINTS[hint], index)


def weight_prefetch(family: str) -> str:
    """``family``'s weight prefetch now: ``t0``, ``t1``, ``nta`` or ``none``."""
    if family not in PREFETCH_FAMILIES:
        raise ValueError(f"weight prefetch family: expected one of {sorted(PREFETCH_FAMILIES)}, got {family!r}")
    return _PREFETCH_NAMES[engine_module().weight_prefetch(PREFETCH_FAMILIES[family])]


def set_activation_bits(bits: int) -> None:
    """The 4- to 6-bit GEMVs' activations (int4, GPTQ, MXFP4 and the GGUF types but Q8_0): 16, the
    default, quantizes each block of 32 to int16-level codes (~1.5e-5 relative), which the GEMVs
    take as two int8 digits; 8, an explicit lower-accuracy choice, to int8 codes as llama.cpp's Q8
    activations (~5e-3 relative on a projection's output), which the 512-bit GEMVs take with half the
    products: where their arithmetic, not the memory, limits decode (an AMD Zen 4: a MoE layer 5-14%
    faster, a DeepSeek-V3-shaped model's Q4_0 and Q4_K_M decode 11%).
    The int8, Q8_0, bf16 and fp8 GEMVs are unchanged. Applies from the next engine call."""
    if bits not in (8, 16):
        raise ValueError(f"activation bits: expected 8 or 16, got {bits!r}")
    engine_module().set_activation_bits(int(bits))


def activation_bits() -> int:
    """The 4- to 6-bit GEMVs' activation bits now (set_activation_bits): 16 or 8."""
    return int(engine_module().activation_bits())


def weight_prefetches() -> dict[str, str]:
    """Every family's weight prefetch now: ``{"int4": "t1", "int8": "none", "bf16": "none"}``."""
    return {f: weight_prefetch(f) for f in PREFETCH_FAMILIES}


def isa_report() -> dict[str, Any]:
    """CPU features as the engine sees them, the best and the selected variant."""
    try:
        mod = engine_module()
    except (EngineUnavailableError, ValueError) as exc:
        return {"available": False, "error": str(exc)}
    return {
        "available": True,
        "features": mod.cpu_features(),
        "best": mod.best_isa(),
        "selected": mod.selected_isa(),
        "int_vector_bits": int_vector_widths() if mod.selected_isa() != "avx2" else 256,
        "weight_prefetch": weight_prefetches(),
        "activation_bits": activation_bits(),
        "pool": pool_report(),
    }


def pool_report() -> dict[str, Any]:
    """The engine's thread pool: its threads and how they split into NUMA groups (csrc/numa.h),
    or the error a bad ``HETMOE_NUMA`` gives."""
    mod = engine_module()
    try:
        numa = mod.numa_info()
    except ValueError as exc:
        return {"threads": mod.num_threads(), "error": str(exc)}
    return {"threads": mod.num_threads(), **numa}
