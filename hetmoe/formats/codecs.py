"""Imports every built-in codec module so that each registers itself with the registry."""

from . import bf16, fp8, fp8_channel, gguf, gptq, int4, int8, mxfp4  # noqa: F401
