"""DiscreteDistributedNoise in runs: the integer pipeline end to end, the modular sum, the ledger
against the papers' bounds written here, masks, dropouts, secure mode, refusals."""

import math

import dp_accounting  # noqa: F401 - the conversion used below is dp_accounting's
import numpy as np
import pytest
import torch
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
from scipy import stats

from dpfl_lightning import rng
from dpfl_lightning.comm import modular_sum
from dpfl_lightning.comm.secagg import simulate_dropouts
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.federated.secure_sum import IntegerSumRound, IntegerSumSettings
from dpfl_lightning.plugins import (SCAFFOLD, AdaptiveClip, CorrelatedNoise, DiscreteDistributedNoise, FedEXP,
                                    GaussianNoise, PrivUnitRandomizer, ScaffNew, UpdateClipping)
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.plugins.discrete_distributed_noise import SEGMENT
from dpfl_lightning.privacy.quantization import clip_l2
from helpers import TinyClassifier, quiet_trainer, tiny_data


class Seen(FederatedCallback):
    """Records what each client released and each round's cohort (runs after the noise)."""

    order = 990

    def __init__(self):
        self.rows, self.cohorts = [], []

    def before_round(self, *, plan, server):
        self.cohorts.append(tuple(plan.cohort))

    def on_client_released(self, *, client, released):
        self.rows.append({k: v.clone() for k, v in released.items()})


def _fit(tmp_path, noise, rounds=3, seen=None, data=None, **kw):
    plugins = [UpdateClipping(0.5), noise] + ([seen] if seen else [])
    kw.setdefault("clients_per_round", 6)
    trainer = quiet_trainer(str(tmp_path), rounds=rounds, seed=3, plugins=plugins, **kw)
    module = trainer.fit(TinyClassifier(), data or tiny_data(num_clients=12))
    return trainer, module


# ----------------------------------------------------------------------------- item 2: the modular all-reduce
class TwoRanks:
    """A communicator whose all-reduce adds another rank's tensor (what MPI's would)."""

    size = 2

    def __init__(self, other):
        self.other = other

    def allreduce_sum_(self, t):
        return t.add_(self.other)


@pytest.mark.parametrize("bits", [12, 16, 32, 62])
def test_modular_sum_is_exact_and_the_same_for_any_split_over_ranks(bits):
    g = torch.Generator().manual_seed(bits)
    rows = torch.randint(0, 1 << min(bits, 62), (9, 257), generator=g, dtype=torch.int64) if bits < 63 else None
    expected = torch.tensor([sum(int(v) for v in col) % (1 << bits) for col in rows.T])  # Python's big integers
    assert torch.equal(modular_sum.local_mod_sum(rows, bits), expected)
    for cut in (0, 4, 9):  # rank 0 holds rows[:cut], rank 1 the rest: limbs through a float64 all-reduce
        mine = modular_sum.local_mod_sum(rows[:cut], bits) if cut else torch.zeros(257, dtype=torch.int64)
        theirs = modular_sum.to_limbs(modular_sum.local_mod_sum(rows[cut:], bits), bits, torch.float64) \
            if cut < 9 else torch.zeros(257 * modular_sum.limb_count(bits), dtype=torch.float64)
        assert torch.equal(modular_sum.allreduce_mod_(TwoRanks(theirs), mine, bits), expected)


# ----------------------------------------------------------------------------- item 1: the pipeline
def test_round_trip_of_a_sum_with_tiny_noise_is_the_clipped_sum_up_to_rounding():
    cohort, dim, clip, gamma = tuple(range(8)), 300, 1.0, 1e-3
    settings = IntegerSumSettings("discrete_gaussian", 32, gamma, math.exp(-0.5), clip, 0.25, secagg=True,
                                  dropout=0.3)
    source = rng.RandomSource(5)
    r = IntegerSumRound(settings, 2, cohort, dim, source, b"public rotation key")
    xs = [torch.randn(dim, generator=torch.Generator().manual_seed(c)) * (0.3 + c) for c in cohort]
    rows = [r.client_row(c, x, source.stream(2, c, rng.CLIENT_NOISE), source.stream(2, c, 999)) for c, x in
            zip(cohort, xs)]
    assert r.dropped and all((row is None) == (c in r.dropped) for c, row in zip(cohort, rows))
    limbs = torch.stack([row.double() for row in rows if row is not None]).sum(0)
    got = r.decode_sum(limbs)
    want = sum(clip_l2(x, clip) for c, x in zip(cohort, xs) if c in r.survivors)
    n = len(r.survivors)
    # rounding: variance <= gamma^2/4 a client; noise: variance 0.25 gamma^2 a client (grid units 0.25)
    err = (got - want).double()
    assert float(err.pow(2).mean()) < 4 * n * gamma**2 * (0.25 + 0.25)
    assert float(err.abs().max()) < 12 * math.sqrt(n * 0.5) * gamma


def test_masked_sum_unmasks_to_the_survivors_residues_bit_for_bit():
    cohort, dim = tuple(range(10)), 64
    settings = IntegerSumSettings("skellam", 20, 0.01, 0.5, 1.0, 3.0, secagg=True, neighbours=4, dropout=0.25)
    source = rng.RandomSource(9)
    r = IntegerSumRound(settings, 4, cohort, dim, source, b"k")
    xs = {c: torch.randn(dim, generator=torch.Generator().manual_seed(100 + c)) for c in cohort}
    residues = {c: r.residues(xs[c], source.stream(4, c, rng.CLIENT_NOISE), source.stream(4, c, 998))
                for c in r.survivors}
    masked = {c: r.secagg.mask(c, residues[c]) for c in r.survivors}
    limbs = sum(modular_sum.to_limbs(masked[c], 20, torch.float64) for c in r.survivors)
    expected = modular_sum.local_mod_sum(torch.stack([residues[c] for c in r.survivors]), 20)
    assert r.dropped and torch.equal(r.modular_total(limbs), expected)
    assert not torch.equal(masked[r.survivors[0]], residues[r.survivors[0]])


# ----------------------------------------------------------------------------- what reaches the server
def test_nothing_un_noised_leaves_a_client_and_a_masked_row_is_uniform(tmp_path):
    seen = Seen()
    _fit(tmp_path, DiscreteDistributedNoise(noise_multiplier=0.5, bits=16), rounds=2, seen=seen)
    assert seen.rows and all(float(r["update"].abs().max()) == 0.0 for r in seen.rows)
    row = seen.rows[0][SEGMENT].to(torch.int64)  # 16 bits: one limb a coordinate, the masked residue itself
    counts = torch.bincount(row >> 12, minlength=16).numpy()
    assert stats.chisquare(counts).pvalue > 1e-4


def test_without_masks_the_row_carries_the_noise_share(tmp_path):
    seen = Seen()
    noise = DiscreteDistributedNoise(noise_multiplier=2.0, bits=32, secagg=False)
    _fit(tmp_path, noise, rounds=1, seen=seen)
    row = seen.rows[0][SEGMENT].to(torch.int64)
    half = row.numel() // 2
    signed = modular_sum.from_limb_sums(row.double(), 32)
    signed = torch.where(signed >= 1 << 31, signed - (1 << 32), signed).double()
    share = math.sqrt(noise.noise_parameter) if noise.mechanism == "discrete_gaussian" else None
    # the update's signal is at most clip/gamma in norm: the spread is the share's (within 10%)
    assert half > 0 and abs(float(signed.std()) / share - 1) < 0.1


def test_the_model_learns_and_runs_are_reproducible_from_the_seed(tmp_path):
    one = _fit(tmp_path / "a", DiscreteDistributedNoise(noise_multiplier=0.3, bits=20), rounds=3)[1]
    two = _fit(tmp_path / "b", DiscreteDistributedNoise(noise_multiplier=0.3, bits=20), rounds=3)[1]
    assert torch.equal(one.global_params, two.global_params)


def test_sequential_and_vmap_executors_give_the_same_model(tmp_path):
    runs = [_fit(tmp_path / ex, DiscreteDistributedNoise(noise_multiplier=0.3, bits=24), rounds=2, executor=ex)[1]
            for ex in ("sequential", "vmap")]
    assert torch.allclose(runs[0].global_params, runs[1].global_params, atol=1e-5)


# ----------------------------------------------------------------------------- item 3: the ledger
def _ddg_rdp(orders, l2, l1, sigma, n, d):
    """Kairouz, Liu, Steinke 2021 (Prop. 14): the least of three bounds, written out here."""
    tau = 10 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, n))
    s2 = n * sigma**2
    return np.array([min(a * l2**2 / (2 * s2) + tau * d,
                         a / 2 * (l2**2 / s2 + 2 * l1 * tau / math.sqrt(s2) + tau**2 * d),
                         a / 2 * (l2 / math.sqrt(s2) + tau * math.sqrt(d)) ** 2) for a in orders])


def _skellam_rdp(orders, l2, l1, mu):
    """Agarwal, Kairouz, Liu 2021 (Thm 3.5), for Sk(mu, mu) in the sum."""
    return np.array([a * l2**2 / (4 * mu) + min(((2 * a - 1) * l2**2 + 6 * l1) / (16 * mu**2), 3 * l1 / (4 * mu))
                     for a in orders])


@pytest.mark.parametrize("mechanism", ["discrete_gaussian", "skellam"])
def test_ledger_epsilon_equals_the_papers_bounds(tmp_path, mechanism):
    noise = DiscreteDistributedNoise(mechanism, noise_multiplier=1.0, bits=24)
    trainer, _ = _fit(tmp_path, noise, rounds=3, sampling="full", clients_per_round=None, data=tiny_data(num_clients=6))
    orders = list(range(2, 129)) + [160, 192, 256]
    d = 1 << (sum(p.numel() for p in TinyClassifier().parameters()) - 1).bit_length()
    c, beta = 0.5 / noise.gamma, math.exp(-0.5)
    l2 = min(c + math.sqrt(d), math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(d) / 2)))
    l1 = l2 * min(math.sqrt(d), l2)
    s2 = noise.noise_parameter if mechanism == "discrete_gaussian" else 2 * noise.noise_parameter
    m = noise.min_survivors
    assert m == 6  # full participation without dropouts: every client's share counts

    def curve(k):  # sensitivities times k (replace-one doubles them)
        if mechanism == "discrete_gaussian":
            return _ddg_rdp(orders, k * l2, k * l1, math.sqrt(s2), m, d)
        return _skellam_rdp(orders, k * l2, k * l1, m * s2 / 2)

    delta = next(p for p in trainer.plugins if type(p).__name__ == "PrivacyLedger").delta
    row = trainer.history[-1]
    towards_server = compute_epsilon(orders, 3 * curve(2), delta)[0]  # every client took part 3 times
    towards_models = compute_epsilon(orders, 3 * curve(1), delta)[0]  # add/remove, no sampling to amplify
    assert math.isclose(row["epsilon"], towards_server, rel_tol=1e-6)
    assert math.isclose(row["epsilon_client_distributed_models"], towards_models, rel_tol=1e-6)


def test_accounted_noise_never_exceeds_the_noise_present_and_short_rounds_are_skipped(tmp_path):
    seen = Seen()
    noise = DiscreteDistributedNoise(noise_multiplier=0.5, bits=20, dropout=0.4, min_survivors=4)
    trainer, _ = _fit(tmp_path, noise, rounds=6, seen=seen)
    source = rng.RandomSource(3)
    expect_skipped = []
    for r, cohort in enumerate(seen.cohorts):
        survivors, _ = simulate_dropouts(cohort, 0.4, r, source)
        if len(survivors) < 4:
            expect_skipped.append(r)
        else:  # the noise present: one share per survivor, >= the min_survivors shares accounted
            assert len(survivors) * noise.noise_parameter >= noise.min_survivors * noise.noise_parameter
    assert noise.skipped_rounds == expect_skipped and expect_skipped  # this seed skips some rounds
    assert len(trainer.history) == 6  # the ledger counts skipped rounds too


def test_too_few_survivors_can_stop_the_run_instead(tmp_path):
    with pytest.raises(RuntimeError, match="fewer surviving clients"):
        _fit(tmp_path, DiscreteDistributedNoise(noise_multiplier=0.5, dropout=0.4, min_survivors=6, on_too_few="raise"))


# ----------------------------------------------------------------------------- item 6: secure mode
def test_secure_mode_runs_from_the_csprng(tmp_path):
    a = _fit(tmp_path / "a", DiscreteDistributedNoise(noise_multiplier=0.5, bits=20), rounds=2, secure=True)[1]
    b = _fit(tmp_path / "b", DiscreteDistributedNoise(noise_multiplier=0.5, bits=20), rounds=2, secure=True)[1]
    assert not torch.equal(a.global_params, b.global_params)  # a secret nobody logs: not the seed's draws
    assert torch.isfinite(a.global_params).all()


# ----------------------------------------------------------------------------- refusals
def test_a_bit_width_that_cannot_hold_the_sum_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="bits"):
        _fit(tmp_path, DiscreteDistributedNoise(noise_multiplier=0.5, bits=3))


def test_noise_without_a_fixed_bound_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="UpdateClipping"):
        quiet_trainer(str(tmp_path), rounds=1, clients_per_round=4, plugins=[
            DiscreteDistributedNoise(noise_multiplier=0.5)]).fit(TinyClassifier(), tiny_data(num_clients=8))
    with pytest.raises(ConfigError, match="fixed UpdateClipping"):
        quiet_trainer(str(tmp_path), rounds=1, clients_per_round=4, plugins=[
            AdaptiveClip(initial_clip=0.5, count_noise=1.0), DiscreteDistributedNoise(noise_multiplier=0.5)]).fit(
            TinyClassifier(), tiny_data(num_clients=8))


def test_target_epsilon_is_met(tmp_path):
    noise = DiscreteDistributedNoise("skellam", target_epsilon=8.0, bits=24)
    trainer, _ = _fit(tmp_path, noise, rounds=2)
    assert trainer.history[-1]["epsilon"] <= 8.0 and trainer.history[-1]["epsilon"] > 7.0


def test_dpfl_audit_of_a_discrete_noise_run_stays_below_the_ledger(tmp_path, capsys):
    from dpfl_lightning.cli import command as cli

    cli.main(["audit", "--config", "configs/ddp_quickstart.yaml", "--trainer.rounds", "2",  # exit 0: returns
              "--trainer.test_after_fit", "false", "--trainer.log_dir", str(tmp_path), "--canaries", "60"])
    assert "consistent: the canaries do not refute the ledger" in capsys.readouterr().out


# ----------------------------------------------------------------------------- pairings that would see zeros
def _refused_beside(tmp_path, other, match, clip_segments=("update",), **kw):
    """Set up DiscreteDistributedNoise next to ``other`` and expect the pairing's refusal."""
    kw.setdefault("clients_per_round", 4)
    plugins = [UpdateClipping(0.5, segments=list(clip_segments)), DiscreteDistributedNoise(noise_multiplier=0.5),
               other]
    with pytest.raises(ConfigError, match=match) as err:
        quiet_trainer(str(tmp_path), rounds=1, plugins=plugins, **kw).fit(TinyClassifier(), tiny_data(num_clients=8))
    assert "DiscreteDistributedNoise" in str(err.value)
    return str(err.value)


def test_scaffold_beside_integer_noise_is_refused_with_the_reason(tmp_path):
    _refused_beside(tmp_path, SCAFFOLD(), "SCAFFOLD builds each c_i", clip_segments=("update", "dc"))


def test_scaffnew_beside_integer_noise_is_refused_with_the_reason(tmp_path):
    _refused_beside(tmp_path, ScaffNew(p=0.5), "ScaffNew builds each D_i", sampling="full")


@pytest.mark.parametrize("variant", ["plain", "cdp"])
def test_fedexp_beside_integer_noise_is_refused_with_the_reason(tmp_path, variant):
    _refused_beside(tmp_path, FedEXP(variant=variant, sigma_xi=1.0 if variant == "cdp" else None),
                    "FedEXP's step size reads each client's update norm")


@pytest.mark.parametrize("placement", ["central", "distributed", "local"])
def test_a_second_noise_on_the_update_is_refused(tmp_path, placement):
    msg = _refused_beside(tmp_path, GaussianNoise(noise_multiplier=0.5, placement=placement),
                          "accounted noise that never reaches the model")
    assert "DiscreteDistributedNoise alone" in msg  # the fix


def test_correlated_noise_and_privunit_beside_integer_noise_are_refused(tmp_path):
    _refused_beside(tmp_path / "c", CorrelatedNoise("banded", noise_multiplier=0.5, bands=1), "CorrelatedNoise "
                    "randomizes the update too", sampling="cyclic")
    _refused_beside(tmp_path / "p", PrivUnitRandomizer(), "PrivUnitRandomizer randomizes the update too")


def test_an_adaptive_clip_beside_integer_noise_is_refused_as_a_moving_bound(tmp_path):
    plugins = [AdaptiveClip(initial_clip=0.5, count_noise=1.0), DiscreteDistributedNoise(noise_multiplier=0.5)]
    with pytest.raises(ConfigError, match="moves it every round"):
        quiet_trainer(str(tmp_path), rounds=1, clients_per_round=4, plugins=plugins).fit(
            TinyClassifier(), tiny_data(num_clients=8))


# ----------------------------------------------------------------------------- short rounds under hidden sampling
def test_skipping_short_rounds_is_refused_under_poisson_sampling(tmp_path):
    noise = DiscreteDistributedNoise(noise_multiplier=0.5, dropout=0.1, min_survivors=2, on_too_few="skip")
    with pytest.raises(ConfigError, match="on_too_few.*reveals"):
        _fit(tmp_path, noise, rounds=1, sampling="poisson", sampling_rate=0.5)


def test_under_poisson_sampling_a_likely_stop_is_refused_and_its_bound_is_the_binomial_mixture(tmp_path):
    noise = DiscreteDistributedNoise(noise_multiplier=0.5, bits=20, dropout=0.5, min_survivors=5)
    with pytest.raises(ConfigError, match="min_survivors.*leaves no epsilon.*sampling='uniform'"):
        _fit(tmp_path, noise, rounds=1, sampling="poisson", sampling_rate=0.5)  # refused before any round
    assert noise.policy == "raise"  # the default under Poisson sampling

    def short(n):  # cohort Binomial(n, 0.5), half of it drops; short below max(5, SecAgg's majority, 2)
        return sum(math.comb(n, c) * 0.5**n * sum(math.comb(c, k) * 0.5**c for k in range(max(5, c // 2 + 1, 2)))
                   for c in range(n + 1))

    assert math.isclose(noise.shortfall_bound, max(short(12), short(11)), rel_tol=1e-9)  # 12 clients, or 11
