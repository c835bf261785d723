"""Paper 001 (DP-SCAFFOLD) accountant: Table 1 reproduced, the bound's structure, and the modern
dp_accounting comparison.

The expected T values are the ones printed in the paper's Table 1 (Table 4 prints the same): an
independent reference. A plain-loop transcription of Lemma B.7 / App. B.4 checks the vectorised
code at single points.
"""

import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
import yaml
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.privacy import paper001
from dpfl_lightning.privacy.paper001 import (
    max_rounds,
    modern_epsilon,
    modern_event,
    modern_max_rounds,
    paper_epsilon,
    paper_rdp,
    wang_general_cgf,
)

EPS, L, S, R, M = 3.0, 0.05, 0.2, 4000, 100
RUN = dict(l=L, s=S, R=R, M=M)
DELTA = 1 / (M * R)
KS = (1, 5, 10, 20, 40)
PUBLISHED = {  # Table 1 of the paper: largest T for each sigma_g (rows) and K (columns)
    10: (542, 488, 428, 324, 72),
    20: (545, 502, 451, 352, 83),
    40: (546, 505, 457, 360, 86),
    80: (546, 506, 458, 362, 87),
}


@pytest.mark.parametrize("sigma_g", sorted(PUBLISHED))
def test_table1_reproduced(sigma_g):
    assert tuple(max_rounds(EPS, sigma_g, k, **RUN) for k in KS) == PUBLISHED[sigma_g]


def test_table1_boundaries_are_not_knife_edge():
    # the published T is within budget and T + 1 is not, each by a margin well above rounding
    for sigma_g, row in PUBLISHED.items():
        for k, t in zip(KS, row):
            assert paper_epsilon(sigma_g, k, t, **RUN) <= EPS - 1e-4
            assert paper_epsilon(sigma_g, k, t + 1, **RUN) >= EPS + 1e-4


def test_sigma_160_row_is_off_by_at_most_one():
    # Printed: 546, 506, 458, 362, 87 (a copy of the sigma_g = 80 row); the method gives one more
    # round for K = 5, 10, 20, where epsilon at the printed T + 1 is below 3 by < 5e-4.
    ours = tuple(max_rounds(EPS, 160, k, **RUN) for k in KS)
    assert ours == (546, 507, 459, 363, 87)
    for k, t in zip((5, 10, 20), (506, 458, 362)):
        assert EPS - 5e-4 < paper_epsilon(160, k, t + 1, **RUN) <= EPS


def test_noise_independent_floor():
    # the general subsampling bound's 2 q^j terms do not vanish: T saturates as sigma_g grows
    limit = tuple(max_rounds(EPS, 1e6, k, **RUN) for k in KS)
    assert limit == (546, 507, 459, 363, 87)
    assert paper_epsilon(1e8, 1, 546, **RUN) == pytest.approx(paper_epsilon(1e6, 1, 546, **RUN), rel=1e-9)
    assert paper_epsilon(1e8, 1, 546, **RUN) > 2.99


def _lemma_b7_cgf(alpha: int, q: float, eps) -> float:
    """(alpha - 1) times the Wang et al. Thm. 9 bound (eps(inf) = inf), written as in the paper."""
    e2 = eps(2)
    total = 1 + q**2 * math.comb(alpha, 2) * min(4 * (math.exp(e2) - 1), 2 * math.exp(e2))
    total += sum(2 * q**j * math.comb(alpha, j) * math.exp((j - 1) * eps(j)) for j in range(3, alpha + 1))
    return math.log(total)


def _reference_paper_epsilon(sigma_g: float, k: int, t: int, max_order: int = 100) -> float:
    """Plain-loop App. B.4: Step 1 (Lemma B.7, z = sigma_g sqrt(lM), K times), Step 2 (Thm. 9 with
    l), T times, Eq. (5) over integer orders."""
    z2 = sigma_g**2 * L * M

    def step1(j: int) -> float:
        return k * _lemma_b7_cgf(j, S, lambda i: i / (2 * z2)) / (j - 1)

    best = math.inf
    for a in range(2, max_order + 1):
        rdp = t * _lemma_b7_cgf(a, L, step1) / (a - 1)
        best = min(best, rdp + math.log(1 / DELTA) / (a - 1))
    return best


@pytest.mark.parametrize("sigma_g,k,t", [(10, 1, 542), (20, 10, 451), (7.5, 3, 100)])
def test_matches_plain_transcription_of_the_paper(sigma_g, k, t):
    assert paper_epsilon(sigma_g, k, t, **RUN) == pytest.approx(_reference_paper_epsilon(sigma_g, k, t), rel=1e-10)


def test_general_cgf_is_lemma_b7_for_a_gaussian():
    sigma = 3.0
    orders = np.arange(41, dtype=float)
    cgf = wang_general_cgf(orders / (2 * sigma**2), 0.2)
    for a in (2, 3, 7, 40):
        assert cgf[a] == pytest.approx(_lemma_b7_cgf(a, 0.2, lambda j: j / (2 * sigma**2)), rel=1e-12)


def test_integer_orders_give_the_infimum_over_real_orders():
    # Eq. (7) interpolates the CGF linearly, so (CGF + log 1/delta)/(alpha - 1) is monotone between
    # integers: a fine real grid never goes below the integer minimum and meets it at integers.
    alphas = np.arange(1.001, 60.0, 0.001)
    for sigma_g, k, t in [(10, 5, 488), (80, 40, 87)]:
        fine = paper_rdp(alphas, sigma_g, k, t, **RUN) + math.log(1 / DELTA) / (alphas - 1)
        eps = paper_epsilon(sigma_g, k, t, **RUN)
        assert fine.min() >= eps - 1e-12
        ints = np.arange(2.0, 60.0)
        assert (paper_rdp(ints, sigma_g, k, t, **RUN) + math.log(1 / DELTA) / (ints - 1)).min() == pytest.approx(eps)


def test_monotone_in_rounds_local_steps_and_noise():
    ts = [1, 2, 10, 100, 300, 542, 1000]
    for k in (1, 10):
        eps_t = [paper_epsilon(10, k, t, **RUN) for t in ts]
        assert all(a < b for a, b in zip(eps_t, eps_t[1:]))
    eps_k = [paper_epsilon(10, k, 200, **RUN) for k in (1, 2, 5, 10, 20, 40)]
    assert all(a < b for a, b in zip(eps_k, eps_k[1:]))
    eps_sigma = [paper_epsilon(sg, 5, 300, **RUN) for sg in (2, 5, 10, 40, 160)]
    assert all(a > b for a, b in zip(eps_sigma, eps_sigma[1:]))
    assert paper_epsilon(10, 5, 0, **RUN) == 0.0


@pytest.mark.parametrize("sigma_g,k,t,view",
                         [(10, 1, 235, "client"), (20, 5, 192, "client"), (10, 10, 120, "aggregate")])
def test_modern_record_equals_rdp_accountant(sigma_g, k, t, view):
    z = paper001.modern_noise_multiplier(sigma_g, L, M, view)
    acc = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(R, int(S * R), dp_accounting.GaussianDpEvent(z)), k * t))
    assert modern_epsilon(sigma_g, k, t, **RUN, noise_view=view) == acc.get_epsilon(DELTA)
    acc2 = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc2.compose(modern_event(z, k, t, S, R))
    assert acc2.get_epsilon(DELTA) == acc.get_epsilon(DELTA)


def test_modern_max_rounds_is_the_boundary():
    for method in paper001.MODERN_METHODS:
        t = modern_max_rounds(EPS, 10, 5, **RUN, method=method)
        eps_t, eps_next = (modern_epsilon(10, 5, n, **RUN, method=method) for n in (t, t + 1))
        assert eps_t <= EPS < eps_next
    assert modern_max_rounds(EPS, 10, 1, **RUN) == 235


def test_participation_uses_user_sampling_and_reduces_to_record_without_it():
    for t in (10, 100, 1000):
        part = modern_epsilon(20, 5, t, **RUN, method="participation")
        assert part < modern_epsilon(20, 5, t, **RUN, method="record")
    every_round = dict(RUN, l=1.0)
    assert modern_epsilon(20, 5, 50, **every_round, method="participation") == pytest.approx(
        modern_epsilon(20, 5, 50, **every_round, method="record"), rel=1e-12)


@pytest.mark.parametrize("bad_eps", [0.0, -1.0, math.inf, math.nan])
def test_bad_target_epsilon(bad_eps):
    with pytest.raises(ConfigError, match="target_epsilon"):
        max_rounds(bad_eps, 10, 5, **RUN)
    with pytest.raises(ConfigError, match="target_epsilon"):
        modern_max_rounds(bad_eps, 10, 5, **RUN)


@pytest.mark.parametrize("bad_delta", [0.0, 1.0, -1e-6, 1.5])
def test_bad_delta(bad_delta):
    with pytest.raises(ConfigError, match="delta"):
        paper_epsilon(10, 5, 100, **RUN, delta=bad_delta)
    with pytest.raises(ConfigError, match="delta"):
        max_rounds(EPS, 10, 5, **RUN, delta=bad_delta)
    with pytest.raises(ConfigError, match="delta"):
        modern_epsilon(10, 5, 100, **RUN, delta=bad_delta)


@pytest.mark.parametrize("kwargs,setting", [
    (dict(sigma_g=0.0), "sigma_g"), (dict(K=0), "K"), (dict(T=-1), "T"), (dict(l=0.001), "l"),
    (dict(s=1.5), "s"), (dict(R=0), "R"),
])
def test_bad_run_settings(kwargs, setting):
    args = dict(sigma_g=10.0, K=5, T=100, **RUN) | kwargs
    with pytest.raises(ConfigError, match=f"^{setting}="):
        paper_epsilon(**args)


def test_bad_modern_options():
    with pytest.raises(ConfigError, match="method"):
        modern_epsilon(10, 5, 100, **RUN, method="pld")
    with pytest.raises(ConfigError, match="noise_view"):
        modern_max_rounds(EPS, 10, 5, **RUN, noise_view="server")


def test_dp_scaffold_noise_multiplier_is_twice_sigma_g(log_dir):
    """Alg. 1 adds (2C / sR) N(0, sigma_g^2) to the mean clipped gradient of a batch of sR records;
    DP-SGD's z adds N(0, (z C)^2) to the clipped sum, then divides by sR: z = 2 sigma_g. The ledger
    then accounts exactly the paper's replace-one Gaussian of multiplier sigma_g (``record`` method)."""
    from dpfl_lightning.algorithms import DPSCAFFOLD
    from dpfl_lightning.plugins import FederatedCallback, PrivacyLedger
    from helpers import TinyClassifier, quiet_trainer, tiny_data

    class ZeroGradient(TinyClassifier):  # every record's gradient is 0: a step moves by the noise only
        def training_step(self, batch, batch_idx):
            return 0.0 * super().training_step(batch, batch_idx)

    sigma_g, C, B, records, clients, K, T, delta = 3.0, 0.5, 8, 32, 4, 2, 3, 1e-5
    ledger = PrivacyLedger(delta=delta)
    rec_updates = []

    class Updates(FederatedCallback):
        order = 999

        def on_client_end(self, *, client):
            if client.round_idx == 0:
                rec_updates.append(client.payload["update"].detach().double().clone())

    t = quiet_trainer(log_dir, rounds=T, local_steps=K, batch_size=B, seed=1,
                      algorithm=DPSCAFFOLD(noise_multiplier=2 * sigma_g, max_grad_norm=C, warm_start=False),
                      plugins=[ledger, Updates()])
    t.fit(ZeroGradient(lr=1.0), tiny_data(num_clients=clients, samples=records))
    # round 1 (c = c_i = 0): K steps of lr 1, each -(2C / B) N(0, sigma_g^2) per coordinate
    noise = torch.cat(rec_updates) / math.sqrt(K)
    assert noise.numel() > 1000  # the std is known to about 2%
    assert float(noise.std()) == pytest.approx(2 * C / B * sigma_g, rel=0.06)
    expected = modern_epsilon(sigma_g, K, T, l=1.0, s=B / records, R=records, M=clients, delta=delta, method="record")
    assert t.history[-1]["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_dp_scaffold_synthetic_config_uses_the_papers_sigma_g():
    # paper 001 Sec. 5 / App. D: sigma_g = 60 on synthetic data, i.e. noise_multiplier = 2 sigma_g
    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "dp_scaffold_synthetic.yaml").read_text())
    args = config["trainer"]["algorithm"]["init_args"]
    assert config["trainer"]["algorithm"]["class_path"] == "dpfl_lightning.algorithms.DPSCAFFOLD"
    assert args["noise_multiplier"] == 2 * 60
    assert config["trainer"]["batch_size"] / config["data"]["init_args"]["samples_per_client"] == 0.2  # s


def _scaffold_benchmark():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "paper001_scaffold.py"
    spec = importlib.util.spec_from_file_location("paper001_scaffold_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("study", ["compare", "table1"])
def test_the_scaffold_benchmark_runs_the_seeds_from_first_seed(study, monkeypatch, capsys):
    """`--first_seed 7 --seeds 2` trains seeds 7 and 8 in both studies (compare ran 0..n-1)."""
    import argparse
    bench = _scaffold_benchmark()
    seen = []
    monkeypatch.setattr(bench, "run", lambda *a, **k: seen.append(a[7]) or 0.5)
    args = argparse.Namespace(study=study, seeds=2, first_seed=7, rounds=3, eta0=1.0, alpha=5.0, beta=5.0,
                              reading="short", ks=[1])
    (bench.compare if study == "compare" else bench.table1)(args)
    assert seen and set(seen) == {7, 8}, seen
    if study == "compare":
        assert "seeds 7..8" in capsys.readouterr().out
