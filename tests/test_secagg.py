"""Secure aggregation masks (SecAgg / SecAgg+) and Shamir sharing: uniform masked rows, exact
cancellation, dropouts, thresholds, reproducibility. Expected sums are computed here with Python
integers, not with the module's helpers."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from scipy import stats

from dpfl_lightning import rng
from dpfl_lightning.comm import shamir
from dpfl_lightning.comm.secagg import (Reveal, SecAggRound, TooFewSurvivorsError, mod_sum,
                                        simulate_dropouts)
from dpfl_lightning.errors import ConfigError


def rows_for(cohort, d, seed=0, low=-(2**40), high=2**40):
    g = torch.Generator().manual_seed(seed)
    return {c: torch.randint(low, high, (d,), generator=g, dtype=torch.int64) for c in cohort}


def expected_sum(rows, clients, bits):
    """The sum modulo 2^bits with Python integers (Python's % is non-negative for a positive modulus)."""
    cols = zip(*[rows[c].tolist() for c in clients])
    return torch.tensor([sum(col) % (1 << bits) for col in cols], dtype=torch.int64)


def masked_sum(r, rows, clients, bits):
    return mod_sum(torch.stack([r.mask(c, rows[c]) for c in clients]), bits)


# ------------------------------------------------------------------------------- uniformity
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("fill", [0, 1])
def test_single_masked_row_is_uniform(bits, fill):
    d = 200_000
    cohort = [0, 1, 2, 3, 4]
    r = SecAggRound(cohort, bits, d, 3, rng.RandomSource(11))
    row = torch.full((d,), fill * ((1 << bits) - 1), dtype=torch.int64)  # all zeros, or all at the top
    y = r.mask(2, row).numpy()
    assert y.min() >= 0 and y.max() < (1 << bits)
    binned = y if bits == 8 else y >> 8  # 256 bins of 256 values each for bits=16
    assert stats.chisquare(np.bincount(binned, minlength=256)).pvalue > 1e-3
    if bits == 16:  # the low byte too
        assert stats.chisquare(np.bincount(y & 255, minlength=256)).pvalue > 1e-3


# ------------------------------------------------------------------------------- cancellation
@pytest.mark.parametrize("n", [5, 20])
@pytest.mark.parametrize("neighbours", [None, 4])
@pytest.mark.parametrize("bits", [1, 13, 62])
def test_masks_cancel_in_the_sum(n, neighbours, bits):
    cohort = list(range(10, 10 + n))
    rows = rows_for(cohort, 257, seed=n)
    r = SecAggRound(cohort, bits, 257, 5, rng.RandomSource(2), neighbours=neighbours)
    masked = {c: r.mask(c, rows[c]) for c in cohort}
    reduced = expected_sum(rows, [cohort[0]], bits)
    assert not torch.equal(masked[cohort[0]], reduced)  # a row is masked, not sent as is
    total = mod_sum(torch.stack(list(masked.values())), bits)
    assert torch.equal(r.unmask(total, cohort, []), expected_sum(rows, cohort, bits))


def test_k_regular_graph_is_k_regular_and_keyed_by_round():
    cohort = list(range(100))
    src = rng.RandomSource(4)
    r = SecAggRound(cohort, 16, 4, 0, src, neighbours=6)
    for c in cohort:
        nb = r.graph.neighbours(c)
        assert len(nb) == 6 and c not in nb
        assert all(c in r.graph.neighbours(v) for v in nb)  # symmetric
    other = SecAggRound(cohort, 16, 4, 1, src, neighbours=6)
    assert [r.graph.neighbours(c) for c in cohort] != [other.graph.neighbours(c) for c in cohort]
    full = SecAggRound(cohort[:8], 16, 4, 0, src, neighbours=7)
    assert full.graph.neighbours(3) == (0, 1, 2, 4, 5, 6, 7)


# ------------------------------------------------------------------------------- dropouts
@pytest.mark.parametrize("n,t", [(8, 5), (20, 11)])
def test_dropouts_recover_survivors_sum_complete_graph(n, t):
    bits, d = 20, 64
    cohort = list(range(n))
    rows = rows_for(cohort, d, seed=1)
    r = SecAggRound(cohort, bits, d, 2, rng.RandomSource(9), threshold=t)
    masked = {c: r.mask(c, rows[c]) for c in cohort}
    pick = random.Random(0)
    for n_drop in range(1, n - t + 1):
        dropped = sorted(pick.sample(cohort, n_drop))
        survivors = [c for c in cohort if c not in dropped]
        total = mod_sum(torch.stack([masked[c] for c in survivors]), bits)
        assert torch.equal(r.unmask(total, survivors, dropped), expected_sum(rows, survivors, bits)), n_drop
    dropped = cohort[: n - t + 1]  # t - 1 survivors
    survivors = cohort[n - t + 1 :]
    with pytest.raises(TooFewSurvivorsError, match="secagg.threshold"):
        r.unmask(mod_sum(torch.stack([masked[c] for c in survivors]), bits), survivors, dropped)


def test_dropouts_k_regular_graph_recover_or_refuse():
    bits, d, n, k, t = 16, 32, 20, 6, 4
    cohort = list(range(100, 100 + n))
    rows = rows_for(cohort, d, seed=2)
    r = SecAggRound(cohort, bits, d, 0, rng.RandomSource(5), neighbours=k, threshold=t)
    masked = {c: r.mask(c, rows[c]) for c in cohort}
    pick = random.Random(1)
    outcomes = set()
    for trial in range(30):
        dropped = sorted(pick.sample(cohort, 1 + trial % 8))
        survivors = [c for c in cohort if c not in dropped]
        # the server needs t surviving holders of each survivor's b, and of each dropped client's sk
        # when that client has a surviving neighbour
        needed = [c for c in cohort if c in survivors or any(v in survivors for v in r.graph.neighbours(c))]
        ok = all(sum(h in survivors for h in r.graph.holders(c)) >= t for c in needed)
        total = mod_sum(torch.stack([masked[c] for c in survivors]), bits)
        if ok:
            assert torch.equal(r.unmask(total, survivors, dropped), expected_sum(rows, survivors, bits))
        else:
            with pytest.raises(TooFewSurvivorsError):
                r.unmask(total, survivors, dropped)
        outcomes.add(ok)
    assert outcomes == {True, False}  # both branches were exercised


def test_a_survivors_private_key_is_never_revealed():
    cohort = list(range(6))
    r = SecAggRound(cohort, 8, 4, 0, rng.RandomSource(0))
    dropped, survivors = [0], cohort[1:]
    reveals = r.reveal(survivors, dropped)
    assert {x.kind for x in reveals if x.owner == 0} == {"private_key"}
    assert {x.kind for x in reveals if x.owner != 0} == {"self_mask"}
    assert all(x.holder in survivors for x in reveals)
    forged = Reveal(1, 2, "private_key", reveals[0].share)
    with pytest.raises(ValueError, match="never both"):
        r.unmask(torch.zeros(4, dtype=torch.int64), survivors, dropped, reveals + [forged])


def test_unmask_refuses_a_bad_partition():
    r = SecAggRound([0, 1, 2, 3], 8, 4, 0, rng.RandomSource(0))
    with pytest.raises(ValueError, match="split the cohort"):
        r.unmask(torch.zeros(4, dtype=torch.int64), [0, 1, 2], [2, 3])


def test_simulated_dropouts_are_keyed_by_round_and_client():
    src = rng.RandomSource(3)
    cohort = list(range(4000))
    survivors, dropped = simulate_dropouts(cohort, 0.1, 7, src)
    assert abs(len(dropped) / len(cohort) - 0.1) < 0.02
    sub = cohort[::-3]  # another cohort, another order: each client's fate is its own
    assert set(simulate_dropouts(sub, 0.1, 7, src)[1]) == set(dropped) & set(sub)
    assert set(simulate_dropouts(cohort, 0.1, 8, src)[1]) != set(dropped)


# ------------------------------------------------------------------------------- Shamir
def test_shamir_any_t_shares_reconstruct_fewer_are_refused():
    secret = bytes(range(32))
    shares = shamir.split(secret, [1, 2, 3, 4, 5, 6], 3)
    for subset in itertools.combinations(shares.values(), 3):
        assert shamir.reconstruct(subset, 3) == secret
    assert shamir.reconstruct(shares.values(), 3) == secret
    for subset in itertools.combinations(shares.values(), 2):
        with pytest.raises(shamir.NotEnoughSharesError):
            shamir.reconstruct(subset, 3)
    other = shamir.split(b"\xff" * 32, [1, 2, 3, 4, 5, 6], 3)
    mixed = [shares[1], shares[2], other[3]]  # shares of two secrets: almost surely not a secret
    with pytest.raises(ValueError, match="do not decode"):
        shamir.reconstruct(mixed, 3)


@pytest.mark.parametrize("secret", [bytes(32), b"\xff" * 32], ids=["zeros", "ones"])
def test_shamir_t_minus_1_shares_are_uniform_whatever_the_secret(secret):
    coins = np.random.default_rng(0)
    low = []
    for _ in range(6000):
        s = shamir.split(secret, [1, 2, 3], 3, coins=lambda n: coins.bytes(n))
        low.append((s[1].values[0] & 15) * 16 + (s[2].values[0] & 15))  # two shares, jointly
    assert stats.chisquare(np.bincount(low, minlength=256)).pvalue > 1e-3


# ------------------------------------------------------------------------------- modes, ranks
def test_simulation_is_reproducible_secure_mode_is_not():
    cohort, d = [0, 1, 2, 3], 16
    row = torch.arange(d, dtype=torch.int64)
    a = SecAggRound(cohort, 16, d, 1, rng.RandomSource(7))
    b = SecAggRound(cohort, 16, d, 1, rng.RandomSource(7))
    c = SecAggRound(cohort, 16, d, 1, rng.RandomSource(8))
    assert a.public_keys() == b.public_keys() and torch.equal(a.mask(2, row), b.mask(2, row))
    assert a.public_keys()[0] != c.public_keys()[0] and not torch.equal(a.mask(2, row), c.mask(2, row))
    secret = rng.new_secret()
    s1 = SecAggRound(cohort, 16, d, 1, rng.RandomSource(7, secret))
    s2 = SecAggRound(cohort, 16, d, 1, rng.RandomSource(7, secret))
    assert set(s1.public_keys()[0]) and s1.public_keys()[0] != s2.public_keys()[0]
    assert not torch.equal(s1.mask(2, row), s2.mask(2, row))
    rows = rows_for(cohort, d)
    assert torch.equal(s1.unmask(masked_sum(s1, rows, cohort[1:], 16), cohort[1:], [0]),
                       expected_sum(rows, cohort[1:], 16))


@pytest.mark.parametrize("secure", [False, True])
def test_two_ranks_each_with_its_own_clients(secure):
    cohort, d, bits = list(range(9)), 40, 24
    src = rng.RandomSource(1, rng.new_secret() if secure else None)
    ranks = [SecAggRound(cohort, bits, d, 4, src, neighbours=4, local_clients=cohort[i::2]) for i in (0, 1)]
    keys = {}
    for r in ranks:
        keys.update(r.public_keys())
    messages = [m for r in ranks for m in r.shares_to_send()]
    for r in ranks:
        r.add_public_keys(keys)
        r.receive_shares(messages)
    with pytest.raises(KeyError, match="not on this rank"):
        ranks[0].mask(1, torch.zeros(d, dtype=torch.int64))
    rows = rows_for(cohort, d, seed=3)
    dropped, survivors = [4], [c for c in cohort if c != 4]
    total = mod_sum(torch.stack([ranks[c % 2].mask(c, rows[c]) for c in survivors]), bits)
    reveals = ranks[0].reveal(survivors, dropped) + ranks[1].reveal(survivors, dropped)
    assert torch.equal(ranks[0].unmask(total, survivors, dropped, reveals), expected_sum(rows, survivors, bits))


def test_mod_sum_of_any_int64_rows():
    rows = torch.tensor([[-1, 2**62, -(2**63), 5], [3, 2**62, 2**63 - 1, -7]], dtype=torch.int64)
    for bits in (1, 7, 62):
        assert mod_sum(rows, bits).tolist() == [(a + b) % (1 << bits) for a, b in zip(*rows.tolist())]


@pytest.mark.parametrize("kwargs,setting", [
    (dict(bits=0), "secagg.bits"), (dict(bits=63), "secagg.bits"), (dict(neighbours=3), "secagg.neighbours"),
    (dict(threshold=1), "secagg.threshold"), (dict(threshold=9), "secagg.threshold"), (dict(d=0), "secagg.d"),
])
def test_bad_settings_name_the_setting(kwargs, setting):
    args = dict(cohort=list(range(8)), bits=16, d=4, round_idx=0, key_source=rng.RandomSource(0))
    with pytest.raises(ConfigError, match=setting):
        SecAggRound(**{**args, **kwargs})


def test_rows_must_be_int64_of_length_d():
    r = SecAggRound([0, 1, 2], 16, 4, 0, rng.RandomSource(0))
    with pytest.raises(TypeError, match="int64"):
        r.mask(0, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="shape"):
        r.mask(0, torch.zeros(5, dtype=torch.int64))
