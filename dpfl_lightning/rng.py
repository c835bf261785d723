"""Randomness keyed by (seed, round, client, purpose), never by rank.

Every random draw in a run (which clients a round samples, how a client shuffles its data, the
dropout masks inside its steps, the Gaussian noise it adds) comes from a generator seeded by
:func:`key`. Ranks therefore draw the same numbers for the same client whoever trains it, and a run
resumed at round ``r`` draws what the uninterrupted run drew.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1

# Purposes: distinct streams for distinct uses of the same (seed, round, client).
SAMPLING = 1
CLIENT_TRAIN = 2
CLIENT_NOISE = 3
CENTRAL_NOISE = 4
SERVER = 5
DATA = 6
PLUGIN = 7  # plugins add their own offset (e.g. PLUGIN + 10) for further streams

SERVER_CLIENT = -1  # the "client" index used for draws that belong to the server


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def key(seed: int, round_idx: int, client: int, purpose: int) -> int:
    """A 63-bit seed that depends on every argument and on nothing else."""
    h = _splitmix64(seed & _MASK)
    for part in (round_idx, client, purpose):
        h = _splitmix64(h ^ (part & _MASK))
    return h & ((1 << 63) - 1)


def generator(seed: int, round_idx: int, client: int, purpose: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with :func:`key`."""
    g = torch.Generator(device=device)
    g.manual_seed(key(seed, round_idx, client, purpose))
    return g


def seed_global(seed: int, round_idx: int, client: int, device: torch.device) -> None:
    """Seed torch's global generator(s) for one client's local training (dropout and the like).

    ``torch.manual_seed`` costs ~100 us because it visits every device; seeding only the CPU
    generator and the one of ``device`` costs ~1 us.
    """
    s = key(seed, round_idx, client, CLIENT_TRAIN)
    torch.default_generator.manual_seed(s)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(s)
