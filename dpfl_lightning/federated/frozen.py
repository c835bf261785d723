"""Frozen parameters: what is not trained in a round is not part of that round's update.

A parameter with ``requires_grad=False`` when a round starts (a pretrained backbone under a trained
head, a layer a schedule unfreezes later) is left out of the round's update in a private run: a
client's payload holds the trainable entries only (so frozen ones are neither clipped, noised nor
sent, even if a hook unfreezes the layer during local training; a LoRA model all-reduces its
adapter alone), and the server step leaves frozen parameters as they are. The sensitivity is
unchanged (the bound applies to the trainable part) and the noise dimension is the trainable
part's. A parameter unfrozen later joins the update from the round that starts with it trainable.
A run without DP sends the whole update (frozen entries are zero), so a layer the module unfreezes
during local training trains in that round, as under ``lightning.Trainer``.

The round's plan carries the mask (``RoundPlan.trainable``): ``None`` when every parameter is
trainable, which costs nothing and leaves every result as it was.
"""

from __future__ import annotations

import torch


def trainable_mask(params: list[torch.nn.Parameter], slices: list[tuple[int, int]], numel: int,
                   device: torch.device) -> torch.Tensor | None:
    """A bool mask over the flat parameters (``slices``: each parameter's ``(offset, size)``) of the
    trainable ones, or ``None`` when all are trainable."""
    if all(p.requires_grad for p in params):
        return None
    mask = torch.zeros(numel, dtype=torch.bool, device=device)
    for p, (offset, size) in zip(params, slices):
        if p.requires_grad:
            mask[offset : offset + size] = True
    return mask


def zero_frozen_(update: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Zero the entries of ``update`` that belong to frozen parameters."""
    if mask is not None:
        update.masked_fill_(~mask, 0.0)


def add_noise_(stream, x: torch.Tensor, std: float, mask: torch.Tensor | None) -> None:
    """``x += N(0, std^2)`` on the trainable entries only (``mask``; every entry when ``None``)."""
    if mask is None:
        stream.add_normal_(x, std)
        return
    noise = torch.zeros(int(mask.sum()), dtype=x.dtype, device=x.device)
    stream.add_normal_(noise, std)
    x[mask] += noise


def count(mask: torch.Tensor | None, numel: int) -> int:
    """The number of trainable entries (the noise dimension)."""
    return numel if mask is None else int(mask.sum())
