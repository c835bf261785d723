"""``dpfl audit --config run.yaml``: an empirical privacy audit of a configuration, with canary clients.

It builds the run from the same YAML (and dotted overrides) as ``dpfl fit`` and sets the privacy
ledger's statement against what canaries measure, for each threat model: only the final model is
seen; every round's model is seen; and, for local or distributed noise, the server sees the messages
(each client's noised message, or the securely aggregated sum).

- one run (default): ``--canaries K`` canary clients, each inserted with probability 1/2, at 100
  times the clip bound in force (:class:`~dpfl_lightning.plugins.canary.CanaryClients`). The verdict
  is the one-run f-DP test of Mahloujifar, Melis and Chaudhuri (2025) of the ledger's own privacy
  curve (its epsilon at deltas 1e-12 .. 0.1), which refutes the ledger at ``--confidence`` with no
  assumption on the mechanism; next to it the Gaussian-DP lower bound of the same paper and the
  Gaussian-fit estimate of Andrew et al. (2024), with its interval. The noise check
  (:func:`~dpfl_lightning.privacy.audit_bounds.noise_check`) tests the declared Gaussian noise in the
  released sum and in the canary slots' messages: less noise than declared is a violation too.
- many runs (``--trials N``, small configurations): ``N`` runs with one canary inserted and ``N``
  without, in secure mode; a Clopper-Pearson lower bound at the ledger's delta.

Before training, the audit computes the most its bound can show for this delta and number of
canaries (or trials); if that is below the ledger's epsilon it says so and which settings would
(the one-run audit still trains, for the noise check; the many-run audit trains nothing). The one-run
audit also adds :class:`~dpfl_lightning.plugins.contribution_check.ContributionCheck`: every client's
contribution to the sum, every round, against its declared bound (no canary needed). Exit status: 0
consistent; 3 violated (the ledger's statement is refuted, less noise than declared, or a contribution
above its bound); 4 suspect (:func:`~dpfl_lightning.privacy.audit.suspect_lower_bound`, a lower
confidence bound on the Gaussian fit's epsilon, lies above the ledger's epsilon, no refutation; only where
the fit models the release: an additive Gaussian or discrete-Gaussian mechanism with noise fresh each round,
not a pure-DP local randomizer nor correlated noise, see
:func:`~dpfl_lightning.privacy.audit.fit_assumption_fails`); 5 this audit cannot
detect a violation here; 1 and 2 as every ``dpfl`` command (a failure, a bad configuration). A
record-level (DP-SGD) configuration is refused: record-level DP is not audited.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Any

from jsonargparse import ArgumentParser

from dpfl_lightning.cli.run_objects import expect_model_labels, federated_data
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.plugins.canary import NOISE_CHECKS, THREAT_MODELS, CanaryClients
from dpfl_lightning.plugins.contribution_check import ContributionCheck
from dpfl_lightning.plugins.privacy_ledger import PrivacyLedger
from dpfl_lightning.privacy.accountants import epsilon
from dpfl_lightning.privacy.audit import fit_assumption_fails, many_run_lower_bound, suspect_lower_bound
from dpfl_lightning.privacy.audit_bounds import (Guesses, curve_refutable, curve_rejected, gdp_ceiling,
                                                  many_run_ceiling, profile_tradeoff, propose_settings)
from dpfl_lightning.federated.sampling import ClientSampler


def _build(parser: ArgumentParser, cfg: Any, **trainer_settings: Any):
    """The trainer, model and data of the ``audit`` config, with ``trainer_settings`` overridden."""
    import lightning

    sub = cfg.audit.clone()
    for key, value in trainer_settings.items():
        setattr(sub.trainer, key, value)
    lightning.seed_everything(sub.trainer.seed, verbose=False)
    whole = cfg.clone()
    whole.audit = sub
    init = parser.instantiate_classes(whole).audit
    trainer, model = init.trainer, init.model
    data = federated_data(init.data, sub.split)  # a plain LightningDataModule is split as `dpfl fit` splits it
    trainer.config = sub.as_dict()
    for key in ("config", "resume", "canaries", "trials", "confidence"):
        trainer.config.pop(key, None)
    expect_model_labels(model, data)
    return trainer, model, data


def _add(trainer: Any, plugin: CanaryClients) -> CanaryClients:
    """Add ``plugin`` to the trainer (and to its logged config), estimating at the ledger's delta."""
    ledger = next((p for p in trainer.plugins if isinstance(p, PrivacyLedger)), None)
    if plugin.delta is None and ledger is not None and ledger.delta is not None:
        plugin.delta = ledger.delta
    trainer.plugins = sorted([*trainer.plugins, plugin, plugin.message_reader()], key=lambda p: p.order)
    trainer.hparams["plugins"] = [*trainer.hparams["plugins"], repr(plugin)]
    args = {k: getattr(plugin, k) for k in ("canaries", "inserted", "norm", "delta", "confidence", "every", "boost")}
    config = trainer.config["trainer"]
    config["plugins"] = [*(config.get("plugins") or []),
                         {"class_path": "dpfl_lightning.plugins.canary.CanaryClients", "init_args": args}]
    return plugin


EXIT_CONSISTENT, EXIT_VIOLATED, EXIT_SUSPECT, EXIT_CANNOT_DETECT = 0, 3, 4, 5
PROFILE_DELTAS = tuple(10.0 ** -k for k in range(12, 0, -1))  # the ledger's curve is built from these
_ROW = "{:<34} {:<12} {:<30} {:<34} {}"


def _guarantee_for(ledger: PrivacyLedger, threat: str):
    """The guarantee a threat model's scores are held to: towards the server for the messages,
    towards model observers (where the ledger has one, else the server's) for the models."""
    client = [g for g in ledger.guarantees if g.granularity == "client"]
    if threat == "messages":
        return next(g for g in client if g.audience == "server")
    return next((g for g in client if g.audience == "models"), client[0])


def _epsilon_of(ledger: PrivacyLedger, g, delta: float) -> float:
    """The ledger's epsilon of guarantee ``g`` at ``delta`` after the rounds it accounted."""
    if g.name == ledger.main:
        return ledger.epsilon_at(delta)
    return max(epsilon(p.release, ledger.rounds, delta, ledger.accountant, ledger.pld_discretization).epsilon
               for p in g.profiles)  # a models guarantee: one composition per round


def _refuse_record_level(ledger: PrivacyLedger) -> None:
    if ledger.guarantees and not any(g.granularity == "client" for g in ledger.guarantees):
        raise ConfigError("dpfl audit", "record-level DP", "record-level DP is not audited: this configuration's "
                          "guarantee is per record (DP-SGD) and canary clients measure client-level privacy",
                          "audit a configuration with client-level noise (UpdateClipping + GaussianNoise)")
    require(bool(ledger.guarantees), "dpfl audit", "no DP mechanism", "the configuration states no privacy "
            "guarantee, so there is nothing to audit", "add UpdateClipping and GaussianNoise to trainer.plugins")


def _cohort(trainer: Any, clients: int) -> float:
    """The expected cohort of the configuration (as :func:`~dpfl_lightning.run.setup.prepare_privacy` samples)."""
    s = trainer.settings
    rate = s.sampling_rate
    if s.sampling == "poisson" and rate is None and s.clients_per_round is not None:
        rate = s.clients_per_round / clients
    return ClientSampler(s.sampling, clients, s.clients_per_round, rate).expected_cohort


def _cannot_detect(trainer: Any, eps: float, ceiling: float, reach: str, delta: float, canaries: int,
                   confidence: float, threats: int, clients: int) -> int:
    """Say before training that ``reach`` (the settings in force) cannot exceed ``eps``, and which would."""
    print(f"this audit cannot detect a violation here: {reach} at delta={delta:g} the bound can reach at most "
          f"epsilon {ceiling:.3g} (every guess right), below the ledger's {eps:.4g}")
    cohort = _cohort(trainer, clients)
    p = propose_settings(eps, delta, canaries=canaries, clients=clients, rounds=trainer.rounds, cohort=cohort,
                         canary_confidence=1.0 - (1.0 - confidence) / (threats + len(NOISE_CHECKS)),
                         trial_confidence=1.0 - (1.0 - confidence) / len(THREAT_MODELS))
    basis = f"{trainer.rounds} rounds x {cohort:g} clients per round"
    if p.canaries is not None:
        print(f"settings that would: --canaries {p.canaries} (the bound can then reach epsilon {p.ceiling:.3g}); "
              f"run time basis: one run of {basis} = {p.client_updates:g} client updates")
    elif p.trials is not None:
        print(f"settings that would: --trials {p.trials} (no number of canaries up to half the {clients} clients "
              f"reaches it; the many-run bound can then reach epsilon {p.ceiling:.3g}); run time basis: "
              f"{2 * p.trials} runs of {basis} = {p.client_updates:g} client updates")
    else:
        print(f"settings that would: none with at most {clients // 2} canaries or 32768 trials; audit a "
              "configuration whose ledger epsilon is lower (more noise, fewer rounds or a lower sampling rate)")
    return EXIT_CANNOT_DETECT


def _plan(trainer: Any, model: Any, data: Any, m: int, confidence: float) -> tuple[int | None, float]:
    """Before training: :data:`EXIT_CANNOT_DETECT` when no bound of ``m`` canaries can exceed the
    planned ledger (said here; the run still trains for the noise check), else None; and the
    confidence of each test."""
    from dpfl_lightning.cli.privacy_command import plan_run

    ledger = plan_run(trainer, data, model=model)
    _refuse_record_level(ledger)
    planned = ledger.planned_epsilons(trainer.rounds)
    lowest = min(planned[g.name] for g in ledger.guarantees if g.granularity == "client")
    threats = 3 if any(g.audience == "server" for g in ledger.guarantees) else 2
    each = 1.0 - (1.0 - confidence) / (threats + len(NOISE_CHECKS))  # the canary tests and the noise checks
    ceiling = gdp_ceiling(m, ledger.delta, each).epsilon
    if ceiling <= lowest and trainer.is_global_zero:
        _cannot_detect(trainer, lowest, ceiling, f"with {m} canaries", ledger.delta, m, confidence, threats,
                       data.num_clients)
        print("the run still trains for the noise check (less noise than declared shows at any epsilon)")
    return (EXIT_CANNOT_DETECT if ceiling <= lowest else None), each


def _noise_rows(plugin: CanaryClients, each: float) -> list[tuple[str, ...]]:
    """The noise check's rows: where the noise was read, and its bound on the observed std."""
    rows = [] if plugin.noise_checks(each) else [("noise check", "-", "not run", "no Gaussian noise read", "-")]
    for name, c in plugin.noise_checks(each).items():
        test = ("REFUTED (less noise than declared)" if c.refuted else "the declared noise is there")
        rows.append((NOISE_CHECKS[name], "-", f"std <= {c.upper:.3g} x declared", f"{c.coordinates} entries", test))
    return rows


@dataclass
class Verdict:
    """One threat model's result: the ledger's epsilon there, and what the scores say."""

    threat: str
    ledger_eps: float
    estimate: Any
    gdp: Any
    refuted: Guesses | None
    refutable: bool
    fit_low: float = 0.0  # the Gaussian fit's lower confidence bound (suspect_lower_bound)
    fit_fails: str | None = None  # why the Gaussian fit does not model this release (fit_assumption_fails)

    @property
    def suspect(self) -> bool:
        return self.fit_fails is None and self.fit_low > self.ledger_eps


def _verdicts(trainer: Any, plugin: CanaryClients, each: float) -> list[Verdict]:
    ledger, ins = trainer.ledger, plugin.is_inserted.numpy()
    out = []
    for name, res in plugin.audit().items():
        g = _guarantee_for(ledger, name)
        f = profile_tradeoff([(_epsilon_of(ledger, g, d), d) for d in PROFILE_DELTAS])
        scores = plugin.scores[name].numpy()
        fails = fit_assumption_fails([p.release for p in g.profiles])
        low = (suspect_lower_bound(scores[ins], scores[~ins], ledger.delta, each)
               if fails is None and 2 <= ins.sum() <= len(ins) - 2 else 0.0)
        out.append(Verdict(name, _epsilon_of(ledger, g, ledger.delta), res.estimate, res.gdp,
                           curve_rejected(f, scores, ins, each), curve_refutable(f, len(scores), each), low, fails))
    return out


def _row(v: Verdict) -> tuple[str, ...]:
    e, b = v.estimate, v.gdp
    est = "-" if e is None else f"{e.epsilon:.3g} [{e.low:.3g}, {e.high:.3g}]"
    gdp = "-" if b is None else f"{b.epsilon:.3g} (mu {b.mu:.3g})"
    test = (f"REFUTED ({v.refuted.correct} of {v.refuted.guesses} right)" if v.refuted else
            "not refuted" if v.refutable else "cannot refute")
    return THREAT_MODELS[v.threat], f"{v.ledger_eps:.4g}", est, gdp, test


def _status(verdicts: list[Verdict], noise: list, reach: int | None) -> tuple[int, str]:
    if any(v.refuted for v in verdicts):
        return EXIT_VIOLATED, ("VIOLATED: the canaries refute the ledger's privacy curve: this configuration "
                               "leaks more than its privacy statement says")
    if any(c.refuted for c in noise):
        return EXIT_VIOLATED, ("VIOLATED: the released values hold less noise than the mechanisms declare, so the "
                               "ledger accounts noise the run does not add")
    if any(v.suspect for v in verdicts):
        return EXIT_SUSPECT, ("SUSPECT: the Gaussian fit's lower confidence bound lies above the ledger's epsilon "
                              "(parametric, or the bootstrap's with 50+ canaries a side), though no test refutes it: "
                              "rerun with more canaries")
    if reach is not None or not any(v.refutable for v in verdicts):
        checked = ("the noise check found the declared noise" if noise else
                   "no Gaussian noise was read, so no noise check ran")
        return EXIT_CANNOT_DETECT, ("this audit cannot detect a violation here: even canaries guessed without an "
                                    f"error could not refute the ledger's curve ({checked}; the contribution check "
                                    "found every contribution within its bound)")
    return EXIT_CONSISTENT, "consistent: the canaries do not refute the ledger's privacy curve"


def _add_contribution_check(trainer: Any) -> ContributionCheck:
    """Add the message-level contribution check (an audit run only: see its threat model)."""
    check = ContributionCheck()
    trainer.plugins = sorted([*trainer.plugins, check], key=lambda p: p.order)
    trainer.hparams["plugins"] = [*trainer.hparams["plugins"], repr(check)]
    return check


def _contribution_row(check: ContributionCheck) -> tuple[str, ...]:
    test = "REFUTED (a contribution above the declared bound)" if check.refuted else "every one within its bound"
    return ("contributions to the sum", "-", "norm <= clip bound x weight 1", f"{check.checked} checked", test)


def _with_contributions(code: int, line: str, check: ContributionCheck) -> tuple[int, str]:
    """The verdict with the contribution check: a contribution above its bound is a violation."""
    if not check.refuted:
        return code, line
    text = (f"VIOLATED: {check.over} of {check.checked} client contributions to the sum exceeded the declared bound "
            "(the clip bound in force times the weight the ledger assumes), so the ledger accounts a sensitivity "
            "the run does not keep")
    return EXIT_VIOLATED, (f"{line}\n{text}" if code == EXIT_VIOLATED else text)


def _one_run(parser: ArgumentParser, cfg: Any) -> int:
    a = cfg.audit
    trainer, model, data = _build(parser, cfg)
    k = a.canaries if a.canaries is not None else max(2, min(1000, data.num_clients // 2))
    reach, each = _plan(trainer, model, data, k, a.confidence)
    plugin = _add(trainer, CanaryClients(canaries=k, confidence=a.confidence))
    check = _add_contribution_check(trainer)
    t0 = time.perf_counter()
    trainer.fit(model, data)
    verdicts = _verdicts(trainer, plugin, each)
    noise = list(plugin.noise_checks(each).values())
    code, line = _with_contributions(*_status(verdicts, noise, reach), check)
    if trainer.is_global_zero:
        ledger = trainer.ledger
        print(f"dpfl audit: {k} canaries, {int(plugin.is_inserted.sum())} inserted at {plugin.boost:g} x the clip "
              f"bound; {trainer.rounds} rounds; {time.perf_counter() - t0:.1f} s; delta={ledger.delta:g}")
        for g, text in zip(ledger.guarantees, ledger.describe()):
            print(f"ledger: {text}")
        header = ("threat model", "ledger eps", "estimate (Andrew et al.)", "Gaussian-DP bound (Mahloujifar)",
                  f"f-DP test of the ledger's curve ({each:g})")
        for row in [header, *map(_row, verdicts), *_noise_rows(plugin, each), _contribution_row(check)]:
            print(_ROW.format(*row))
        for why in dict.fromkeys(v.fit_fails for v in verdicts if v.fit_fails is not None):
            where = ", ".join(THREAT_MODELS[v.threat] for v in verdicts if v.fit_fails == why)
            print(f"no verdict rests on the Gaussian fit's estimate ({where}): {why}")
        print(line)
    return code


def _trial(parser: ArgumentParser, cfg: Any, inserted: str, log_dir: str):
    trainer, model, data = _build(parser, cfg, secure=True, loggers=None, enable_progress_bar=False,
                                  enable_summary=False, checkpoint_every=None, final_checkpoint=False, log_dir=log_dir)
    plugin = _add(trainer, CanaryClients(canaries=1, inserted=inserted, every=trainer.rounds))
    trainer.fit(model, data)
    return trainer, plugin.delta_used, {name: float(score[0]) for name, score in plugin.scores.items()}


def _many_runs(parser: ArgumentParser, cfg: Any) -> int:
    a = cfg.audit
    require(a.trials >= 4, "--trials", a.trials, "the many-run bound needs at least 4 runs per world",
            "set --trials 4 or more")
    from dpfl_lightning.cli.privacy_command import plan_run

    trainer, model, data = _build(parser, cfg)
    ledger = plan_run(trainer, data, model=model)
    _refuse_record_level(ledger)
    planned = ledger.planned_epsilons(trainer.rounds)[ledger.main]
    each = 1.0 - (1.0 - a.confidence) / len(THREAT_MODELS)
    ceiling = many_run_ceiling(a.trials, ledger.delta, each)
    if ceiling <= planned:
        threats = 3 if any(g.audience == "server" for g in ledger.guarantees) else 2
        return _cannot_detect(trainer, planned, ceiling, f"{a.trials} runs per world", ledger.delta, 1, a.confidence,
                              threats, data.num_clients)
    t0 = time.perf_counter()
    scores: dict[str, dict[str, list[float]]] = {w: {} for w in ("all", "none")}
    with tempfile.TemporaryDirectory(prefix="dpfl-audit-") as log_dir:
        for _ in range(a.trials):
            for world in ("all", "none"):
                trainer, delta, got = _trial(parser, cfg, world, log_dir)
                for name, value in got.items():
                    scores[world].setdefault(name, []).append(value)
    eps = trainer.ledger.epsilon_at()
    bounds = {n: many_run_lower_bound(scores["all"][n], scores["none"][n], delta, each) for n in scores["all"]}
    worst = max(b.epsilon for b in bounds.values())
    if trainer.is_global_zero:
        print(f"dpfl audit: {a.trials} runs with one canary and {a.trials} without (secure mode); "
              f"{time.perf_counter() - t0:.1f} s; ledger epsilon = {eps:.4g} (delta={delta:g})")
        for n, b in bounds.items():
            print(f"{THREAT_MODELS[n]:<34} {b.epsilon:.3g} (many runs, Clopper-Pearson, confidence {b.confidence:g}; "
                  f"{b.correct} of {b.guesses} right)")
        print("VIOLATED: a lower bound exceeds the ledger's epsilon" if worst > eps else
              f"consistent: no lower bound exceeds the ledger's epsilon ({worst:.3g} <= {eps:.4g})")
    return EXIT_VIOLATED if worst > eps else EXIT_CONSISTENT


def run(parser: ArgumentParser, cfg: Any) -> int:
    """``dpfl audit``: returns the exit status (see the module docstring)."""
    a = cfg.audit
    require(a.resume is None, "--resume", a.resume, "an audit trains from the start", "drop --resume")
    require(0 < a.confidence < 1, "--confidence", a.confidence, "must be in (0, 1)", "set e.g. 0.95")
    return _many_runs(parser, cfg) if a.trials is not None else _one_run(parser, cfg)
