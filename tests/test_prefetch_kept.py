"""The decode GEMVs' software prefetches survive the compiler.

Decode streams weights from DRAM, and on the Intel Xeons the hardware prefetchers alone leave the
integer GEMVs streaming 28-51% less than with a prefetch a row ahead (int4 to Q4_K, a 102400 x 2048
weight, the AMX Xeon; csrc/kernels_common.inc). A compiler may delete a prefetch (nothing a program
observes changes): gcc 12 did, for every integer GEMV, once the hint became an argument (its IPA
mod-ref pass took the helper that only prefetches for a function without effects and deleted its
calls), and every other test still passed, as the results do not change. This reads the built
extension's instructions instead: every GEMV function that does the dot products (inlined loops
included, whatever the compiler chose to inline) must hold a prefetch instruction.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from hetmoe.kernels import engine_module

FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
GEMV = re.compile(r"^(?:void )?hetmoe::\(anonymous namespace\)::gemv_")
DOT = re.compile(r"\t(?:vpdpbusd|vpdpwssd|vpmaddwd|vpmaddubsw|vfmadd\w+|vdpbf16ps)\b")


def _gemv_functions(path: str) -> dict[str, tuple[int, int]]:
    """``{function: (prefetch instructions, dot-product instructions)}`` of the GEMV functions in the
    shared object at ``path`` that do dot products (the dispatchers that only call loops do none)."""
    out = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", path], check=True, capture_output=True, text=True
    ).stdout
    counts: dict[str, list[int]] = {}
    name = None
    for line in out.splitlines():
        m = FUNCTION.match(line)
        if m:
            name = m.group(1) if GEMV.match(m.group(1)) else None
            if name is not None:
                counts[name] = [0, 0]
        elif name is not None:
            counts[name][0] += "\tprefetch" in line
            counts[name][1] += bool(DOT.search(line))
    return {n: (p, d) for n, (p, d) in counts.items() if d}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_every_gemv_loop_prefetches() -> None:
    gemvs = _gemv_functions(engine_module().__file__)
    # Three kernel variants of some twenty methods: far more than this, unless the names changed.
    assert len(gemvs) >= 20, f"only {len(gemvs)} GEMV functions with dot products found: the names changed?"
    missing = sorted(name for name, (prefetches, _) in gemvs.items() if prefetches == 0)
    assert not missing, f"{len(missing)} of {len(gemvs)} GEMV functions hold no prefetch instruction: {missing[:4]}"
