"""Command-line entry points: argument parsing and printing only; the work lives in lower layers."""
