"""Errors of the checkpoint layer: every one names the file it is about."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint file or directory cannot be read as what it claims to be."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")
