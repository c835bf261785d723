"""The noise check's whitening of correlated noise and its variance of discrete noise
(:mod:`dpfl_lightning.privacy.noise_whitening`), against the noise the mechanisms really draw."""

import numpy as np
import pytest
import torch

from dpfl_lightning.plugins.correlated_noise import build_strategy
from dpfl_lightning.privacy import audit_bounds as ab
from dpfl_lightning.privacy import matrix_factorization as mf
from dpfl_lightning.privacy.correlated_noise import noise_generator
from dpfl_lightning.privacy.discrete_noise import integer_noise
from dpfl_lightning.privacy.noise_whitening import Whitener, discrete_gaussian_variance, share_variance

T, D = 10, 8000
SCALES = [1.0 + 0.5 * (t % 3) for t in range(T)]  # a bound that moves between rounds


def _released(kind, tmp_path, factor=1.0, signal=0.0):
    kind, height = (kind, None) if ":" not in kind else ("tree", int(kind.split(":")[1]))  # tree:h restarts
    """Each round's noise as the mechanism's generator draws it at ``factor`` x the declared scales,
    plus a signal that depends on the noise of earlier rounds (as training does); and the draws."""
    strategy = build_strategy(kind, mf.prefix_sum(T), 3, tree_height=height, cache_dir=str(tmp_path))
    g = torch.Generator().manual_seed(1)
    draws = {}

    def normal(t, rows):
        draws[t] = torch.randn(rows, D, generator=g, dtype=torch.float64)
        return draws[t]

    gen = noise_generator(strategy, D, normal)
    past = torch.zeros(D, dtype=torch.float64)
    out = []
    for t in range(T):
        n = gen.next(factor * SCALES[t])
        out.append(n + signal * torch.tanh(past))
        past = past + out[-1]
    return strategy, out, draws


@pytest.mark.parametrize("kind", ["independent", "banded", "blt", "tree", "tree:2"])
def test_whitening_with_the_declared_strategy_gives_unit_iid_noise(tmp_path, kind):
    strategy, released, draws = _released(kind, tmp_path)
    w = Whitener(strategy.inverse, strategy.rows_per_round)
    e = torch.stack([w.next(y, s) for y, s in zip(released, SCALES)])
    cov = e @ e.T / D  # across rounds: the identity, up to sampling (~1/sqrt(D) = 0.011)
    assert (cov - torch.eye(T, dtype=torch.float64)).abs().max() < 0.06
    if strategy.C.shape[0] == T:  # square C: the whitened sum is the mechanism's own Z (D^-1 C y)
        z = torch.cat([draws[t] for t in range(T)])
        assert torch.allclose(e, z, atol=1e-9)
    # raw, the correlated noise is not unit noise at the declared scale (the check could refute nothing)
    raw = torch.stack([y / s for y, s in zip(released, SCALES)]).square().mean()
    assert kind == "independent" or not 0.9 < float(raw) < 1.1


@pytest.mark.parametrize("kind", ["banded", "tree"])
def test_the_whitened_check_refutes_half_the_noise_and_not_the_declared_noise_plus_a_signal(tmp_path, kind):
    for factor, signal, refuted in ((1.0, 3.0, False), (0.5, 0.0, True)):
        strategy, released, _ = _released(kind, tmp_path, factor, signal)
        w = Whitener(strategy.inverse, strategy.rows_per_round)
        sums = np.zeros(ab.NOISE_BLOCKS)
        for y, s in zip(released, SCALES):
            sums += (w.next(y, s).numpy() ** 2).reshape(ab.NOISE_BLOCKS, -1).sum(1)
        check = ab.noise_check(sums, np.full(ab.NOISE_BLOCKS, T * D / ab.NOISE_BLOCKS), 0.95)
        assert check.refuted == refuted
        assert (0.45 < check.upper < 0.55) if refuted else check.ratio > 1.0


@pytest.mark.parametrize("mechanism,parameter", [("discrete_gaussian", 0.3), ("discrete_gaussian", 9.0),
                                                 ("skellam", 0.4), ("skellam", 6.0)])
def test_the_share_variance_is_the_samplers(mechanism, parameter):
    from dpfl_lightning import rng
    from dpfl_lightning.privacy.discrete_noise import WordSource

    n = 200_000
    stream = rng.RandomSource(3).stream(0, 0, rng.CLIENT_NOISE, tag="test")
    x = integer_noise(WordSource(stream), mechanism, parameter, (n,)).double()
    v = share_variance(mechanism, parameter)
    assert abs(float(x.var()) - v) < 5 * v * (2 / n) ** 0.5 + 1e-3  # sampling error of a variance
    if mechanism == "discrete_gaussian":
        assert v == pytest.approx(parameter, rel=1e-9) if parameter > 1 else v < parameter - 0.01


def test_a_small_discrete_gaussian_has_less_variance_than_its_parameter():
    # sigma^2 = 0.1: P[k] ~ e^(-5 k^2); |k| >= 3 weighs e^-45, below the tolerance
    e1, e2 = np.exp(-5.0), np.exp(-20.0)
    assert discrete_gaussian_variance(0.1) == pytest.approx((2 * e1 + 8 * e2) / (1 + 2 * e1 + 2 * e2), rel=1e-12)
