"""The engine's traits table (csrc/method_traits.h) against the gguf package's block sizes, the Python
side that reads it, and the compile-time checks that refuse a table missing a row."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hetmoe.kernels.dispatch import engine_method_id, engine_module
from hetmoe.runtime.engine_layout import ENGINE_METHODS

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def test_rows_in_method_order_and_gguf_blocks_as_the_gguf_package_has_them() -> None:
    rows = engine_module().methods()
    assert [r["id"] for r in rows] == list(range(len(rows)))
    for r in rows:
        if r["name"].startswith("gguf:"):
            elements, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[r["name"][5:].upper()]]
            assert (r["block_weights"], r["block_bytes"]) == (elements, nbytes), r["name"]
            assert r["scales_inside"] and r["k_multiple"] == elements
            assert r["bits_per_weight"] == nbytes * 8 / elements


def test_every_python_method_has_an_engine_row() -> None:
    # gptq and int4-asym run as the engine's int4 rows (engine_layout repacks them); fp8-channel as fp8
    runs_as = {"int4-asym": "int4", "gptq": "int4", "fp8-channel": "fp8"}
    for method in ENGINE_METHODS:
        if method != "gguf:*":
            engine_method_id(runs_as.get(method, method))
    with pytest.raises(KeyError):
        engine_method_id("gguf:q2_k")  # transcoded at load: no native row


def _compile(header_text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "method_traits.h").write_text(header_text)
    shutil.copy(CSRC / "kernels.h", tmp_path / "kernels.h")
    (tmp_path / "check.cpp").write_text('#include "method_traits.h"\nint main() { return 0; }\n')
    cxx = shutil.which("g++") or shutil.which("c++")
    return subprocess.run(
        [cxx, "-std=c++17", "-fsyntax-only", str(tmp_path / "check.cpp")], capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler")
def test_a_missing_row_does_not_compile(tmp_path: Path) -> None:
    text = (CSRC / "method_traits.h").read_text()
    assert _compile(text, tmp_path).returncode == 0  # the table as it is compiles
    without_last = re.sub(r"\n\s*\{kQ5_0,[^\n]*", "", text)
    assert without_last != text
    proc = _compile(without_last, tmp_path)
    assert proc.returncode != 0 and "every Method needs exactly one traits row" in proc.stderr
    swapped = text.replace("{kQ4K,", "{kTMP,").replace("{kQ6K,", "{kQ4K,").replace("{kTMP,", "{kQ6K,")
    proc = _compile(swapped, tmp_path)
    assert proc.returncode != 0 and "the rows must be in Method order" in proc.stderr
