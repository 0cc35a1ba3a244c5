#!/usr/bin/env python3
"""Benchmark a whole Qwen3-30B-A3B-shaped model (4 layers) on the CPU: decode and prefill tokens/s.

Same program as `hetmoe bench model` (see --help); kept here so benchmarks live in bench/.
    python bench/bench_model.py --threads 2 --json docs/bench-model.json
"""

import sys

from hetmoe.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "model", *sys.argv[1:]]))
