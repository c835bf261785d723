"""``dpfl audit`` must be able to fail: the f-DP one-run test on synthetic scores, and the command on
planted bugs (user plugins that declare the honest mechanism and do less, :mod:`planted_bugs`)."""

import math
import re

import numpy as np
import pytest
import scipy.stats
import yaml

from dpfl_lightning.cli import command as cli
from dpfl_lightning.privacy import audit_bounds as ab


# --------------------------------------------------------------------------- the f-DP test on synthetic scores
def _gdp_scores(mu, m, seed):
    g = np.random.default_rng(seed)
    inserted = g.random(m) < 0.5
    return mu * inserted + g.normal(size=m), inserted


def test_the_fdp_test_refutes_a_curve_four_times_too_private_and_never_the_true_one():
    refuted_true = refuted_wrong = 0
    for seed in range(10):
        scores, ins = _gdp_scores(2.0, 500, seed)
        refuted_true += ab.curve_rejected(ab.gdp_tradeoff(2.0), scores, ins) is not None
        refuted_wrong += ab.curve_rejected(ab.gdp_tradeoff(0.5), scores, ins) is not None
    assert refuted_true == 0 and refuted_wrong >= 8


def test_the_gdp_bound_stays_below_the_true_mu_and_its_ceiling():
    ceiling = ab.gdp_ceiling(500, 1e-5)
    for seed in range(5):
        b = ab.gdp_lower_bound(*_gdp_scores(1.5, 500, seed), 1e-5)
        assert 0.3 < b.mu < 1.5 and b.epsilon <= ceiling.epsilon
    assert ab.gdp_lower_bound(*_gdp_scores(0.0, 500, 0), 1e-5).mu == 0.0


def test_a_profile_curve_is_the_kairouz_envelope():
    f = ab.profile_tradeoff([(1.0, 1e-5), (0.5, 1e-2)])
    for a in (0.0, 0.05, 0.3, 0.9):
        expected = max(0.0, 1 - 1e-5 - math.e * a, (1 - 1e-5 - a) / math.e, 1 - 1e-2 - math.exp(0.5) * a,
                       (1 - 1e-2 - a) / math.exp(0.5))
        assert f(a) == pytest.approx(expected, rel=1e-12)
    g = ab.gdp_tradeoff(1.0)
    assert g(0.2) == pytest.approx(scipy.stats.norm.cdf(scipy.stats.norm.ppf(0.8) - 1.0), rel=1e-9)


def test_the_noise_check_refutes_half_the_noise_and_never_the_declared_noise_plus_a_signal():
    g = np.random.default_rng(0)
    d = ab.NOISE_BLOCKS * 500
    false_alarms = 0
    for _ in range(40):  # honest: N(0, 1) per entry on top of a signal (which only adds)
        y = g.normal(size=d) + 0.5 * np.sin(np.arange(d))
        sq = (y ** 2).reshape(ab.NOISE_BLOCKS, -1).sum(1)
        false_alarms += ab.noise_check(sq, np.full(ab.NOISE_BLOCKS, d / ab.NOISE_BLOCKS), 0.95).refuted
    assert false_alarms <= 5  # 5% level: 2 expected at most
    half = (g.normal(0.0, 0.5, size=d) ** 2).reshape(ab.NOISE_BLOCKS, -1).sum(1)
    check = ab.noise_check(half, np.full(ab.NOISE_BLOCKS, d / ab.NOISE_BLOCKS), 0.95)
    assert check.refuted and 0.5 < check.upper < 0.6
    part = (np.concatenate([g.normal(size=d // 2), np.zeros(d // 2)]) ** 2).reshape(ab.NOISE_BLOCKS, -1).sum(1)
    assert ab.noise_check(part, np.full(ab.NOISE_BLOCKS, d / ab.NOISE_BLOCKS), 0.95).upper < 0.01


def test_perfect_separation_refutes_a_small_epsilon_and_not_a_huge_one():
    assert ab.curve_refutable(ab.profile_tradeoff([(0.5, 1e-6)]), 200)
    assert not ab.curve_refutable(ab.profile_tradeoff([(30.0, 1e-12)]), 200)



def _gdp_delta(eps, mu):  # mu-GDP's delta at eps (Dong, Roth, Su 2019, Cor. 2.13), evaluated directly
    return scipy.stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * scipy.stats.norm.cdf(-eps / mu - mu / 2)


def test_proposed_canaries_reach_the_ledger_as_the_audits_own_bound_on_a_perfect_run_shows():
    eps, delta, each = 4.0, 1e-5, 0.99
    assert ab.gdp_ceiling(100, delta, each).epsilon <= eps  # 100 canaries cannot
    p = ab.propose_settings(eps, delta, canaries=100, clients=10_000, rounds=20, cohort=25.0,
                            canary_confidence=each, trial_confidence=0.99)
    assert 100 < p.canaries <= 5000 and p.trials is None and p.client_updates == 20 * 25
    inserted = np.arange(p.canaries) % 2 == 0  # every guess right: the inserted canaries score 1, the others 0
    direct = ab.gdp_lower_bound(inserted.astype(float), inserted, delta, each)
    assert direct.epsilon == pytest.approx(p.ceiling, rel=1e-9) and p.ceiling > eps
    assert _gdp_delta(direct.epsilon, direct.mu) == pytest.approx(delta, rel=1e-4)


def test_when_no_canaries_reach_the_ledger_the_fewest_many_run_trials_are_proposed():
    from dpfl_lightning.privacy.audit import many_run_lower_bound

    eps, delta, each = 3.0, 1e-3, 0.99
    p = ab.propose_settings(eps, delta, canaries=5, clients=20, rounds=4, cohort=10.0, canary_confidence=each,
                            trial_confidence=each)
    assert p.canaries is None and p.trials >= 4 and p.client_updates == 2 * p.trials * 4 * 10
    n = p.trials - p.trials // 2  # held-out runs per world; no error among them
    rate = 1 - ((1 - each) / 2) ** (1 / n)  # Clopper-Pearson upper bound of 0 errors in n, closed form
    assert p.ceiling == pytest.approx(math.log((1 - delta - rate) / rate), rel=1e-9) and p.ceiling > eps
    runs = many_run_lower_bound(np.ones(p.trials), np.zeros(p.trials), delta, each)
    assert runs.epsilon == pytest.approx(p.ceiling, rel=1e-9)
    assert ab.many_run_ceiling(p.trials - 1, delta, each) <= eps  # and one trial fewer would not


def test_nothing_is_proposed_where_no_setting_reaches_the_ledger():
    p = ab.propose_settings(80.0, 1e-6, canaries=100, clients=1000, rounds=5, cohort=10.0, canary_confidence=0.99,
                            trial_confidence=0.99)
    assert p.canaries is None and p.trials is None and p.ceiling <= 80.0


def test_the_suspect_bound_holds_at_four_canaries_where_the_bootstrap_interval_does_not():
    from dpfl_lightning.privacy.audit import gaussian_epsilon, gaussian_fit_estimate, gaussian_fit_lower_bound

    mu, delta, conf = 126.5, 1e-3, 0.99  # dp_scaffnew_quadratic's messages at 10 rounds: 10 canaries, ~4 inserted
    truth = gaussian_epsilon(mu, delta)
    g = np.random.default_rng(0)
    above = boot_above = 0
    for seed in range(200):
        ins, out = mu + g.normal(size=4), g.normal(size=6)
        above += gaussian_fit_lower_bound(ins, out, delta, conf) > truth
        boot_above += gaussian_fit_estimate(ins, out, delta, conf, resamples=300, seed=seed).low > truth
    assert above <= 4 and boot_above >= 20  # 1% expected; the bootstrap's lower end misses far more often


def test_the_suspect_bound_sees_scores_twice_as_separated_as_the_ledger_allows():
    from dpfl_lightning.privacy.audit import gaussian_epsilon, gaussian_fit_lower_bound

    g = np.random.default_rng(1)
    ledger = gaussian_epsilon(1.5, 1e-5)
    seen = sum(gaussian_fit_lower_bound(3.0 + g.normal(size=100), g.normal(size=100), 1e-5, 0.99) > ledger
               for _ in range(10))
    assert seen >= 8

# --------------------------------------------------------------------------- dpfl audit on planted bugs
CLIP = {"class_path": "dpfl_lightning.plugins.UpdateClipping", "init_args": {"max_norm": 1.0}}
NOISE = {"class_path": "dpfl_lightning.plugins.GaussianNoise", "init_args": {"noise_multiplier": 2.0}}


def _config(tmp_path, clip=CLIP, noise=NOISE, **trainer) -> str:
    cfg = {"trainer": {"rounds": 20, "clients_per_round": 25, "sampling": "poisson", "local_steps": 1, "batch_size": 4,
                       "seed": 0, "num_threads": 1, "enable_progress_bar": False, "enable_summary": False,
                       "log_dir": str(tmp_path / "runs"), "plugins": [p for p in (clip, noise) if p], **trainer},
           "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                     "init_args": {"in_features": 10, "hidden": [128], "num_classes": 10, "lr": 0.5}},
           "data": {"class_path": "dpfl_lightning.data.SyntheticLogistic",
                    "init_args": {"num_clients": 500, "samples_per_client": 12, "test_samples_per_client": 4,
                                  "dim": 10}}}
    path = tmp_path / "audit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _audit(config, *args) -> tuple[int, str]:
    try:
        cli.main(["audit", "--config", config, *args])
    except SystemExit as e:
        return e.code, ""
    return 0, ""


@pytest.mark.parametrize("clip", ["LooseClip", "HalfSkippedClip"])
def test_a_clip_that_does_not_clip_is_a_violation(tmp_path, capsys, clip):
    code, _ = _audit(_config(tmp_path, clip={**CLIP, "class_path": f"planted_bugs.{clip}"}), "--canaries", "250")
    out = capsys.readouterr().out
    assert code == 3 and "VIOLATED" in out and "REFUTED" in out


def test_the_honest_clip_and_noise_are_consistent(tmp_path, capsys):
    code, _ = _audit(_config(tmp_path), "--canaries", "250")
    out = capsys.readouterr().out
    assert code == 0 and "consistent" in out and "REFUTED" not in out


def test_a_ledger_out_of_reach_is_said_before_training_with_settings_that_reach_it(tmp_path, capsys):
    config = _config(tmp_path, noise={**NOISE, "init_args": {"noise_multiplier": 0.65}}, rounds=5)  # ledger ~4.0
    code, _ = _audit(config, "--canaries", "100")
    out = capsys.readouterr().out
    assert code == 5 and out.index("this audit cannot detect a violation here") < out.index("dpfl audit:")
    assert "one run of 5 rounds x 25 clients per round = 125 client updates" in out
    assert "the declared noise is there" in out  # the run still trained, for the noise check
    k = re.search(r"settings that would: --canaries (\d+)", out).group(1)
    code, _ = _audit(config, "--canaries", k)  # the proposed canaries: the check passes and the test can refute
    out = capsys.readouterr().out
    assert code == 0 and "cannot" not in out and "not refuted" in out


@pytest.mark.parametrize("noise", ["HalfNoise", "HalfCoordinateNoise"])
def test_central_noise_below_the_declared_is_a_violation(tmp_path, capsys, noise):
    code, _ = _audit(_config(tmp_path, noise={**NOISE, "class_path": f"planted_bugs.{noise}"}), "--canaries", "250")
    out = capsys.readouterr().out
    assert code == 3 and "VIOLATED" in out
    assert "noise in the released sum" in out and "REFUTED (less noise than declared)" in out


def test_local_noise_a_quarter_of_the_declared_is_a_violation(tmp_path, capsys):
    quarter = {"class_path": "planted_bugs.QuarterLocalNoise", "init_args": {"noise_multiplier": 2.0}}
    code, _ = _audit(_config(tmp_path, noise=quarter), "--canaries", "250")
    out = capsys.readouterr().out
    assert code == 3 and "noise in each message" in out and "REFUTED (less noise than declared)" in out


@pytest.mark.parametrize("placement", ["local", "distributed"])
def test_honest_local_and_distributed_noise_pass_the_noise_check(tmp_path, capsys, placement):
    noise = {**NOISE, "init_args": {"noise_multiplier": 2.0, "placement": placement}}
    code, _ = _audit(_config(tmp_path, noise=noise), "--canaries", "250")
    out = capsys.readouterr().out
    assert code in (0, 5) and "the declared noise is there" in out and "REFUTED" not in out


def test_dp_sgd_is_refused_as_record_level_before_any_canary_check(tmp_path, capsys):
    dpsgd = {"class_path": "dpfl_lightning.plugins.DPSGD", "init_args": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}}
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--config", _config(tmp_path, clip=dpsgd, noise=None)])
    assert e.value.code == 2
    assert "record-level DP is not audited" in capsys.readouterr().err


# --------------------------------------------------------------------------- suspect, and the contribution check
def test_the_suspect_bound_sees_mixture_scores_the_parametric_bound_misses():
    from dpfl_lightning.privacy.audit import gaussian_fit_lower_bound, suspect_lower_bound

    # Poisson sampling: 64% of the inserted canaries were sampled (a wide spike), the rest score as
    # unseen (as a planted skipped clip's scores: sd 0.2 against 0.011)
    g = np.random.default_rng(0)
    gains = []
    for _ in range(10):
        ins = np.where(g.random(125) < 0.64, 0.25 + 0.2 * g.normal(size=125), 0.011 * g.normal(size=125))
        out = 0.011 * g.normal(size=125)
        gains.append(suspect_lower_bound(ins, out, 1e-4, 0.9875) - gaussian_fit_lower_bound(ins, out, 1e-4, 0.9875))
    assert min(gains) > 0.4  # e.g. 1.55 -> 2.21: a ledger of 1.356 ... 2 is suspect by the new bound only


def test_the_suspect_bound_stays_below_the_truth_on_gaussian_scores():
    from dpfl_lightning.privacy.audit import gaussian_epsilon, suspect_lower_bound

    g = np.random.default_rng(2)
    for mu in (0.5, 1.5):
        truth = gaussian_epsilon(mu, 1e-4)
        above = sum(suspect_lower_bound(mu + g.normal(size=100), g.normal(size=100), 1e-4, 0.99, resamples=1000,
                                        seed=s) > truth for s in range(100))
        assert above <= 5  # 1% expected


def _uneven_data(tmp_path) -> dict:
    g = np.random.default_rng(0)
    x = g.normal(size=(20000, 10)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int64) + 2 * (x[:, 3] > 0)
    np.savez(tmp_path / "uneven.npz", x_train=x, y_train=y, x_test=x[:500], y_test=y[:500])
    return {"class_path": "dpfl_lightning.data.NpzFile",
            "init_args": {"path": str(tmp_path / "uneven.npz"), "num_clients": 500, "partition": "dirichlet",
                          "alpha": 1.0, "num_classes": 10}}


PLANTED_CLIPS = {"clip at 2C": ("LooseClip", {"factor": 2.0}), "clip at 10C": ("LooseClip", {}),
                 "clip skipped for half the clients": ("HalfSkippedClip", {}),
                 "size-weighted averaging": ("SizeWeightedClip", {})}


@pytest.mark.parametrize("bug", list(PLANTED_CLIPS))
def test_the_contribution_check_refutes_every_planted_clip_bug(tmp_path, capsys, bug):
    name, extra = PLANTED_CLIPS[bug]
    clip = {"class_path": f"planted_bugs.{name}", "init_args": {"max_norm": 1.0, **extra}}
    config = _config(tmp_path, clip=clip)
    if name == "SizeWeightedClip":
        cfg = yaml.safe_load(open(config))
        cfg["data"] = _uneven_data(tmp_path)
        open(config, "w").write(yaml.safe_dump(cfg))
    code, _ = _audit(config, "--canaries", "250")
    out = capsys.readouterr().out
    assert code == 3 and "REFUTED (a contribution above the declared bound)" in out
    assert re.search(r"VIOLATED: [1-9]\d* of \d+ client contributions to the sum exceeded the declared bound", out)


def test_size_weighted_honest_data_without_the_bug_passes_the_contribution_check(tmp_path, capsys):
    config = _config(tmp_path)
    cfg = yaml.safe_load(open(config))
    cfg["data"] = _uneven_data(tmp_path)
    open(config, "w").write(yaml.safe_dump(cfg))
    code, _ = _audit(config, "--canaries", "250")
    out = capsys.readouterr().out
    assert code == 0 and "every one within its bound" in out and "REFUTED" not in out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_skipped_clip_is_violated_or_suspect_and_the_honest_run_consistent_over_seeds(tmp_path, capsys, seed):
    noise = {**NOISE, "init_args": {"noise_multiplier": 1.0}}  # ledger ~2: the canaries alone do not refute it
    (tmp_path / "bug").mkdir()
    (tmp_path / "honest").mkdir()
    code, _ = _audit(_config(tmp_path / "bug", clip={**CLIP, "class_path": "planted_bugs.HalfSkippedClip"},
                             noise=noise, seed=seed), "--canaries", "250")
    assert code in (3, 4)
    capsys.readouterr()
    code, _ = _audit(_config(tmp_path / "honest", noise=noise, seed=seed), "--canaries", "250")
    out = capsys.readouterr().out
    assert code == 0 and "SUSPECT" not in out and "REFUTED" not in out
# --------------------------------------------------------------------------- correlated and discrete noise
SHIPPED_NOISE = ["ftrl_banded", "ftrl_amplified_banded", "ftrl_blt", "ftrl_independent", "ftrl_tree", "ddp_quickstart",
                 "ddp_skellam_quickstart"]
PLANTED = {"dpfl_lightning.plugins.CorrelatedNoise": "planted_bugs.HalfCorrelatedNoise",
           "dpfl_lightning.plugins.DiscreteDistributedNoise": "planted_bugs.HalfDiscreteNoise"}


def _shipped(tmp_path, name, planted=False) -> str:
    from pathlib import Path

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml").read_text())
    t = cfg["trainer"]
    t.update(rounds=6, log_dir=str(tmp_path / "runs"), enable_progress_bar=False, enable_summary=False,
             num_threads=1, eval_every=6)
    if planted:
        for p in t["plugins"]:
            p["class_path"] = PLANTED.get(p["class_path"], p["class_path"])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _noise_bound(out: str) -> float:
    return float(re.search(r"noise in the released sum .*?std <= ([0-9.]+) x declared", out).group(1))


@pytest.mark.parametrize("name", ["ftrl_banded", "ddp_quickstart"])
def test_correlated_and_discrete_noise_at_half_the_declared_std_is_a_violation(tmp_path, capsys, name):
    code, _ = _audit(_shipped(tmp_path, name, planted=True))
    out = capsys.readouterr().out
    assert code == 3 and "VIOLATED: the released values hold less noise" in out
    assert "REFUTED (less noise than declared)" in out and 0.45 < _noise_bound(out) < 0.6


@pytest.mark.parametrize("name", SHIPPED_NOISE)
def test_the_shipped_correlated_and_discrete_configs_pass_the_noise_check(tmp_path, capsys, name):
    code, _ = _audit(_shipped(tmp_path, name))
    out = capsys.readouterr().out
    assert code in (0, 5) and "REFUTED" not in out and "the declared noise is there" in out
    assert 1.0 <= _noise_bound(out) < 1.1  # the whitened (or integer) noise reads as declared: upper bound near 1


# --------------------------------------------------------------------------- false alarms on honest shipped configs
def test_the_privunit_config_is_not_suspect_where_the_gaussian_fit_does_not_model_its_randomizer(tmp_path, capsys):
    # before: exit 4 (SUSPECT) at 2 rounds, the messages' fit 20.5 [15.9, 27.4] against a pure-DP ledger of 12
    from pathlib import Path

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "ldp_fedexp_privunit.yaml").read_text())
    cfg["trainer"].update(rounds=2, log_dir=str(tmp_path / "runs"), enable_progress_bar=False, enable_summary=False,
                          num_threads=1, eval_every=2)
    path = tmp_path / "ldp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, _ = _audit(str(path))
    out = capsys.readouterr().out
    assert code in (0, 5) and "SUSPECT" not in out and "REFUTED" not in out
    assert "no verdict rests on the Gaussian fit's estimate" in out and "non-Gaussian release" in out


def test_the_gaussian_fit_is_relied_on_for_gaussian_and_discrete_noise_only():
    import dp_accounting

    from dpfl_lightning.privacy.accountants import Release
    from dpfl_lightning.privacy.audit import fit_assumption_fails
    from dpfl_lightning.privacy.discrete_accounting import DiscreteNoiseDpEvent, skellam_rdp
    from dpfl_lightning.privacy.mechanisms import Stream

    gaussian = Release((dp_accounting.GaussianDpEvent(1.0),), "poisson", 0.1)
    assert fit_assumption_fails([gaussian]) is None
    assert fit_assumption_fails([Release((DiscreteNoiseDpEvent(skellam_rdp(10.0, 30.0, 400.0)),))]) is None
    pure = Release((dp_accounting.LaplaceDpEvent(0.5),))
    assert "non-Gaussian" in fit_assumption_fails([gaussian, pure])
    stream = Stream("participations", 1.2, rounds=30, min_sep=5)
    assert "correlated" in fit_assumption_fails([Release((), stream=stream)])
