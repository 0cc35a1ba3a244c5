"""The compiled CPU engine (hetmoe._C), its ISA dispatch, and the pure-torch reference."""

from .dispatch import engine_module, isa_report, select_isa, selected_isa, set_num_threads, set_numa
from .reference import moe_forward_reference

__all__ = [
    "engine_module",
    "isa_report",
    "moe_forward_reference",
    "select_isa",
    "selected_isa",
    "set_num_threads",
    "set_numa",
]
