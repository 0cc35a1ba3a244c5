"""Benchmark programs' library side: ``hetmoe bench`` and the scripts in bench/ call into it."""
