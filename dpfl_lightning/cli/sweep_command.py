"""``dpfl sweep`` and ``dpfl report`` with the privacy of what a sweep releases: each run's privacy
planned from its ``dpfl fit`` configuration (:func:`plan_fit`, which builds the configured objects and
so lives with the command line), private selection (:mod:`dpfl_lightning.tracking.private_sweep`), and
the epsilons a report shows for a sweep of DP runs (:func:`report_privacy`)."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Sequence

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.tracking.sweep_privacy import RunPrivacy

#: the setting ``--target_epsilon`` calibrates by default
NOISE_SETTING = "trainer.algorithm.init_args.noise_multiplier"


def configured(arguments: Sequence[str], label: str = "") -> tuple[Any, Any, Any]:
    """``dpfl fit ARGUMENTS`` parsed and built: ``(config, instantiated objects, federated data)``;
    trains nothing (imports torch)."""
    from dpfl_lightning.cli.parsers import fit_parser
    from dpfl_lightning.cli.run_objects import federated_data

    import argparse

    parser = fit_parser()
    try:
        cfg = parser.parse_args(list(arguments))
    except (SystemExit, argparse.ArgumentError) as exc:  # jsonargparse exits (or, by version, raises)
        why = f" ({exc})" if isinstance(exc, argparse.ArgumentError) else ""
        raise ConfigError("sweep configuration", label or " ".join(arguments), f"is not a valid dpfl fit "
                          f"configuration{why}", "check it with dpfl fit ... --print_config (a config path is "
                          "relative to the directory dpfl sweep runs in)") from exc
    init = parser.instantiate_classes(cfg)
    return cfg, init, federated_data(init.data, cfg.split)


def plan_fit(arguments: Sequence[str], label: str = "", rounds: int | None = None,
             noise_setting: str = NOISE_SETTING) -> RunPrivacy | None:
    """The :class:`RunPrivacy` of ``dpfl fit ARGUMENTS`` after ``rounds`` rounds (default: the
    configured ones), or ``None`` for a run without DP: its privacy ledger's main guarantee, one
    trial per profile. Builds the configured trainer, data and model (imports torch), trains nothing."""
    from dpfl_lightning.cli.privacy_command import plan_run
    from dpfl_lightning.privacy.selection_accounting import Trial

    cfg, init, data = configured(arguments, label)
    ledger = plan_run(init.trainer, data, model=init.model)
    if not ledger.guarantees:
        return None
    rounds = init.trainer.rounds if rounds is None else int(rounds)
    g = ledger.guarantees[0]
    if g.stop_probability > 0:  # selection composes RDP curves; the stop's charge is on delta (guarantees.py)
        raise ConfigError("sweep configuration", label or " ".join(arguments), f"its main guarantee ({g.name}) "
                          "charges a stop that depends on the hidden sample to its delta, which private selection's "
                          "RDP composition does not carry", "sweep it with a fixed-size sampler (trainer.sampling="
                          "uniform), or with no stop (dropout=0 and a min_survivors the cohort always meets)")
    comps = ledger.planned_compositions(rounds)[g.name]
    many = len(g.profiles) > 1
    trials = tuple(Trial((_composable(p.release, int(n), label),), f"{label}; profile {k}" if many else label)
                   for k, (p, n) in enumerate(zip(g.profiles, comps)))
    try:
        noise = cfg.get(noise_setting)
    except (KeyError, AttributeError):
        noise = None
    from dpfl_lightning.tracking.loggers import AUDIENCES

    return RunPrivacy(trials, AUDIENCES.get(g.audience, g.audience), g.granularity, float(ledger.delta), str(ledger.accountant),
                      bool(init.trainer.settings.secure), float(noise) if isinstance(noise, (int, float)) else None)


def _composable(release: Any, steps: int, label: str) -> tuple[Any, int]:
    """``(release, steps)`` whose ``steps``-fold composition is the run's: a correlated-noise stream is
    not a per-round release, so its whole run becomes one release of the stream's events (marked
    ``exact`` where they are one Gaussian: the ledger's exact Gaussian then accounts whole runs too)."""
    if release.stream is None:
        return release, steps
    from dpfl_lightning.privacy.accountants import Release, one_gaussian, stream_events

    events = stream_events(release, steps)
    if any(rel.name == "REPLACE_SPECIAL" for _, rel in events):
        raise ConfigError("private selection", label, "a tree-aggregation event (correlated noise with one "
                          "participation per client) is accounted under dp_accounting's special replace relation, "
                          "which private selection does not compose", "use strategy banded or blt, or more rounds "
                          "than cyclic groups; dpfl privacy epsilon gives the run's own epsilon")
    # one Gaussian mechanism (no amplification): its runs compose exactly, as the run's ledger accounts it
    return Release(tuple(e for e, _ in events), exact=one_gaussian(events) is not None), 1


def run_sweep(cfg: Any, out: Any = None) -> int:
    """``dpfl sweep``: a private selection when the file or ``--private_selection`` asks for it
    (exit 0 when it released, or released nothing because K = 0, or printed its plan under
    ``--dry_run``; 1 when a trial failed), else every configuration
    (:func:`dpfl_lightning.tracking.sweep.run_from_cli`). A private selection's metric is checked
    on every point's set-up before anything is drawn (:mod:`dpfl_lightning.cli.selection_metric`)."""
    from dpfl_lightning.tracking import sweep as sweeps

    out = out or sys.stderr
    sweep = sweeps.load_sweep(cfg.sweep_file)
    selection = getattr(cfg, "private_selection", None)
    if sweep.private_selection is None and selection is None:
        if getattr(cfg, "target_epsilon", None) is not None or getattr(cfg, "wandb", False):
            raise ConfigError("--target_epsilon" if cfg.target_epsilon is not None else "--wandb",
                              cfg.target_epsilon if cfg.target_epsilon is not None else True,
                              "applies to a private-selection sweep",
                              "add private_selection: {distribution: poisson, mean: 8} to the sweep file (or "
                              "--private_selection)")
        return sweeps.run_from_cli(cfg)
    from dpfl_lightning.tracking import private_sweep

    from dpfl_lightning.cli.selection_metric import refuse_metric_at_setup

    count = private_sweep.selection_setting(sweep, selection)
    setting = getattr(cfg, "noise_setting", None) or NOISE_SETTING
    options = private_sweep.Options(
        directory=cfg.dir or os.path.join("sweeps", sweep.name),
        planner=lambda args, label: plan_fit(args, label, noise_setting=setting), seed=cfg.seed, jobs=cfg.jobs,
        mpi=cfg.mpi, target_epsilon=getattr(cfg, "target_epsilon", None), delta=getattr(cfg, "delta", None),
        noise_setting=setting, wandb=bool(getattr(cfg, "wandb", False)), check_metric=refuse_metric_at_setup,
        dry_run=bool(getattr(cfg, "dry_run", False)))
    info = private_sweep.run_private(sweep, count, options, out)
    return 1 if info is None else 0


def report_privacy(runs: list[Any], sweep_dir: str) -> dict[str, Any] | None:
    """The epsilons of what a sweep of DP runs releases, for ``dpfl report``: one run (the largest of
    its runs) and every run composed (``dp_accounting`` through ``selection_accounting``), each run's
    trial planned from its saved ``config.yaml`` at the rounds it logged; for a private selection's
    release (the sweep's directory, its ``released/`` or a folder in it), the guarantee its
    ``selection.json`` gives (:func:`~dpfl_lightning.tracking.report.release_privacy`). ``None``
    when no run is a DP run."""
    from dpfl_lightning.tracking.report import private_release, release_privacy

    release = private_release(sweep_dir)
    if release is not None:  # what a private selection released carries the selection's guarantee
        return release_privacy(release)
    from dpfl_lightning.privacy.selection_accounting import all_runs_epsilon, one_run_epsilon
    from dpfl_lightning.tracking.sweep_privacy import config_arguments

    planned = []
    for run in runs:
        if run.repeat_of is not None or not run.config.get("privacy.epsilons.epsilon.towards", run.config.get(
                "privacy.guarantees")):
            continue
        args = config_arguments(os.path.dirname(run.path))
        privacy = plan_fit(args, run.label, rounds=run.rounds) if args else None
        if privacy is not None:
            planned.append(privacy)
    if not planned:
        return None
    delta = min(p.delta for p in planned)
    accountant = planned[0].accountant
    trials = [t for p in planned for t in p.trials]
    out = {"runs": len(planned), "delta": delta, "audience": f"{planned[0].granularity}-level, {planned[0].audience}",
           "one_run": one_run_epsilon(trials, delta, accountant).epsilon,
           "all_runs": all_runs_epsilon([max(p.trials, key=lambda t: t.rdp().max()) for p in planned], delta,
                                        accountant).epsilon}
    out["tuned"] = out["all_runs"]
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else float("inf")) for k, v in out.items()}


def run_report(cfg: Any) -> None:
    """``dpfl report`` with the privacy of the sweep's runs (:func:`report_privacy`)."""
    from dpfl_lightning.tracking import report as reporting

    reporting.run_from_cli(cfg, privacy=report_privacy)
