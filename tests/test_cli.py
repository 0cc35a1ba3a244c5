"""The command line: demo (the README's main job until the engine exists) and inspect."""

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import save_file

from hetmoe.cli.main import main
from hetmoe.formats import get_codec


def test_demo_writes_inspects_and_meets_floors(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "example.safetensors").exists() and (tmp_path / "example.gguf").exists()
    for word in ("fp8", "int4", "gptq", "mxfp4", "gguf:q4_k", "SNR dB", "at or above their floors"):
        assert word in out


def test_inspect_json_and_snr(tmp_path: Path, capsys) -> None:
    w = __import__("torch").randn(64, 128)
    state = {"a.weight": w, **get_codec("int4", group_size=32).quantize(w).state_dict("b")}
    save_file(state, tmp_path / "model.safetensors")
    assert main(["inspect", str(tmp_path), "--json", "--snr", "--methods", "int8,int4,mxfp4"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in report["tensors"]}
    assert rows["a.weight"]["method"] == "fp32" and rows["b.weight"]["method"] == "int4"
    assert rows["a.weight"]["snr_db"]["int8"] > 38 and rows["a.weight"]["snr_db"]["int4"] > 19
    assert "snr_db" not in rows["b.weight"]
    assert report["bytes_by_method"]["int4"] == 64 * 64 + 64 * 4 * 2


def test_inspect_bad_file_is_a_clean_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05")
    proc = subprocess.run(
        [sys.executable, "-m", "hetmoe.cli.main", "inspect", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "truncated" in proc.stderr and "Traceback" not in proc.stderr


def test_help_teaches() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hetmoe.cli.main", "inspect", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "examples:" in proc.stdout and "--snr" in proc.stdout
