"""Attacks on the guarantees of three mechanisms, by someone who holds what a run or a sweep writes.

Each test is one attack: it passes when the guarantee held against it. An attack that succeeds (a
real leak) is marked ``xfail(strict=True)`` with the leak in its reason, so that the fix turns it
into a failure to be unmarked.

(a) Private selection in ``dpfl sweep`` (Papernot & Steinke): the theorems need ``K`` (the number of
    trials) and every non-selected trial secret. The attacker holds ``released/`` and the console.
(b) DP-FTRL correlated noise (``CorrelatedNoise``): in secure mode nothing written may let one rebuild
    the noise rows; on neighbouring datasets a run writes the same.
(c) Distributed discrete Gaussian / Skellam with SecAgg (``DiscreteDistributedNoise``): the server sees
    the modular sum only; the noise in the sum is at least the accounted noise when clients drop; on
    neighbouring datasets a run writes the same and every client sends the same outside its masked row.

Sweeps run a fake ``dpfl fit`` (a script writing a run's files, ``config.yaml`` with the trial's seed
and run name as ``dpfl fit`` saves them) so that they take a second; runs are 2-4 rounds of a tiny
model.
"""

from __future__ import annotations

import io
from unittest import mock
import json
import math
import os
import time

import pytest
import torch
import yaml

from dpfl_lightning import FederatedDataModule, FederatedTrainer, rng
from dpfl_lightning.comm.secagg import simulate_dropouts
from dpfl_lightning.plugins import CorrelatedNoise, DiscreteDistributedNoise, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.plugins.discrete_distributed_noise import SEGMENT
from dpfl_lightning.privacy.accountants import GaussianRelease
from dpfl_lightning.privacy.selection import draw_trial_count, trial_count
from dpfl_lightning.privacy.selection_accounting import Trial
from dpfl_lightning.tracking import private_sweep, sweep
from dpfl_lightning.tracking.sweep_privacy import RunPrivacy
from helpers import TinyClassifier, neighbouring_data
from neighbours import differences, written


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")


# =============================================================================== (a) private selection
# A fake `dpfl fit`: writes <log_dir>/<run_name>/version_0/{metrics.csv, hparams.yaml, config.yaml,
# release_kinds.json} as dpfl fit does; its score is a function of lr only (NAN_SCORE=1: the run diverged).
FAKE_FIT = r'''
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
root = os.path.join(args["trainer.log_dir"], args["trainer.run_name"], "version_0")
os.makedirs(os.path.join(root, "checkpoints"), exist_ok=True)
lr = float(args.get("model.init_args.lr", 1))
score = float("nan") if os.environ.get("NAN_SCORE") else 1.0 / (1.0 + abs(lr - 0.3))
with open(os.path.join(root, "metrics.csv"), "w") as f:
    f.write("round,test_acc\n1,%r\n" % (score,))
with open(os.path.join(root, "hparams.yaml"), "w") as f:
    f.write("privacy:\n  delta: 1.0e-05\n")
with open(os.path.join(root, "config.yaml"), "w") as f:
    f.write("trainer:\n  seed: %s\n  run_name: %s\n  log_dir: %s\nmodel:\n  init_args:\n    lr: %r\n"
            % (args.get("trainer.seed", 0), args["trainer.run_name"], args["trainer.log_dir"], lr))
with open(os.path.join(root, "checkpoints", "final.ckpt"), "w") as f:
    f.write("weights")
with open(os.path.join(root, "release_kinds.json"), "w") as f:
    json.dump({"kinds": {"round": "public", "test_acc": "evaluation"}, "evaluation_from_clients": False}, f)
'''
DELTA, AUDIENCE = 1e-5, "towards anyone who sees the models"


def _planner(secure: bool = False):
    def plan(arguments, label):
        return RunPrivacy((Trial(((GaussianRelease(2.0), 10),), label),), AUDIENCE, "client", DELTA, "rdp", secure, 2.0)
    return plan


def _sweep_file(tmp_path, lrs, selection) -> str:
    script = tmp_path / "fake_fit.py"
    script.write_text(FAKE_FIT)
    spec = {"name": "ps", "method": "grid", "metric": {"name": "test_acc", "goal": "maximize"},
            "command": ["${interpreter}", str(script), "fit", "${args}"],
            "parameters": {"model.init_args.lr": {"values": list(lrs)}}, "private_selection": selection}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


SWEEP_SECRET = bytes(range(32))  # the sweep draws K from a fresh secret; fixed here to choose K (unknown to the attacks)


def _sweep(path, directory, seed=0, secure=False):
    s = sweep.load_sweep(path)
    opts = private_sweep.Options(str(directory), _planner(secure), seed=seed)
    out = io.StringIO()
    with mock.patch.object(rng, "new_secret", lambda: SWEEP_SECRET):
        info = private_sweep.run_private(s, private_sweep.selection_setting(s), opts, out)
    return info, out.getvalue()


def _seed_with(selection, want, start=0):
    """A sweep seed whose draws (under :data:`SWEEP_SECRET`) give ``K`` with ``want(K)`` (the sampler
    itself, not the sweep)."""
    for seed in range(start, start + 500):
        k = draw_trial_count(rng.RandomSource(seed, SWEEP_SECRET), trial_count(selection))
        if want(k):
            return seed, k
    raise AssertionError("no seed")


def _tree(root) -> dict[str, str]:
    """Every file under ``root`` by relative path: its text."""
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            p = os.path.join(base, name)
            out[os.path.relpath(p, root)] = open(p, errors="replace").read()
    return out


def test_released_folder_and_console_are_the_same_whatever_k(tmp_path):
    """Attack: compare what two sweeps of one point release, one with K = 1 and one with K = 6 (the
    selected result is the same): file names, counts, version_N, selection.json, summary.md, the
    selected run's files (its own seed and run name aside) and the console must not tell K apart."""
    selection = {"distribution": "poisson", "mean": 3}
    s1, k1 = _seed_with(selection, lambda k: k == 1)
    s6, k6 = _seed_with(selection, lambda k: k == 6)
    path = _sweep_file(tmp_path, [0.3], selection)
    (info1, out1), (info6, out6) = _sweep(path, tmp_path / "one", s1), _sweep(path, tmp_path / "six", s6)
    assert info1["result"] == info6["result"] == "selected"
    assert len(os.listdir(tmp_path / "six" / "private" / "runs")) == 6  # the trials did run

    def masked(directory):
        files = _tree(directory / "released")
        cfg = yaml.safe_load(files[os.path.join("runs", "selected", "version_0", "config.yaml")])
        own = (str(cfg["trainer"]["seed"]), cfg["trainer"]["run_name"])  # the selected trial's own draw
        return {k: v.replace(own[0], "<seed>").replace(own[1], "<name>").replace(str(directory), "<dir>")
                for k, v in files.items()}

    assert masked(tmp_path / "one") == masked(tmp_path / "six")
    assert out1.replace(str(tmp_path / "one"), "<dir>") == out6.replace(str(tmp_path / "six"), "<dir>")


def test_released_files_do_not_date_the_selected_trial(tmp_path):
    """Attack: read the modification times in released/. The trials' files are dated 2001 (as if the
    selected trial had run long before the release); a released copy must not carry that date."""
    selection = {"distribution": "poisson", "mean": 3}
    seed, _ = _seed_with(selection, lambda k: k >= 2)
    path = _sweep_file(tmp_path, [0.1, 0.3], selection)
    _sweep(path, tmp_path / "sw", seed)
    old = 978307200  # 2001-01-01
    for base, _, names in os.walk(tmp_path / "sw" / "private" / "runs"):
        for name in names:
            os.utime(os.path.join(base, name), (old, old))
    before = time.time() - 1
    _sweep(path, tmp_path / "sw", seed)  # every trial done: the sweep releases again
    stamps = {p: os.stat(os.path.join(base, p)).st_mtime for base, _, names in
              os.walk(tmp_path / "sw" / "released") for p in names}
    assert stamps and min(stamps.values()) >= before, stamps


def test_released_trial_seed_does_not_give_away_the_sweep_seed(tmp_path):
    """Attack: from the released selected run's seed, search the sweep seeds 0..999 for one whose
    draws hold that trial seed; that seed's draw is K."""
    selection = {"distribution": "poisson", "mean": 3}
    seed, k = _seed_with(selection, lambda k: k >= 2, start=137)
    path = _sweep_file(tmp_path, [0.1, 0.3, 0.9], selection)
    _sweep(path, tmp_path / "sw", seed)
    files = _tree(tmp_path / "sw" / "released")
    released_seed = yaml.safe_load(files[os.path.join("runs", "selected", "version_0", "config.yaml")])["trainer"]["seed"]
    count, found = trial_count(selection), []
    for guess in range(1000):
        state = private_sweep.draw_state(rng.RandomSource(guess), count, 3)
        if any(t["seed"] == released_seed for t in state["trials"]):
            found.append(state["count"])
    assert found != [k], f"the released seed gives away K = {k}"


def test_releasing_nothing_does_not_say_whether_k_was_zero(tmp_path, monkeypatch):
    """Attack: compare a K = 0 sweep with a K >= 1 sweep whose trials all diverged (NaN score)."""
    selection = {"distribution": "poisson", "mean": 1}
    s0, _ = _seed_with(selection, lambda k: k == 0)
    s2, _ = _seed_with(selection, lambda k: k >= 2)
    path = _sweep_file(tmp_path, [0.1, 0.3], selection)
    monkeypatch.setenv("NAN_SCORE", "1")
    (i0, o0), (i2, o2) = _sweep(path, tmp_path / "zero", s0), _sweep(path, tmp_path / "two", s2)
    assert i0["result"] == i2["result"] == "nothing"
    assert _tree(tmp_path / "zero" / "released") == _tree(tmp_path / "two" / "released")
    assert o0.replace(str(tmp_path / "zero"), "<d>") == o2.replace(str(tmp_path / "two"), "<d>")


def test_secure_sweep_trial_seed_is_not_a_function_of_the_sweep_seed(tmp_path):
    """Attack (secure mode): the same search as above finds no sweep seed whose draws hold the
    released trial's seed (K came from the CSPRNG)."""
    selection = {"distribution": "geometric", "mean": 3}
    path = _sweep_file(tmp_path, [0.1, 0.3], selection)
    info, _ = _sweep(path, tmp_path / "sw", seed=0, secure=True)
    assert info["result"] == "selected"
    files = _tree(tmp_path / "sw" / "released")
    released_seed = yaml.safe_load(files[os.path.join("runs", "selected", "version_0", "config.yaml")])["trainer"]["seed"]
    count = trial_count(selection)
    hits = [g for g in range(200) if any(t["seed"] == released_seed for t in
                                         private_sweep.draw_state(rng.RandomSource(g), count, 2)["trials"])]
    assert hits == []
    assert "selection_state" not in "".join(_tree(tmp_path / "sw" / "released"))


# =============================================================================== neighbouring datasets
CLIENTS, RECORDS = 4, 10


def _data(change: str | None) -> FederatedDataModule:
    """Four clients of ten records; ``change`` alters client 3's (a marker record, a huge record, fewer)."""
    return neighbouring_data(change, CLIENTS, RECORDS, marker_at=4)


def _fit(change, plugins, **kw):
    def fit(log_dir: str) -> None:
        settings = dict(log_dir=log_dir, run_name="nb", rounds=3, local_epochs=1, batch_size=4, num_threads=1,
                        enable_progress_bar=False, enable_summary=True, checkpoint_every=1, final_checkpoint=True,
                        seed=0, plugins=plugins())
        FederatedTrainer(**{**settings, **kw}).fit(TinyClassifier(), _data(change))
    return fit


def _neighbours(tmp_path, change, plugins, **kw):
    a = written(str(tmp_path / "a"), _fit(None, plugins, **kw))
    b = written(str(tmp_path / "b"), _fit(change, plugins, **kw))
    assert a.error is None and b.error is None, (a.error, b.error)
    assert os.path.isfile(tmp_path / "a" / "nb" / "version_0" / "metrics.csv")
    return a, b


# =============================================================================== (b) correlated noise
@pytest.mark.parametrize("strategy", ["banded", "tree"])
@pytest.mark.parametrize("change", ["marker", "fewer"])
def test_correlated_noise_run_writes_the_same_on_neighbouring_datasets(tmp_path, strategy, change):
    """Attack: diff everything a CorrelatedNoise run writes (warnings, console, metrics, hparams,
    config, checkpoints: the scales and restart rounds included) when client 3's data changes."""
    cache = str(tmp_path / "cache")
    plugins = lambda: [UpdateClipping(1.0), CorrelatedNoise(strategy, noise_multiplier=1.0, cache_dir=cache)]  # noqa: E731
    a, b = _neighbours(tmp_path, change, plugins, sampling="cyclic", clients_per_round=2)
    assert differences(a, b) == []


class NoiseRows(FederatedCallback):
    """Records the noised sum of updates after the noise (the noise itself with zero updates)."""

    order = 300

    def __init__(self):
        self.sums = []

    def on_aggregate(self, *, server) -> None:
        self.sums.append(server.aggregate["update"].detach().double().clone())


SECRET = bytes(range(0xA0, 0xC0))  # a recognisable 256-bit secret


def _byte_forms(x: torch.Tensor) -> list[bytes]:
    """The first four values of ``x`` as float64, float32 and int64 bytes (what a file would hold)."""
    v = x.reshape(-1)[:4]
    return [v.double().numpy().tobytes(), v.float().numpy().tobytes(), v.to(torch.int64).numpy().tobytes()]


def _all_bytes(root) -> dict[str, bytes]:
    return {os.path.join(b, n): open(os.path.join(b, n), "rb").read() for b, _, ns in os.walk(root) for n in ns}


def test_secure_correlated_noise_writes_neither_the_secret_nor_the_noise(tmp_path, monkeypatch):
    """Attack (secure mode): search every byte written (checkpoints, logs, hparams) for the run's
    secret, its hex, and the noise rows added (zero updates: the noised sum is the noise); and check
    that the checkpoint's CorrelatedNoise state holds only the public scales, strategy and restarts."""
    monkeypatch.setattr(rng, "new_secret", lambda: SECRET)
    rows = NoiseRows()
    cn = CorrelatedNoise("banded", noise_multiplier=1.0, cache_dir=str(tmp_path / "cache"))
    trainer = FederatedTrainer(log_dir=str(tmp_path / "run"), run_name="s", rounds=3, batch_size=4, num_threads=1,
                               enable_progress_bar=False, enable_summary=False, checkpoint_every=1, secure=True,
                               sampling="cyclic", clients_per_round=2, plugins=[UpdateClipping(1.0), cn, rows])
    trainer.fit(TinyClassifier(lr=0.0), _data(None))
    assert len(rows.sums) == 3 and all(float(s.abs().max()) > 0 for s in rows.sums)
    needles = [SECRET, SECRET.hex().encode(), repr(SECRET).encode()] + [b for s in rows.sums for b in _byte_forms(s)]
    files = _all_bytes(tmp_path / "run")
    assert any(p.endswith(".ckpt") for p in files)
    for path, data in files.items():
        assert not any(n in data for n in needles), path
    ckpt = torch.load(next(p for p in files if p.endswith(".ckpt")), map_location="cpu", weights_only=False)
    state = _find_key(ckpt, "CorrelatedNoise")
    assert set(state) <= {"scales", "strategy", "starts", "noise_multiplier"}, state
    # a second secure run of the same seed draws other noise (it is not the seed's)
    rows2 = NoiseRows()
    monkeypatch.setattr(rng, "new_secret", lambda: bytes(32))
    FederatedTrainer(log_dir=str(tmp_path / "run2"), rounds=3, batch_size=4, num_threads=1, enable_progress_bar=False,
                     enable_summary=False, secure=True, sampling="cyclic", clients_per_round=2,
                     plugins=[UpdateClipping(1.0), CorrelatedNoise("banded", noise_multiplier=1.0,
                                                                   cache_dir=str(tmp_path / "cache")), rows2]
                     ).fit(TinyClassifier(lr=0.0), _data(None))
    assert not torch.equal(rows.sums[0], rows2.sums[0])


def _find_key(obj, key):
    """The value under ``key`` anywhere in nested dicts."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


# =============================================================================== (c) discrete noise + SecAgg
@pytest.mark.parametrize("mechanism, secagg, dropout", [("discrete_gaussian", True, 0.25), ("skellam", False, 0.0)],
                         ids=["ddg-secagg-dropouts", "skellam-plain"])
@pytest.mark.parametrize("change", ["marker", "huge", "fewer"])
def test_discrete_noise_run_writes_the_same_on_neighbouring_datasets(tmp_path, mechanism, secagg, dropout, change):
    """Attack: diff everything a DiscreteDistributedNoise run writes (wrap-around bound, noise std,
    skipped rounds, warnings from rounding or wrap-around, checkpoints) when client 3's data changes."""
    plugins = lambda: [UpdateClipping(0.5), DiscreteDistributedNoise(mechanism, noise_multiplier=0.5, bits=20,  # noqa: E731
                                                                      secagg=secagg, dropout=dropout)]
    a, b = _neighbours(tmp_path, change, plugins, clients_per_round=4)
    assert differences(a, b) == []


class Sent(FederatedCallback):
    """What each client sends (the row as summed), by client, after the noise and masks."""

    order = 990

    def __init__(self):
        self.rows = []

    def on_client_released(self, *, client, released):
        self.rows.append((client.round_idx, client.client, {k: v.clone() for k, v in released.items()}))


def test_outside_the_masked_row_a_client_sends_nothing_of_its_data(tmp_path):
    """Attack (server's view): on neighbouring datasets, every segment a client sends other than
    the masked ``integer_sum`` row (the float update, counts, flags) is the same, and the float
    update is zero."""
    sent = {}
    for change in (None, "huge"):
        s = Sent()
        FederatedTrainer(log_dir=str(tmp_path / str(change)), rounds=2, batch_size=4, num_threads=1, seed=0,
                         enable_progress_bar=False, enable_summary=False, clients_per_round=4,
                         plugins=[UpdateClipping(0.5), DiscreteDistributedNoise(noise_multiplier=0.5, bits=16,
                                                                                dropout=0.25), s]
                         ).fit(TinyClassifier(), _data(change))
        sent[change] = s.rows
    a, b = sent[None], sent["huge"]
    assert [(r, c) for r, c, _ in a] == [(r, c) for r, c, _ in b] and a
    for (_, c, ra), (_, _, rb) in zip(a, b):
        assert float(ra["update"].abs().max()) == 0.0
        for name in ra:
            if name != SEGMENT:
                assert torch.equal(ra[name], rb[name]), (c, name)


@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_noise_in_the_sum_is_at_least_the_accounted_noise_when_clients_drop(tmp_path, executor):
    """Attack on the accounting: with zero updates (lr 0) the decoded sum is the noise of the
    survivors' shares. Its variance per coordinate, measured, must be at least the accounted
    ``(z C)^2`` (``min_survivors`` shares) and match one share per survivor (dropouts keyed by the seed,
    recomputed here); a dropped client's share (and mask) must not be in it."""
    seed, z, clip, rounds = 0, 2.0, 0.5, 6
    rows = NoiseRows()
    noise = DiscreteDistributedNoise(noise_multiplier=z, bits=20, dropout=0.3, min_survivors=3)
    plans = []

    class Cohorts(FederatedCallback):
        order = 10

        def before_round(self, *, plan, server):
            plans.append(tuple(plan.cohort))

    FederatedTrainer(log_dir=str(tmp_path), rounds=rounds, batch_size=4, num_threads=1, seed=seed, executor=executor,
                     enable_progress_bar=False, enable_summary=False, clients_per_round=4,
                     plugins=[UpdateClipping(clip), noise, rows, Cohorts()]).fit(TinyClassifier(lr=0.0), _data(None))
    source = rng.RandomSource(seed)
    share = noise.noise_parameter * noise.gamma ** 2 * (1 if noise.mechanism == "discrete_gaussian" else 2)
    checked, dropped = 0, 0
    for r, (cohort, total) in enumerate(zip(plans, rows.sums)):
        survivors, _ = simulate_dropouts(cohort, 0.3, r, source)
        if r in noise.skipped_rounds:
            assert len(survivors) < 3
            continue
        dropped += len(survivors) < len(cohort)
        var = float(total.pow(2).mean())
        n = total.numel()  # the measured variance of n values: within 5 standard errors
        assert var >= (z * clip) ** 2 * (1 - 5 * math.sqrt(2 / n)), (r, var, (z * clip) ** 2)
        assert abs(var / (len(survivors) * share) - 1) < 5 * math.sqrt(2 / n), (r, var, len(survivors) * share)
        checked += 1
    assert checked >= 3 and dropped  # rounds measured, some of them run with a client dropped


def test_secure_discrete_noise_writes_no_secret(tmp_path, monkeypatch):
    """Attack (secure mode, SecAgg): search every byte the run writes for its secret and for the noised
    sums the server decoded (zero updates: the summed noise of the round)."""
    monkeypatch.setattr(rng, "new_secret", lambda: SECRET)
    rows = NoiseRows()
    FederatedTrainer(log_dir=str(tmp_path / "run"), run_name="s", rounds=2, batch_size=4, num_threads=1, secure=True,
                     enable_progress_bar=False, enable_summary=False, checkpoint_every=1, clients_per_round=4,
                     plugins=[UpdateClipping(0.5), DiscreteDistributedNoise(noise_multiplier=0.5, bits=20,
                                                                            dropout=0.25), rows]
                     ).fit(TinyClassifier(lr=0.0), _data(None))
    needles = [SECRET, SECRET.hex().encode()] + [b for s in rows.sums for b in _byte_forms(s)[:2]]
    files = _all_bytes(tmp_path / "run")
    assert any(p.endswith(".ckpt") for p in files)
    for path, data in files.items():
        assert not any(n in data for n in needles), path
