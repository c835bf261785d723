"""DP-FedEXP (paper 002): the adaptive global step size of each variant against hand-computed cases,
the unbiasedness of the LDP estimator, the extra release of CDP-FedEXP, PrivUnit as the local
randomizer, and evaluation on the average of the last two iterates."""

import math
from types import SimpleNamespace

import dp_accounting
import pytest
import torch
from dp_accounting import rdp as dp_rdp

from dpfl_lightning.algorithms import CDPFedEXP, DPFedAvg, FedEXP, LDPFedEXP
from dpfl_lightning.federated.payload import Aggregate
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.plugins import FedEXP as FedEXPPlugin
from dpfl_lightning.plugins import PrivacyLedger
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data


def _server(update, n, **sums):
    agg = Aggregate(0, {k: torch.tensor([v], dtype=torch.float64) for k, v in sums.items()}, n, float(n))
    return SimpleNamespace(aggregate=agg, update=torch.as_tensor(update, dtype=torch.float64), plan=RoundPlan(0, ()))


def _plugin(variant, **kw):
    p = FedEXPPlugin(variant, **kw)
    p._d = 3
    return p


def test_step_sizes_of_every_variant_by_hand():
    # three clients with updates D_i; c_bar their mean (no noise here)
    D = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    mean_sq = float((D**2).sum(1).mean())  # (1 + 4 + 3) / 3
    c_bar = D.mean(0)
    server = _server(c_bar, 3, norm_sq=float((D**2).sum()))
    plain = mean_sq / float((c_bar**2).sum())  # eq. (2): 8/3 / (4/9 + 1 + 1/9)
    assert _plugin("plain").step_size(server) == pytest.approx(plain)
    assert _plugin("plain", half=True, eps=0.1).step_size(server) == pytest.approx(
        max(1.0, mean_sq / (2 * (float((c_bar**2).sum()) + 0.1))))
    ldp = _plugin("ldp_gaussian")
    ldp._sigma = 0.5  # eq. (6): subtract d sigma^2 from the mean squared norm of the noisy updates
    assert ldp.step_size(server) == pytest.approx((mean_sq - 3 * 0.25) / float((c_bar**2).sum()))
    cdp = _plugin("cdp")  # eq. (7): xi is already in the noisy sum
    assert cdp.step_size(_server(c_bar, 3, norm_sq=float((D**2).sum()) + 0.6)) == pytest.approx(
        (mean_sq + 0.2) / float((c_bar**2).sum()))
    pu = _plugin("ldp_privunit")  # eq. (8): the mean of the clients' estimates s_hat
    assert pu.step_size(_server(c_bar, 3, norm_sq_estimate=6.0)) == pytest.approx(2.0 / float((c_bar**2).sum()))


def test_step_size_is_never_below_one():
    g = torch.Generator().manual_seed(0)
    for variant in ("plain", "ldp_gaussian", "cdp"):
        p = _plugin(variant)
        p._sigma = 3.0
        for _ in range(200):
            c_bar = torch.randn(3, generator=g, dtype=torch.float64) * 10 ** torch.empty(1).uniform_(-3, 3).item()
            total = float(torch.randn(1, generator=g)) * 5  # may be negative after noise / bias correction
            assert p.step_size(_server(c_bar, 4, norm_sq=total)) >= 1.0
        assert p.step_size(_server(torch.zeros(3), 4, norm_sq=1.0)) == 1.0  # a zero mean update


def test_the_ldp_estimator_is_unbiased():
    # E[mean ||c_i||^2 - d sigma^2] = mean ||D_i||^2 for c_i = D_i + N(0, sigma^2 I)
    g = torch.Generator().manual_seed(1)
    M, d, sigma, reps = 20, 50, 0.7, 4000
    D = torch.randn(M, d, generator=g, dtype=torch.float64) * 0.1
    truth = float((D**2).sum(1).mean())
    est = []
    for _ in range(reps):
        c = D + sigma * torch.randn(M, d, generator=g, dtype=torch.float64)
        est.append(float((c**2).sum(1).mean()) - d * sigma**2)
    est = torch.tensor(est)
    # Var ||c_i||^2 = 4 sigma^2 ||D_i||^2 + 2 d sigma^4; the mean over M clients and reps draws
    se = math.sqrt(float((4 * sigma**2 * (D**2).sum(1) + 2 * d * sigma**4).mean()) / M / reps)
    assert abs(float(est.mean()) - truth) < 4 * se
    assert float(est.std()) > 10 * se  # a single round's estimate is noisy: the test has power


def test_cdp_fedexp_spends_the_update_noise_composed_with_xi(log_dir):
    def run(algorithm):
        ledger = PrivacyLedger(delta=1e-5)
        t = quiet_trainer(log_dir, rounds=4, clients_per_round=5, sampling="poisson", algorithm=algorithm,
                          plugins=[ledger])
        t.fit(TinyClassifier(), tiny_data(num_clients=40))
        return t, [h["epsilon"] for h in t.history]

    t, cdp = run(CDPFedEXP(clip=1.0, noise_multiplier=2.0))
    _, fedavg = run(DPFedAvg(clip=1.0, noise_multiplier=2.0, placement="central"))
    d, M, z = t.module.num_parameters, 5.0, 2.0
    sigma_sum = z * 1.0  # std of the update noise on the sum; the mean carries sigma^2 / M with sigma^2 = sigma_sum^2 / M
    xi_on_sum = d * (sigma_sum**2 / M)  # M sigma_xi, sigma_xi = d sigma^2 / M
    z_xi = xi_on_sum / 1.0**2  # sensitivity of the sum of squared norms: C^2
    z_eff = (z**-2 + z_xi**-2) ** -0.5  # two Gaussians on the same Poisson sample
    for rounds, eps in enumerate(cdp, start=1):
        acc = dp_rdp.RdpAccountant()
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(5 / 40, dp_accounting.GaussianDpEvent(z_eff)), rounds))
        assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert all(a > b for a, b in zip(cdp, fedavg))
    assert all(h["eta_g"] >= 1 for h in t.history)


def test_cdp_fedexp_accounts_xi_with_sensitivity_c_squared(log_dir):
    # clip C = 0.5: the sum of squared norms changes by at most C^2 (Prop. 4.2's rho_xi = C^4 T /
    # 2 M^2 sigma_xi^2); with the default sigma_xi = d sigma^2 / M its multiplier is d z^2 / M, whatever C
    ledger = PrivacyLedger(delta=1e-5)
    C, z, M = 0.5, 2.0, 5.0
    t = quiet_trainer(log_dir, rounds=3, clients_per_round=5, sampling="poisson",
                      algorithm=CDPFedEXP(clip=C, noise_multiplier=z), plugins=[ledger])
    t.fit(TinyClassifier(), tiny_data(num_clients=40))
    d = t.module.num_parameters
    xi_on_sum = M * d * (z * C / math.sqrt(M)) ** 2 / M  # M sigma_xi
    z_eff = (z**-2 + (xi_on_sum / C**2) ** -2) ** -0.5
    for rounds, h in enumerate(t.history, start=1):
        acc = dp_rdp.RdpAccountant()
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(5 / 40, dp_accounting.GaussianDpEvent(z_eff)), rounds))
        assert h["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)


def test_ldp_fedexp_costs_what_ldp_fedavg_costs_and_logs_eta_g(log_dir):
    def run(algorithm):
        t = quiet_trainer(log_dir, rounds=3, clients_per_round=5, algorithm=algorithm)
        t.fit(TinyClassifier(), tiny_data())
        return t

    ldp = run(LDPFedEXP(clip=1.0, noise_multiplier=0.7))
    from dpfl_lightning.algorithms import DPFedAvgLocal

    base = run(DPFedAvgLocal(clip=1.0, noise_multiplier=0.7))
    assert [h["epsilon"] for h in ldp.history] == [h["epsilon"] for h in base.history]
    assert "norm_sq" in ldp.run.layout.names and all(h["eta_g"] >= 1 for h in ldp.history)


def test_privunit_randomizer_through_the_trainer(log_dir):
    after = Recorder(order=900)
    t = quiet_trainer(log_dir, rounds=2, clients_per_round=4, algorithm=LDPFedEXP(clip=1.0, randomizer="privunit"),
                      plugins=[after])
    t.fit(TinyClassifier(), tiny_data())
    consts = t.plugins[1].consts
    for u in after.updates:  # every sent vector has norm |r_hat| / m, r_hat = a (J - b) on ScalarDP's lattice
        r = float(torch.linalg.vector_norm(u.double())) * consts.m
        j = r / consts.a  # = |J - b| for some level J in 0..k
        assert min(abs(j - abs(level - consts.b)) for level in range(consts.k + 1)) < 1e-4
    rr = dp_accounting.RandomizedResponseDpEvent(2 / (1 + math.exp(6.0)), 2)
    acc = dp_rdp.RdpAccountant(neighboring_relation=dp_accounting.privacy_accountant.NeighboringRelation.REPLACE_ONE)
    busiest = int(t.ledger.counts["client_local"].max())
    acc.compose(dp_accounting.SelfComposedDpEvent(rr, busiest))
    assert t.history[-1]["epsilon"] == min(acc.get_epsilon(t.ledger.delta), 6.0 * busiest)


def test_evaluation_sees_the_average_of_the_last_two_iterates(log_dir):
    seen = []

    class Spy(TinyClassifier):
        def on_validation_epoch_start(self):
            seen.append(torch.cat([p.detach().flatten().clone() for p in self.parameters()]))

    t = quiet_trainer(log_dir, rounds=2, clients_per_round=4, algorithm=FedEXP(average_last=2), eval_every=1)
    models = []

    class Snap(Recorder):
        def on_round_end(self, *, server, metrics):
            models.append(server.global_params.detach().clone())

    t.plugins.append(Snap(order=999))
    t.fit(Spy(), tiny_data())
    assert torch.allclose(seen[1], (models[0] + models[1]) / 2, atol=1e-6)  # round 2 evaluates the average
    assert torch.equal(t.module.global_params, models[1])  # training goes on from the last iterate


def test_fedexp_gets_closer_to_the_shared_optimum_than_fedavg(log_dir):
    """Paper 002 App. G's setting without noise: every client shares w*, so the extrapolated step
    (eta_g >= 1) can only help; the logged distance ||w - w*|| is computed from the data's seed."""
    from dpfl_lightning.algorithms import FedAvg
    from dpfl_lightning.data import SyntheticLinearRegression
    from dpfl_lightning.models import LinearRegression

    data = SyntheticLinearRegression(num_clients=20, samples_per_client=5, dim=10, seed=3)
    x, y = data.load()[0].tensors
    assert torch.allclose(x @ data.w_star, y)  # noiseless labels: w* minimises every client's loss

    def distance(algorithm):
        t = quiet_trainer(log_dir, rounds=8, local_steps=5, batch_size=None, algorithm=algorithm, eval_every=8)
        t.fit(LinearRegression(10, lr=0.005, target_seed=3), data)
        w = t.module.global_params.double()  # average_last=1: evaluation sees the last iterate
        assert t.history[-1]["distance_to_optimum"] == pytest.approx(float(torch.linalg.vector_norm(w - data.w_star)),
                                                                     rel=1e-5)
        return t.history[-1]["distance_to_optimum"], t

    start = float(torch.linalg.vector_norm(data.w_star))
    fedavg, _ = distance(FedAvg())
    fedexp, t = distance(FedEXP(average_last=1))
    assert fedexp < fedavg < start
    assert max(h["eta_g"] for h in t.history) > 1.5


def test_linear_regression_test_records_are_fresh_draws():
    # The global test set must not hold training records (test_set_from_clients is False).
    from dpfl_lightning.data import SyntheticLinearRegression

    data = SyntheticLinearRegression(num_clients=30, samples_per_client=5, dim=10, seed=1)
    train, test, clients = data.load()
    (x, _), (xt, yt) = train.tensors, test.tensors
    assert len(xt) == 60 and torch.allclose(xt @ data.w_star, yt)
    assert torch.cdist(xt, x).min() > 1e-3


def test_fedexp_refuses_sample_weighting(log_dir):
    # the step size is defined for the uniform mean c_bar: refused at set-up, before the model moves
    from dpfl_lightning.errors import ConfigError

    for algorithm in (FedEXP(), LDPFedEXP(), CDPFedEXP()):
        trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=4, weighting="samples", algorithm=algorithm)
        with pytest.raises(ConfigError, match=r"trainer.weighting=.*FedEXP.*plain mean.*weighting='uniform'"):
            trainer.fit(TinyClassifier(), tiny_data())
        assert trainer.history == []
    model = TinyClassifier()
    start = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=4, weighting="samples", plugins=[FedEXPPlugin("plain")])
    with pytest.raises(ConfigError, match=r"trainer.weighting=.*FedEXP.*weighting='uniform'"):
        trainer.fit(model, tiny_data())
    assert trainer.history == [] and all(torch.equal(a, b) for a, b in zip(start, model.parameters()))


def test_privunit_variant_without_the_randomizer_is_refused_before_training(log_dir):
    from dpfl_lightning.errors import ConfigError
    from dpfl_lightning.plugins import GaussianNoise, UpdateClipping

    for others in ([UpdateClipping(1.0)], [UpdateClipping(1.0), GaussianNoise(noise_multiplier=0.7, placement="local")]):
        model = TinyClassifier()
        start = [p.detach().clone() for p in model.parameters()]
        trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=4, plugins=[*others, FedEXPPlugin("ldp_privunit")])
        with pytest.raises(ConfigError, match=r"FedEXP.variant='?ldp_privunit.*PrivUnitRandomizer"):
            trainer.fit(model, tiny_data())
        assert trainer.history == [] and all(torch.equal(a, b) for a, b in zip(start, model.parameters()))


class _Spy(Recorder):
    """Per round: what every client sends as FedEXP reads it (order 700: after clipping and local
    randomization), the cohort's divisor, the sum of squared norms before FedEXP's on_aggregate, and
    c_bar before FedEXP scales it. A second spy after FedEXP (order 850) sees the sum with xi."""

    def __init__(self, order):
        super().__init__(order)
        self.rounds = {}

    def _round(self, r):
        return self.rounds.setdefault(r, {"sent": [], "estimates": []})

    def on_client_end(self, *, client):
        row = self._round(client.round_idx)
        row["sent"].append(client.update.detach().double().clone())
        if "norm_sq_estimate" in client.payload:
            row["estimates"].append(float(client.payload["norm_sq_estimate"]))

    def on_aggregate(self, *, server):
        row = self._round(server.round_idx)
        row["n"] = server.aggregate.denominator
        if "norm_sq" in server.aggregate:
            row["norm_sq"] = server.aggregate.scalar("norm_sq")

    def on_server_update(self, *, server):
        self._round(server.round_idx)["c_bar"] = server.update.detach().double().clone()


@pytest.mark.parametrize("variant", ["ldp_gaussian", "ldp_privunit", "cdp"])
def test_logged_eta_g_follows_the_papers_formula_with_clip_half(log_dir, variant):
    """eta_g recomputed from what the server received, with C = 0.5 and noise: eq. (6)
    max(1, (mean ||c_i||^2 - d sigma^2) / ||c_bar||^2) with sigma = z C for LDP-FedEXP; eq. (8) with
    the clients' PrivUnit estimates s_hat_i; eq. (7) max(1, (mean ||D_i||^2 + xi) / ||c_bar||^2) for
    CDP-FedEXP, where c_bar = mean D + N(0, sigma^2 / M) (Alg. 2) with sigma = z C / sqrt(M), and
    xi ~ N(0, sigma_xi^2) with sigma_xi = d sigma^2 / M (Sec. 4.1, Theorem 4.6). The settings make
    eta_g > 1 in most rounds, so the formula, not the floor at 1, is compared."""
    C = 0.5
    if variant == "ldp_gaussian":
        z, M, rounds = 0.1, 10, 8
        algorithm = LDPFedEXP(clip=C, noise_multiplier=z)
    elif variant == "ldp_privunit":
        z, M, rounds = None, 40, 4  # PrivUnit's outputs are long: eta_g > 1 needs a large cohort or eps
        algorithm = LDPFedEXP(clip=C, randomizer="privunit", eps0=10.0, eps1=10.0, eps2=10.0)
    else:
        z, M, rounds = 0.3, 10, 20
        algorithm = CDPFedEXP(clip=C, noise_multiplier=z)
    before, after = _Spy(order=700), _Spy(order=850)
    t = quiet_trainer(log_dir, rounds=rounds, clients_per_round=M, local_steps=3, algorithm=algorithm,
                      plugins=[before, after])
    model = TinyClassifier(lr=0.5)
    d = sum(p.numel() for p in model.parameters())
    t.fit(model, tiny_data(num_clients=max(M, 20)))
    logged = [h["eta_g"] for h in t.history]
    ratios, xi, mean_noise = [], [], []
    for r in range(rounds):
        row = before.rounds[r]
        sent, n, c_bar = torch.stack(row["sent"]), row["n"], row["c_bar"]
        assert n == len(sent) == M
        sq = (sent**2).sum(1)
        if variant == "ldp_gaussian":
            assert torch.allclose(c_bar, sent.mean(0), rtol=0, atol=1e-6)
            numerator = float(sq.mean()) - d * (z * C) ** 2
        elif variant == "ldp_privunit":
            assert torch.allclose(c_bar, sent.mean(0), rtol=0, atol=1e-6)
            numerator = sum(row["estimates"]) / M
        else:
            assert float(sq.max()) <= C**2 * (1 + 1e-5)  # clipped D_i (the noise is central)
            assert row["norm_sq"] == pytest.approx(float(sq.sum()), rel=1e-6)  # before xi
            xi.append((after.rounds[r]["norm_sq"] - row["norm_sq"]) / M)  # xi, on the mean
            mean_noise.append(c_bar - sent.mean(0))
            numerator = float(sq.mean()) + xi[-1]
        ratios.append(numerator / float((c_bar**2).sum()))
        assert logged[r] == pytest.approx(max(1.0, ratios[-1]), rel=1e-6, abs=1e-9), r
    assert sum(ratio > 1.2 for ratio in ratios) >= rounds / 2
    if variant == "cdp":
        sigma = z * C / math.sqrt(M)
        assert float(torch.cat(mean_noise).std()) == pytest.approx(sigma / math.sqrt(M), rel=0.05)
        sigma_xi = d * sigma**2 / M
        spread = math.sqrt(sum(x * x for x in xi) / len(xi)) / sigma_xi  # 1 +- 0.16 for 20 draws
        assert 0.6 < spread < 1.5


def test_privunit_draws_from_the_csprng_in_secure_mode(log_dir, monkeypatch):
    # PrivUnit is the mechanism: in secure mode its randomness is the SHAKE-256 stream keyed by the
    # run's secret, in a simulation the seed's stream (reproducible)
    from dpfl_lightning import rng
    from dpfl_lightning.privacy import privunit

    seen = []
    original = privunit.privatize

    def spy(x, consts, source):
        seen.append(type(source))
        return original(x, consts, source)

    monkeypatch.setattr(privunit, "privatize", spy)
    outs = {}
    for secure in (True, False, False):
        after = Recorder(order=900)
        t = quiet_trainer(log_dir, rounds=1, clients_per_round=2, seed=3, secure=secure, plugins=[after],
                          algorithm=LDPFedEXP(clip=1.0, randomizer="privunit"))
        t.fit(TinyClassifier(), tiny_data())
        outs.setdefault(secure, []).append(after.updates[0])
    assert seen[:2] == [rng.SecureStream] * 2 and rng.SecureStream not in seen[2:]
    assert torch.equal(outs[False][0], outs[False][1])


def test_paper_002_convention_replace_one_doubles_the_update_not_xi():
    # paper 002 App. E: replace-one neighbours, sensitivity 2C for the mean update and C^2 (not 2C^2) for
    # the squared norms; full participation. Recomputed here with dp_accounting's RDP accountant.
    from dpfl_lightning import FederatedTrainer
    from dpfl_lightning.cli.privacy_command import plan_run

    z, rounds, M = 5.0, 50, 20
    model = TinyClassifier()
    d = sum(p.numel() for p in model.parameters())
    xi = d * z**2 / M  # the xi multiplier on C^2 with the default sigma_xi = d sigma^2 / M

    def planned(relation):
        t = FederatedTrainer(rounds=rounds, algorithm=CDPFedEXP(clip=1.0, noise_multiplier=z), enable_summary=False,
                             plugins=[PrivacyLedger(delta=1e-5, relation=relation)])
        ledger = plan_run(t, tiny_data(num_clients=M), model=model)
        return ledger.planned_epsilons(rounds)["client_central"], ledger.describe()[0]

    def independent(update_multiplier):
        acc = dp_rdp.RdpAccountant()
        acc.compose(dp_accounting.GaussianDpEvent((update_multiplier**-2 + xi**-2) ** -0.5), rounds)
        return acc.get_epsilon(1e-5)

    replace_one, line = planned("replace_one")
    assert replace_one == pytest.approx(independent(z / 2), rel=1e-9) and "replace-one neighbours" in line
    add_remove, line = planned(None)
    assert add_remove == pytest.approx(independent(z), rel=1e-9) and "add/remove neighbours" in line
