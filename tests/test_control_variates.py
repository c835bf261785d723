"""SCAFFOLD, DP-SCAFFOLD(-warm), ScaffNew and DP-ScaffNew (papers 001 and 000).

On a heterogeneous strongly convex problem (clients with different minimisers) FedAvg with K local
steps stalls at a biased point; the control variates remove the drift and reach the optimum."""

import math

import pytest
import torch
import torch.nn.functional as F

from dpfl_lightning import ConfigError
from dpfl_lightning.errors import NonFiniteUpdateError
from dpfl_lightning.data import QuadraticClients, quadratic_problem
from dpfl_lightning.models import QuadraticModel
from dpfl_lightning.plugins import DPSGD, FederatedCallback, GaussianNoise, PrivacyLedger, UpdateClipping
from dpfl_lightning.plugins.scaffnew import ScaffNew, geometric_steps
from dpfl_lightning.plugins.scaffold import SCAFFOLD
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data

N, D, K = 8, 5, 10  # rank 10 >= dim 5: every client's loss is strongly convex
PROBLEM = quadratic_problem(N, D, K, 0)
Q = PROBLEM.A.double() @ PROBLEM.A.double().transpose(1, 2)
EIG = torch.linalg.eigvalsh(Q)
L, MU = float(EIG.max()), float(EIG.min())
W_STAR = PROBLEM.w_star.double()
GRAD_STAR = torch.einsum("nij,nj->ni", Q, W_STAR.unsqueeze(0) - PROBLEM.w_star_i.double())  # grad f_i(x*)


def _quadratic(log_dir, plugins, rounds, lr, local_steps=10, **kw):
    trainer = quiet_trainer(log_dir, rounds=rounds, local_steps=local_steps, batch_size=None, plugins=plugins,
                            eval_every=10**9, **kw)
    module = trainer.fit(QuadraticModel(N, D, K, 0, lr=lr), QuadraticClients(N, D, K, 0))
    return trainer, float((module.global_params.double() - W_STAR).norm())


def test_control_variates_reach_the_optimum_where_fedavg_stalls(log_dir):
    _, fedavg = _quadratic(log_dir, [], 200, 0.5 / L)
    _, scaffold = _quadratic(log_dir, [SCAFFOLD()], 200, 0.5 / L)
    _, scaffnew = _quadratic(log_dir, [ScaffNew(p=math.sqrt(MU / L))], 200, 1.0 / L)
    assert fedavg > 0.05  # FedAvg's fixed point is biased by the heterogeneity
    assert scaffold < 1e-5 and scaffnew < 1e-5  # float32 parameters: ~1e-7 is exact


class Invariants(FederatedCallback):
    """After every round: the sum of the h_i (ScaffNew) or c - mean(c_i) (SCAFFOLD) over this
    rank's clients (a test adds the ranks up)."""

    order = 999

    def __init__(self):
        self.sums, self.scales = [], []

    def on_round_end(self, *, server, metrics):
        states = [server.client_state(c) for c in range(server.num_clients) if c in server.my_clients]
        key = "h" if states and "h" in states[0] else "c_i"
        self.sums.append(sum(s[key] for s in states))
        self.scales.append(max(float(s[key].abs().max()) for s in states))


def test_sum_of_h_is_zero_and_c_is_the_mean_of_the_c_i(log_dir):
    inv = Invariants()
    trainer, _ = _quadratic(log_dir, [ScaffNew(p=0.3), UpdateClipping(0.5),
                                      GaussianNoise(noise_multiplier=0.2, placement="local"), inv], 8, 1.0 / L)
    scale = max(inv.scales)
    assert scale > 1e-3  # the h_i moved
    # sum_i h_i = (p / eta) sum_i (mean D - D_i) is zero but for the exact aggregation's grid: the mean
    # differs from the plain float64 mean by at most 2^(L-1) per value (grid 2^L of the update's declared
    # bound C + tail * sigma), so each round adds at most (p / eta) N 2^(L-1); rounding of float64 aside
    from dpfl_lightning.federated.aggregation import HEADROOM_BITS
    from dpfl_lightning.comm.exact_sum import grid_exponent
    from dpfl_lightning.plugins.gaussian_noise import NOISE_TAIL

    grid = 2.0 ** (grid_exponent(0.5 + NOISE_TAIL * 0.2 * 0.5, N, HEADROOM_BITS) - 1)
    per_round = 0.3 / (1.0 / L) * N * grid
    for r, s in enumerate(inv.sums, start=1):
        assert float(s.abs().max()) <= r * per_round + 1e-12 * scale
    scaffold = SCAFFOLD()
    trainer, _ = _quadratic(log_dir, [scaffold], 8, 0.5 / L, clients_per_round=3)
    mean_c_i = sum(s["c_i"] for s in trainer.client_states.values()) / N
    assert float(scaffold.c.abs().max()) > 1e-3
    assert torch.allclose(scaffold.c, mean_c_i, rtol=0, atol=1e-9 * float(scaffold.c.abs().max()))


def test_scaffnew_lyapunov_contracts_at_least_as_fast_as_the_theorem(log_dir):
    # Theorem 1 of paper 000 with sigma = 0 and no clipping: E psi_T <= theta^T psi_0, where
    # theta = max(1 - mu eta, 1 - p^2) and T counts local iterations
    eta, p = 1.0 / L, math.sqrt(MU / L)
    theta = max(1 - MU * eta, 1 - p * p)

    class Lyapunov(FederatedCallback):
        order = 999

        def setup(self, *, ctx):
            self.module, self.iterations, self.psi = ctx.module, 0, []

        def on_round_end(self, *, server, metrics):
            self.iterations += server.plan.local_steps
            x = self.module.global_params.double()
            h = torch.stack([server.client_state(c)["h"] for c in range(N)])
            psi = N * float(((x - W_STAR) ** 2).sum()) + eta**2 / p**2 * float(((h - GRAD_STAR) ** 2).sum())
            self.psi.append((self.iterations, psi))

    w0 = QuadraticModel(N, D, K, 0).w.detach().double()
    psi0 = N * float(((w0 - W_STAR) ** 2).sum()) + eta**2 / p**2 * float((GRAD_STAR**2).sum())
    for seed in range(3):
        lyap = Lyapunov()
        _quadratic(log_dir, [ScaffNew(p), lyap], 30, eta, seed=seed)
        assert len({t for t, _ in lyap.psi}) == len(lyap.psi) > 10
        for t, psi in lyap.psi:
            if psi > 1e-9:  # above float32's floor
                assert psi <= theta**t * psi0, (seed, t, psi, theta**t * psi0)


def test_shared_coin_gives_geometric_local_steps(log_dir):
    us = torch.rand(20000, generator=torch.Generator().manual_seed(0)).tolist()
    steps = [geometric_steps(u, 0.25) for u in us]
    assert min(steps) == 1
    assert sum(steps) / len(steps) == pytest.approx(4.0, rel=0.03)  # E = 1/p; sd of the mean ~0.024
    sn = ScaffNew(p=0.25)
    trainer, _ = _quadratic(log_dir, [sn], 12, 0.5 / L)
    assert [h["local_steps"] for h in trainer.history] == sn.steps and len(set(sn.steps)) > 2
    again = ScaffNew(p=0.25)
    _quadratic(log_dir, [again], 12, 0.5 / L)
    assert again.steps == sn.steps  # keyed by (seed, round)


def test_scaffnew_needs_full_participation_and_plain_sgd(log_dir):
    with pytest.raises(ConfigError, match="every client"):
        _quadratic(log_dir, [ScaffNew(p=0.5)], 2, 0.1, clients_per_round=3)

    class Momentum(TinyClassifier):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    with pytest.raises(ConfigError, match="plain SGD"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[SCAFFOLD()]).fit(Momentum(), tiny_data())


def test_dp_scaffold_costs_no_more_privacy_than_dp_sgd_fedavg(log_dir):
    def run(extra):
        ledger = PrivacyLedger(delta=1e-4)
        t = quiet_trainer(log_dir, rounds=4, clients_per_round=3, batch_size=4, seed=2,
                          plugins=[DPSGD(noise_multiplier=1.0), *extra, ledger])
        t.fit(TinyClassifier(), tiny_data(num_clients=10, samples=16))
        return [h["epsilon"] for h in t.history], t

    fedavg, _ = run([])
    scaffold, t = run([SCAFFOLD()])
    assert scaffold == fedavg and math.isfinite(scaffold[-1])
    assert "dc" in t.run.layout.names  # dc travels, covered by DP-SGD (a function of the noisy gradients)


def test_dp_scaffold_warm_start_sets_the_control_variates_without_moving_the_model(log_dir):
    scaffold = SCAFFOLD(warm_start=True)
    model = TinyClassifier()
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    t = quiet_trainer(log_dir, rounds=3, clients_per_round=5, batch_size=4, plugins=[DPSGD(noise_multiplier=1.0), scaffold],
                      log_client_metrics=True)
    # rounds 1-2 are the warm start (ceil(10 / 5)); nothing moves the model in them
    t.fit(model, tiny_data(num_clients=10, samples=16))
    assert scaffold.warm_start_rounds == 2 and [h["warm_start"] for h in t.history] == [1.0, 1.0, 0.0]
    assert float(scaffold.c.abs().max()) > 0
    assert len(t.ledger.guarantees) == 1 and t.ledger.rounds == 3  # the warm start is accounted
    m2 = TinyClassifier()

    class Stop(FederatedCallback):
        def before_round(self, *, plan, server):
            if plan.round_idx == 2:
                server.stop("warm start done")

    stop = quiet_trainer(log_dir, rounds=3, clients_per_round=5, batch_size=4,
                         plugins=[DPSGD(noise_multiplier=1.0), SCAFFOLD(warm_start=True, warm_start_rounds=2), Stop()])
    out = stop.fit(m2, tiny_data(num_clients=10, samples=16))  # stopped right after the warm start
    assert torch.equal(out.global_params, start)  # the same initial model (TinyClassifier seeds it)
    assert not torch.equal(start, t.module.global_params)


def test_scaffold_corrects_the_first_local_step_by_c_minus_c_i(log_dir):
    # y_1 = x - eta_l (g + c - c_i) (paper 001 Alg. 1 line 13): with one local step the update is the
    # plain SGD update minus eta_l (c - c_i), for known c and c_i; with DP-SGD g is the noisy clipped
    # gradient, keyed by (seed, round, client) like the batches, so the same in both runs.
    d, lr, clients = sum(p.numel() for p in TinyClassifier().parameters()), 0.1, 4
    g = torch.Generator().manual_seed(0)
    c = 0.5 * torch.randn(d, generator=g, dtype=torch.float64)
    c_i = {k: 0.5 * torch.randn(d, generator=g, dtype=torch.float64) for k in range(clients)}

    class KnownControlVariates(FederatedCallback):
        order = 0  # before SCAFFOLD's on_client_start

        def on_client_start(self, *, client):
            client.state["c_i"] = c_i[client.client].clone()

    def run(dp, extra):
        rec = Recorder(order=999)
        plugins = ([DPSGD(noise_multiplier=1.0)] if dp else []) + extra + [rec]
        t = quiet_trainer(log_dir, rounds=1, local_steps=1, seed=3, plugins=plugins, log_client_metrics=True)
        t.fit(TinyClassifier(lr=lr), tiny_data(num_clients=clients))
        return {k: u.double() for k, u in zip(rec.clients, rec.updates)}

    for dp in (False, True):
        scaffold = SCAFFOLD()
        scaffold.load_state_dict({"c": c.clone()})
        plain, corrected = run(dp, []), run(dp, [KnownControlVariates(), scaffold])
        assert sorted(corrected) == list(range(clients))
        for k in range(clients):
            expected = plain[k] - lr * (c - c_i[k])
            assert torch.allclose(corrected[k], expected, rtol=0, atol=1e-6), (dp, k)
            assert float((corrected[k] - plain[k]).abs().max()) > 0.05  # the correction is far above the tolerance


class _Poisonable(TinyClassifier):
    poisoned = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.poisoned else loss


@pytest.mark.parametrize("where", ["training", "warm_start"])
def test_skipped_non_finite_client_keeps_its_control_variate(log_dir, where):
    # the client's training diverges (also in the warm start's second round): the client is skipped
    # before SCAFFOLD sees it, which then sends dc = 0 and keeps c_i
    bad_client, bad_round = 2, 1
    snapshots = []

    class PoisonOnce(FederatedCallback):
        order = 0

        def _hit(self, client):
            return (client.client, client.round_idx) == (bad_client, bad_round)

        def on_client_start(self, *, client):
            client.model.poisoned = self._hit(client)

    class Snapshot(FederatedCallback):
        order = 999

        def on_round_end(self, *, server, metrics):
            snapshots.append({c: server.client_state(c)["c_i"].clone() for c in server.my_clients})

    scaffold = SCAFFOLD(warm_start=True, warm_start_rounds=2) if where == "warm_start" else SCAFFOLD()
    t = quiet_trainer(log_dir, rounds=4, on_nonfinite="skip", plugins=[PoisonOnce(), scaffold, Snapshot()])
    module = t.fit(_Poisonable(), tiny_data(num_clients=4))
    assert [h["skipped_clients"] for h in t.history] == [0.0, 1.0, 0.0, 0.0]
    assert torch.equal(snapshots[bad_round][bad_client], snapshots[bad_round - 1][bad_client])  # unchanged
    assert not torch.equal(snapshots[bad_round + 1][bad_client], snapshots[bad_round][bad_client])  # trains again
    c_is = [t.client_states[k]["c_i"] for k in range(4)]
    assert all(torch.isfinite(c).all() for c in c_is)
    assert torch.isfinite(scaffold.c).all() and torch.isfinite(module.global_params).all()
    assert torch.allclose(scaffold.c, sum(c_is) / 4, rtol=0, atol=1e-9 * float(scaffold.c.abs().max()))
    assert all(math.isfinite(h["my_train_loss"]) for h in t.history[bad_round + 1:])


def test_a_plugin_that_makes_a_finite_update_non_finite_stops_the_round(log_dir):
    # a client's finite update is checked before the plugins run; a plugin that writes inf into it
    # afterwards is a broken plugin: the aggregation refuses the round, nothing is applied
    class BreakAfterScaffold(FederatedCallback):
        order = 50  # SCAFFOLD's on_client_end runs at 41

        def on_client_end(self, *, client):
            if (client.client, client.round_idx) == (2, 1):
                client.payload["update"][0] = float("inf")

    t = quiet_trainer(log_dir, rounds=3, on_nonfinite="skip", plugins=[SCAFFOLD(), BreakAfterScaffold()])
    with pytest.raises(NonFiniteUpdateError, match="after the finite check"):
        t.fit(_Poisonable(), tiny_data(num_clients=4))
    assert len(t.history) == 1  # round 2 was not applied


class _StepDecay(TinyClassifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                   "interval": "step"}}


@pytest.mark.parametrize("model,settings,lr_sum", [
    # 4 batches of a 16-record client, a step every 2nd batch: K = 2 optimizer steps of lr 0.1
    (TinyClassifier, dict(local_steps=4, accumulate_grad_batches=2), 2 * 0.1),
    # 3 steps with the lr halved after each: K eta_l = 0.1 + 0.05 + 0.025
    (_StepDecay, dict(local_steps=3), 0.1 + 0.05 + 0.025),
])
def test_scaffold_counts_optimizer_steps_and_their_learning_rates(log_dir, model, settings, lr_sum):
    # round 1 from c = c_i = 0: c_i+ = (x - y_K) / (K eta_l) = -update / (sum of the steps' lrs)
    rec = Recorder(order=999)
    t = quiet_trainer(log_dir, rounds=1, plugins=[SCAFFOLD(), rec], **settings)
    t.fit(model(lr=0.1), tiny_data(num_clients=3, samples=16))
    for k, update in zip(rec.clients, rec.updates):
        expected = -update.double() / lr_sum
        assert torch.allclose(t.client_states[k]["c_i"], expected, rtol=1e-6, atol=1e-9)


def test_scaffold_refuses_what_breaks_its_step_count(log_dir):
    class TwoGroups(TinyClassifier):
        def configure_optimizers(self):
            return torch.optim.SGD([{"params": self.net[0].parameters(), "lr": 0.1},
                                    {"params": self.net[2].parameters(), "lr": 0.01}])

    class TwoOptimizers(TinyClassifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opts = self.optimizers()
            for o in opts:
                o.zero_grad()
            self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
            for o in opts:
                o.step()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                    torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    with pytest.raises(ConfigError, match="same learning rate"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[SCAFFOLD()]).fit(TwoGroups(), tiny_data())
    with pytest.raises(ConfigError, match="one torch.optim.SGD"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[SCAFFOLD()]).fit(TwoOptimizers(), tiny_data())


def test_scaffnew_refuses_sample_weighting(log_dir):
    # sum_i h_i = 0 needs the plain mean of the D_i: refused at set-up, before the model or any h_i moves
    from dpfl_lightning.algorithms import DPScaffNew
    from dpfl_lightning.algorithms import ScaffNew as ScaffNewPreset

    for algorithm in (ScaffNewPreset(p=0.5), DPScaffNew(p=0.5)):
        trainer = quiet_trainer(log_dir, rounds=2, weighting="samples", algorithm=algorithm)
        with pytest.raises(ConfigError, match=r"trainer.weighting=.*ScaffNew.*h_i sum to zero.*weighting='uniform'"):
            trainer.fit(TinyClassifier(), tiny_data(num_clients=4))
        assert trainer.history == []
    model = TinyClassifier()
    start = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(log_dir, rounds=2, weighting="samples", plugins=[ScaffNew(p=0.5)])
    with pytest.raises(ConfigError, match=r"trainer.weighting=.*ScaffNew.*weighting='uniform'"):
        trainer.fit(model, tiny_data(num_clients=4))
    assert trainer.history == [] and all(torch.equal(a, b) for a, b in zip(start, model.parameters()))


def test_scaffnew_refuses_a_learning_rate_schedule(log_dir):
    class Scheduled(TinyClassifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
                                                       "interval": "step"}}

    trainer = quiet_trainer(log_dir, rounds=1, plugins=[ScaffNew(p=0.5)])
    with pytest.raises(ConfigError, match="ScaffNew.*step size gamma"):
        trainer.fit(Scheduled(), tiny_data(num_clients=4))
    assert trainer.history == []


@pytest.mark.parametrize("plugin", [lambda: SCAFFOLD(), lambda: ScaffNew(p=0.5)], ids=["scaffold", "scaffnew"])
def test_control_variates_refuse_lr_normalized_updates(log_dir, plugin):
    trainer = quiet_trainer(log_dir, rounds=1, plugins=[plugin()], normalize_update_by_lr=True)
    with pytest.raises(ConfigError, match="normalize_update_by_lr"):
        trainer.fit(TinyClassifier(), tiny_data(num_clients=4))


# ---------------------------------------------------------------- warm start: every client exactly once
class Cohorts(FederatedCallback):
    """The clients that trained in each round (order 999: after SCAFFOLD chose the warm cohort)."""

    order = 999

    def __init__(self):
        self.rounds: dict[int, list[int]] = {}

    def on_client_start(self, *, client):
        self.rounds.setdefault(client.round_idx, []).append(client.client)


@pytest.mark.parametrize("secure", [False, True], ids=["simulation", "secure"])
def test_warm_start_meets_every_client_exactly_once_and_the_ledger_counts_one_participation(log_dir, secure):
    # 10 clients, cohorts of 3: ceil(10/3) = 4 warm rounds of 3, 3, 3 and 1 clients. Independent
    # uniform cohorts met 64-67% of the clients in ceil(M/m) rounds (the rest kept c_i = 0).
    M, m, K = 10, 3, 2
    cohorts, scaffold, ledger = Cohorts(), SCAFFOLD(warm_start=True), PrivacyLedger(delta=1e-4)
    t = quiet_trainer(log_dir, rounds=6, clients_per_round=m, local_steps=K, batch_size=4, seed=5, secure=secure,
                      plugins=[DPSGD(noise_multiplier=1.0), scaffold, cohorts, ledger])
    t.fit(TinyClassifier(), tiny_data(num_clients=M, samples=16))
    W = scaffold.warm_start_rounds
    warm = [sorted(cohorts.rounds[r]) for r in range(W)]
    assert W == 4 and [len(c) for c in warm] == [3, 3, 3, 1]
    assert sorted(c for cohort in warm for c in cohort) == list(range(M))  # each client exactly once
    c_is = scaffold.control_variates
    assert len(c_is) == M and all(float(v.abs().max()) > 0 for v in c_is.values())
    planner = t.run.ctx.privacy
    if secure:  # the participation bound of secure mode: once in the warm rounds, binomial after them
        from dpfl_lightning.privacy.planning import participation_bound

        assert planner.busiest(None, W, ledger.delta) == 1
        assert planner.busiest(None, 6, ledger.delta) == 1 + participation_bound(2, m / M, planner.tail(ledger.delta))
    else:  # the ledger counts each client's K DP-SGD steps of the warm start once, as the planner planned
        assert planner.counts(W).tolist() == [1] * M
        eps_after_warm = t.history[W - 1]["epsilon"]
        assert eps_after_warm == pytest.approx(ledger.planned_epsilons(W)["record"], rel=1e-12)
        assert ledger.planned_epsilons(6)["record"] == pytest.approx(t.history[-1]["epsilon"], rel=1e-12)
    # the partition is keyed by the run's random source: another seed, other blocks
    other = Cohorts()
    quiet_trainer(log_dir, rounds=5, clients_per_round=m, local_steps=1, seed=6,
                  plugins=[SCAFFOLD(warm_start=True), other]).fit(TinyClassifier(), tiny_data(num_clients=M))
    assert [sorted(other.rounds[r]) for r in range(W)] != warm or secure


# ---------------------------------------------------------------- client-level DP on dc: c and the c_i
def _client_dp(scaffold, placement, z=1.0, clip=1.0):
    return [scaffold, scaffold.commit, UpdateClipping(clip, segments=["update", "dc"]),
            GaussianNoise(noise_multiplier=z, placement=placement, segments=["update", "dc"])]


class DcSums(FederatedCallback):
    """The cohort's dc sum before the central noise (order 150) or after it (order 250)."""

    def __init__(self, order):
        self.order, self.sums = order, []

    def on_aggregate(self, *, server):
        self.sums.append(server.aggregate["dc"].clone())


@pytest.mark.parametrize("placement", ["local", "distributed", "central"])
def test_c_stays_the_mean_of_the_c_i_under_client_level_noise(log_dir, placement):
    # partial participation (3 of 12 clients, 5 rounds): every client adds the dc it sent (clipped and
    # noised) to c_i, the server adds the noised sum / M to c. With central noise the clients cannot
    # know the aggregator's noise: c - mean(c_i) is that noise on the dc sums over M, round by round.
    M = 12
    scaffold, clean, noised = SCAFFOLD(), DcSums(150), DcSums(250)
    t = quiet_trainer(log_dir, rounds=5, clients_per_round=3, local_steps=3, seed=1,
                      plugins=[*_client_dp(scaffold, placement), clean, noised])
    t.fit(TinyClassifier(lr=0.1), tiny_data(num_clients=M))
    c_is = scaffold.control_variates  # the clients never sampled keep c_i = 0
    mean = sum(c_is.values()) / M
    scale = max(float(v.abs().max()) for v in c_is.values())
    assert len(c_is) < M and scale > 0.05
    expected = mean if placement != "central" else mean + sum(b - a for a, b in zip(clean.sums, noised.sums)) / M
    # the exact aggregation rounds every value to a grid of ~B n 2^-43 (B = C + 50 sigma): far below 1e-9
    assert torch.allclose(scaffold.c, expected, rtol=0, atol=1e-9 * scale)
    if placement == "central":
        assert float((scaffold.c - mean).abs().max()) > 1e-3  # the aggregator's noise, not rounding


# ---------------------------------------------------------------- checkpoints: the raw-update attack
def _vectors(obj, d):
    """Every tensor of d values anywhere in a checkpoint."""
    if isinstance(obj, torch.Tensor):
        return [obj.double().reshape(-1)] if obj.numel() == d else []
    if isinstance(obj, dict):
        return [v for x in obj.values() for v in _vectors(x, d)]
    if isinstance(obj, (list, tuple)):
        return [v for x in obj for v in _vectors(x, d)]
    return []


def _best_fit(u, candidates):
    """The smallest relative residual of ``u`` against any multiple of a candidate."""
    u = u.double()
    out = float("inf")
    for v in candidates:
        a = float(v @ u) / max(float(v @ v), 1e-300)
        out = min(out, float((a * v - u).norm() / u.norm()))
    return out


@pytest.mark.parametrize("placement", [None, "local", "central", "distributed"])
def test_scaffold_checkpoint_does_not_give_back_a_clients_raw_update(log_dir, placement):
    # Round 1 from c = c_i = 0 makes c_i+ = -update / (K eta_l): a checkpoint holding that c_i gives
    # back the client's raw update. Without DP the attack works (the test can fail); with client-level
    # DP the checkpoint holds c_i built from the clipped, noised dc it released (local), or none.
    from dpfl_lightning.run.checkpoint_format import load

    K, lr, d = 3, 0.1, sum(p.numel() for p in TinyClassifier().parameters())
    scaffold, raw = SCAFFOLD(), Recorder(order=60)  # after SCAFFOLD (41), before the clipping (100)
    plugins = [scaffold, raw] if placement is None else [*_client_dp(scaffold, placement), raw]
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=4, local_steps=K, seed=2, checkpoint_every=1,
                      plugins=plugins)
    t.fit(TinyClassifier(lr=lr), tiny_data(num_clients=6))
    state = load(f"{t.checkpoint_dir}/last.ckpt")
    saved = state["client_states"]
    for client, u in zip(raw.clients, raw.updates):
        c_i = saved.get(client, {}).get("c_i")
        if placement in ("central", "distributed"):
            assert c_i is None
            continue
        residual = float((-K * lr * c_i - u.double()).norm() / u.double().norm())
        assert residual < 1e-5 if placement is None else residual > 0.5, (placement, residual)
    if placement is not None:  # nothing in the checkpoint is a multiple of a client's raw update
        vectors = _vectors(state, d)
        assert vectors and min(_best_fit(u, vectors) for u in raw.updates) > 0.5
        held = placement != "local"
        assert ("checkpoints leave c_i out" in scaffold.privacy_note) == held
        assert (placement in scaffold.privacy_note) or not held


@pytest.mark.parametrize("placement", [None, "local", "central", "distributed"])
def test_scaffnew_checkpoint_does_not_give_back_a_clients_clipped_update(log_dir, placement):
    # After round 1 from h = 0: h_i = (p / eta)(mean D - D_i), and mean D = x1 - x0 is public, so a
    # checkpoint holding h_i gives back D_i. Under central noise D_i is the clipped, un-noised update.
    from dpfl_lightning.run.checkpoint_format import load

    p, lr = 0.5, 0.1

    class Start(FederatedCallback):
        def on_fit_start(self, *, ctx):
            self.x0 = ctx.module.global_params.double().clone()

    start, clipped = Start(), Recorder(order=150)  # after the clipping, before the noise
    dp = [] if placement is None else [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement=placement)]
    scaffnew = ScaffNew(p=p)
    t = quiet_trainer(log_dir, rounds=1, seed=4, checkpoint_every=1, plugins=[scaffnew, *dp, clipped, start])
    t.fit(TinyClassifier(lr=lr), tiny_data(num_clients=5))
    state = load(f"{t.checkpoint_dir}/last.ckpt")
    mean = state["global_params"].double() - start.x0
    for client, D in zip(clipped.clients, clipped.updates):
        h = state["client_states"].get(client, {}).get("h")
        if placement in ("central", "distributed"):
            assert h is None
            continue
        residual = float((mean - lr / p * h - D.double()).norm() / D.double().norm())
        assert residual < 1e-4 if placement is None else residual > 0.5, (placement, residual)
    if placement is not None:
        assert ("checkpoints leave h_i out" in scaffnew.privacy_note) == (placement != "local")


def test_resume_without_checkpointed_c_i_restarts_every_client_from_c(log_dir):
    # distributed noise: the c_i carry the clients' noise shares and stay out of checkpoints; the
    # resumed run starts every client from the checkpointed c, so c = mean(c_i) still holds
    from dpfl_lightning.run.checkpoint_format import load

    M, kw = 6, dict(clients_per_round=2, local_steps=2, seed=3, checkpoint_every=2)
    first = SCAFFOLD()
    t = quiet_trainer(log_dir, rounds=2, plugins=_client_dp(first, "distributed"), **kw)
    t.fit(TinyClassifier(lr=0.1), tiny_data(num_clients=M))
    ckpt = f"{t.checkpoint_dir}/round-000002.ckpt"
    saved = load(ckpt)
    assert not any("c_i" in s for s in saved["client_states"].values())
    c_saved = saved["plugins"]["SCAFFOLD"]["c"].double()
    assert float(c_saved.abs().max()) > 0
    resumed = SCAFFOLD()
    t2 = quiet_trainer(log_dir, rounds=4, plugins=_client_dp(resumed, "distributed"), **kw)
    t2.fit(TinyClassifier(lr=0.1), tiny_data(num_clients=M), ckpt_path=ckpt)
    met = resumed.control_variates
    mean = (sum(met.values()) + (M - len(met)) * c_saved) / M
    assert 0 < len(met) < M
    assert torch.allclose(resumed.c, mean, rtol=0, atol=1e-9 * float(resumed.c.abs().max()))


def test_scaffold_refuses_client_level_dp_it_cannot_follow(log_dir):
    def fit(plugins, **kw):
        quiet_trainer(log_dir, rounds=3, clients_per_round=2, plugins=plugins, **kw).fit(
            TinyClassifier(), tiny_data(num_clients=4))

    with pytest.raises(ConfigError, match="covers the update but not dc"):  # c would move with an un-noised sum
        fit([DPSGD(noise_multiplier=1.0), SCAFFOLD(), UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    warm = SCAFFOLD(warm_start=True)
    with pytest.raises(ConfigError, match="amplified by client sampling"):  # partition blocks are not sampled
        fit(_client_dp(warm, "central"))


def test_scaffold_preset_carries_its_commit_so_client_level_dp_on_dc_keeps_c_the_mean(log_dir):
    from dpfl_lightning.algorithms import SCAFFOLD as SCAFFOLDPreset

    M = 6
    t = quiet_trainer(log_dir, rounds=3, clients_per_round=2, local_steps=2, algorithm=SCAFFOLDPreset(),
                      plugins=[UpdateClipping(1.0, segments=["update", "dc"]),
                               GaussianNoise(noise_multiplier=1.0, placement="local", segments=["update", "dc"])])
    t.fit(TinyClassifier(lr=0.1), tiny_data(num_clients=M))
    scaffold = next(p for p in t.plugins if isinstance(p, SCAFFOLD))
    mean = sum(scaffold.control_variates.values()) / M
    assert float(scaffold.c.abs().max()) > 0.01
    assert torch.allclose(scaffold.c, mean, rtol=0, atol=1e-9 * float(scaffold.c.abs().max()))


def test_scaffold_alone_follows_the_dc_sent_under_client_level_dp_as_with_the_deprecated_commit(log_dir):
    """No companion plugin: SCAFFOLD reads the clipped, noised dc after every on_client_end, so c stays
    the mean of the c_i; listing the deprecated scaffold.commit (a no-op) changes nothing."""
    M = 6

    def fit(plugins_of):
        scaffold = SCAFFOLD()
        t = quiet_trainer(log_dir, rounds=3, clients_per_round=2, local_steps=2, seed=0, plugins=plugins_of(scaffold))
        torch.manual_seed(0)
        module = t.fit(TinyClassifier(lr=0.1), tiny_data(num_clients=M))
        return scaffold, module.global_params.clone()

    clip_noise = [UpdateClipping(1.0, segments=["update", "dc"]),
                  GaussianNoise(noise_multiplier=1.0, placement="local", segments=["update", "dc"])]
    alone, params = fit(lambda s: [*clip_noise, s])  # listed after the noise: plugin order does not matter
    mean = sum(alone.control_variates.values()) / M
    assert float(alone.c.abs().max()) > 0.01
    assert torch.allclose(alone.c, mean, rtol=0, atol=1e-9 * float(alone.c.abs().max()))
    with pytest.warns(DeprecationWarning, match="remove it from the plugins"):
        old, old_params = fit(lambda s: [s, s.commit, *clip_noise])
    assert torch.equal(old.c, alone.c) and torch.equal(old_params, params)


def test_scaffnew_h_i_follow_the_noised_d_i_whatever_its_order(log_dir):
    """ScaffNew placed before the noise plugins still builds h_i from the D_i each client sent (read in
    on_client_released, after every on_client_end), so the h_i keep summing to zero."""
    from dpfl_lightning.federated.aggregation import HEADROOM_BITS
    from dpfl_lightning.comm.exact_sum import grid_exponent
    from dpfl_lightning.plugins.gaussian_noise import NOISE_TAIL

    early, inv = ScaffNew(p=0.3), Invariants()
    early.order = 150  # after DP-SGD's slot, before UpdateClipping's noise (200)
    _quadratic(log_dir, [early, UpdateClipping(0.5), GaussianNoise(noise_multiplier=0.2, placement="local"), inv],
               8, 1.0 / L)
    scale = max(inv.scales)
    assert scale > 1e-3
    grid = 2.0 ** (grid_exponent(0.5 + NOISE_TAIL * 0.2 * 0.5, N, HEADROOM_BITS) - 1)
    for r, s in enumerate(inv.sums, start=1):  # as in test_sum_of_h_is_zero_and_c_is_the_mean_of_the_c_i
        assert float(s.abs().max()) <= r * 0.3 / (1.0 / L) * N * grid + 1e-12 * scale
