"""Empirical privacy audit: the estimators on synthetic scores, canary clients in real runs (through
the run's own clipping and noise), and ``dpfl audit`` on a sound and on a planted-bug configuration."""

import math

import numpy as np
import pytest
import scipy.optimize
import scipy.stats
import torch
import yaml

from dpfl_lightning import ConfigError, rng
from dpfl_lightning.cli import command as cli
from dpfl_lightning.algorithms import DPFedAvg
from dpfl_lightning.models import MLPClassifier
from dpfl_lightning.plugins import (DPSGD, AdaptiveClip, FederatedCallback, GaussianNoise, UpdateClipping)
from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE
from dpfl_lightning.plugins.canary import CanaryClients
from dpfl_lightning.privacy import audit
from dpfl_lightning.privacy.mechanisms import Mechanism
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data


def gdp_epsilon(mu: float, delta: float) -> float:
    """The Gaussian mechanism's epsilon at ``delta``, solved here from Balle & Wang's formula."""
    f = lambda e: (scipy.stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * scipy.stats.norm.cdf(-e / mu - mu / 2)
                   - delta)  # noqa: E731
    return scipy.optimize.brentq(f, 0.0, 200.0)


# --------------------------------------------------------------------------- estimators
def test_gaussian_fit_interval_covers_a_known_gaussian_epsilon():
    mu, delta = 1.5, 1e-5
    true = gdp_epsilon(mu, delta)
    covered, points = 0, []
    for seed in range(30):
        g = np.random.default_rng(seed)
        est = audit.gaussian_fit_estimate(g.normal(mu, 1.0, 300), g.normal(0.0, 1.0, 300), delta, seed=seed)
        covered += est.low <= true <= est.high
        points.append(est.epsilon)
        assert est.low <= est.epsilon <= est.high
    assert covered >= 25  # a 95% interval; 30 draws
    assert abs(np.median(points) - true) < 0.1 * true
    assert audit.gaussian_epsilon(mu, delta) == pytest.approx(true, rel=1e-6)


def test_one_run_bound_stays_below_the_true_epsilon():
    # each canary's score is one Gaussian mechanism output: mu if inserted, plus N(0, 1)
    mu, delta = 3.0, 1e-5
    true = gdp_epsilon(mu, delta)
    bounds = []
    for seed in range(40):
        g = np.random.default_rng(seed)
        inserted = g.random(1000) < 0.5
        bounds.append(audit.one_run_lower_bound(mu * inserted + g.normal(size=1000), inserted, delta).epsilon)
    assert sum(b > true for b in bounds) <= 2  # confidence 0.95
    assert min(bounds) > 1.0  # and it does find something: 3-GDP is far from private
    no_signal = audit.one_run_lower_bound(np.random.default_rng(0).normal(size=1000), inserted, delta)
    assert no_signal.epsilon < 0.5


def test_one_run_p_value_is_the_binomial_tail_plus_the_delta_term():
    m, r, v, eps, delta = 300, 60, 50, 1.2, 1e-4
    q = math.exp(eps) / (1 + math.exp(eps))
    tail = scipy.stats.binom.sf(v - 1, r, q)
    spread = max(sum(scipy.stats.binom.pmf(j, r, q) for j in range(v - i, v)) / i for i in range(1, v + 1))
    assert audit.one_run_p_value(m, r, v, eps, delta) == pytest.approx(tail + 2 * m * delta * spread, rel=1e-9)


@pytest.mark.parametrize("k,n,alpha", [(0, 20, 0.05), (3, 50, 0.025), (17, 40, 0.01), (99, 100, 0.05), (5, 5, 0.05)])
def test_clopper_pearson_matches_the_beta_quantile(k, n, alpha):
    expected = 1.0 if k == n else scipy.stats.beta.ppf(1 - alpha, k + 1, n - k)
    assert audit.clopper_pearson_upper(k, n, alpha) == pytest.approx(expected, rel=1e-8)


def test_many_run_bound_from_the_held_out_half():
    # choice half: perfectly separated at 1.0; test half: 1 of 10 "out" scores above it, 2 of 10 "in" below
    ins = [2.0] * 10 + [2.0] * 8 + [0.5, 0.4]
    outs = [0.0] * 10 + [0.1] * 9 + [1.5]
    delta, confidence = 1e-5, 0.9
    b = audit.many_run_lower_bound(ins, outs, delta, confidence)
    fpr = scipy.stats.beta.ppf(1 - 0.05, 2, 9)  # 1 false positive of 10, each rate at 1 - 0.1 / 2
    fnr = scipy.stats.beta.ppf(1 - 0.05, 3, 8)
    expected = max(math.log((1 - delta - fnr) / fpr), math.log((1 - delta - fpr) / fnr))
    assert b.epsilon == pytest.approx(expected, rel=1e-6)
    assert (b.guesses, b.correct) == (20, 17)


# --------------------------------------------------------------------------- canary clients in runs
def _canary_run(log_dir, z=1.0, canaries=20, plugins=None, **kw):
    c = CanaryClients(canaries=canaries)
    kw.setdefault("algorithm", DPFedAvg(clip=1.0, noise_multiplier=z))
    t = quiet_trainer(log_dir, rounds=3, plugins=[*(plugins or []), c], seed=0, **kw)
    torch.manual_seed(0)  # the same initial model in every run
    t.fit(MLPClassifier(in_features=64, hidden=[64], num_classes=10, lr=0.5), tiny_data(num_clients=40, dim=64))
    return t, c


def test_the_estimate_grows_as_the_noise_vanishes(log_dir):
    # full participation: every inserted canary is in every round; d = 4810 >> 20 canaries
    est = []
    for z in (1.0, 0.1, 0.01):
        t, c = _canary_run(log_dir, z)
        est.append((t.history[-1]["audit_eps_final"], t.history[-1]["audit_eps_rounds"]))
    assert est[0][0] < est[1][0] < est[2][0] and est[0][1] < est[1][1] < est[2][1]
    assert min(est[2]) > 100  # the ledger's epsilon is ~1.6e4 at z = 0.01; a sound z = 1 run: ~5
    assert max(est[0]) < 15


def test_canaries_pass_through_the_runs_clipping_and_noise(log_dir):
    # pair: adaptive clipping moves C_t every round; local noise comes after it
    before, after = Recorder(order=150), Recorder(order=250)
    clip = AdaptiveClip(initial_clip=0.3, count_noise=5.0, learning_rate=0.5)
    t, c = _canary_run(log_dir, algorithm=None, clients_per_round=10,
                       plugins=[clip, GaussianNoise(noise_multiplier=1.0, placement="local"), before, after])
    bounds = [h["clip_norm"] for h in t.history]
    assert len(set(bounds)) == 3
    slot = c.slots
    per_round = len(before.clients) // 3
    seen = {"in": 0, "out": 0}
    for k, client in enumerate(before.clients):
        if client not in slot:
            continue
        r, u, noised = k // per_round, before.updates[k], after.updates[k]
        direction = c.direction(slot[client])
        if bool(c.is_inserted[slot[client]]):
            seen["in"] += 1
            assert float(u.norm()) == pytest.approx(bounds[r], rel=1e-5) and float(u.norm()) <= bounds[r]
            assert float(torch.dot(u, direction)) == pytest.approx(bounds[r], rel=1e-5)
        else:
            seen["out"] += 1
            assert not u.any()
        assert float((noised - u).std()) == pytest.approx(bounds[r], rel=0.1)  # sigma_t = z C_t, z = 1
    assert seen["in"] > 0 and seen["out"] > 0


def test_canaries_are_keyed_by_the_seed_and_give_the_same_audit_in_both_executors(log_dir):
    runs = {ex: _canary_run(log_dir, clients_per_round=10, executor=ex)[1] for ex in ("sequential", "vmap")}
    a, b = runs["sequential"], runs["vmap"]
    assert a.slots == b.slots and torch.equal(a.is_inserted, b.is_inserted)
    for name in ("final", "rounds"):
        assert torch.allclose(a.scores[name], b.scores[name], atol=1e-5)
    other = CanaryClients(canaries=20)
    quiet_trainer(log_dir, rounds=1, plugins=[other], seed=1, algorithm=DPFedAvg(clip=1.0, noise_multiplier=1.0)).fit(
        TinyClassifier(seed=1), tiny_data(num_clients=40))
    assert other.slots != a.slots


def test_a_resumed_canary_run_scores_as_the_uninterrupted_one(log_dir, tmp_path):
    def fit(rounds, ckpt=None, every=None):
        c = CanaryClients(canaries=10)
        t = quiet_trainer(str(tmp_path / ("a" if ckpt is None else "b")), rounds=rounds, clients_per_round=8, seed=2,
                          algorithm=DPFedAvg(clip=1.0, noise_multiplier=0.5), plugins=[c], checkpoint_every=every,
                          checkpoint_dir=str(tmp_path / "ckpt"))
        t.fit(TinyClassifier(seed=2), tiny_data(num_clients=20), ckpt_path=ckpt)
        return t, c

    full, c_full = fit(4, every=2)
    resumed, c_res = fit(4, ckpt=str(tmp_path / "ckpt" / "round-000002.ckpt"))
    for name in ("final", "rounds"):
        assert torch.allclose(c_full.scores[name], c_res.scores[name], atol=1e-6)
    assert resumed.history[-1]["audit_eps_final"] == pytest.approx(full.history[-1]["audit_eps_final"], rel=1e-6)


def test_bad_canary_settings_are_refused(log_dir):
    data = tiny_data(num_clients=20)
    with pytest.raises(ConfigError, match="CanaryClients.canaries"):
        quiet_trainer(log_dir, rounds=1, plugins=[UpdateClipping(1.0), CanaryClients(canaries=21)]).fit(
            TinyClassifier(), data)
    with pytest.raises(ConfigError, match="CanaryClients.norm"):
        quiet_trainer(log_dir, rounds=1, plugins=[CanaryClients(canaries=5)]).fit(TinyClassifier(), data)
    with pytest.raises(ConfigError, match="record-level"):
        quiet_trainer(log_dir, rounds=1, plugins=[DPSGD(max_grad_norm=1.0, noise_multiplier=1.0),
                                                  CanaryClients(canaries=5, norm=1.0)]).fit(TinyClassifier(), data)
    with pytest.raises(ConfigError, match="inserted"):
        CanaryClients(inserted="half")


# --------------------------------------------------------------------------- dpfl audit
class NoiseOnTheMean(FederatedCallback):
    """A planted bug: declares central Gaussian noise of multiplier z on the sum, but adds the
    standard deviation meant for the mean (z C / expected cohort) to the sum."""

    order = ORDER_ADD_NOISE

    def __init__(self, noise_multiplier: float = 2.0) -> None:
        self.noise_multiplier = noise_multiplier

    def setup(self, *, ctx) -> None:
        self._bound, self._n = ctx.norm_bound(("update",), before=self), ctx.sampler.expected_cohort

    def privacy_mechanisms(self, *, ctx):
        c = self._bound()
        return [Mechanism.gaussian("NoiseOnTheMean", self.noise_multiplier * c, c, "central", ("update",))]

    def on_aggregate(self, *, server) -> None:
        stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, rng.CENTRAL_NOISE)
        stream.add_normal_(server.aggregate["update"], self.noise_multiplier * self._bound() / self._n)


def _config(tmp_path, noise: dict, data: dict | None = None, **trainer) -> str:
    cfg = {"trainer": {"rounds": 20, "clients_per_round": 25, "sampling": "poisson", "local_steps": 1, "batch_size": 4,
                       "seed": 0, "num_threads": 1, "enable_progress_bar": False, "enable_summary": False,
                       "log_dir": str(tmp_path / "runs"),
                       "plugins": [{"class_path": "dpfl_lightning.plugins.UpdateClipping",
                                    "init_args": {"max_norm": 1.0}}, noise], **trainer},
           "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                     "init_args": {"in_features": 10, "hidden": [128], "num_classes": 10, "lr": 0.5}},
           "data": {"class_path": "dpfl_lightning.data.SyntheticLogistic",
                    "init_args": {"num_clients": 500, "samples_per_client": 12, "test_samples_per_client": 4,
                                  "dim": 10, **(data or {})}}}
    path = tmp_path / "audit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


SOUND = {"class_path": "dpfl_lightning.plugins.GaussianNoise", "init_args": {"noise_multiplier": 2.0}}
PLANTED = {"class_path": "test_audit.NoiseOnTheMean", "init_args": {"noise_multiplier": 2.0}}


def test_dpfl_audit_passes_a_sound_config_and_catches_a_planted_bug(tmp_path, capsys):
    sound, planted = ({**n, "init_args": {"noise_multiplier": 6.0}} for n in (SOUND, PLANTED))
    config = _config(tmp_path, sound, rounds=10, sampling="full", clients_per_round=None, data={"num_clients": 400})
    cli.main(["audit", "--config", config, "--canaries", "200"])  # exit 0: returns
    out = capsys.readouterr().out
    assert "consistent" in out and "REFUTED" not in out
    assert "only the final model is seen" in out and "every round's model is seen" in out

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["audit", "--config", _config(tmp_path, planted, rounds=10, sampling="full", clients_per_round=None,
                                               data={"num_clients": 400}), "--canaries", "200"])
    assert exit_info.value.code == 3
    assert "VIOLATED" in capsys.readouterr().out


def test_dpfl_audit_many_runs(tmp_path, capsys):
    config = _config(tmp_path, SOUND, rounds=2, sampling="full", clients_per_round=None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["audit", "--config", config, "--trials", "4", "--data.init_args.num_clients", "10"])
    assert exit_info.value.code == 5  # 4 runs per world cannot reach the ledger's epsilon: nothing is trained
    out = capsys.readouterr().out
    assert "this audit cannot detect a violation here" in out and "--trials" in out


def _readme_audit_commands() -> list[list[str]]:
    import os
    import shlex
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    block = readme.split("## Auditing a configuration", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [line for line in block.strip().splitlines() if line.startswith("dpfl audit")]
    return [[w for w in shlex.split(line.split("[", 1)[0])[1:]] for line in lines]


def test_the_readmes_audit_examples_exit_as_the_readme_says(tmp_path, capsys, monkeypatch):
    """The README's first example exits 5 (the ledger is out of the canaries' reach) and says what
    would reach it; its second, the same run cut to 20 rounds, exits 0 with the canary test able to
    refute (not 'cannot'). Both as the README's text next to them says."""
    import os
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    first, second = _readme_audit_commands()
    fast = ["--trainer.enable_progress_bar", "false", "--trainer.num_threads", "1", "--trainer.loggers", "[]",
            "--trainer.log_dir", str(tmp_path)]
    codes, outs = [], []
    for args in (first, second):
        try:
            cli.main([*args, *fast])
            codes.append(0)
        except SystemExit as e:
            codes.append(e.code)
        outs.append(capsys.readouterr().out)
    assert codes == [5, 0], codes
    assert "this audit cannot detect a violation here" in outs[0] and "settings that would:" in outs[0]
    assert "not refuted" in outs[1] and "cannot" not in outs[1]
