"""Streaming generation of correlated noise: round ``t``'s noise ``(L Z)_t`` without forming ``L``.

``L`` is a strategy's left inverse of ``C`` (:mod:`dpfl_lightning.privacy.matrix_factorization`),
``Z``'s rows are standard normal vectors of the model's dimension ``d``. A generator draws round
``t``'s rows of ``Z`` from ``normal(t, rows) -> Tensor[rows, d]`` (a keyed stream: the same ``t``
always gives the same rows; ``rows`` is 1 except for a tree, which draws one row per node completed
in round ``t``) and returns ``(L Z)_t`` at unit scale: the server multiplies it by ``noise_multiplier
* sensitivity * clip_bound`` -- or passes ``scale=`` to :meth:`CorrelatedNoise.next`, which scales
``Z_t`` before it enters the state, so that a clip bound that changes between rounds scales each
round's fresh noise as the ledger accounts it.

Memory: ``banded`` keeps the last ``b - 1`` noise rows (``(b - 1) x d``), ``blt`` its buffers
(``buffers x d``), ``tree`` the estimates of the maximal complete nodes (``<= height x d``),
``independent`` nothing. That state is the mechanism's secret: it must never enter a checkpoint or a
log. :meth:`CorrelatedNoise.resume` rebuilds it at round ``r`` by replaying the keyed draws (rounds
``0 .. r - 1``; a tree only from its current restart), with the same floating-point operations as the
uninterrupted run, so a resumed stream continues bit for bit.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dpfl_lightning.privacy.matrix_factorization import Strategy, tree_variances

__all__ = ["CorrelatedNoise", "IndependentNoise", "BandedNoise", "BLTNoise", "TreeNoise", "noise_generator"]

Normal = Callable[[int, int], torch.Tensor]


class CorrelatedNoise:
    """Base class: ``next()`` returns round ``self.round``'s noise and advances; ``resume(r)``."""

    def __init__(self, strategy: Strategy, d: int, normal: Normal):
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"d={d!r}: give the number of noised parameters, an integer >= 1")
        self.strategy, self.d, self.normal = strategy, d, normal
        self.round = 0

    def next(self, scale: float = 1.0) -> torch.Tensor:
        """Round ``self.round``'s noise ``(L (scale Z))_t``; raises once the strategy's ``T`` rounds are used."""
        t = self.round
        if t >= self.strategy.T:
            raise RuntimeError(f"the {self.strategy.kind} factorization covers T={self.strategy.T} rounds and all "
                               "are used: build it for the run's number of rounds (or restart a new one, accounted)")
        z = self._draw(t)
        if scale != 1.0:
            z = z * scale
        out = self._step(t, z)
        self.round = t + 1
        return out

    def resume(self, r: int, scales: Sequence[float] | None = None) -> None:
        """Rebuild the state at round ``r`` (the next ``next()`` is round ``r``) from the keyed draws;
        ``scales[t]``: the ``scale`` round ``t`` was drawn with (default 1)."""
        if not isinstance(r, int) or not 0 <= r <= self.strategy.T:
            raise ValueError(f"resume round r={r!r}: give an integer in [0, T={self.strategy.T}]")
        self._reset()
        self.round = self._replay_from(r)
        while self.round < r:
            self.next(1.0 if scales is None else float(scales[self.round]))

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors of the secret state (what ``O(state x d)`` memory counts)."""
        raise NotImplementedError

    def _draw(self, t: int) -> torch.Tensor:
        rows = self.strategy.rows_per_round[t]
        z = self.normal(t, rows)
        if rows == 1 and z.dim() == 1:
            z = z[None]
        if tuple(z.shape) != (rows, self.d):
            raise ValueError(f"normal({t}, {rows}) returned shape {tuple(z.shape)}; it must return [{rows}, {self.d}] "
                             "standard normal rows")
        return z

    def _replay_from(self, r: int) -> int:
        return 0

    def _reset(self) -> None:
        raise NotImplementedError

    def _step(self, t: int, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class IndependentNoise(CorrelatedNoise):
    """``C = I``: each round's own row."""

    def state_tensors(self):
        return []

    def _reset(self):
        pass

    def _step(self, t, z):
        return z[0]


class BandedNoise(CorrelatedNoise):
    """Any ``b``-banded lower-triangular ``C``: ``x_t = (Z_t - sum_{s=1}^{b-1} C[t, t-s] x_{t-s}) / C[t, t]``."""

    def __init__(self, strategy: Strategy, d: int, normal: Normal):
        super().__init__(strategy, d, normal)
        C = strategy.C
        T = strategy.T
        if C.shape[0] != T:
            raise ValueError(f"BandedNoise needs a square C, got {tuple(C.shape)}")
        lags = torch.arange(T)[:, None] - torch.arange(T)[None, :]
        nonzero = lags[C != 0]
        if (nonzero < 0).any():
            raise ValueError("BandedNoise needs a lower-triangular C")
        self.b = int(nonzero.max()) + 1
        t = torch.arange(T)[:, None]
        s = torch.arange(self.b)[None, :]
        self.band = torch.where(t - s >= 0, C[t, (t - s).clamp(min=0)], torch.zeros((), dtype=C.dtype))  # [T, b]
        self._reset()

    def state_tensors(self):
        return list(self.history)

    def _reset(self):
        self.history: list[torch.Tensor] = []  # x_{t-1}, x_{t-2}, ... (at most b - 1)

    def _step(self, t, z):
        acc = z[0]
        for s, past in enumerate(self.history, start=1):
            acc = acc - self.band[t, s].to(acc.dtype) * past
        x = acc / self.band[t, 0].to(acc.dtype)
        if self.b > 1:
            self.history = [x] + self.history[: self.b - 2]
        return x


class BLTNoise(CorrelatedNoise):
    """``C = BLT(theta, omega)``: ``x_t = Z_t - sum_i omega_i S_i``, then ``S_i <- theta_i S_i + x_t``,
    with ``S_i = sum_{s<t} theta_i^(t-1-s) x_s`` (``C``'s coefficient at lag ``l >= 1`` is ``sum_i
    omega_i theta_i^(l-1)``)."""

    def __init__(self, strategy: Strategy, d: int, normal: Normal):
        super().__init__(strategy, d, normal)
        self.theta, self.omega = strategy.params["theta"], strategy.params["omega"]
        self._reset()

    def state_tensors(self):
        return [] if self.buffers is None else [self.buffers]

    def _reset(self):
        self.buffers = None  # [buffers, d], zero until the first round

    def _step(self, t, z):
        x = z[0]
        theta, omega = self.theta.to(x.dtype), self.omega.to(x.dtype)
        if self.buffers is None:
            self.buffers = torch.zeros(len(theta), self.d, dtype=x.dtype)
        else:
            x = x - omega @ self.buffers
        self.buffers = theta[:, None] * self.buffers + x[None, :]
        return x


class TreeNoise(CorrelatedNoise):
    """Honaker's online tree (see :func:`~dpfl_lightning.privacy.matrix_factorization.tree`): round
    ``t`` completes the nodes of levels ``0 .. j``; the new level-``j`` node's estimate merges the
    stored maximal nodes of levels ``< j`` with the new leaf, and the round's noise is that estimate
    minus the merged nodes' estimates (the change of the prefix sum's noise)."""

    def __init__(self, strategy: Strategy, d: int, normal: Normal):
        super().__init__(strategy, d, normal)
        self.height = strategy.params["height"]
        self.v = tree_variances(self.height)
        self._reset()

    def state_tensors(self):
        return list(self.stored.values())

    def _reset(self):
        self.stored: dict = {}

    def _replay_from(self, r):
        return r - r % (2 ** self.height)

    def _step(self, t, z):
        if t % (2 ** self.height) == 0:
            self.stored = {}
        j = z.shape[0] - 1
        siblings = [self.stored.pop(level) for level in range(j)]
        estimate = z[0]
        for level in range(1, j + 1):
            estimate = self.v[level] * z[level] + (1.0 - self.v[level]) * (siblings[level - 1] + estimate)
        out = estimate
        for sibling in siblings:
            out = out - sibling
        self.stored[j] = estimate
        return out


_GENERATORS = {"independent": IndependentNoise, "banded": BandedNoise, "blt": BLTNoise, "tree": TreeNoise}


def noise_generator(strategy: Strategy, d: int, normal: Normal) -> CorrelatedNoise:
    """The streaming generator for ``strategy`` (by its ``kind``), for ``d`` noised parameters."""
    if strategy.kind not in _GENERATORS:
        raise ValueError(f"no streaming generator for strategy kind {strategy.kind!r}; known: {sorted(_GENERATORS)}")
    return _GENERATORS[strategy.kind](strategy, d, normal)
