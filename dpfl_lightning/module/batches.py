"""What the local loop and evaluation need to know of a batch: its size and how it moves to a device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

Batch = Any


def batch_size_of(batch: Batch) -> int:
    """The number of records in a batch: the first dimension of its first tensor (1 when it has none)."""
    if type(batch) is tuple and batch and type(batch[0]) is torch.Tensor and batch[0].dim():
        return batch[0].shape[0]  # the common case, without recursion
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, Mapping) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1


def move_batch(batch: Batch, device: torch.device) -> Batch:
    """The batch with every tensor in it on ``device`` (lists, tuples and dicts followed)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_batch(v, device) for k, v in batch.items()}
    return batch
