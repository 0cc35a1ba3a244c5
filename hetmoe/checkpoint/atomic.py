"""Atomic file writes: write under a temporary name beside the target, fsync, rename, fsync the dir.

A reader (or a user after a crash or kill -9) sees either the old file or the complete new one,
never a partial file under the final name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``target`` atomically."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    # mkstemp makes the file 0600; a written checkpoint should get the mode any new file gets here
    os.fchmod(fd, 0o666 & ~_umask())
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
        _fsync_dir(target.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask sets it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temporary directory to fill; on success every file in it is fsynced and it replaces
    ``target`` (an older ``target`` is moved aside first and removed after), else it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.rmdir(old)
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: str | Path, write: Callable[[Path], None]) -> None:
    with atomic_path(target) as tmp:
        write(tmp)


def save_safetensors(
    tensors: dict[str, torch.Tensor], target: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file``, atomically."""
    from safetensors.torch import save_file

    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    write_atomic(target, lambda tmp: save_file(contiguous, str(tmp), metadata=metadata))


def write_text_atomic(target: str | Path, text: str) -> None:
    write_atomic(target, lambda tmp: tmp.write_text(text))


def start_writeback(fd: int, start: int, length: int) -> None:
    """Have the kernel start writing ``length`` freshly written bytes at ``start`` to the disk now
    (Linux starts the write-back of dirty pages on POSIX_FADV_DONTNEED and then drops them from the
    page cache once clean), so that the fsync ``atomic_path`` ends with waits for the last chunk
    only and the disk works while the writer computes the next one. A no-op elsewhere."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
