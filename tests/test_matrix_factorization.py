"""Matrix-factorization strategies: workloads, sensitivities against brute force, error orderings,
the tree's least-squares estimator, the BLT's structure and the on-disk cache."""

import itertools
import json
import math
import os

import pytest
import torch

from dpfl_lightning.privacy import mf_optimize
from dpfl_lightning.privacy.matrix_factorization import (final_variance, independent, momentum, prefix_sum,
                                                         total_squared_error, tree)
from dpfl_lightning.privacy.mf_sensitivity import sensitivity, sensitivity_details

F64 = torch.float64


def allowed_sets(T, b, k):
    """Every non-empty set of rounds pairwise >= b apart with at most k members."""
    for size in range(1, k + 1):
        for s in itertools.combinations(range(T), size):
            if all(y - x >= b for x, y in zip(s, s[1:])):
                yield s


def brute_sensitivity(C, b, k=None):
    M = (C.T @ C).double()
    T = M.shape[0]
    k = math.ceil(T / b) if k is None else k
    return math.sqrt(max(float(M[list(s)][:, list(s)].sum()) for s in allowed_sets(T, b, k)))


@pytest.fixture(scope="module")
def strategies12():
    W = prefix_sum(12)
    return {"independent": independent(12), "tree": tree(12), "tree-restarts": tree(12, height=2),
            "banded3": mf_optimize.banded(W, 3), "banded12": mf_optimize.banded(W, 12),
            "blt": mf_optimize.blt(W, 3, min_sep=3)}


@pytest.mark.parametrize("name", ["independent", "tree", "tree-restarts", "banded3", "banded12", "blt"])
@pytest.mark.parametrize("b", [1, 2, 3, 5, 12])
def test_sensitivity_equals_brute_force_over_all_allowed_participations(strategies12, name, b):
    C = strategies12[name].C
    M = C.T @ C
    far = (torch.arange(12)[:, None] - torch.arange(12)[None, :]).abs() >= b
    # the brute force maximises 1_S^T M 1_S: that is the sensitivity when M >= 0, or when the cross
    # terms of allowed sets vanish (banded C under min-separation b)
    assert (M >= -1e-12).all() or (M[far].abs() < 1e-12).all()
    details = sensitivity_details(C, b)
    assert details.exact
    assert details.value == pytest.approx(brute_sensitivity(C, b), rel=1e-10)


@pytest.mark.parametrize("T, height, b", [(16, 2, 3), (16, 3, 5), (20, 2, 3), (20, None, 4)])
def test_tree_sensitivity_equals_brute_force_across_restarts(T, height, b):
    C = tree(T, height).C
    assert sensitivity(C, b) == pytest.approx(brute_sensitivity(C, b), rel=1e-10)


def test_sensitivity_with_fewer_participations_than_the_pattern_allows(strategies12):
    for name in ("tree", "blt", "banded3"):
        C = strategies12[name].C
        assert sensitivity(C, 3, 2) == pytest.approx(brute_sensitivity(C, 3, 2), rel=1e-10)


def test_unstructured_nonnegative_and_signed_factors():
    g = torch.Generator().manual_seed(0)
    C = torch.rand(14, 10, generator=g, dtype=F64)  # M >= 0, no structure: enumeration
    d = sensitivity_details(C, 2)
    assert d.exact and d.value == pytest.approx(brute_sensitivity(C, 2), rel=1e-10)
    S = torch.randn(14, 10, generator=g, dtype=F64)  # signed M: a safe upper bound, flagged
    d = sensitivity_details(S, 3)
    assert not d.exact
    M = S.T @ S
    worst_signs = max(float(sg @ M[list(s)][:, list(s)] @ sg) for s in allowed_sets(10, 3, 4)
                      for sg in (torch.tensor(x, dtype=F64) for x in itertools.product([-1.0, 1.0], repeat=len(s))))
    assert d.value ** 2 >= worst_signs - 1e-9


def test_single_participation_sensitivities():
    assert tree(16).sensitivity() == pytest.approx(math.sqrt(5))  # 5 levels contain each round
    # 128 leaves, but the root and level-6 node [64, 128) never complete within 100 rounds: 7 levels
    assert tree(100).sensitivity() == pytest.approx(math.sqrt(7))
    assert tree(64, height=3).sensitivity() == pytest.approx(2.0)  # restarts every 8 rounds
    assert independent(50).sensitivity(5) == pytest.approx(math.sqrt(10))


def test_workloads_match_server_sgd_with_and_without_momentum():
    T, beta, lr = 9, 0.8, 0.1
    g = torch.randn(T, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    for workload, b in ((prefix_sum(T), 0.0), (momentum(T, beta), beta)):
        x, m, xs = torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64), []
        for t in range(T):
            m = b * m + g[t]
            x = x - lr * m
            xs.append(x)
        assert torch.allclose(torch.stack(xs), -lr * workload.matrix() @ g, atol=1e-13)


def test_tree_noise_is_the_least_squares_estimate_from_the_nodes_complete_so_far():
    for T, h in ((12, None), (16, None), (13, 2)):
        s = tree(T, h)
        prefix_noise = torch.cumsum(s.inverse, 0)  # prefix sums' noise as combinations of Z's rows
        for t in range(T):
            done = [r for r in range(s.C.shape[0]) if int(s.C[r].nonzero().max()) <= t]
            blue = torch.ones(t + 1, dtype=F64) @ torch.linalg.pinv(s.C[done][:, : t + 1])
            expected = torch.zeros(s.C.shape[0], dtype=F64)
            expected[done] = blue
            assert torch.allclose(prefix_noise[t], expected, atol=1e-12)
    # Honaker's estimate has less noise than summing the raw nodes of the prefix's decomposition
    plain = sum(bin(t + 1).count("1") for t in range(16))
    assert float(torch.cumsum(tree(16).inverse, 0).pow(2).sum()) < plain


def test_banded_error_ordering_at_T64():
    T = 64
    W = prefix_sum(T)
    ident = total_squared_error(independent(T), W)
    one = mf_optimize.banded(W, 1)
    assert total_squared_error(one, W) == pytest.approx(ident)
    previous = ident
    for b in (2, 4, 8, 16):
        s = mf_optimize.banded(W, b)
        for sep in (b, T):  # cyclic participation in b groups, and single participation
            assert total_squared_error(s, W, sep) <= total_squared_error(one, W, sep) * (1 + 1e-9)
        err = total_squared_error(s, W)
        assert err <= previous * (1 + 1e-9)  # more bands never hurt (single participation)
        previous = err
    full = total_squared_error(mf_optimize.banded(W, T), W)
    assert full <= total_squared_error(tree(T), W)
    assert full <= previous * (1 + 1e-9)


def test_blt_is_monotone_positive_and_close_to_the_full_toeplitz_optimum():
    T = 64
    W = prefix_sum(T)
    s = mf_optimize.blt(W, 3)
    c = s.C[:, 0]
    assert (c > 0).all() and (c[1:] <= c[:-1]).all()
    assert s.sensitivity_details(8).method == "monotone"  # cyclic in 8 groups: the earliest pattern
    assert total_squared_error(s, W) <= 1.03 * total_squared_error(mf_optimize.banded(W, T), W)
    cyclic = mf_optimize.blt(W, 3, min_sep=8)
    assert total_squared_error(cyclic, W, 8) <= total_squared_error(s, W, 8) * (1 + 1e-9)


def test_momentum_workload_is_optimised_for():
    T = 32
    W = momentum(T, 0.9)
    for_momentum = mf_optimize.banded(W, 4)
    for_prefix = mf_optimize.banded(prefix_sum(T), 4)
    assert total_squared_error(for_momentum, W) <= total_squared_error(for_prefix, W) * (1 + 1e-9)


def test_the_cache_is_written_once_and_read_back(tmp_path):
    W = prefix_sum(40)
    first = mf_optimize.banded(W, 5, cache_dir=str(tmp_path))
    files = os.listdir(tmp_path)
    assert len(files) == 1 and not files[0].startswith(".tmp")
    assert first.params["optimise_seconds"] > 0
    again = mf_optimize.banded(W, 5, cache_dir=str(tmp_path))
    assert again.params["optimise_seconds"] == 0.0 and torch.equal(again.C, first.C)
    stored = json.load(open(tmp_path / files[0]))
    assert stored["value"]["c"] == [float(v) for v in first.params["coeffs"]]
    mf_optimize.banded(W, 6, cache_dir=str(tmp_path))
    mf_optimize.blt(W, 2, cache_dir=str(tmp_path))
    assert len(os.listdir(tmp_path)) == 3


def test_final_variance_of_the_prefix_sum():
    T = 16
    W = prefix_sum(T)
    assert final_variance(independent(T), W, unit_sensitivity=True) == pytest.approx(T)
    # a single tree's root estimate: variance v_4 of Honaker's recursion, times 5 levels' sensitivity^2
    v = 1.0
    for _ in range(4):
        v = 1 / (1 + 1 / (2 * v))
    assert final_variance(tree(T), W) == pytest.approx(5 * v)


@pytest.mark.parametrize("call, word", [
    (lambda: sensitivity(torch.eye(4), 0), "min_sep"),
    (lambda: sensitivity(torch.eye(4), 2, 0), "max_participations"),
    (lambda: mf_optimize.banded(prefix_sum(8), 9), "banded b"),
    (lambda: mf_optimize.blt(prefix_sum(8), 0), "blt buffers"),
    (lambda: momentum(8, 1.0), "momentum beta"),
    (lambda: tree(8, -1), "tree height"),
    (lambda: total_squared_error(tree(8), prefix_sum(9)), "T=8"),
])
def test_bad_input_is_refused_by_name(call, word):
    with pytest.raises(ValueError, match=word):
        call()
