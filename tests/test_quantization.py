"""Rotation, scaling, conditional rounding and modular sums: round trips, exactness, the norm bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.privacy import quantization as q
from dpfl_lightning.privacy.discrete_noise import WordSource

KEY = rng.RandomSource(11).key(3, rng.SERVER_CLIENT, rng.SERVER)


def test_rotation_is_orthogonal_and_undone():
    x = torch.randn(300, dtype=torch.float64)
    y = q.rotate(x, KEY)
    assert y.numel() == 512
    assert math.isclose(float(y.norm()), float(x.norm()), rel_tol=1e-12)
    assert torch.allclose(q.unrotate(y, KEY, 300), x, atol=1e-12)
    other = rng.RandomSource(11).key(4, rng.SERVER_CLIENT, rng.SERVER)
    assert not torch.allclose(q.rotate(x, other), y)  # another round's key: another rotation


def test_rotation_flattens_a_spike():
    x = torch.zeros(1024, dtype=torch.float64)
    x[5] = 1.0
    assert float(q.rotate(x, KEY).abs().max()) == pytest.approx(1 / 32)


def _client_rows(xs, clip, gamma, bits, beta, round_idx):
    src = rng.RandomSource(5)
    return torch.stack([q.encode(x, clip, gamma, bits, KEY, src.stream(round_idx, i, rng.CLIENT_NOISE), beta)
                        for i, x in enumerate(xs)])


def test_sum_without_noise_is_unbiased_with_the_rounding_variance():
    """In the rotated grid the decoded sum minus the true sum is the clients' rounding errors:
    mean 0 and variance sum_i f_i (1 - f_i) a coordinate (f: fractional parts), checked over
    repetitions."""
    n, d, clip, gamma, bits = 6, 200, 1.0, 0.01, 20
    xs = [torch.randn(d, dtype=torch.float64) * (0.3 + i / 10) for i in range(n)]
    scaled = torch.stack([q.rotate(q.clip_l2(x, clip), KEY) / gamma for x in xs])
    frac = scaled - torch.floor(scaled)
    var = float((frac * (1 - frac)).sum(0).mean())  # expected squared error a coordinate (grid units)
    errs = []
    for r in range(150):
        total = q.modular_sum(_client_rows(xs, clip, gamma, bits, 0.0, r), bits)
        errs.append(q.to_signed(total, bits).to(torch.float64) - scaled.sum(0))
    e = torch.stack(errs)
    se = math.sqrt(var / e.numel())
    assert abs(float(e.mean())) < 5 * se
    assert float((e * e).mean()) == pytest.approx(var, rel=0.03)
    true = sum(q.clip_l2(x, clip) for x in xs)
    est = q.decode(q.modular_sum(_client_rows(xs, clip, gamma, bits, 0.0, 0), bits), gamma, bits, KEY, d)
    assert float((est - true).abs().max()) < 6 * gamma * math.sqrt(n / 4)


def test_modular_sum_is_bit_identical_in_any_order_and_grouping():
    bits = 16
    rows = torch.randint(0, 1 << bits, (37, 64), generator=torch.Generator().manual_seed(0))
    whole = q.modular_sum(rows, bits)
    perm = rows[torch.randperm(37, generator=torch.Generator().manual_seed(1))]
    two_ranks = q.modular_sum(torch.stack([q.modular_sum(perm[:20], bits), q.modular_sum(perm[20:], bits)]), bits)
    assert torch.equal(whole, q.modular_sum(perm, bits)) and torch.equal(whole, two_ranks)
    assert torch.equal(whole, torch.remainder(rows.sum(0), 1 << bits))  # int64 sum: no overflow at 37 rows
    big = torch.full((5, 3), (1 << 62) - 1)
    assert torch.equal(q.modular_sum(big, 62), torch.full((3,), ((1 << 62) - 1) * 5 % (1 << 62)))


def test_signed_range_and_wraparound():
    bits = 8
    vals = torch.tensor([-128, -1, 0, 1, 127, 128, -129])
    assert q.to_signed(q.to_modular(vals, bits), bits).tolist() == [-128, -1, 0, 1, 127, -128, 127]


def test_conditional_rounding_never_exceeds_the_bound():
    """Adversarial inputs: every coordinate half-way between integers (largest rounding variance)
    at the clip's norm; the unconditional rounding exceeds the bound in some tries, the
    conditional one never."""
    from dpfl_lightning.privacy.discrete_accounting import rounded_l2_bound

    d = 1024
    v = torch.full((d,), 2.5, dtype=torch.float64)
    c = float(v.norm())
    bound = rounded_l2_bound(c, d, beta=math.exp(-0.5))
    src = rng.RandomSource(9).stream(0, 0, rng.DATA)
    words = WordSource(src)
    over = 0
    for _ in range(300):
        free = torch.floor(v) + (torch.from_numpy(words.words(d) * 2.0**-53) < v - torch.floor(v))
        over += float(free.norm()) > bound
        r = q.conditional_round(v, bound, src)
        assert float((r.to(torch.float64) ** 2).sum()) <= bound * bound
    assert over > 0
    tight = q.conditional_round(v, c, src, max_tries=1)  # the bound at the vector's own norm: fallback path
    assert float(tight.to(torch.float64).norm()) <= c


def test_encode_is_keyed_and_residues_lie_in_range():
    x = torch.randn(100)
    a = _client_rows([x], 1.0, 0.01, 12, 0.5, 0)
    b = _client_rows([x], 1.0, 0.01, 12, 0.5, 0)
    assert torch.equal(a, b) and int(a.min()) >= 0 and int(a.max()) < 4096


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="bits"):
        q.to_modular(torch.zeros(3, dtype=torch.int64), 63)
    with pytest.raises(ConfigError, match="gamma"):
        q.encode(torch.randn(4), 1.0, 0.0, 16, KEY, rng.RandomSource(0).stream(0, 0, rng.DATA), 0.5)
    with pytest.raises(ConfigError, match="noise shape"):
        q.encode(torch.randn(4), 1.0, 0.1, 16, KEY, rng.RandomSource(0).stream(0, 0, rng.DATA), 0.5,
                 noise=torch.zeros(3, dtype=torch.int64))


def test_noise_rows_sum_to_the_total_noise():
    """Integer noise shares ride through the modular sum exactly."""
    from dpfl_lightning.privacy import discrete_noise as dn

    bits, d = 16, 64
    x = torch.zeros(d)
    src = rng.RandomSource(8)
    noises = [dn.integer_noise(src.stream(0, i, rng.CLIENT_NOISE), "discrete_gaussian", 25.0, (d,)) for i in range(4)]
    rows = torch.stack([q.encode(x, 1.0, 0.1, bits, KEY, src.stream(0, i, rng.DATA), 0.5, noise=noises[i])
                        for i in range(4)])
    assert torch.equal(q.to_signed(q.modular_sum(rows, bits), bits), torch.stack(noises).sum(0))
    assert np.abs(torch.stack(noises).numpy()).max() > 0
