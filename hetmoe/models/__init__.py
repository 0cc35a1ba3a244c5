"""Model architectures: well-known MoE shapes (more adapters arrive with the hybrid runtime)."""
