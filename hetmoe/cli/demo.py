"""``hetmoe demo``: the whole format layer on a built-in example, no download needed.

Quantizes the built-in example tensor with every codec, writes the results as a checkpoint in
each method's own on-disk convention (a safetensors file and a GGUF file), inspects them with the
same reader users point at real models, and prints the fidelity table against its floors.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from ..checkpoint.atomic import save_safetensors, write_atomic
from ..formats import get_codec
from ..formats.fidelity import STANDARD_SET, example_weight, fidelity_table, format_table
from ..hw import cpu_info
from .inspect_cmd import format_report, inspect_path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="quantize a built-in example with every codec, write and inspect it, print the fidelity table",
        description=(
            "Runs hetmoe's format layer end to end on a built-in example tensor (Gaussian 1024x1024, seed 0): "
            "every codec quantizes it, the results are written in each method's on-disk convention "
            "(safetensors and GGUF), 'hetmoe inspect' reads them back, and the round-trip SNR of every codec "
            "is printed against the floor it must reach. Exits 1 if any codec misses its floor."
        ),
    )
    p.add_argument("--out", metavar="DIR", help="keep the example checkpoint in DIR (default: a temporary dir)")
    p.set_defaults(run=run)


def write_example_checkpoint(out: Path) -> tuple[Path, Path]:
    """Write ``example.safetensors`` (every non-GGUF codec) and ``example.gguf``; return both paths."""
    import gguf

    w = example_weight()
    tensors = {}
    writer_items = []
    for method, params, _ in STANDARD_SET:
        codec = get_codec(method, **params)
        q = codec.quantize(w)
        name = codec.label().replace(" ", "_").replace("=", "").replace(",", "-").replace("[", "").replace("]", "")
        if method.startswith("gguf:"):
            writer_items.append((f"example.{name}.weight", q))
        else:
            tensors.update(q.state_dict(f"example.{name}"))
    st_path = out / "example.safetensors"
    save_safetensors(tensors, st_path, metadata={"producer": "hetmoe demo"})

    def write_gguf(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch="hetmoe-example")
        for name, q in writer_items:
            ggml_type = gguf.GGMLQuantizationType[q.params["ggml_type"]]
            raw = q.tensors[".weight"].numpy().astype(np.uint8)
            writer.add_tensor(name, raw, raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    gguf_path = out / "example.gguf"
    write_atomic(gguf_path, write_gguf)
    return st_path, gguf_path


def run(args: argparse.Namespace) -> int:
    print(f"machine: {cpu_info().summary()}\n")
    with tempfile.TemporaryDirectory(prefix="hetmoe-demo-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for path in write_example_checkpoint(out):
            print(f"$ hetmoe inspect {path}")
            print(format_report(inspect_path(str(path)), None))
            print()
    rows = fidelity_table()
    print("Round-trip fidelity of every codec on the example tensor (Gaussian 1024x1024, seed 0):")
    print(format_table(rows))
    failed = [r.label for r in rows if not r.ok]
    if failed:
        print(f"\nFAILED floors: {', '.join(failed)}")
        return 1
    print(f"\nall {len(rows)} codecs at or above their floors")
    return 0
