"""SCAFFOLD, DP-SCAFFOLD(-warm), ScaffNew and DP-ScaffNew (papers 001 and 000).

On a heterogeneous strongly convex problem (clients with different minimisers) FedAvg with K local
steps stalls at a biased point; the control variates remove the drift and reach the optimum."""

import math

import pytest
import torch
import torch.nn.functional as F

from dpfl_lightning import ConfigError
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
    from dpfl_lightning.aggregation import HEADROOM_BITS
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


@pytest.mark.parametrize("where", ["training", "warm_start", "after_scaffold"])
def test_skipped_non_finite_client_keeps_its_control_variate(log_dir, where):
    # the client's training diverges (its dc is not finite; also in the warm start's second round),
    # or a plugin after SCAFFOLD makes its payload non-finite (its dc was finite and committed, then
    # the client is skipped)
    bad_client, bad_round = 2, 1
    snapshots = []

    class PoisonOnce(FederatedCallback):
        order = 50 if where == "after_scaffold" else 0  # SCAFFOLD's on_client_end runs at 41

        def _hit(self, client):
            return (client.client, client.round_idx) == (bad_client, bad_round)

        def on_client_start(self, *, client):
            client.model.poisoned = where != "after_scaffold" and self._hit(client)

        def on_client_end(self, *, client):
            if where == "after_scaffold" and self._hit(client) and not client.replay:
                client.payload["update"][0] = float("inf")

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
