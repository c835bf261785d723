"""Whether a private selection may rank its trials by its metric, decided from a point's configuration
before anything is drawn or trained (``dpfl sweep``). The rule is that of
:func:`~dpfl_lightning.tracking.sweep_privacy.metric_refusal`, which judges a finished run by the
release kinds it recorded (see :mod:`dpfl_lightning.federated.releases`): only ``public``, ``noised``
and ``evaluation`` metrics may select, ``evaluation`` only on global sets not drawn from the clients.

What a DP run will release, and as what, is known from its set-up:

- a plugin's ``released_metrics`` declares its keys and their kinds (the ledger's ``epsilon``, a
  noise level, FedEXP's step size); the run's set-up is made as ``dpfl privacy epsilon`` makes it;
- the keys the module logs in ``validation_step`` / ``test_step`` are ``evaluation``: they are read
  by running the configured, untrained module on one batch of the data module's global validation
  and test sets (the server's data, never a client's; the values are dropped, nothing is written).
  Where those sets are drawn from the clients' own data (``test_set_from_clients``) no evaluation
  metric may select and none is run;
- anything else a DP run could release is computed from clients' data without noise (what
  ``training_step`` logs, per-client evaluation, the round's time): refused.

The first trial's recorded kinds are still checked after it ends (a key logged only under a data
condition), as before.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Sequence

from dpfl_lightning.errors import ConfigError

_FIX = "select by a metric of the server's validation or test set (kind 'evaluation') or a DP release in the ledger " \
       "(kind 'noised')"


class _FirstBatch:
    """A re-iterable view of the first batch of ``make()`` (every ``iter`` starts a new pass)."""

    def __init__(self, make: Callable[[], Iterator[Any]]) -> None:
        self._make = make

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self._make()), 1)


def evaluation_keys(model: Any, data: Any) -> dict[str, list[str]]:
    """The keys ``model`` logs in ``validation_step`` (``"validate"``) and ``test_step``
    (``"test"``) on one batch of ``data``'s global validation and test sets, under
    ``lightning.Trainer`` (as ``dpfl validate`` runs them); a stage the model or the data lacks is
    left out."""
    from dpfl_lightning.module import is_overridden
    from dpfl_lightning.run.lightning_eval import run_lightning_stage

    data.setup()
    stages = {"validate": ("validation_step", data.has_val_set, data.val_batches),
              "test": ("test_step", data.has_test_set, data.test_batches)}
    keys: dict[str, list[str]] = {}
    for stage, (step, present, batches) in stages.items():
        if present and is_overridden(model, step):
            results = run_lightning_stage(stage, model, dataloaders=_FirstBatch(batches), accelerator="cpu",
                                          verbose=False, announce=False)
            keys[stage] = sorted({k for r in results for k in r})
    return keys


def metric_refusal_at_setup(arguments: Sequence[str], label: str, metric: str) -> tuple[str, str] | None:
    """Why ``metric`` may not select among the DP runs ``dpfl fit ARGUMENTS`` makes (see the module
    docstring), and the fix naming the metrics that may; ``None`` when it may, or when the
    configuration is not a DP run (private selection refuses it for that)."""
    from dpfl_lightning.cli.privacy_command import plan_setup
    from dpfl_lightning.cli.sweep_command import configured
    from dpfl_lightning.federated.releases import MetricRelease

    _, init, data = configured(arguments, label)
    plugins, ctx, ledger = plan_setup(init.trainer, data, model=init.model)
    if not ledger.guarantees:
        return None
    declared = [MetricRelease("round", "public", "trainer")]
    for p in plugins:
        declared.extend(p.released_metrics(ctx=ctx))
    public = sorted({r.key for r in declared if r.kind in ("public", "noised")})
    match = next((r for r in declared if r.matches(metric)), None)
    if match is not None and match.kind in ("public", "noised"):
        return None
    if match is not None:
        return (f"{metric} is released as '{match.kind}' ({match.source}: {match.why or 'declared so'}): no guarantee "
                f"covers it", f"{_FIX}: {', '.join(public)}")
    if getattr(data, "test_set_from_clients", False):
        return (f"{metric} is no DP release of the run's plugins, and its evaluation sets ({type(data).__name__}) are "
                "drawn from the clients' own data (test_set_from_clients): no mechanism accounts for an evaluation "
                "on them", f"select by a DP release in the ledger ({', '.join(public)}), or evaluate on data of "
                "people outside the run")
    keys = evaluation_keys(init.model, data)
    may = sorted(set(keys.get("validate", [])) | set(keys.get("test", [])) | set(public))
    admissible = f"{_FIX}: {', '.join(may)}"
    if metric in keys.get("validate", []):
        return None
    if metric in keys.get("test", []):
        if init.trainer.test_after_fit:
            return None
        return (f"{metric} is logged by test_step only, which a run calls after its last round only with "
                "trainer.test_after_fit=true: no trial would log it", f"set trainer.test_after_fit: true, or "
                f"{admissible}")
    logged = "; ".join(f"{stage}: {', '.join(k) or 'nothing'}" for stage, k in keys.items()) or "no evaluation"
    return (f"{metric} is neither a DP release the run's plugins declare nor logged by the module's validation_step or "
            f"test_step on the global evaluation sets ({logged}): a DP run releases it only as computed from the "
            "clients' data without noise (what training_step logs, per-client evaluation), which no guarantee "
            "covers, or withholds it", admissible)


def refuse_metric_at_setup(arguments: Sequence[str], label: str, metric: str) -> None:
    """:func:`metric_refusal_at_setup` as one :class:`ConfigError` naming the setting and the fix."""
    refused = metric_refusal_at_setup(arguments, label, metric)
    if refused is not None:
        why, fix = refused
        raise ConfigError("sweep metric.name", metric, f"may not select among DP runs: {why}", fix)
