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
from dpfl_lightning.comm.secagg import (Reveal, SecAggRound, TooFewSurvivorsError, UnmaskingRefusedError, agree,
                                        mod_sum, prg_words, simulate_dropouts)
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
    pick = random.Random(0)
    for n_drop in range(1, n - t + 1):  # one dropout pattern per round (a round is unmasked once)
        r = SecAggRound(cohort, bits, d, 2 + n_drop, rng.RandomSource(9), threshold=t)
        dropped = sorted(pick.sample(cohort, n_drop))
        survivors = [c for c in cohort if c not in dropped]
        total = masked_sum(r, rows, survivors, bits)
        assert torch.equal(r.unmask(total, survivors, dropped), expected_sum(rows, survivors, bits)), n_drop
    r = SecAggRound(cohort, bits, d, 2, rng.RandomSource(9), threshold=t)
    dropped = cohort[: n - t + 1]  # t - 1 survivors
    survivors = cohort[n - t + 1 :]
    with pytest.raises(TooFewSurvivorsError, match="secagg.threshold"):
        r.unmask(masked_sum(r, rows, survivors, bits), survivors, dropped)


def test_dropouts_k_regular_graph_recover_or_refuse():
    bits, d, n, k, t = 16, 32, 20, 6, 4
    cohort = list(range(100, 100 + n))
    rows = rows_for(cohort, d, seed=2)
    pick = random.Random(1)
    outcomes = set()
    for trial in range(30):  # one dropout pattern per round (a round is unmasked once)
        r = SecAggRound(cohort, bits, d, trial, rng.RandomSource(5), neighbours=k, threshold=t)
        dropped = sorted(pick.sample(cohort, 1 + trial % 8))
        survivors = [c for c in cohort if c not in dropped]
        # the server needs t surviving holders of each survivor's b, and of each dropped client's sk
        # when that client has a surviving neighbour
        needed = [c for c in cohort if c in survivors or any(v in survivors for v in r.graph.neighbours(c))]
        ok = all(sum(h in survivors for h in r.graph.holders(c)) >= t for c in needed)
        total = masked_sum(r, rows, survivors, bits)
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


# ------------------------------------------------------------------------------- double unmasking
def strip_pairwise_masks(r, late_row, owner, private_key, bits):
    """The server's attempt on a row of ``owner`` that arrived after the round was unmasked: remove its
    pairwise masks with every neighbour, recomputed from ``owner``'s private key (Python integers)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    sk = X25519PrivateKey.from_private_bytes(private_key)
    values = [int(v) for v in late_row.tolist()]
    for v in r.graph.neighbours(owner):
        mask = prg_words(agree(sk, r.public_keys()[v], r.round_idx, owner, v), len(values))
        sign = -1 if v > owner else 1  # owner added +PRG(s_uv) for v > owner, -PRG(s_uv) for v < owner
        values = [x + sign * int(m) for x, m in zip(values, mask)]
    return [x % (1 << bits) for x in values]


def test_double_unmasking_attack_is_refused_and_the_late_row_stays_masked():
    """Bonawitz et al. 2017, Round 4: the server unmasks with client 0 dropped (getting shares of its
    private key), then 0's row arrives late and the server asks again with 0 alive, for its self-mask seed."""
    cohort, d, bits = list(range(6)), 16, 32  # complete graph: 6 holders, t = 4
    rows = rows_for(cohort, d, seed=4)
    r = SecAggRound(cohort, bits, d, 3, rng.RandomSource(21))
    survivors, dropped = cohort[1:], [0]
    first = r.reveal(survivors, dropped)
    assert torch.equal(r.unmask(masked_sum(r, rows, survivors, bits), survivors, dropped, first),
                       expected_sum(rows, survivors, bits))  # the honest round still unmasks
    late = r.mask(0, rows[0])
    with pytest.raises(UnmaskingRefusedError, match=r"clients \[0\] that clients \[1, 2, 3, 4, 5\] already treated "
                       r"as dropped.*Bonawitz et al\. 2017.*Round 4"):
        r.reveal(cohort, [])
    with pytest.raises(UnmaskingRefusedError):  # nor through unmask, which asks for the reveals itself
        r.unmask(mod_sum(torch.stack([r.mask(c, rows[c]) for c in cohort]), bits), cohort, [])
    # with what the protocol returned -- the private key of 0 -- the late row is still masked by PRG(b_0)
    shares = [x.share for x in first if x.owner == 0]
    assert {x.kind for x in first if x.owner == 0} == {"private_key"}
    guess = strip_pairwise_masks(r, late, 0, shamir.reconstruct(shares, r.threshold), bits)
    truth = [x % (1 << bits) for x in rows[0].tolist()]
    assert sum(g == x for g, x in zip(guess, truth)) <= 1  # uniform words: no coordinate recovered (but by chance)
    # the control: the refused secret was all that stood between the server and the row
    b0 = prg_words(r.client_secrets(0).self_mask_seed, d)
    assert [(g - int(m)) % (1 << bits) for g, m in zip(guess, b0)] == truth


@pytest.mark.parametrize("first,second,match", [
    ([0], [], "already treated as dropped"),  # the attack: 0 dropped, then alive
    ([], [0], "already treated as surviving"),  # the other way round
    ([0], [0], "second unmasking request"),  # the same request again
    ([0, 3], [3], "already treated as dropped"),  # 0 brought back with another dropout
    ([2], [2, 5], "already treated as surviving"),  # 5 dropped after its seed's shares were revealed
])
def test_each_client_answers_one_unmasking_request_per_round(first, second, match):
    cohort = list(range(7))
    r = SecAggRound(cohort, 16, 4, 0, rng.RandomSource(2))
    answered = r.reveal([c for c in cohort if c not in first], first)
    with pytest.raises(UnmaskingRefusedError, match=match):
        r.reveal([c for c in cohort if c not in second], second)
    kinds = {}
    for x in answered:
        kinds.setdefault(x.owner, set()).add(x.kind)
    assert all(len(k) == 1 for k in kinds.values()) and set(kinds) == set(cohort)
    fresh = SecAggRound(cohort, 16, 4, 1, rng.RandomSource(2))  # the next round is a new request
    again = fresh.reveal([c for c in cohort if c not in second], second)
    assert {x.kind for x in again} == ({"private_key", "self_mask"} if second else {"self_mask"})


def test_holders_split_between_two_requests_never_give_both_secrets_at_a_strict_majority():
    """Across ranks no signed consistency round is simulated: a server may send holders on different
    ranks different survivor sets. Every way of splitting client 0's 7 holders between "0 dropped" and
    "0 survived" gives the server fewer than t shares of one of 0's two secrets at the default
    (strict-majority) threshold; at t = 3 some split gives it both (why the default is a majority)."""
    cohort = list(range(7))
    src = rng.RandomSource(6)
    for threshold, safe in ((None, True), (3, False)):
        both = []
        for told_dropped in itertools.product([False, True], repeat=6):  # holders 1..6; 0 itself survives
            ranks = [SecAggRound(cohort, 16, 4, 0, src, threshold=threshold, local_clients=[c]) for c in cohort]
            keys, messages = {}, []
            for rank in ranks:
                keys.update(rank.public_keys())
                messages += rank.shares_to_send()
            for rank in ranks:
                rank.add_public_keys(keys)
                rank.receive_shares(messages)
            got = {"private_key": [], "self_mask": []}
            for c, rank in enumerate(ranks):
                gone = [0] if c and told_dropped[c - 1] else []
                got_c = rank.reveal([v for v in cohort if v not in gone], gone)
                for x in got_c:
                    if x.owner == 0:
                        got[x.kind].append(x.share)
            t = ranks[0].threshold
            if all(len(v) >= t for v in got.values()):
                assert shamir.reconstruct(got["private_key"], t) == ranks[0].client_secrets(0).private_key
                both.append(told_dropped)
        assert (not both) is safe, (threshold, both[:3])


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
