"""Checkpoints written atomically: a reader sees the old file or the complete new one, never half.

The file is written next to its destination under a temporary name, flushed and fsync'ed, then
``os.replace``d over the destination (atomic on POSIX), and the directory entry is fsync'ed.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from dpfl_lightning.errors import ConfigError

FORMAT = 1


def save_atomic(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` such that ``path`` is never left partially written."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".ckpt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: str) -> dict[str, Any]:
    """Read a checkpoint written by the trainer, with a clear error if it is not one."""
    if not os.path.isfile(path):
        raise ConfigError("resume", path, "no such checkpoint file", "pass the path of a .ckpt file the trainer wrote")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # corrupt or foreign file
        raise ConfigError("resume", path, f"cannot be read as a checkpoint ({type(exc).__name__})",
                          "pass a checkpoint the trainer wrote") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError("resume", path, "is not a dpfl_lightning checkpoint", "pass a checkpoint the trainer wrote")
    return state
