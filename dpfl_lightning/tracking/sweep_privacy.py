"""The privacy of a sweep's runs, read from their configurations and files: the trial of a ``dpfl fit``
command line (its release and number of compositions, planned by the privacy ledger without training),
whether a metric may select among DP runs, and the guarantee lines a sweep writes.

**A run's trial** (:class:`RunPrivacy`, planned by ``dpfl_lightning.cli.sweep_command.plan_fit``). The
``dpfl fit`` arguments of a run are parsed and instantiated as ``dpfl privacy epsilon`` does (no
training, no model laid out), and its :class:`PrivacyLedger` gives the *main*
guarantee (the ``epsilon`` column: its audience and granularity) and the compositions of each of its
profiles after the run's rounds (:meth:`PrivacyLedger.planned_compositions`). A guarantee of several
profiles (clients of different record counts) gives one :class:`Trial` per profile: the worst case
over them is their pointwise maximum, as over a sweep's points.

**Admissible selection metrics** (:func:`metric_refusal`). Selection is only as private as its score.
A DP run writes, next to its ``metrics.csv``, the release kind of every metric it released
(``release_kinds.json``, see :mod:`dpfl_lightning.federated.releases`): ``public`` (a function of the
settings), ``noised`` (post-processing of DP releases in the ledger), ``evaluation`` (the server's
validation or test set) or ``unaccounted`` (computed from clients' data without noise: the training
loss a module logs, per-client evaluation, what ``log_client_metrics=True`` releases). Only the first
three may select, and ``evaluation`` only where the evaluation set is not drawn from the clients'
own data. The decision reads the kind the run recorded, never the metric's name. A run without DP is
not checked.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.tracking.run_files import is_private_run

if TYPE_CHECKING:  # the accountants load dp_accounting and scipy: `dpfl sweep` starts without them
    from dpfl_lightning.privacy.selection_accounting import Trial

RELEASE_KINDS = "release_kinds.json"  # as dpfl_lightning.run.log_setup writes it
ADMISSIBLE = ("public", "noised", "evaluation")
_VERSION = re.compile(r"version_(\d+)")


@dataclass(frozen=True)
class RunPrivacy:
    """A run's main guarantee, planned: one :class:`Trial` per profile, and what the guarantee is."""

    trials: tuple[Trial, ...]
    audience: str
    granularity: str
    delta: float
    accountant: str
    secure: bool
    noise: float | None = None  # the configured value of the setting a calibration scales

    def describe(self) -> str:
        return f"{self.granularity}-level, {self.audience}, delta={self.delta:g}"


def fit_arguments(command: Sequence[str]) -> list[str]:
    """The ``dpfl fit`` arguments of a run's command line (after ``fit``), without the options that
    only place the run (log directory, run name)."""
    words = list(command)
    if "fit" not in words:
        raise ConfigError("sweep command", " ".join(words), "is not a dpfl fit command (no `fit` in it)",
                          "private selection and sweep privacy need commands of the form ... -m dpfl_lightning fit "
                          "--config BASE.yaml ${args}")
    rest = words[words.index("fit") + 1:]
    return [w for w in rest if not w.startswith(("--trainer.log_dir=", "--trainer.run_name="))]


def newest_version(run_dir: str) -> str | None:
    """``run_dir/version_N`` of the largest ``N`` holding a ``metrics.csv``, else ``None``."""
    if not os.path.isdir(run_dir):
        return None
    found = sorted((int(m.group(1)), m.group(0)) for m in map(_VERSION.fullmatch, os.listdir(run_dir)) if m)
    for _, name in reversed(found):
        if os.path.isfile(os.path.join(run_dir, name, "metrics.csv")):
            return os.path.join(run_dir, name)
    return None


def metric_refusal(run_dir: str, metric: str) -> str | None:
    """Why ``metric`` may not select among the runs of a DP sweep, judged from the release kind the
    run in ``run_dir`` recorded (see the module docstring); ``None`` when it may, or when the run
    is not a DP run."""
    if not is_private_run(run_dir):
        return None
    version = newest_version(run_dir)
    record = os.path.join(version, RELEASE_KINDS) if version else ""
    if not version or not os.path.isfile(record):
        return (f"the run in {run_dir} recorded no release kinds ({RELEASE_KINDS}), so whether {metric} is computed "
                "from clients' data without noise cannot be told")
    with open(record) as f:
        saved = json.load(f)
    kind = saved.get("kinds", {}).get(metric)
    if kind is None:
        return (f"{metric} was not released by the DP run in {run_dir}: a DP run withholds what it computes from "
                "clients' data without noise (the training loss a module logs, per-client evaluation)")
    if kind not in ADMISSIBLE:
        return (f"{metric} is released as '{kind}': computed from clients' data without noise (the training loss a "
                "module logs, per-client evaluation, what log_client_metrics=True releases), no guarantee covers it")
    if kind == "evaluation" and saved.get("evaluation_from_clients"):
        return (f"{metric} is an evaluation on a set drawn from the clients' own data (the data module's "
                "test_set_from_clients): no mechanism accounts for it")
    return None


def refuse_metric(run_dir: str, metric: str | None) -> None:
    """:func:`metric_refusal` as one :class:`ConfigError` naming the setting and the fix."""
    why = metric_refusal(run_dir, metric) if metric else None
    if why:
        raise ConfigError("sweep metric.name", metric, f"may not select among DP runs: {why}",
                          "select by a metric of the server's validation or test set (val_*, test_*: kind "
                          "'evaluation') or a DP release already in the ledger (kind 'noised')")


def run_rounds(run_dir: str) -> int | None:
    """The rounds a run did: the largest ``round`` of its newest ``metrics.csv``."""
    from dpfl_lightning.tracking.run_files import read_metrics

    version = newest_version(run_dir)
    if version is None:
        return None
    rounds = [r.get("round", 0) for r in read_metrics(os.path.join(version, "metrics.csv"))]
    return int(max(rounds)) if rounds else None


def config_arguments(version_dir: str) -> list[str] | None:
    """``--config <version_dir>/config.yaml``: the saved configuration of a run, as fit arguments."""
    path = os.path.join(version_dir, "config.yaml")
    return ["--config", path] if os.path.isfile(path) else None
