"""``dpfl audit --config run.yaml``: an empirical privacy audit of a configuration, with canary clients.

It builds the run from the same YAML (and dotted overrides) as ``dpfl fit`` and prints the privacy
ledger's epsilon next to what canaries measure, for two threat models (only the final model is seen;
every round's model is seen):

- one run (default): the run itself, with ``--canaries K`` canary clients, each inserted with
  probability 1/2 (:class:`~dpfl_lightning.plugins.canary.CanaryClients`): the Gaussian-fit estimate
  of Andrew et al. (with its interval) and the one-run lower bound of Steinke et al.; the numbers
  also go into the run's summary and its loggers (W&B) as ``audit_eps_*``;
- many runs (``--trials N``, for small configurations): ``N`` runs with one canary inserted and ``N``
  without, in secure mode so that every run draws fresh noise and cohorts; a Clopper-Pearson lower
  bound with a threshold chosen on half of the runs.

The lower bounds hold jointly at ``--confidence`` (each at ``1 - (1 - confidence) / 2``). The exit
status is 1 when a lower bound exceeds the ledger's epsilon: the run leaks more than it claims.
"""

from __future__ import annotations

import math
import tempfile
import time
from typing import Any

from jsonargparse import ArgumentParser

from dpfl_lightning.cli_config import expect_model_labels, federated_data
from dpfl_lightning.errors import require
from dpfl_lightning.plugins.canary import THREAT_MODELS, CanaryClients
from dpfl_lightning.plugins.privacy_ledger import PrivacyLedger
from dpfl_lightning.privacy.audit import LowerBound, many_run_lower_bound

EXIT_VIOLATION = 1
_ROW = "{:<30} {:<32} {}"


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
    trainer.plugins = sorted([*trainer.plugins, plugin], key=lambda p: p.order)
    trainer.hparams["plugins"] = [*trainer.hparams["plugins"], repr(plugin)]
    args = {k: getattr(plugin, k) for k in ("canaries", "inserted", "norm", "delta", "confidence", "every")}
    config = trainer.config["trainer"]
    config["plugins"] = [*(config.get("plugins") or []),
                         {"class_path": "dpfl_lightning.plugins.canary.CanaryClients", "init_args": args}]
    return plugin


def _ledger(trainer: Any) -> tuple[float, str]:
    """The epsilon of the run's client-level guarantee (towards model observers where there is one)."""
    ledger = trainer.ledger
    if ledger is None or not ledger.guarantees:
        return math.inf, "no DP mechanism: no guarantee"
    found = [g for g in ledger.guarantees if g.granularity == "client"]
    g = next((g for g in found if g.audience == "models"), found[0])
    return ledger.epsilons()[g.name], f"{g.description}; delta={ledger.delta:g}"


def _bound_text(b: LowerBound | None, how: str) -> str:
    if b is None:
        return "-"
    guesses = f"; {b.correct} of {b.guesses} guesses right" if b.guesses else ""
    return f"{b.epsilon:.3g} ({how}, confidence {b.confidence:g}{guesses})"


def _report(title: str, trainer: Any, rows: list[tuple[str, str, str]], bounds: list, seconds: float) -> int:
    """Print the audit (rank 0) and return the exit status."""
    eps, line = _ledger(trainer)
    worst = max((b.epsilon for b in bounds if b is not None), default=0.0)
    if trainer.is_global_zero:
        print(f"dpfl audit: {title}; {trainer.rounds} rounds; {seconds:.1f} s")
        print(f"ledger epsilon = {eps:.4g} ({line})")
        for row in [("threat model", "estimate (Andrew et al.)", "lower bound"), *rows]:
            print(_ROW.format(*row))
        if worst > eps:
            print(f"VIOLATION: a lower bound ({worst:.4g}) exceeds the ledger's epsilon ({eps:.4g}): this "
                  "configuration leaks more than its privacy statement says")
        else:
            print(f"consistent: no lower bound exceeds the ledger's epsilon ({worst:.3g} <= {eps:.4g})")
    return EXIT_VIOLATION if worst > eps else 0


def _one_run(parser: ArgumentParser, cfg: Any) -> int:
    a = cfg.audit
    trainer, model, data = _build(parser, cfg)
    k = a.canaries if a.canaries is not None else max(2, min(100, data.num_clients // 2))
    plugin = _add(trainer, CanaryClients(canaries=k, confidence=a.confidence))
    t0 = time.perf_counter()
    trainer.fit(model, data)
    rows, bounds = [], []
    for name, res in plugin.audit().items():
        e = res.estimate
        est = "-" if e is None else f"{e.epsilon:.3g} [{e.low:.3g}, {e.high:.3g}] ({e.confidence:g})"
        rows.append((THREAT_MODELS[name], est, _bound_text(res.bound, "one run, Steinke et al.")))
        bounds.append(res.bound)
    title = f"{k} canaries, {int(plugin.is_inserted.sum())} inserted"
    return _report(title, trainer, rows, bounds, time.perf_counter() - t0)


def _trial(parser: ArgumentParser, cfg: Any, inserted: str, log_dir: str):
    trainer, model, data = _build(parser, cfg, secure=True, loggers=None, enable_progress_bar=False,
                                  enable_summary=False, checkpoint_every=None, final_checkpoint=False, log_dir=log_dir)
    plugin = _add(trainer, CanaryClients(canaries=1, inserted=inserted, every=trainer.rounds))
    trainer.fit(model, data)
    return trainer, plugin.delta_used, {name: float(plugin.scores[name][0]) for name in THREAT_MODELS}


def _many_runs(parser: ArgumentParser, cfg: Any) -> int:
    a = cfg.audit
    require(a.trials >= 4, "--trials", a.trials, "the many-run bound needs at least 4 runs per world",
            "set --trials 4 or more")
    t0 = time.perf_counter()
    scores: dict[str, dict[str, list[float]]] = {w: {n: [] for n in THREAT_MODELS} for w in ("all", "none")}
    with tempfile.TemporaryDirectory(prefix="dpfl-audit-") as log_dir:
        for _ in range(a.trials):
            for world in ("all", "none"):
                trainer, delta, got = _trial(parser, cfg, world, log_dir)
                for name, value in got.items():
                    scores[world][name].append(value)
    each = 1.0 - (1.0 - a.confidence) / len(THREAT_MODELS)
    bounds = {n: many_run_lower_bound(scores["all"][n], scores["none"][n], delta, each) for n in THREAT_MODELS}
    rows = [(THREAT_MODELS[n], "-", _bound_text(b, "many runs, Clopper-Pearson")) for n, b in bounds.items()]
    title = f"{a.trials} runs with one canary and {a.trials} without (secure mode)"
    return _report(title, trainer, rows, list(bounds.values()), time.perf_counter() - t0)


def run(parser: ArgumentParser, cfg: Any) -> int:
    """``dpfl audit``: returns the exit status (0: consistent; 1: a lower bound exceeds the ledger)."""
    a = cfg.audit
    require(a.resume is None, "--resume", a.resume, "an audit trains from the start", "drop --resume")
    require(0 < a.confidence < 1, "--confidence", a.confidence, "must be in (0, 1)", "set e.g. 0.95")
    return _many_runs(parser, cfg) if a.trials is not None else _one_run(parser, cfg)
