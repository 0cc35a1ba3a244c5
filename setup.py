"""Build hetmoe's compiled CPU engine (hetmoe._C); everything else is in pyproject.toml.

Each ISA translation unit gets its own -m flags; the rest is baseline x86-64, so importing the
module never executes an instruction the CPU lacks: the variant is chosen at run time from CPUID.
"""

import os
import platform
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).parent
SOURCES = [
    "bindings.cpp",
    "moe_engine.cpp",
    "linear_engine.cpp",
    "thread_pool.cpp",
    "cpu_features.cpp",
    "measure.cpp",
    "norms.cpp",
    "decode_step.cpp",
    "routing.cpp",
    "mla_step.cpp",
    "delta_rule.cpp",
    "numa.cpp",
    "numa_split.cpp",
    "quantize.cpp",
]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"]
ISA_SOURCES = {
    # the weight quantizers: AVX2 code whose float operations must round where the Python codecs'
    # do (csrc/quantize.h), so no multiply-add is fused
    "quantize_rows.cpp": ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"],
    "quantize_rows_avx512.cpp": [*_AVX512, "-ffp-contract=off"],
    # the GGUF row decoders (embedding lookups): baseline x86-64, rounding where formats/gguf's do
    "gguf_rows.cpp": ["-ffp-contract=off"],
    "kernels_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "kernels_avx512.cpp": _AVX512,
    "kernels_amx.cpp": ["-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mavx512bf16", "-mavx512vbmi", *_AVX512],
    # kernels_amx.cpp again with its tile operations emulated: no AMX instruction in it
    "kernels_amx_emu.cpp": ["-mavx512bf16", "-mavx512vbmi", *_AVX512],
}


class BuildWithISAFlags(build_ext):
    """build_ext that adds each ISA unit's own flags to that unit only."""

    def build_extensions(self) -> None:
        compiler = self.compiler
        original = compiler._compile

        def compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts):
            flags = ISA_SOURCES.get(Path(src).name, [])
            return original(obj, src, ext, cc_args, [*extra_postargs, *flags], pp_opts)

        compiler._compile = compile_one
        super().build_extensions()


# HETMOE_SANITIZE=1: AddressSanitizer and UndefinedBehaviorSanitizer (or the -fsanitize= list it names,
# e.g. "address"), for scripts/sanitize.sh (the module then needs libasan preloaded into Python; that
# script does it)
_SANITIZERS = {"1": "address,undefined"}.get(os.environ.get("HETMOE_SANITIZE", ""), os.environ.get("HETMOE_SANITIZE"))
SANITIZE = [f"-fsanitize={_SANITIZERS}", "-fno-omit-frame-pointer", "-g"] if _SANITIZERS else []

ext_modules = []
if platform.machine().lower() in ("x86_64", "amd64"):
    ext_modules.append(
        Pybind11Extension(
            "hetmoe._C",
            sorted(str(Path("csrc") / s) for s in [*SOURCES, *ISA_SOURCES]),
            # headers and the shared kernel bodies: a change to any of them rebuilds the extension
            # (kernels_amx.cpp is also included by kernels_amx_emu.cpp)
            depends=sorted(
                str(p)
                for p in [
                    *Path("csrc").glob("*.h"),
                    *Path("csrc").glob("*.inc"),
                    Path("csrc/kernels_amx.cpp"),
                    Path("csrc/quantize_rows.cpp"),  # also included by quantize_rows_avx512.cpp
                ]
            ),
            cxx_std=17,
            extra_compile_args=[
                "-O3",
                "-fno-math-errno",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-maybe-uninitialized",
                "-Wno-uninitialized",
                *SANITIZE,
            ],
            extra_link_args=["-pthread", "-ldl", *SANITIZE],  # -ldl: libnuma is loaded at run time
        )
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildWithISAFlags})
