"""What the commands that take a MODEL argument (generate, serve, chat, eval) accept, and its tokenizer.

A model is a transformers checkpoint directory or a llama.cpp ``.gguf`` file. The tokenizer of a
directory is its own tokenizer files; a GGUF file's is the tokenizer files beside it, else the one
its metadata carries (gguf_model.load_gguf_tokenizer). Every failure is a ValueError naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def is_gguf_file(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def is_model_path(path: Path) -> bool:
    """A checkpoint directory or a .gguf file (what load_model and the tokenizer loader take)."""
    return path.is_dir() or is_gguf_file(path)


def check_model_path(path: str | Path) -> Path:
    p = Path(path)
    if not is_model_path(p):
        why = "no such file or directory" if not p.exists() else "found a file of another kind"
        raise ValueError(f"{p}: not a model directory or a .gguf file ({why})")
    return p


def load_tokenizer(path: str | Path, purpose: str = "this command") -> Any:
    """The model's tokenizer; ``purpose`` finishes the error of a directory without one."""
    p = check_model_path(path)
    if is_gguf_file(p):  # its CheckpointErrors are ValueErrors that name the file already
        from .gguf_model import load_gguf_tokenizer

        try:
            return load_gguf_tokenizer(p)
        except OSError as exc:  # the tokenizer files beside it are unreadable
            raise ValueError(f"{p}: cannot load a tokenizer ({exc})") from None
    if not any((p / f).exists() for f in TOKENIZER_FILES):
        raise ValueError(f"{p}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); {purpose} needs the model's")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{p}: cannot load a tokenizer ({exc})") from None


def model_files_dir(path: Path) -> Path:
    """Where the model's side files (generation_config.json, tokenizer files) lie."""
    return path if path.is_dir() else path.parent
