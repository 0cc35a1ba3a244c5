#!/usr/bin/env python3
"""Benchmark one MoE layer's routed experts: hetmoe's engine against the torch baseline.

Same program as `hetmoe bench moe` (see --help); kept here so benchmarks live in bench/.
    python bench/bench_moe.py --methods int4 --tokens 1,512 --json bench-moe.json
"""

import sys

from hetmoe.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "moe", *sys.argv[1:]]))
