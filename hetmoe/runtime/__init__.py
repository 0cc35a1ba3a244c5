"""Running experts: CPUExperts (one MoE layer's routed experts in the CPU engine)."""

from .cpu_experts import CPUExperts

__all__ = ["CPUExperts"]
