"""Checkpoints: what a run saves, how it is restored, and atomic writes.

A checkpoint holds the global parameters, each plugin's state under its ``state_key``, every
client's state by client id (gathered from the ranks that own them), the round, the filtered
history and the configuration. Never a secret: secure mode's key is not saved, so a resumed secure
run draws fresh randomness.

The file is written next to its destination under a temporary name, flushed and fsync'ed, then
``os.replace``d over the destination (atomic on POSIX), and the directory entry is fsync'ed: a
reader sees the old file or the complete new one, never half.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.plugins.callback import FederatedCallback

FORMAT = 2


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
    if not isinstance(state, dict) or "format" not in state:
        raise ConfigError("resume", path, "is not a dpfl_lightning checkpoint", "pass a checkpoint the trainer wrote")
    if state["format"] != FORMAT:
        raise ConfigError("resume", path, f"was written in checkpoint format {state['format']}, this version reads "
                          f"format {FORMAT}", "resume with the version that wrote it, or start a new run")
    return state


_RUN_ONLY = ("trainer.rounds", "trainer.log_dir", "trainer.run_name", "trainer.checkpoint_every",
             "trainer.checkpoint_dir", "trainer.enable_progress_bar", "trainer.enable_summary", "trainer.num_threads",
             "trainer.loggers", "resume", "config")


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out or {prefix: obj}
    return {prefix: obj}


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings that differ between the checkpoint's configuration and this run's, one line
    each (``key: old -> new``), leaving out the ones that only say how long or where to run.
    Changes that affect privacy are refused elsewhere (the ledger); these are reported."""
    a, b = _flatten(saved), _flatten(now)
    out = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(_RUN_ONLY) or a.get(key) == b.get(key):
            continue
        out.append(f"{key}: {a.get(key, '(unset)')!r} -> {b.get(key, '(unset)')!r}")
    return out


def plugin_states(plugins: list[Any]) -> dict[str, Any]:
    """Each stateful plugin's state under its ``state_key``."""
    out: dict[str, Any] = {}
    for p in plugins:
        state = p.state_dict()
        if state:
            out[p.state_key] = state
    return out


def check_state_keys(plugins: list[Any]) -> None:
    """Two stateful plugins whose states would land under one key cannot be checkpointed."""
    seen: dict[str, str] = {}
    for p in plugins:
        if type(p).state_dict is FederatedCallback.state_dict:
            continue  # stateless
        key = p.state_key
        if key in seen:
            raise ConfigError("trainer.plugins", [seen[key], type(p).__name__],
                              f"two plugins share the checkpoint state key {key!r}",
                              "give one of them a distinct state_key (override the property)")
        seen[key] = type(p).__name__


def restore_plugins(plugins: list[Any], saved: dict[str, Any], rounds_done: int) -> list[str]:
    """Load each plugin's saved state; return the plugins that start fresh (stateful now, absent
    from the checkpoint). A saved state no plugin takes is refused: it would be lost silently."""
    keys = {p.state_key for p in plugins}
    orphans = sorted(set(saved) - keys)
    if orphans:
        raise ConfigError("resume", orphans, "the checkpoint holds state of plugins this run does not have",
                          "resume with the plugins that wrote the checkpoint")
    fresh = []
    for p in plugins:
        if p.state_key in saved:
            p.load_state_dict(saved[p.state_key])
        elif getattr(p, "guarantees", None) and rounds_done > 0:  # a ledger: past rounds unaccounted
            raise ConfigError("resume", p.state_key, f"the checkpoint's {rounds_done} rounds ran without this privacy "
                              "ledger, so their releases are not accounted", "start a new run for a DP guarantee")
        elif p.state_dict():
            fresh.append(p.state_key)
    return fresh
