"""CorrelatedNoise in a run: cyclic participation, refusals, the ledger against dp_accounting, the noise a
zero-update run receives against the factorization's prediction, secrecy of the noise state, resume."""

from __future__ import annotations

import itertools
import math
import os
import re

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from dp_accounting.privacy_accountant import NeighboringRelation

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.federated.sampling import ClientSampler
from dpfl_lightning.plugins import AdaptiveClip, CorrelatedNoise, FedEXP, ServerOptimizer, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.privacy import matrix_factorization as mf
from tests.helpers import TinyClassifier, exact_gaussian_epsilon, quiet_trainer, tiny_data

STRATEGIES = ["tree", "banded", "blt", "independent"]


class Aggregates(FederatedCallback):
    """Records the noised sum of the updates (after the noise, before the server step)."""

    order = 300

    def __init__(self):
        self.sums = []

    def on_aggregate(self, *, server) -> None:
        self.sums.append(server.aggregate["update"].detach().double().clone())


def _run(tmp_path, strategy="banded", rounds=6, m=5, sampling="cyclic", plugins=(), model=None, data=None, **kw):
    cn = kw.pop("noise", None) or CorrelatedNoise(strategy, noise_multiplier=kw.pop("z", 1.0),
                                                  cache_dir=str(tmp_path / "cache"))
    tr = quiet_trainer(str(tmp_path / "run"), rounds=rounds, sampling=sampling, clients_per_round=m,
                       plugins=[UpdateClipping(1.0), cn, *plugins], **kw)
    out = tr.fit(model or TinyClassifier(), data or tiny_data())
    return tr, cn, out


# ------------------------------------------------------------------ the tree's default restarts
def _prefix_rms(strategy, workload, sep, k):
    """The root-mean-square noise of the workload's outputs at z = 1: sqrt(sens^2 ||A L||_F^2 / T)."""
    return math.sqrt(mf.total_squared_error(strategy, workload, sep, k) / workload.T)


@pytest.mark.parametrize("T,b,momentum", [(64, 4, 0.0), (64, 8, 0.0), (64, 16, 0.0), (64, 64, 0.0), (30, 5, 0.0),
                                          (12, 3, 0.0), (40, 7, 0.0), (32, 4, 0.9)])
def test_the_default_tree_restarts_where_its_error_is_least(tmp_path, T, b, momentum):
    from dpfl_lightning.plugins.correlated_noise import build_strategy

    w = mf.momentum(T, momentum)
    k = -(-T // b)
    chosen = build_strategy("tree", w, b, cache_dir=str(tmp_path))
    error = _prefix_rms(chosen, w, b, k)
    # independent noise by hand: C = I has sensitivity sqrt(k), so its error is k ||A||_F^2
    independent = math.sqrt(k * float(w.matrix().pow(2).sum()) / T)
    assert _prefix_rms(mf.independent(T), w, b, k) == pytest.approx(independent, rel=1e-12)
    one_tree = _prefix_rms(mf.tree(T), w, b, k)
    every = [_prefix_rms(mf.tree(T, h), w, b, k) for h in range(math.ceil(math.log2(T)) + 1)]
    assert error <= independent * (1 + 1e-12) and error <= one_tree * (1 + 1e-12)
    assert error == pytest.approx(min(every), rel=1e-12) and chosen.params["height"] == every.index(min(every))
    assert error < min(independent, one_tree)  # restarts do beat both here: the check can fail
    if (T, b) == (64, 4):  # the numbers: 16 participations over 64 rounds
        assert (round(error, 2), round(one_tree, 2), round(independent, 2)) == (15.63, 31.72, 22.80)
        assert chosen.params["height"] == 3
    # cached: the same height from the cache, and the same as computed without one
    assert build_strategy("tree", w, b, cache_dir=str(tmp_path)).params == chosen.params
    assert build_strategy("tree", w, b).params == chosen.params


def test_a_given_tree_height_worse_than_independent_noise_warns(tmp_path, recwarn):
    # 8 rounds, 2 groups (4 participations): one tree (height 3) 6.16 against independent 4.24
    _, cn, _ = _run(tmp_path, "tree", rounds=8, m=10, noise=CorrelatedNoise("tree", noise_multiplier=1.0,
                                                                           tree_height=3))
    said = [str(w.message) for w in recwarn if "tree_height=3" in str(w.message)]
    assert len(said) == 1 and "error is 6.16 per round" in said[0] and "independent noise's 4.243" in said[0]
    assert "Fix: leave tree_height unset" in said[0]
    recwarn.clear()
    _, default, _ = _run(tmp_path, "tree", rounds=8, m=10)
    assert default.strategy.params["height"] == 1 and default.k == 4 and default.min_sep == 2
    _run(tmp_path, "tree", rounds=8, m=10, noise=CorrelatedNoise("tree", noise_multiplier=1.0, tree_height=1))
    assert not [w for w in recwarn if "tree_height" in str(w.message)]


# ------------------------------------------------------------------ participation
def test_cyclic_participation_min_separation_and_count():
    s, random, T = ClientSampler("cyclic", 23, 5), rng.RandomSource(7), 14
    b = s.groups
    assert b == 5  # ceil(23 / 5)
    seen: dict[int, list[int]] = {}
    for t in range(T):
        for c in s.sample(random, t):
            seen.setdefault(c, []).append(t)
    assert sorted(seen) == list(range(23))  # the groups partition the population
    for rounds in seen.values():
        assert len(rounds) <= math.ceil(T / b)
        assert all(b2 - b1 >= b for b1, b2 in zip(rounds, rounds[1:]))
    assert s.sample(random, 3) == s.sample(rng.RandomSource(7, secret=b"x" * 32), 3)  # keyed by the seed alone
    assert s.sample(random, 3) != s.sample(rng.RandomSource(8), 3)


def test_amplified_cyclic_samples_inside_the_group():
    s, random = ClientSampler("amplified_cyclic", 40, 10, 0.5), rng.RandomSource(0)
    group = set(ClientSampler("cyclic", 40, 10).sample(random, 6))
    sizes = []
    for t in (2, 6, 10):
        cohort = s.sample(random, t)
        assert set(cohort) <= group
        sizes.append(len(cohort))
    assert len(set(sizes)) > 1  # independent coins each round
    assert not s.cohort_size_is_public and s.expected_cohort == 5.0


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("sampling,kw", [("poisson", {"sampling_rate": 0.2}), ("uniform", {}), ("full", {})])
def test_other_samplers_are_refused(tmp_path, sampling, kw):
    cn = CorrelatedNoise("banded", noise_multiplier=1.0, cache_dir=str(tmp_path))
    m = None if sampling != "uniform" else 5
    tr = quiet_trainer(str(tmp_path), rounds=3, sampling=sampling, clients_per_round=m,
                       plugins=[UpdateClipping(1.0), cn], **kw)
    with pytest.raises(ConfigError, match="cyclic participation"):
        tr.fit(TinyClassifier(), tiny_data())


def test_amplified_tree_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="proven for banded"):
        _run(tmp_path, "tree", sampling="amplified_cyclic", sampling_rate=0.5)


def test_momentum_needs_the_momentum_workload(tmp_path):
    with pytest.raises(ConfigError, match="workload"):
        _run(tmp_path, "banded", plugins=[ServerOptimizer("sgd", lr=1.0, momentum=0.9)])
    with pytest.raises(ConfigError, match="workload"):
        _run(tmp_path, "banded", plugins=[ServerOptimizer("adam", lr=0.1)])
    cn = CorrelatedNoise("banded", noise_multiplier=1.0, server_momentum=0.9, cache_dir=str(tmp_path / "c"))
    tr, _, _ = _run(tmp_path, noise=cn, plugins=[ServerOptimizer("sgd", lr=1.0, momentum=0.9)])
    assert len(tr.history) == 6 and cn.workload.name == mf.momentum(6, 0.9).name


def _secure_resume(tmp_path, strategy, ckpt, name, z):
    cn = CorrelatedNoise(strategy, noise_multiplier=z, cache_dir=str(tmp_path / "cache"))
    from dpfl_lightning.plugins import PrivacyLedger

    tr = quiet_trainer(str(tmp_path / name), rounds=12, sampling="cyclic", clients_per_round=7, secure=True,
                       checkpoint_every=5, plugins=[UpdateClipping(1.0), cn, PrivacyLedger(delta=1e-3,
                                                                                           accountant="pld")])
    with pytest.warns(UserWarning, match=r"secure-mode resume at round (6|11).*cannot be rebuilt"):
        tr.fit(TinyClassifier(), tiny_data(), ckpt_path=ckpt)
    return tr, cn


def _gaussians_epsilon(zs, delta):
    """Unamplified Gaussians composed are one Gaussian: the ledger gives its exact epsilon."""
    return exact_gaussian_epsilon(zs, delta)


def _released(C, n):
    """C's rows released by the first n rounds (a tree's nodes that end before n), on those rounds."""
    return C[[i for i in range(C.shape[0]) if not C[i, n:].any()]][:, :n]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_secure_resume_restarts_the_mechanism_and_composes_the_segments(tmp_path, strategy):
    """T = 12 rounds, 20 clients in b = 3 cyclic groups. Resumed at round 5, then at round 10: three
    segments [0, 5), [5, 10), [10, 12), each a Gaussian of multiplier z sens(C_i) / sens(C_i's released
    rows on the segment's rounds), sensitivities by brute force under the pattern restricted to them."""
    from dpfl_lightning.plugins import PrivacyLedger

    z, delta = 1.1, 1e-3
    first = CorrelatedNoise(strategy, noise_multiplier=z, cache_dir=str(tmp_path / "cache"))
    full = quiet_trainer(str(tmp_path / "a"), rounds=12, sampling="cyclic", clients_per_round=7, secure=True,
                         checkpoint_every=5, plugins=[UpdateClipping(1.0), first,
                                                      PrivacyLedger(delta=delta, accountant="pld")])
    full.fit(TinyClassifier(), tiny_data())
    C1 = first.strategy.C
    assert first.sensitivity == pytest.approx(_brute_sensitivity(C1, 3, 4), rel=1e-9)
    secrets = [b for t in first._generator.state_tensors() for b in _noise_bytes(t)]

    second, cn2 = _secure_resume(tmp_path, strategy, os.path.join(full.checkpoint_dir, "round-000005.ckpt"), "b", z)
    C2 = cn2.strategy.C
    assert cn2.strategy.T == 7 and cn2.starts == [0, 5]
    assert cn2.sensitivity == pytest.approx(_brute_sensitivity(C2, 3, 3), rel=1e-9)
    assert cn2.scales[5:] == pytest.approx([z * cn2.sensitivity] * 7, rel=1e-12)
    z1 = z * _brute_sensitivity(C1, 3, 4) / _brute_sensitivity(_released(C1, 5), 3, 2)
    if strategy == "independent":
        assert z1 == pytest.approx(z * math.sqrt(4 / 2), rel=1e-12)  # C = I: sqrt(participations)
    # secure mode accounts the mechanisms at delta less its participation bound's tail (the ledger's rule)
    dm = second.ledger.mechanism_delta
    assert 0 < dm <= delta and full.epsilon() == pytest.approx(_gaussians_epsilon([z], dm), rel=1e-9)
    assert second.epsilon() == pytest.approx(_gaussians_epsilon([z1, z], dm), rel=1e-9)
    assert second.epsilon() != pytest.approx(full.epsilon(), rel=1e-3)
    assert "restarted at round 6 on a secure resume, 2 segments" in second.ledger.describe()[0]
    secrets += [b for t in cn2._generator.state_tensors() for b in _noise_bytes(t)]

    third, cn3 = _secure_resume(tmp_path, strategy, os.path.join(second.checkpoint_dir, "round-000010.ckpt"), "c", z)
    assert cn3.starts == [0, 5, 10] and cn3.strategy.T == 2
    z2 = z * _brute_sensitivity(C2, 3, 3) / _brute_sensitivity(_released(C2, 5), 3, 2)
    if strategy == "tree":  # the last 2 rounds: one participation, dp_accounting's tree event (RDP)
        assert cn3.sensitivity == pytest.approx(_brute_sensitivity(cn3.strategy.C, 2, 1), rel=1e-9)
        acc = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
        for event in (dp_accounting.GaussianDpEvent(z1), dp_accounting.GaussianDpEvent(z2),
                      dp_accounting.SingleEpochTreeAggregationDpEvent(z * cn3.sensitivity,
                                                                      _tree_counts(2, cn3.strategy))):
            acc.compose(event)
        expected = acc.get_epsilon(dm)
    else:
        expected = _gaussians_epsilon([z1, z2, z], dm)
    assert third.epsilon() == pytest.approx(expected, rel=1e-9)
    assert [h["epsilon"] for h in third.history][-1] == third.epsilon()
    secrets += [b for t in cn3._generator.state_tensors() for b in _noise_bytes(t)]
    assert secrets or strategy == "independent"  # C = I keeps no state
    for root, _, files in os.walk(tmp_path):
        for name in files:
            if name.endswith(".json") and "cache" in root:
                continue  # factors: functions of T and b only
            data = open(os.path.join(root, name), "rb").read()
            assert not any(s in data for s in secrets), os.path.join(root, name)


# ------------------------------------------------------------------ accounting
def _tree_counts(T, strategy):
    """dp_accounting's step counts of a tree restarted every 2**height rounds over T rounds."""
    size = 2 ** strategy.params["height"]
    return [size] * (T // size) + ([T % size] if T % size else [])


def _dp_accounting_epsilon(strategy, z, sens, T, b, delta, accountant, rate=1.0, counts=None):
    """Independently of the ledger: the Gaussian mechanism of multiplier z over the stream (its exact
    epsilon, whichever accountant: Balle & Wang 2018), dp_accounting's tree event for a single
    participation (``counts``: its restarts), per-participation Poisson-sampled Gaussians when amplified."""
    k = math.ceil(T / b)
    if rate < 1:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z * sens)), k)
    elif strategy == "tree" and k == 1:
        acc = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
        acc.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(z * sens, counts or [T]))
        return acc.get_epsilon(delta)
    else:
        return exact_gaussian_epsilon([z], delta)
    acc = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("strategy,m,sampling", [(s, 5, "cyclic") for s in STRATEGIES] +
                         [("tree", 2, "cyclic"), ("banded", 5, "amplified_cyclic")])
def test_ledger_epsilon_equals_dp_accounting(tmp_path, strategy, m, sampling, accountant):
    from dpfl_lightning.plugins import PrivacyLedger

    z, delta, T = 1.3, 1e-3, 6
    kw = {"sampling_rate": 0.5} if sampling == "amplified_cyclic" else {}
    tr, cn, _ = _run(tmp_path, strategy, rounds=T, m=m, sampling=sampling, z=z,
                     plugins=[PrivacyLedger(delta=delta, accountant=accountant)], **kw)
    b = math.ceil(20 / m)
    counts = _tree_counts(T, cn.strategy) if strategy == "tree" else None
    expected = _dp_accounting_epsilon(strategy, z, cn.sensitivity, T, b, delta, accountant, kw.get("sampling_rate", 1),
                                      counts)
    assert tr.epsilon() == pytest.approx(expected, rel=1e-9)
    line = tr.ledger.describe()[0]
    if cn.stream().kind == "gaussian":  # one Gaussian: exact, and below what dp_accounting's RDP says of it
        acc = rdp.RdpAccountant()
        acc.compose(dp_accounting.GaussianDpEvent(z))
        assert tr.epsilon() < acc.get_epsilon(delta) and f"exact Gaussian accountant ({accountant} was asked for" in line
    else:
        assert f"; {accountant} accountant" in line or "rdp accountant" in line


@pytest.mark.parametrize("sampling,words", [
    ("cyclic", ["cyclic participation, rounds >= 4 apart, no amplification", "one Gaussian over the stream"]),
    ("amplified_cyclic", ["cyclic participation, rounds >= 4 apart, Poisson sampling q=0.5 inside the group",
                          "a Gaussian per participation"])])
def test_printed_guarantee_names_the_participation_and_the_stream(tmp_path, capsys, sampling, words):
    kw = {"sampling_rate": 0.5} if sampling == "amplified_cyclic" else {}
    _, cn, _ = _run(tmp_path, "banded", sampling=sampling, enable_summary=True, z=1.3, **kw)
    printed = capsys.readouterr()
    line = next(x for x in (printed.out + printed.err).splitlines() if "client-level DP, central noise" in x)
    for w in words + ["correlated noise (banded, "]:
        assert w in line, line
    assert "no sampling" not in line and "non-Gaussian" not in line, line
    # every mention of the noise multiplier is z, as in every other privacy line (never z x sensitivity)
    assert cn.sensitivity > 1.2
    said = [float(v) for v in re.findall(r"noise multiplier ([0-9.]+)", line)]
    assert len(said) == 2 and said == [1.3, 1.3], line
    if sampling == "amplified_cyclic":  # the per-participation Gaussian is said as such
        assert f"(x sensitivity {cn.sensitivity:.4g} = {1.3 * cn.sensitivity:.4g} per participation)" in line


def test_a_single_participation_tree_prints_z_as_its_noise_multiplier(tmp_path, capsys):
    _, cn, _ = _run(tmp_path, "tree", rounds=6, m=2, enable_summary=True, z=1.3)  # 10 groups: one participation
    assert cn.stream().kind == "tree" and cn.sensitivity > 1.2
    printed = capsys.readouterr()
    line = next(x for x in (printed.out + printed.err).splitlines() if "client-level DP, central noise" in x)
    assert [float(v) for v in re.findall(r"noise multiplier ([0-9.]+)", line)] == [1.3, 1.3], line
    assert f"= {1.3 * cn.sensitivity:.4g} per tree node)" in line


def test_target_epsilon_is_met(tmp_path):
    cn = CorrelatedNoise("blt", target_epsilon=2.0, cache_dir=str(tmp_path / "c"))
    tr, _, _ = _run(tmp_path, noise=cn)
    assert 2.0 * 0.98 <= tr.epsilon() <= 2.0


def _brute_sensitivity(C, b, k):
    """max over every participation set (pairwise >= b apart, at most k) and sign pattern of ||C s||."""
    T, best = C.shape[1], 0.0
    for n in range(1, k + 1):
        for S in itertools.combinations(range(T), n):
            if any(j - i < b for i, j in zip(S, S[1:])):
                continue
            for signs in itertools.product((1.0, -1.0), repeat=n - 1):
                v = C[:, S[0]] + sum(s * C[:, j] for s, j in zip(signs, S[1:]))
                best = max(best, float(v.norm()))
    return best


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plugin_sensitivity_equals_brute_force(tmp_path, strategy):
    T, m = 12, 7  # 20 clients in b = 3 groups
    _, cn, _ = _run(tmp_path, strategy, rounds=T, m=m)
    assert cn.min_sep == 3 and cn.k == 4
    assert cn.sensitivity == pytest.approx(_brute_sensitivity(cn.strategy.C, 3, 4), rel=1e-9)


# ------------------------------------------------------------------ the noise a zero-update run receives
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zero_update_noise_has_the_predicted_covariance(tmp_path, strategy):
    T, z = 8, 0.7
    rec = Aggregates()
    model = TinyClassifier(in_features=200, lr=0.0)  # zero updates: the model moves by the noise alone
    start = None
    tr, cn, out = _run(tmp_path, strategy, rounds=T, z=z, plugins=[rec], model=model, data=tiny_data(dim=200))
    X = torch.stack(rec.sums)  # [T, d]: round t's noise (L Z)_t scale
    scale = z * cn.sensitivity * 1.0
    predicted = scale ** 2 * cn.strategy.covariance()
    d = X.shape[1]
    empirical = X @ X.T / d
    tol = 5 * math.sqrt(2.0 / d)  # 5 standard errors of a variance estimate from d coordinates
    diag = predicted.diagonal()
    assert torch.allclose(empirical.diagonal() / diag, torch.ones(T, dtype=torch.float64), atol=tol)
    norm = torch.sqrt(diag[:, None] * diag[None, :])
    assert ((empirical - predicted).abs() / norm).max() < tol
    total = float(X.sum(0).var(unbiased=False))
    summed = scale ** 2 * mf.final_variance(cn.strategy, mf.prefix_sum(T), unit_sensitivity=True)
    assert total == pytest.approx(summed, rel=tol)
    del start, tr, out


# ------------------------------------------------------------------ composition
def test_noise_follows_the_adaptive_bound(tmp_path):
    cn = CorrelatedNoise("banded", noise_multiplier=1.0, cache_dir=str(tmp_path / "c"))
    tr = quiet_trainer(str(tmp_path / "r"), rounds=6, sampling="cyclic", clients_per_round=5,
                       plugins=[AdaptiveClip(initial_clip=1.0, target_quantile=0.5, count_noise=2.0), cn])
    tr.fit(TinyClassifier(), tiny_data())
    clips = [h["clip_norm"] for h in tr.history]
    assert len(set(clips)) > 1  # the bound moved
    assert cn.scales == pytest.approx([cn.noise_multiplier * cn.sensitivity * c for c in clips], rel=1e-12)
    assert tr.epsilon() < math.inf and "AdaptiveClip" in tr.ledger.describe()[0]


def test_frozen_parameters_get_no_noise(tmp_path):
    model = TinyClassifier(lr=0.0)
    model.net[0].requires_grad_(False)
    frozen_before = model.net[0].weight.detach().clone()
    trainable_before = model.net[2].weight.detach().clone()
    _run(tmp_path, "blt", model=model)
    assert torch.equal(model.net[0].weight.detach(), frozen_before)
    assert not torch.equal(model.net[2].weight.detach(), trainable_before)


def test_fedexp_cdp_composes_and_local_variants_are_refused(tmp_path):
    tr, _, _ = _run(tmp_path, "banded", plugins=[FedEXP("cdp")])
    assert "FedEXP" in tr.ledger.describe()[0] and tr.epsilon() < math.inf
    with pytest.raises(ConfigError):
        _run(tmp_path, "banded", plugins=[FedEXP("ldp_gaussian")])


# ------------------------------------------------------------------ secrecy and resume
def _noise_bytes(x: torch.Tensor) -> list[bytes]:
    v = x.reshape(-1)[:4]
    return [v.double().numpy().tobytes(), v.float().numpy().tobytes()]


def test_noise_state_never_written_and_resume_is_bit_identical(tmp_path):
    full, cn, ref = _run(tmp_path / "a", "banded", rounds=6, checkpoint_every=3)
    secrets = [b for t in cn._generator.state_tensors() for b in _noise_bytes(t)]
    assert secrets or strategy == "independent"  # C = I keeps no state
    for root, _, files in os.walk(tmp_path / "a"):
        for name in files:
            if name.endswith(".json") and "cache" in root:
                continue  # the factor (a function of T and b only)
            data = open(os.path.join(root, name), "rb").read()
            assert not any(s in data for s in secrets), os.path.join(root, name)
    first = os.path.join(full.checkpoint_dir, "round-000003.ckpt")
    cn2 = CorrelatedNoise("banded", noise_multiplier=1.0, cache_dir=str(tmp_path / "a" / "cache"))
    resumed = quiet_trainer(str(tmp_path / "b"), rounds=6, sampling="cyclic", clients_per_round=5,
                            plugins=[UpdateClipping(1.0), cn2])
    out = resumed.fit(TinyClassifier(seed=5), tiny_data(), ckpt_path=first)
    assert torch.equal(out.global_params, ref.global_params)
    assert [h["epsilon"] for h in resumed.history] == [h["epsilon"] for h in full.history]


def test_state_is_buffers_times_d_at_a_million_parameters():
    from dpfl_lightning.privacy.correlated_noise import noise_generator
    from dpfl_lightning.plugins.correlated_noise import build_strategy

    d, T = 1_000_000, 16
    for kind, rows in (("blt", 3), ("banded", 3)):
        s = build_strategy(kind, mf.prefix_sum(T), 4, buffers=3)
        gen = noise_generator(s, d, lambda t, r: torch.randn(r, d, dtype=torch.float64,
                                                              generator=torch.Generator().manual_seed(t)))
        for _ in range(6):
            gen.next()
        assert sum(t.numel() for t in gen.state_tensors()) == rows * d  # buffers x d; banded: (b - 1) x d


# ------------------------------------------------------------------ dpfl audit and dpfl privacy on correlated-noise runs
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FTRL = ["--config", os.path.join(ROOT, "configs", "ftrl_banded.yaml"), "--trainer.rounds", "4",
        "--trainer.local_epochs", "1", "--trainer.enable_progress_bar", "false", "--trainer.num_threads", "1"]


def test_dpfl_audit_runs_canaries_through_correlated_noise(tmp_path, capsys):
    import re

    import yaml

    from dpfl_lightning.cli import command as cli

    z, delta = 3.0, 1e-4
    cfg = {"trainer": {"rounds": 6, "clients_per_round": 100, "sampling": "cyclic", "local_steps": 1, "batch_size": 4,
                       "seed": 0, "num_threads": 1, "enable_progress_bar": False, "enable_summary": False,
                       "log_dir": str(tmp_path / "runs"),
                       "plugins": [{"class_path": "dpfl_lightning.plugins.UpdateClipping", "init_args": {"max_norm": 1.0}},
                                   {"class_path": "dpfl_lightning.plugins.CorrelatedNoise",
                                    "init_args": {"strategy": "banded", "noise_multiplier": z,
                                                  "cache_dir": str(tmp_path / "cache")}}]},
           "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                     "init_args": {"in_features": 10, "hidden": [128], "num_classes": 10, "lr": 0.5}},
           "data": {"class_path": "dpfl_lightning.data.SyntheticLogistic",
                    "init_args": {"num_clients": 400, "samples_per_client": 12, "test_samples_per_client": 4, "dim": 10}}}
    path = tmp_path / "ftrl_audit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli.main(["audit", "--config", str(path), "--canaries", "100"])  # exit 0: consistent
    out = capsys.readouterr().out
    assert "100 canaries" in out and "consistent" in out and "REFUTED" not in out and "VIOLATED" not in out
    assert "correlated noise (banded" in out
    ledger = exact_gaussian_epsilon([z], delta)  # the ledger's: one Gaussian of multiplier z over the 6-round stream
    for model in ("only the final model is seen", "every round's model is seen"):
        row = re.search(re.escape(model) + r"\s+([0-9.]+)\s", out)
        assert float(row.group(1)) == pytest.approx(ledger, abs=6e-4), out


def test_dpfl_privacy_epsilon_and_selection_plan_give_the_ledgers_epsilon(tmp_path, capsys):
    import csv
    import glob
    import re

    from dpfl_lightning.cli import command as cli

    cli.main(["privacy", "epsilon", *FTRL])
    out = capsys.readouterr().out
    planned = float(re.search(r"epsilon = ([0-9.]+) after 4 rounds", out).group(1))
    z = float(re.search(r"noise multiplier ([0-9.]+);", out).group(1))
    assert "cyclic participation, rounds >= 4 apart, no amplification" in out and "one Gaussian over the stream" in out
    cli.main(["fit", *FTRL, "--trainer.log_dir", str(tmp_path)])
    capsys.readouterr()
    (path,) = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    with open(path) as f:
        logged = [float(r["epsilon"]) for r in csv.DictReader(f) if r.get("epsilon")]
    assert logged and all(e == pytest.approx(planned, abs=1e-4) for e in logged)  # the stream's, from round 1

    # the configured 30 rounds: one Gaussian over the stream calibrated to the same target, so the same z
    cli.main(["privacy", "plan", "--selection", FTRL[1], "--delta", "1e-4"])
    table = capsys.readouterr().out
    rows = {int(m.group(1)): (float(m.group(2)), float(m.group(3)), float(m.group(4)))
            for m in re.finditer(r"^\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)$", table, re.M)}
    for mean, (selected, one, every) in rows.items():
        assert one == pytest.approx(planned, abs=2e-3)
        # a grid of `mean` runs: the stream `mean` times, one Gaussian of multiplier z / sqrt(mean), exactly
        assert every == pytest.approx(exact_gaussian_epsilon([z] * mean, 1e-4), rel=5e-3)
        assert selected > 0  # it once composed a stream's release as zero rounds
    assert len(rows) >= 5
