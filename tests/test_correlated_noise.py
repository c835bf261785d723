"""Streaming correlated noise: equals the dense ``L Z``, resumes bit for bit, has the covariance the
factorization predicts, and keeps O(b x d) / O(buffers x d) / O(log T x d) state."""

import math

import pytest
import torch

from dpfl_lightning.privacy import mf_optimize
from dpfl_lightning.privacy.correlated_noise import noise_generator
from dpfl_lightning.privacy.matrix_factorization import independent, prefix_sum, tree

F64 = torch.float64
T = 16


def keyed_normal(d, seed=0, dtype=F64):
    """A keyed stream per round: the same round always draws the same rows."""
    def normal(t, rows):
        g = torch.Generator().manual_seed(1_000_003 * seed + t)
        return torch.randn(rows, d, generator=g, dtype=dtype)
    return normal


def dense_inverse(strategy):
    """L computed independently of the library's: C^{-1} for square C, the least-squares prefix-sum
    estimator's increments for a tree."""
    C = strategy.C
    if C.shape[0] == C.shape[1]:
        return torch.linalg.solve_triangular(C, torch.eye(C.shape[1], dtype=F64), upper=False)
    prefix = []
    for t in range(C.shape[1]):
        done = [r for r in range(C.shape[0]) if int(C[r].nonzero().max()) <= t]
        row = torch.zeros(C.shape[0], dtype=F64)
        row[done] = torch.ones(t + 1, dtype=F64) @ torch.linalg.pinv(C[done][:, : t + 1])
        prefix.append(row)
    prefix = torch.stack(prefix)
    return torch.cat([prefix[:1], prefix[1:] - prefix[:-1]])


@pytest.fixture(scope="module")
def strategies():
    W = prefix_sum(T)
    return {"independent": independent(T), "tree": tree(T), "tree-restarts": tree(T, height=2),
            "banded": mf_optimize.banded(W, 4), "blt": mf_optimize.blt(W, 3, min_sep=4)}


NAMES = ["independent", "tree", "tree-restarts", "banded", "blt"]


def stacked_rows(strategy, normal):
    return torch.cat([normal(t, strategy.rows_per_round[t]) for t in range(strategy.T)])


@pytest.mark.parametrize("name", NAMES)
def test_stream_equals_dense_noise(strategies, name):
    s, d = strategies[name], 7
    normal = keyed_normal(d, seed=1)
    gen = noise_generator(s, d, normal)
    streamed = torch.stack([gen.next() for _ in range(T)])
    assert torch.allclose(streamed, dense_inverse(s) @ stacked_rows(s, normal), rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="T=16"):
        gen.next()


@pytest.mark.parametrize("name", NAMES)
def test_resume_reproduces_the_uninterrupted_stream_bit_for_bit(strategies, name):
    s, d = strategies[name], 5
    normal = keyed_normal(d, seed=2)
    gen = noise_generator(s, d, normal)
    full = [gen.next() for _ in range(T)]
    for r in (1, 5, 8, 11):
        fresh = noise_generator(s, d, normal)
        fresh.resume(r)
        assert all(torch.equal(fresh.next(), full[t]) for t in range(r, T))


@pytest.mark.parametrize("name", ["banded", "blt", "tree"])
def test_scaled_rounds_match_the_dense_noise_of_scaled_rows(strategies, name):
    s, d = strategies[name], 4
    normal = keyed_normal(d, seed=3)
    scales = [1.0 + 0.1 * t for t in range(T)]
    gen = noise_generator(s, d, normal)
    streamed = torch.stack([gen.next(scale=scales[t]) for t in range(T)])
    row_scales = torch.tensor([scales[t] for t in range(T) for _ in range(s.rows_per_round[t])], dtype=F64)
    dense = dense_inverse(s) @ (row_scales[:, None] * stacked_rows(s, normal))
    assert torch.allclose(streamed, dense, rtol=0, atol=1e-12)
    resumed = noise_generator(s, d, normal)
    resumed.resume(7, scales)
    assert torch.equal(resumed.next(scale=scales[7]), streamed[7])


@pytest.mark.parametrize("name", NAMES)
def test_zero_update_noise_has_the_predicted_covariance(strategies, name):
    """Each coordinate is an independent draw of the T-round noise: n = 100k draws."""
    s, n = strategies[name], 100_000
    gen = noise_generator(s, n, keyed_normal(n, seed=4))
    X = torch.stack([gen.next() for _ in range(T)])  # [T, n]
    L = dense_inverse(s)
    predicted = L @ L.T
    empirical = X @ X.T / n
    # entry (t, u) of a Gaussian sample covariance has variance (S_tt S_uu + S_tu^2) / n
    sd = ((torch.diag(predicted)[:, None] * torch.diag(predicted)[None, :] + predicted ** 2) / n).sqrt()
    assert ((empirical - predicted).abs() <= 5 * sd).all()
    total = X.sum(0)  # the final model's noise: the sum over rounds
    var_total = float(predicted.sum())
    assert abs(float(total.pow(2).mean()) - var_total) <= 5 * var_total * math.sqrt(2 / n)


@pytest.mark.parametrize("kind, bound", [("banded", lambda s: (s.params["b"] - 1)),
                                         ("blt", lambda s: s.params["buffers"]),
                                         ("tree", lambda s: s.params["height"] + 1)])
def test_state_is_a_few_rows_of_d_on_a_million_parameters(kind, bound):
    d, rounds = 1_000_000, 32
    W = prefix_sum(rounds)
    s = {"banded": lambda: mf_optimize.banded(W, 6), "blt": lambda: mf_optimize.blt(W, 4),
         "tree": lambda: tree(rounds)}[kind]()
    gen = noise_generator(s, d, keyed_normal(d, seed=5, dtype=torch.float32))
    most = 0
    for _ in range(rounds):
        gen.next()
        most = max(most, sum(x.numel() for x in gen.state_tensors()))
    assert most <= bound(s) * d
    assert most >= d  # it does keep state


def test_a_normal_of_the_wrong_shape_is_refused(strategies):
    gen = noise_generator(strategies["banded"], 3, lambda t, rows: torch.zeros(rows, 4, dtype=F64))
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        gen.next()


@pytest.mark.parametrize("kind", ["banded", "blt", "tree"])
def test_float32_recursion_stays_within_float32_rounding_of_float64(tmp_path, kind):
    """The plugin draws rows and keeps state in float32: the same rows through the float32 and the float64
    recursion differ by float32 rounding only (no growth over the rounds), per round and in the prefix sum."""
    from dpfl_lightning.plugins.correlated_noise import build_strategy
    from dpfl_lightning.privacy.correlated_noise import noise_generator

    T, d = 400, 500
    s = build_strategy(kind, prefix_sum(T), 8, cache_dir=str(tmp_path))

    def rows(t, r):
        return torch.randn(r, d, generator=torch.Generator().manual_seed(t), dtype=torch.float32)

    g64, g32 = noise_generator(s, d, lambda t, r: rows(t, r).double()), noise_generator(s, d, rows)
    s64 = torch.zeros(d, dtype=torch.float64)
    s32 = torch.zeros(d, dtype=torch.float64)
    for _ in range(T):
        a, b = g64.next(0.5), g32.next(0.5)
        assert b.dtype == torch.float32
        assert float((a - b.double()).norm() / a.norm()) < 2e-6
        s64 += a
        s32 += b.double()
    assert float((s64 - s32).norm() / s64.norm()) < 2e-6
