"""``dpfl sweep`` with private selection (Papernot & Steinke), the admissibility of a DP sweep's metric,
the privacy of what a sweep releases in ``dpfl report``, and ``dpfl privacy plan --selection``.

Most tests run fake trials (a script that writes a run's files like ``dpfl fit``) and plan each point
with a planner written here (Gaussian releases without sampling), so that they take a second; one test
runs real ``dpfl fit`` DP runs. Expected epsilons come from ``dp_accounting``'s ``RdpAccountant`` on
``RepeatAndSelectDpEvent`` / composed events built in the test."""

from __future__ import annotations

import io
import json
import os
import re
from types import SimpleNamespace

import pytest
import yaml
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import RdpAccountant

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.privacy.accountants import GaussianRelease
from dpfl_lightning.privacy.selection import draw_trial_count, trial_count
from dpfl_lightning.privacy.selection_accounting import Trial
from dpfl_lightning.tracking import private_sweep, sweep
from dpfl_lightning.tracking.sweep_privacy import RunPrivacy

DELTA = 1e-5
NOISE = "trainer.algorithm.init_args.noise_multiplier"
ROUNDS = 10
AUDIENCE = "towards anyone who sees the models"

# A fake `dpfl fit`: writes <log_dir>/<run_name>/version_0/{metrics.csv, hparams.yaml, release_kinds.json};
# its score is a function of lr and seed; FAIL_ONCE=<path> makes the first run fail (and creates the path).
FAKE_FIT = r'''
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
marker = os.environ.get("FAIL_ONCE")
if marker and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(3)
root = os.path.join(args["trainer.log_dir"], args["trainer.run_name"], "version_0")
os.makedirs(root, exist_ok=True)
lr, seed = float(args.get("model.init_args.lr", 1)), int(args.get("trainer.seed", 0))
score = 1.0 / (1.0 + abs(lr - 0.3)) + (seed % 97) * 1e-6
with open(os.path.join(root, "metrics.csv"), "w") as f:
    f.write("round,test_acc,train_loss\n1,%r,%r\n" % (score, 1 - score))
with open(os.path.join(root, "hparams.yaml"), "w") as f:
    f.write("privacy:\n  delta: 1.0e-05\n")
kinds = {"round": "public", "test_acc": "evaluation", "train_loss": "unaccounted"}
with open(os.path.join(root, "release_kinds.json"), "w") as f:
    json.dump({"kinds": kinds, "evaluation_from_clients": False}, f)
'''


def gaussian_planner(secure: bool = False, rounds: int = ROUNDS):
    """Each point: ``rounds`` unsampled Gaussians of the point's noise multiplier (``NOISE``, default 2)."""

    def plan(arguments, label):
        args = dict(a[2:].split("=", 1) for a in arguments if a.startswith("--") and "=" in a)
        z = float(args.get(NOISE, 2.0))
        one = Trial(((GaussianRelease(z), rounds),), label)
        return RunPrivacy((one,), AUDIENCE, "client", DELTA, "rdp", secure, z)

    return plan


def write_sweep(tmp_path, parameters, selection=None, metric="test_acc"):
    script = tmp_path / "fake_fit.py"
    script.write_text(FAKE_FIT)
    spec = {"name": "ps", "method": "grid", "metric": {"name": metric, "goal": "maximize"},
            "command": ["${interpreter}", str(script), "fit", "${args}"], "parameters": parameters}
    if selection is not None:
        spec["private_selection"] = selection
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def run_private(path, directory, seed=0, planner=None, **options):
    s = sweep.load_sweep(path)
    count = private_sweep.selection_setting(s, options.pop("selection", None))
    opts = private_sweep.Options(str(directory), planner or gaussian_planner(), seed=seed, **options)
    out = io.StringIO()
    return private_sweep.run_private(s, count, opts, out), out.getvalue()


def rdp_selected(z: float, rounds: int, mean: float, shape: float, delta: float = DELTA) -> float:
    acc = RdpAccountant()
    acc.compose(dpe.RepeatAndSelectDpEvent(dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(z), rounds), mean, shape))
    return acc.get_epsilon(delta)


FIXED = bytes(range(32))  # the sweep's draws use a fresh secret: the tests fix it to choose K


def seed_with_count(selection, want, secure=False):
    """A sweep seed whose draws under the fixed secret give ``want(K)`` (computed with the sampler
    itself, independently of the sweep)."""
    for seed in range(200):
        k = draw_trial_count(rng.RandomSource(seed, FIXED), trial_count(selection))
        if want(k):
            return seed, k
    raise AssertionError("no seed")


# ------------------------------------------------------------------------------ items 1 and 2
@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(rng, "new_secret", lambda: FIXED)


def test_private_selection_releases_only_the_best_trial_and_its_guarantee(tmp_path):
    selection = {"distribution": "poisson", "mean": 3}
    seed, k = seed_with_count(selection, lambda k: k >= 3)
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3, 0.9]}}, selection)
    info, console = run_private(path, tmp_path / "sw", seed=seed)
    with open(tmp_path / "sw" / "private" / "selection_state.json") as f:
        state = json.load(f)
    assert state["count"] == k and len(state["trials"]) == k
    # every trial ran with the point and seed drawn for it; the best by test_acc is released
    scores = {}
    for t in state["trials"]:
        with open(tmp_path / "sw" / "private" / "runs" / t["name"] / "version_0" / "metrics.csv") as f:
            scores[t["name"]] = float(f.read().splitlines()[1].split(",")[1])
    best = max(state["trials"], key=lambda t: scores[t["name"]])
    assert info["result"] == "selected" and info["value"] == scores[best["name"]]
    assert info["parameters"] == {"model.init_args.lr": [0.1, 0.3, 0.9][best["point"]]}
    released = tmp_path / "sw" / "released"
    assert sorted(os.listdir(released)) == ["runs", "selection.json", "summary.md"]
    assert os.listdir(released / "runs") == ["selected"]
    # the guarantee: RepeatAndSelect over the trial's event, as dp_accounting computes it
    expected = rdp_selected(2.0, ROUNDS, 3, float("inf"))
    assert info["guarantee"]["epsilon_selected"] == pytest.approx(expected, rel=1e-6)
    summary = (released / "summary.md").read_text()
    assert f"{expected:.4g}" in summary and AUDIENCE in summary and f"{DELTA:g}" in summary
    assert f"{expected:.4g}" in console and AUDIENCE in console  # the console says it too
    # K and the other trials are released nowhere: no trial's name, no count
    text = "".join(p.read_text(errors="replace") for p in released.rglob("*") if p.is_file()) + console
    assert all(t["name"] not in text for t in state["trials"] if t is not best)
    assert '"count"' not in (released / "selection.json").read_text()
    assert "trial-" not in console  # no progress line names a trial


def test_the_release_lists_hyperparameters_never_display_or_logging_settings(tmp_path):
    selection = {"distribution": "poisson", "mean": 2}
    seed, _ = seed_with_count(selection, lambda k: k >= 1)
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3]}, "model.init_args.hidden": {"value": 8},
                                  "trainer.enable_progress_bar": {"value": False},
                                  "trainer.enable_summary": {"value": False}}, selection)
    info, console = run_private(path, tmp_path / "sw", seed=seed)
    with open(tmp_path / "sw" / "released" / "selection.json") as f:
        saved = json.load(f)
    assert set(saved["parameters"]) == {"model.init_args.lr", "model.init_args.hidden"}
    assert saved["selected"] == ["model.init_args.lr"]  # drawn from two values; hidden is fixed
    summary = (tmp_path / "sw" / "released" / "summary.md").read_text()
    assert re.search(r"\| model.init_args.lr \| 0\.[13] \| selected \|", summary)
    assert "| model.init_args.hidden | 8 | fixed |" in summary
    assert "enable_progress_bar" not in summary + console and "enable_summary" not in summary
    # dpfl report of the release lists the same, also from a selection.json written before display
    # settings were left out of it (which named every setting of the point)
    from dpfl_lightning.tracking.report import write_report

    saved["parameters"]["trainer.enable_progress_bar"] = False
    with open(tmp_path / "sw" / "released" / "selection.json", "w") as f:
        json.dump(saved, f)
    report = write_report(str(tmp_path / "sw" / "released"), out=str(tmp_path / "rep"))
    text = open(report["table"]).read()
    assert re.search(r"\| model.init_args.lr \| 0\.[13] \| selected \|", text)
    assert "| model.init_args.hidden | 8 | fixed |" in text and "enable_progress_bar" not in text


def test_trials_draw_points_uniformly_with_replacement(tmp_path):
    selection = {"distribution": "poisson", "mean": 40}
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3]}}, selection)
    s = sweep.load_sweep(path)
    space = private_sweep.space_of(s)
    state = private_sweep.draw_state(rng.RandomSource(5), trial_count(selection), len(space.points))
    points = [t["point"] for t in state["trials"]]
    assert state["count"] == draw_trial_count(rng.RandomSource(5), trial_count(selection))
    assert set(points) == {0, 1} and len(points) > 2  # both points, repeated: with replacement
    assert len({t["seed"] for t in state["trials"]}) == len(points)  # each trial its own seed


def test_zero_trials_release_nothing_and_say_so(tmp_path):
    selection = {"distribution": "poisson", "mean": 1}
    seed, _ = seed_with_count(selection, lambda k: k == 0)
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3]}}, selection)
    info, console = run_private(path, tmp_path / "sw", seed=seed)
    assert info["result"] == "nothing"
    assert "Nothing is released" in console and "no trial was selected" in console  # the cause is not said
    assert (tmp_path / "sw" / "private" / "nothing_selected.txt").read_text().startswith("the number of trials drawn was 0")
    assert not os.path.exists(tmp_path / "sw" / "released" / "runs")
    assert not os.path.exists(tmp_path / "sw" / "private" / "runs")  # no trial ran


def test_secure_trials_draw_k_from_the_csprng_and_a_resumed_sweep_does_not_redraw(tmp_path, monkeypatch):
    selection = {"distribution": "geometric", "mean": 4}
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3, 0.9]}}, selection)
    monkeypatch.setenv("FAIL_ONCE", str(tmp_path / "failed-once"))
    info, console = run_private(path, tmp_path / "sw", planner=gaussian_planner(secure=True))
    assert info is None and "the sweep did not finish" in console and "failed" not in console  # nothing released yet
    assert not os.path.exists(tmp_path / "sw" / "released")
    with open(tmp_path / "sw" / "private" / "selection_state.json") as f:
        first = json.load(f)
    assert oct(os.stat(tmp_path / "sw" / "private" / "selection_state.json").st_mode & 0o777) == "0o600"

    def no_new_secret():
        raise AssertionError("the resumed sweep drew a new secret")

    monkeypatch.setattr(rng, "new_secret", no_new_secret)
    info, _ = run_private(path, tmp_path / "sw", planner=gaussian_planner(secure=True))
    with open(tmp_path / "sw" / "private" / "selection_state.json") as f:
        assert json.load(f) == first  # K and the trials kept
    assert info["result"] == "selected"
    assert sorted(os.listdir(tmp_path / "sw" / "private" / "runs")) == sorted(t["name"] for t in first["trials"])
    # secure draws: two fresh sweeps of the same seed draw different trials (not reproducible)
    monkeypatch.undo()
    states = []
    for i in range(2):
        s = sweep.load_sweep(path)
        states.append(private_sweep.load_or_draw(str(tmp_path / f"fresh{i}"), "f", 0, trial_count(selection), 3))
    assert states[0]["trials"] != states[1]["trials"]


def test_a_changed_sweep_is_not_redrawn_in_the_same_directory(tmp_path):
    selection = {"distribution": "poisson", "mean": 2}
    seed, _ = seed_with_count(selection, lambda k: k >= 1)
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3]}}, selection)
    run_private(path, tmp_path / "sw", seed=seed)
    with pytest.raises(ConfigError, match="another private-selection sweep"):
        run_private(path, tmp_path / "sw", seed=seed + 1)


# ------------------------------------------------------------------------------ the worst case
def test_noise_in_the_space_gives_the_worst_case_and_names_it(tmp_path):
    selection = {"distribution": "truncated_negative_binomial", "mean": 4, "shape": 0.5}
    path = write_sweep(tmp_path, {NOISE: {"values": [1.0, 3.0]}, "model.init_args.lr": {"values": [0.1]}}, selection)
    s = sweep.load_sweep(path)
    space = private_sweep.space_of(s)
    private_sweep.plan_space(s, space, gaussian_planner(), {})
    g = private_sweep.guarantee_of(space, trial_count(selection), None)
    assert g.selected.epsilon == pytest.approx(rdp_selected(1.0, ROUNDS, 4, 0.5), rel=1e-6)
    assert g.selected.epsilon > rdp_selected(3.0, ROUNDS, 4, 0.5) * 1.5
    assert g.selected.worst == f"{NOISE}=1.0" and "noise_multiplier=1.0" in g.lines()[0]


def test_a_space_that_cannot_be_listed_or_that_sets_the_seed_is_refused(tmp_path):
    selection = {"distribution": "poisson", "mean": 2}
    path = write_sweep(tmp_path, {"trainer.seed": {"values": [0, 1]}}, selection)
    with pytest.raises(ConfigError, match="draws its own seed"):
        run_private(path, tmp_path / "sw")
    spec = yaml.safe_load(open(path))
    spec.update(method="random", parameters={"model.init_args.lr": {"min": 0.1, "max": 0.5}})
    open(path, "w").write(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="must be listed"):
        run_private(path, tmp_path / "sw")


# ------------------------------------------------------------------------------ item 3
def test_a_metric_from_clients_data_is_refused_for_selection(tmp_path):
    """Without a set-up check (fake trials: see the next tests for dpfl sweep's), the kinds the first
    trial recorded refuse the metric before any other trial runs."""
    selection = {"distribution": "poisson", "mean": 3}
    seed, _ = seed_with_count(selection, lambda k: k >= 2)
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3]}}, selection, metric="train_loss")
    with pytest.raises(ConfigError, match="train_loss.*'unaccounted'.*Fix:"):
        run_private(path, tmp_path / "sw", seed=seed)
    ran = os.listdir(tmp_path / "sw" / "private" / "runs")
    assert len(ran) == 1  # refused after the first trial, before the others
    assert not os.path.exists(tmp_path / "sw" / "released")


def _selection_sweep(tmp_path, metric, trainer=None, data=None, selection=None):
    """A private-selection sweep file over the learning rate of a tiny real DP configuration."""
    base = {"trainer": {"rounds": 2, "batch_size": 16, "enable_progress_bar": False, "enable_summary": False,
                        "test_after_fit": True, "algorithm": DP, **(trainer or {})},
            "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                      "init_args": {"in_features": 64, "hidden": [8], "num_classes": 10}},
            "data": data or {"class_path": "dpfl_lightning.data.Digits", "init_args": {"num_clients": 8}}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {"name": "tiny", "method": "grid", "metric": {"name": metric, "goal": "maximize"},
            "private_selection": selection or {"distribution": "poisson", "mean": 2},
            "command": ["${interpreter}", "-m", "dpfl_lightning", "fit", "--config", str(tmp_path / "base.yaml"),
                        "${args}"], "parameters": {"model.init_args.lr": {"values": [0.1, 0.5]}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    return str(tmp_path / "sweep.yaml")


def test_a_dry_run_prints_the_plan_and_draws_trains_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """dpfl sweep --dry_run true on a real configuration: the plan, and no folder; then (fake trials,
    fast) a real run after a dry run draws its trials afresh."""
    from dpfl_lightning.cli import command as cli

    drawn = []
    monkeypatch.setattr(rng, "new_secret", lambda: drawn.append(1) or FIXED)
    path = _selection_sweep(tmp_path, "test_acc")
    out = tmp_path / "sw"
    cli.main(["sweep", path, "--dir", str(out), "--dry_run", "true"])
    printed = capsys.readouterr().err
    assert not out.exists() and not drawn  # nothing written, no secret drawn (so no K)
    assert "dpfl sweep: plan: the number of trials K: poisson number of trials (mean 2): K >= 0, median 2, " \
           "P[K > 5] < 5%; P[K = 0] = 0.135" in printed  # Poisson(2): P[K > 5] = 0.017, P[K > 4] = 0.053
    assert "model.init_args.lr=0.1; model.init_args.lr=0.5" in printed
    assert "dpfl sweep: guarantee: selected result: epsilon = " in printed
    assert "nothing was drawn, trained or written; a real run draws K and the trials from a fresh secret" in printed
    assert "trial-<drawn>" in printed and "--trainer.seed=<drawn>" in printed
    assert sorted(os.listdir(tmp_path)) == ["base.yaml", "sweep.yaml"]  # no runs/, lightning_logs/, ... either

    fake = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3]}}, {"distribution": "poisson", "mean": 3})
    info, console = run_private(fake, tmp_path / "fake", seed=1, dry_run=True)
    assert info["result"] == "dry run" and not (tmp_path / "fake").exists() and not drawn
    info, _ = run_private(fake, tmp_path / "fake", seed=1)
    assert len(drawn) == 1 and info["result"] in ("selected", "nothing")  # drawn once, by the real run
    _, console = run_private(fake, tmp_path / "fake", seed=1, dry_run=True)
    assert "a real run resumes the trials already drawn" in console and len(drawn) == 1


def test_a_metric_of_the_clients_data_is_refused_before_any_training(tmp_path, capsys):
    """The set-up says what a DP run will release: a metric that is neither a plugin's DP release nor
    an evaluation on the server's sets is refused before anything is drawn, trained or written."""
    from dpfl_lightning.cli import command as cli
    from dpfl_lightning.cli.selection_metric import metric_refusal_at_setup

    for metric in ("train_loss", "round_time_s"):
        path = _selection_sweep(tmp_path, metric, trainer={"log_client_metrics": True})
        with pytest.raises(SystemExit) as exit_:
            cli.main(["sweep", path, "--dir", str(tmp_path / "sw")])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"sweep metric.name='{metric}': may not select among DP runs" in err and "computed from the clients' " \
               "data without noise" in err and "val_acc" in err.split("Fix:")[1]  # the fix names what may select
        assert sorted(os.listdir(tmp_path)) == ["base.yaml", "sweep.yaml"]  # no trial, no state, no folder
    args = ["--config", str(tmp_path / "base.yaml")]
    assert metric_refusal_at_setup(args, "p", "test_acc") is None  # the server's test set (test_after_fit)
    assert metric_refusal_at_setup(args, "p", "val_loss") is None
    assert metric_refusal_at_setup(args, "p", "snr") is None  # GaussianNoise's noised release
    why, fix = metric_refusal_at_setup(args + ["--trainer.test_after_fit=false"], "p", "test_acc")
    assert "test_after_fit" in why and "trainer.test_after_fit: true" in fix
    # evaluation sets drawn from the clients' own records: no evaluation may select
    _selection_sweep(tmp_path, "test_acc", data={"class_path": "dpfl_lightning.data.SyntheticLogistic",
                                                 "init_args": {"num_clients": 8, "samples_per_client": 20,
                                                               "test_samples_per_client": 5, "dim": 64}})
    why, fix = metric_refusal_at_setup(args, "p", "test_acc")
    assert "test_set_from_clients" in why and "epsilon" in fix
    assert metric_refusal_at_setup(args, "p", "epsilon") is None


def _fit_sweep(tmp_path, algorithm, metric, extra=None):
    base = {"trainer": {"rounds": 1, "clients_per_round": 4, "batch_size": 16, "enable_progress_bar": False,
                        "enable_summary": False, "test_after_fit": True, "algorithm": algorithm, **(extra or {})},
            "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                      "init_args": {"in_features": 64, "hidden": [8], "num_classes": 10}},
            "data": {"class_path": "dpfl_lightning.data.Digits", "init_args": {"num_clients": 8}}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {"method": "grid", "metric": {"name": metric, "goal": "maximize"},
            "command": ["${interpreter}", "-m", "dpfl_lightning", "fit", "--config", str(tmp_path / "base.yaml"),
                        "${args}"], "parameters": {"model.init_args.lr": {"values": [0.5]}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    return str(tmp_path / "sweep.yaml")


DP = {"class_path": "dpfl_lightning.algorithms.DPFedAvg", "init_args": {"clip": 1.0, "noise_multiplier": 1.0}}


def test_dp_sweeps_refuse_the_training_loss_and_accept_test_accuracy_non_dp_sweeps_are_unaffected(tmp_path):
    """Real dpfl fit runs: the kind each run recorded decides, not the name."""
    for d in "abc":
        (tmp_path / d).mkdir()
    loss = _fit_sweep(tmp_path / "a", DP, "train_loss", {"log_client_metrics": True})
    with pytest.raises(ConfigError, match="train_loss.*unaccounted"):
        sweep.run(loss, directory=str(tmp_path / "a" / "sw"), out=io.StringIO())
    acc = _fit_sweep(tmp_path / "b", DP, "test_acc")
    (r,) = sweep.run(acc, directory=str(tmp_path / "b" / "sw"), out=io.StringIO())
    assert r.status == "done" and r.metric is not None and not r.refused
    plain = _fit_sweep(tmp_path / "c", {"class_path": "dpfl_lightning.algorithms.FedAvg"}, "train_loss")
    (r,) = sweep.run(plain, directory=str(tmp_path / "c" / "sw"), out=io.StringIO())
    assert r.status == "done" and not r.refused

    # item 4: dpfl report on the DP sweep: one run and every run, from the runs' saved configs
    from dpfl_lightning.cli.sweep_command import report_privacy
    from dpfl_lightning.tracking.report import write_report

    report = write_report(str(tmp_path / "b" / "sw"), "test_acc", epsilon="tuned", privacy=report_privacy)
    section = report["privacy"]
    with open(report["table"]) as f:
        table = f.read()
    assert "Privacy of what the sweep releases" in table and f"{section['one_run']:.4g}" in table
    assert os.path.exists(os.path.join(os.path.dirname(report["table"]), "test_acc_vs_epsilon_tuned.png"))
    assert section["all_runs"] == pytest.approx(section["one_run"])  # one run: releasing all is that run


# ------------------------------------------------------------------------------ item 5
def test_target_epsilon_calibrates_the_trials_noise_including_selection(tmp_path):
    selection = {"distribution": "poisson", "mean": 4}
    seed, _ = seed_with_count(selection, lambda k: k >= 1)
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3]}}, selection)
    info, _ = run_private(path, tmp_path / "sw", seed=seed, target_epsilon=4.0, delta=DELTA)
    z = info["parameters"][NOISE]
    assert rdp_selected(z, ROUNDS, 4, float("inf")) <= 4.0  # dp_accounting: the target is met ...
    assert rdp_selected(z * 0.98, ROUNDS, 4, float("inf")) > 4.0  # ... with little noise to spare
    assert "calibrated" in info["guarantee"]["calibration"]
    with pytest.raises(ConfigError, match="unreachable"):
        run_private(path, tmp_path / "sw2", seed=seed, target_epsilon=0.004, delta=DELTA)  # below the floor, 0.00486


# ------------------------------------------------------------------------------ item 6
def test_wandb_sweep_gets_the_drawn_count_and_random_draws_from_the_grid(tmp_path, monkeypatch):
    import subprocess

    import wandb

    selection = {"distribution": "poisson", "mean": 3}
    seed, k = seed_with_count(selection, lambda k: k >= 1)
    path = write_sweep(tmp_path, {"model.init_args.lr": {"values": [0.1, 0.3]}}, selection)
    calls = {}
    monkeypatch.setattr(wandb, "sweep", lambda config, project=None, entity=None: calls.update(config=config) or "abc")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.update(agent=cmd))

    class Run:
        summary: dict = {}

        def finish(self):
            calls["finished"] = True

    monkeypatch.setattr(wandb, "init", lambda **kw: calls.update(init=kw) or Run())
    info, _ = run_private(path, tmp_path / "sw", seed=seed, wandb=True)
    assert calls["agent"] == ["wandb", "agent", "--count", str(k), "abc"]
    assert calls["config"]["method"] == "random" and "private_selection" not in calls["config"]
    assert calls["config"]["parameters"]["model.init_args.lr"] == {"values": [0.1, 0.3]}
    assert Run.summary["epsilon_selected"] == pytest.approx(rdp_selected(2.0, ROUNDS, 3, float("inf")), rel=1e-6)
    assert Run.summary["audience"] == AUDIENCE and calls["finished"]


# ------------------------------------------------------------------------------ one real sweep
def test_a_real_private_selection_sweep_and_its_report(tmp_path, capsys):
    selection = {"distribution": "poisson", "mean": 2}
    seed, _ = seed_with_count(selection, lambda k: k == 1)
    base = {"trainer": {"rounds": 2, "batch_size": 16, "enable_progress_bar": False, "enable_summary": False,
                        "test_after_fit": True, "algorithm": DP},
            "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                      "init_args": {"in_features": 64, "hidden": [8], "num_classes": 10}},
            "data": {"class_path": "dpfl_lightning.data.Digits", "init_args": {"num_clients": 8}}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {"method": "grid", "metric": {"name": "test_acc", "goal": "maximize"}, "private_selection": selection,
            "command": ["${interpreter}", "-m", "dpfl_lightning", "fit", "--config", str(tmp_path / "base.yaml"),
                        "${args}"], "parameters": {"model.init_args.lr": {"values": [0.1, 0.5]}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    from dpfl_lightning.cli import sweep_command

    cfg = SimpleNamespace(sweep_file=str(tmp_path / "sweep.yaml"), dir=str(tmp_path / "sw"), seed=seed, jobs=1,
                          mpi=None, private_selection=None, target_epsilon=None, delta=None, noise_setting=None,
                          wandb=False)
    assert sweep_command.run_sweep(cfg, out=io.StringIO()) == 0
    with open(tmp_path / "sw" / "released" / "selection.json") as f:
        g = json.load(f)["guarantee"]
    # every client every round: 2 unsampled Gaussians of multiplier 1, at the ledger's delta (0.1 / 8 clients)
    assert g["delta"] == 0.01
    assert g["epsilon_selected"] == pytest.approx(rdp_selected(1.0, 2, 2, float("inf"), 0.01), rel=1e-6)
    from dpfl_lightning.tracking.report import write_report

    report = write_report(str(tmp_path / "sw"), "test_acc", privacy=sweep_command.report_privacy)
    assert report["privacy"]["selected"] == pytest.approx(g["epsilon_selected"])
    assert [r.label for r in report["groups"][0].runs] == ["selected"]  # only the released run is read

    # dpfl report SWEEP/released (what a user publishes): the selection's guarantee, not the run's own ledger
    from dpfl_lightning.cli import command as cli
    from dpfl_lightning.tracking.run_files import read_metrics

    released = tmp_path / "sw" / "released"
    (metrics_csv,) = released.glob("runs/selected/version_*/metrics.csv")
    own = read_metrics(str(metrics_csv))[-1]["epsilon"]  # the released run's ledger: the selection left out
    assert f"{own:.4g}" != f"{g['epsilon_selected']:.4g}"
    for target in (released, released / "runs" / "selected"):
        capsys.readouterr()
        cli.main(["report", str(target), "--out", str(tmp_path / "rep")])
        printed = capsys.readouterr().out
        line = (f"guarantee of the private selection: epsilon = {g['epsilon_selected']:.4g} at delta = "
                f"{g['delta']:g} (client-level, {g['audience']}")
        assert line in printed and line in (tmp_path / "rep" / "summary.md").read_text()
        assert "| configuration | seeds | rounds | test_acc |" in printed  # no column of the run's own epsilon
        assert "all 1 runs" not in printed
        assert f"| the selected result: guarantee of the private selection (the selection included) | " \
               f"{g['epsilon_selected']:.4g} |" in printed
        plots = sorted(os.listdir(tmp_path / "rep"))
        assert "test_acc_vs_epsilon_tuned.png" in plots and "test_acc_vs_epsilon.png" not in plots, plots
        assert "| model.init_args.lr | " in printed and "| selected |" in printed
    report = write_report(str(released), out=str(tmp_path / "rep2"))  # no planner needed: selection.json says it
    assert report["privacy"]["tuned"] == g["epsilon_selected"] and report["epsilons"] == []
    report = write_report(str(released), epsilon="epsilon", out=str(tmp_path / "rep3"))  # asked for: the run's own
    assert "(the run's own ledger, the selection left out)" in open(report["table"]).read()
    assert any(p.endswith("test_acc_vs_epsilon.png") for p in report["plots"])


def test_a_trial_config_that_does_not_parse_is_one_line_before_anything_is_drawn(tmp_path, monkeypatch, capsys):
    """Run from another directory, the shipped sweep's relative config path does not exist: one
    `dpfl: error` line naming the point and the reason (jsonargparse raised its ArgumentError through a
    traceback), exit 2, and no folder."""
    from dpfl_lightning.cli import command as cli
    sweep_file = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "sweeps",
                              "private_selection_fedavg.yaml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(["sweep", sweep_file, "--dry_run", "true", "--dir", str(tmp_path / "sw")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert "is not a valid dpfl fit configuration" in err and "File does not exist" in err
    assert not (tmp_path / "sw").exists()
