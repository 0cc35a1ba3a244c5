"""hetmoe: Mixture-of-Experts inference and fine-tuning with routed experts in CPU memory.

Layers (imports point down): cli -> checkpoint -> formats; hw beside them. See ARCHITECTURE.md.
"""

__version__ = "0.1.0"
