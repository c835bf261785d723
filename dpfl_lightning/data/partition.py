"""Partitioners: split one labelled dataset over ``num_clients`` clients.

Every partitioner is a pure function of the labels and a seed, so every rank computes the same
split without communicating.

- ``iid``: a random permutation cut into near-equal parts.
- ``dirichlet``: for each class, its samples are divided among clients in proportions drawn from
  ``Dirichlet(alpha * 1)`` (Hsu et al. 2019); smaller ``alpha`` is more heterogeneous.
- ``shards``: sort by label, cut into ``shards_per_client * num_clients`` shards, give each
  client ``shards_per_client`` shards at random (McMahan et al. 2017; paper 003 App. H with 5
  shards). Shards are cut within classes (a class gets shards in proportion to its size), so a
  client holds at most ``shards_per_client`` classes even when class sizes are uneven.
- ``label_sorted``: each client gets ``iid_fraction`` of its data i.i.d. and the rest from the
  label-sorted remainder (paper 001 Sec. 5, "gamma% similar data"; Hsu et al. 2019).
"""

from __future__ import annotations

import numpy as np
import torch

from dpfl_lightning.errors import ConfigError, require

PARTITIONS = ("iid", "dirichlet", "shards", "label_sorted")


def _equal_split(indices: np.ndarray, parts: int) -> list[np.ndarray]:
    return [np.asarray(p, dtype=np.int64) for p in np.array_split(indices, parts)]


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return _equal_split(rng.permutation(len(labels)), num_clients)


def dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float,
              min_samples: int = 1, max_tries: int = 1000) -> list[np.ndarray]:
    require(alpha > 0, "data.alpha", alpha, "the Dirichlet concentration must be > 0", "set alpha > 0 (e.g. 0.3)")
    classes = np.unique(labels)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            p = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(o) for o in out) >= min_samples:
            return out
    raise ConfigError("data.alpha", alpha,
                      f"{max_tries} Dirichlet draws all left a client with fewer than {min_samples} samples",
                      "raise alpha, lower num_clients or lower min_samples_per_client")


def shards(labels: np.ndarray, num_clients: int, rng: np.random.Generator, shards_per_client: int) -> list[np.ndarray]:
    require(shards_per_client >= 1, "data.shards_per_client", shards_per_client, "must be >= 1", "set it to e.g. 2 or 5")
    n_shards = num_clients * shards_per_client
    require(n_shards <= len(labels), "data.shards_per_client", shards_per_client,
            f"{n_shards} shards need at least that many samples, the dataset has {len(labels)}",
            "lower shards_per_client or num_clients")
    # Shards never straddle two classes (so a client really holds at most k classes): each class
    # gets a number of shards proportional to its size (largest remainder, at least one).
    classes, counts = np.unique(labels, return_counts=True)
    require(n_shards >= len(classes), "data.shards_per_client", shards_per_client,
            f"{n_shards} shards cannot cover {len(classes)} classes", "raise shards_per_client or num_clients")
    quota = counts / counts.sum() * (n_shards - len(classes))
    per_class = 1 + np.floor(quota).astype(np.int64)
    short = n_shards - per_class.sum()
    per_class[np.argsort(-(quota - np.floor(quota)), kind="stable")[:short]] += 1
    pieces = []
    for c, n_c in zip(classes, per_class):
        pieces += _equal_split(np.flatnonzero(labels == c), int(n_c))
    assignment = rng.permutation(n_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[s] for s in row])) for row in assignment]


def label_sorted(labels: np.ndarray, num_clients: int, rng: np.random.Generator, iid_fraction: float) -> list[np.ndarray]:
    require(0.0 <= iid_fraction <= 1.0, "data.iid_fraction", iid_fraction, "must be in [0, 1]",
            "set iid_fraction, e.g. 0.1 for 10% similar data")
    perm = rng.permutation(len(labels))
    n_iid = int(round(iid_fraction * len(labels)))
    iid_part, rest = perm[:n_iid], perm[n_iid:]
    rest = rest[np.argsort(labels[rest], kind="stable")]
    return [np.sort(np.concatenate([a, b])) for a, b in zip(_equal_split(iid_part, num_clients), _equal_split(rest, num_clients))]


def partition(labels: torch.Tensor | np.ndarray, num_clients: int, scheme: str, seed: int, *, alpha: float = 0.5,
              shards_per_client: int = 2, iid_fraction: float = 0.0, min_samples: int = 1) -> list[torch.Tensor]:
    """Split sample indices ``0..len(labels)-1`` over ``num_clients`` clients by ``scheme``."""
    require(scheme in PARTITIONS, "data.partition", scheme, "unknown partitioner", f"use one of {', '.join(PARTITIONS)}")
    labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    require(num_clients >= 1, "data.num_clients", num_clients, "must be >= 1", "set num_clients to a positive number")
    require(num_clients * max(min_samples, 1) <= len(labels), "data.num_clients", num_clients,
            f"{len(labels)} samples cannot give {num_clients} clients {max(min_samples, 1)} sample(s) each",
            "lower num_clients")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = iid(labels, num_clients, rng)
    elif scheme == "dirichlet":
        parts = dirichlet(labels, num_clients, rng, alpha, min_samples)
    elif scheme == "shards":
        parts = shards(labels, num_clients, rng, shards_per_client)
    else:
        parts = label_sorted(labels, num_clients, rng, iid_fraction)
    return [torch.from_numpy(p) for p in parts]
