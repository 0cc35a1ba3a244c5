"""Read checkpoints (safetensors, sharded, GGUF), validate them, and detect how weights are stored."""

from .detect import WeightEntry, group_weights
from .errors import CheckpointError
from .safetensors_file import SafetensorsFile, TensorInfo
from .source import TensorSource, open_source

__all__ = [
    "CheckpointError",
    "SafetensorsFile",
    "TensorInfo",
    "TensorSource",
    "WeightEntry",
    "group_weights",
    "open_source",
]
