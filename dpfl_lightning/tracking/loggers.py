"""Round metrics to disk, to Weights & Biases and to the console -- from rank 0 only.

Lightning's own loggers do the writing: a CSV logger always (``<log_dir>/<run_name>/version_N/
metrics.csv``, one row per round, and ``hparams.yaml`` with the resolved configuration), plus any
logger in ``FederatedTrainer(loggers=[...])``, e.g. :class:`WandbLogger`.

:func:`make_loggers` builds them for a run, new or resumed: a resumed run appends to the
``metrics.csv`` it wrote before (one header, every round once) and continues the same W&B run (its
id is kept in ``wandb_run_id`` next to the CSV). :class:`RoundProgress` is the console progress
(a bar and a metrics line on a terminal, plain lines otherwise) and :func:`summary_rows` the
end-of-run table (totals where a total is meant, last values otherwise).
"""

from __future__ import annotations

import csv
import math
import netrc
import os
import re
import secrets
import shlex
import string
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

WANDB_MODES = ("auto", "online", "offline", "disabled")
WANDB_ID_FILE = "wandb_run_id"
WANDB_STEP_FILE = "wandb_step"
METRICS_FILE = "metrics.csv"


# ---------------------------------------------------------------------------------------- W&B
def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])


def resolve_wandb_mode(mode: str) -> str:
    """``auto``: ``WANDB_MODE`` if set, else ``online`` with an API key and ``offline`` without."""
    if mode not in WANDB_MODES:
        raise ValueError(f"WandbLogger.mode={mode!r}: use one of {WANDB_MODES}")
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    return "online" if _has_wandb_key() else "offline"


def new_wandb_run_id() -> str:
    """A fresh W&B run id (8 characters from ``[a-z0-9]``, W&B's own format)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"rounds": 3}}`` -> ``{"trainer.rounds": 3}``: the keys are the command-line
    options (``--trainer.rounds``), so they are also the names of W&B sweep parameters."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value
    return out


def _in_wandb_sweep() -> bool:
    return bool(os.environ.get("WANDB_SWEEP_ID"))


class WandbLogger(_LightningWandbLogger):
    """Lightning's W&B logger with a ``mode`` that works on machines without network or key.

    Args:
        project: the W&B project (default: ``WANDB_PROJECT``, else ``dpfl``).
        entity / name / group / tags: the W&B run's. ``name`` defaults to the trainer's run name.
        mode: ``auto`` (online with an API key, offline without; ``WANDB_MODE`` wins when set),
            ``online``, ``offline`` or ``disabled``. Offline runs are written under
            ``save_dir/wandb/offline-run-*`` and can be uploaded later with ``wandb sync``.
        save_dir: where W&B writes its files. Default: the run's directory
            (``<log_dir>/<run_name>/version_N``), next to ``metrics.csv``.
        id: the W&B run id. Default: a new one, kept in ``<run dir>/wandb_run_id`` so that a
            resumed run (``--resume``) continues the same W&B run; under ``wandb agent`` the
            agent's.

    The resolved configuration is logged as W&B config with dotted keys (``trainer.rounds``,
    ``model.init_args.lr``): the same names as the command-line options and W&B sweep parameters.
    W&B's end-of-run summary and sparklines are off (the run's own summary table says the same);
    its warnings and errors are not.

    Rows are logged at W&B step = round, so a resumed run continues the steps of the run it
    resumes (also offline, where W&B itself would restart ``_step`` at 0); rounds the interrupted
    run already logged (after its last checkpoint) are not logged again: W&B keeps a step's first
    row, and in a simulation the resumed run computes the same values. In a DP run
    (:meth:`protect_timing`, called before the W&B run starts) W&B's system statistics (CPU,
    memory, disk, network, threads), its system metadata and its console capture are off: they
    are timing and resource channels no mechanism covers.
    """

    #: W&B settings of a DP run: no system statistics, metadata or console capture
    PRIVATE_SETTINGS = {"x_disable_stats": True, "x_disable_meta": True, "x_disable_machine_info": True,
                        "console": "off"}

    def __init__(self, project: str | None = None, entity: str | None = None, name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, mode: str = "auto",
                 save_dir: str | None = None, id: str | None = None, **kwargs: Any) -> None:
        resolved = resolve_wandb_mode(mode)
        self.mode = resolved
        project = project or os.environ.get("WANDB_PROJECT") or "dpfl"
        settings = kwargs.pop("settings", None)
        # offline=False: Lightning's offline flag would set WANDB_MODE=dryrun for the whole process
        # (and every later run in it); the mode goes to wandb.init directly instead.
        super().__init__(name=name, project=project, save_dir=save_dir, offline=False, entity=entity, group=group,
                         tags=list(tags or []), id=id, mode=resolved, settings=_quiet_settings(settings), **kwargs)
        # Lightning always passes anonymous=None, which W&B answers with a deprecation warning.
        self._wandb_init.pop("anonymous", None)
        self._explicit_save_dir = save_dir is not None
        self._explicit_id = id is not None
        self.run_dir: str | None = None
        self._pending_config: dict[str, Any] = {}
        self._logged_through = 0  # the last step the run (or the run it resumes) logged
        self.timing_protected = False

    # ------------------------------------------------------------------ set-up by make_loggers
    def bind_run(self, run_dir: str, run_name: str | None = None, resume: bool = False) -> None:
        """Attach to a run directory before the first W&B call: W&B files go there (unless
        ``save_dir`` was given), the run is named ``run_name`` (unless ``name`` was given), and its id
        is read from ``<run_dir>/wandb_run_id`` when ``resume`` (else a new id is written there).
        Under ``wandb agent`` the agent's run id and project are used as they are."""
        if self._experiment is not None:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        if not self._explicit_save_dir:
            self._wandb_init["dir"] = run_dir
            self._save_dir = run_dir
        if self._wandb_init.get("name") is None and run_name and not _in_wandb_sweep():
            self._wandb_init["name"] = run_name  # (under wandb agent, W&B names the sweep's runs)
            self._name = run_name
        id_file = os.path.join(run_dir, WANDB_ID_FILE)
        run_id = self._wandb_init.get("id") if self._explicit_id else None
        if run_id is None and os.environ.get("WANDB_RUN_ID"):
            run_id = os.environ["WANDB_RUN_ID"]
        if run_id is None and resume and os.path.isfile(id_file):
            with open(id_file) as f:
                run_id = f.read().strip() or None
        if run_id is None:
            run_id = new_wandb_run_id()
        if _in_wandb_sweep():
            # The agent chose the run (WANDB_RUN_ID) and the project; passing them again only makes
            # W&B warn that it ignores them.
            for key in ("id", "project", "entity"):
                self._wandb_init.pop(key, None)
        else:
            self._wandb_init["id"] = run_id
            self._wandb_init["resume"] = "allow"
        self._id = run_id
        if self.mode != "disabled":
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
        step_file = os.path.join(run_dir, WANDB_STEP_FILE)
        if resume and os.path.isfile(step_file):
            with open(step_file) as f:
                self._logged_through = int(f.read().strip() or 0)

    def protect_timing(self) -> bool:
        """Turn W&B's system statistics, metadata and console capture off (a DP run); ``False`` if
        the W&B run has already started (they cannot be turned off any more)."""
        if self._experiment is not None:
            return False
        import wandb

        settings = self._wandb_init.get("settings") or wandb.Settings()
        for key, value in self.PRIVATE_SETTINGS.items():
            setattr(settings, key, value)
        self._wandb_init["settings"] = settings
        self.timing_protected = True
        return True

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The W&B run, started at first use (so a DP run can turn its timing channels off first),
        with the configuration logged so far."""
        started = self._experiment is not None
        run = _LightningWandbLogger.experiment.fget(self)
        if not started and run is not None:
            start = int(getattr(run, "starting_step", 0) or 0)  # a resumed online run: the server's next step
            self._logged_through = max(self._logged_through, start - 1)
            pending, self._pending_config = self._pending_config, {}
            self._update_config(run, pending)
        return run

    @property
    def run_id(self) -> str | None:
        """The W&B run id (known before the run starts when :meth:`bind_run` ran)."""
        if self._experiment is not None:
            return getattr(self._experiment, "id", None) or self._id
        return self._id

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """Log the configuration as W&B config with dotted keys (see the class docstring). Under
        ``wandb agent``, the sweep's own parameters are already in the config and locked: they are
        left as they are."""
        from lightning.fabric.utilities.logger import _convert_params, _sanitize_callable_params

        params = _sanitize_callable_params(_convert_params(params))
        flat = flatten_config(params)
        if self._experiment is None:  # logged when the W&B run starts
            self._pending_config.update(flat)
            return
        self._update_config(self._experiment, flat)

    @staticmethod
    def _update_config(run: Any, flat: dict[str, Any]) -> None:
        if _in_wandb_sweep():
            existing = set(run.config.keys()) if hasattr(run.config, "keys") else set()
            flat = {k: v for k, v in flat.items() if k not in existing}
        if flat:
            run.config.update(flat, allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log one row at W&B step ``step`` (the round); a step the run already logged is skipped
        (see the class docstring)."""
        if step is None:
            super().log_metrics(metrics, step)
            return
        run = self.experiment
        if step <= self._logged_through:
            return
        run.log({**metrics, "trainer/global_step": step}, step=step)
        self._logged_through = step
        if self.run_dir is not None and self.mode != "disabled":
            tmp = os.path.join(self.run_dir, f"{WANDB_STEP_FILE}.tmp-{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(f"{step}\n")
            os.replace(tmp, os.path.join(self.run_dir, WANDB_STEP_FILE))

    def offline_dirs(self) -> list[str]:
        """This run's offline directories (one per start: a resumed run has several)."""
        base = os.path.join(self._wandb_init.get("dir") or ".", "wandb")
        run_id = self.run_id
        if not run_id or not os.path.isdir(base):
            return []
        return sorted(os.path.join(base, d) for d in os.listdir(base)
                      if d.startswith("offline-run-") and d.endswith("-" + run_id))

    def finalize(self, status: str) -> None:
        """End the W&B run too, so the next ``fit`` in this process starts its own run (a preempted one
        marked as such: ``--resume`` continues it); for an offline run, say how to upload it."""
        super().finalize(status)
        if self._experiment is not None:
            if status == "preempted" and hasattr(self._experiment, "mark_preempting"):
                self._experiment.mark_preempting()  # W&B shows the run as preempted (to be resumed), not failed
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment = None
            if self.mode == "offline":
                dirs = self.offline_dirs()
                if dirs:
                    print(sync_hint(self.run_id, dirs), file=sys.stderr, flush=True)


def sync_hint(run_id: str | None, dirs: Sequence[str]) -> str:
    """How to upload an offline W&B run: the ``wandb sync`` command on lines of its own, one
    directory a line (``\\``-continued), so that no path starts mid-line where a terminal would fold
    it; a path wider than the terminal is folded on its own line, still whole when copied."""
    head = "wandb: offline run saved; upload it with:\n  wandb sync"
    if len(dirs) == 1:
        return f"{head} {shlex.quote(dirs[0])}"
    return f"{head} --id {run_id} \\\n" + " \\\n".join(f"    {shlex.quote(d)}" for d in dirs)


def _quiet_settings(settings: Any) -> Any:
    """W&B settings without the end-of-run history/summary printout (our summary table says it);
    warnings and errors stay on."""
    import wandb

    if settings is None:
        return wandb.Settings(quiet=True)
    if isinstance(settings, Mapping):
        return wandb.Settings(**{"quiet": True, **settings})
    return settings


# ---------------------------------------------------------------------------------------- CSV
def _row_round(row: Mapping[str, str]) -> float | None:
    for key in ("round", "step"):
        value = row.get(key)
        if value not in (None, ""):
            try:
                return float(value)
            except ValueError:
                return None
    return None


class _ResumingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that with ``keep_up_to`` set it continues an existing
    ``metrics.csv``: rows of rounds ``<= keep_up_to`` stay, later ones (rounds the resumed run will
    log again) go, and the header is kept (new keys extend it)."""

    def __init__(self, log_dir: str, keep_up_to: int | None) -> None:
        self._keep_up_to = keep_up_to
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        if self._keep_up_to is None:
            super()._check_log_dir_exists()
            return
        if not os.path.isfile(self.metrics_file_path):
            return
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            rows = list(reader)
        kept = [r for r in rows if (_row_round(r) is None or _row_round(r) <= self._keep_up_to)]
        tmp = self.metrics_file_path + f".tmp-{os.getpid()}"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(kept)
        os.replace(tmp, self.metrics_file_path)
        self.metrics_keys = header


class RunCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` (one row per round, ``hparams.yaml``), flushed every round, that can
    continue a run: with ``resume_round=k`` it writes into the newest ``version_N`` of
    ``<save_dir>/<name>`` that has a ``metrics.csv``, keeps its rows of rounds ``1..k`` and appends.
    A new run (``resume_round=None``) gets the next ``version_N``, as with Lightning."""

    def __init__(self, save_dir: str, name: str, resume_round: int | None = None,
                 version: int | str | None = None) -> None:
        if resume_round is not None and version is None:
            version = latest_version(save_dir, name)
        super().__init__(save_dir=save_dir, name=name, version=version, flush_logs_every_n_steps=1)
        self.resume_round = resume_round

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _ResumingWriter(self.log_dir, self.resume_round)
        return self._experiment


def latest_version(save_dir: str, name: str) -> int | None:
    """The largest ``N`` with ``<save_dir>/<name>/version_N/metrics.csv``; ``None`` if there is none."""
    root = os.path.join(save_dir, name)
    if not os.path.isdir(root):
        return None
    found = [int(d[len("version_"):]) for d in os.listdir(root)
             if re.fullmatch(r"version_\d+", d) and os.path.isfile(os.path.join(root, d, METRICS_FILE))]
    return max(found) if found else None


def make_csv_logger(log_dir: str, run_name: str, resume_round: int | None = None,
                    version: int | str | None = None) -> RunCSVLogger:
    """The run's CSV logger; ``resume_round``: rounds already done when continuing a run (``None``:
    a new run); ``version``: the ``version_N`` to write (default: see :class:`RunCSVLogger`)."""
    return RunCSVLogger(log_dir, run_name, resume_round=resume_round, version=version)


def make_loggers(log_dir: str, run_name: str, extra: Iterable[Any] = (), *, resume_round: int | None = None,
                 config: Mapping[str, Any] | None = None, version: int | str | None = None) -> list[Any]:
    """The loggers of a run, ready to log (call on rank 0 only, before the first round).

    Args:
        log_dir / run_name: the trainer's; the CSV goes to ``<log_dir>/<run_name>/version_N``.
        extra: the user's loggers (``trainer.loggers``). A :class:`WandbLogger` among them is bound
            to the CSV's run directory (:meth:`WandbLogger.bind_run`): its files go there, it is
            named after the run, and its id is kept there.
        resume_round: rounds already done when continuing from a checkpoint, ``None`` for a new
            run. A resumed run appends to its ``metrics.csv`` (dropping rows of rounds after
            ``resume_round``, which it will log again) and continues its W&B run.
        config: the resolved configuration, logged as hyperparameters (``hparams.yaml``, W&B config).
        version: the CSV ``version_N`` to write; default: a new run's next version, a resumed run's
            newest one that has a ``metrics.csv`` (pass the one the checkpointed run wrote, if known).

    Returns:
        ``[csv_logger, *extra]``; ``csv_logger.log_dir`` is the run directory.
    """
    csv_logger = make_csv_logger(log_dir, run_name, resume_round=resume_round, version=version)
    loggers: list[Any] = [csv_logger]
    run_dir = csv_logger.log_dir
    _ = csv_logger.experiment  # the CSV writer first: it must find the directory as the last run left it
    for lg in extra:
        if isinstance(lg, WandbLogger):
            lg.bind_run(run_dir, run_name, resume=resume_round is not None)
        loggers.append(lg)
    if config is not None:
        for lg in loggers:
            lg.log_hyperparams(dict(config))
    return loggers


# ---------------------------------------------------------------------------------------- privacy settings
_SIMPLE = (int, float, str, bool, type(None))


def _towards(description: str) -> str:
    """``towards the server`` from a guarantee's description (its audience, in words)."""
    m = re.search(r"towards ([^;(]+)", description)
    return f"towards {m.group(1).strip()}" if m else ""


def epsilon_columns(ledger: Any) -> dict[str, dict[str, Any]]:
    """Which guarantee each logged epsilon column is: ``{"epsilon": {...}, "epsilon_<name>": {...}}``
    with the guarantee's ``name``, ``granularity`` (client or record), ``audience``, ``towards``
    (in words), ``delta`` and ``description``; ``epsilon`` is the ledger's main guarantee."""
    out: dict[str, dict[str, Any]] = {}
    main = getattr(ledger, "main", None)
    for g in getattr(ledger, "guarantees", None) or []:
        column = "epsilon" if g.name == main else f"epsilon_{g.name}"
        out[column] = {"guarantee": g.name, "granularity": g.granularity, "audience": g.audience,
                       "towards": _towards(g.description), "delta": ledger.delta, "description": g.description,
                       "accountant": ledger.accountant_of(g.name)[0] if hasattr(ledger, "accountant_of") else None}
    return out


#: a guarantee's audience in the short form of the console (the privacy statement says it in full)
AUDIENCES = {"models": "towards anyone who sees the models", "server": "towards the server"}


def delta_text(delta: float) -> str:
    """``1e-4``, ``2.5e-6``, ``0.01``: a delta as people write it."""
    if not 0 < delta < 1e-3:
        return f"{delta:g}"
    exponent = math.floor(math.log10(delta))
    mantissa = round(delta / 10.0 ** exponent, 3)
    if mantissa >= 10:
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:g}e{exponent}"


def epsilon_notes(ledger: Any) -> dict[str, str]:
    """What each logged epsilon column is, in the console's short form:
    ``{"epsilon": "(delta=1e-4, towards anyone who sees the models)"}`` (``record-level, `` first for
    a record-level guarantee). The delta and the audience are settings, not data: nothing here
    depends on a client. Empty without a ledger."""
    out = {}
    for column, info in epsilon_columns(ledger).items():
        parts = ["record-level"] if info["granularity"] == "record" else []
        if isinstance(info["delta"], (int, float)):
            parts.append(f"delta={delta_text(info['delta'])}")
        towards = AUDIENCES.get(info["audience"]) or info["towards"]
        parts += [towards] if towards else []
        if info.get("accountant") not in (None, getattr(ledger, "accountant", None)):  # asked for another one
            parts.append(f"{info['accountant']} accountant, not {ledger.accountant}")
        out[column] = f"({', '.join(parts)})"
    return out


def privacy_settings(mechanisms: Iterable[Any], ledger: Any = None, statement: Iterable[str] | None = None) -> dict[str, Any]:
    """The privacy settings of a run, after set-up (calibrated noise resolved): every declared
    mechanism (its source, placement, granularity, covered segments, description); the ledger's
    accountant, delta and budget; ``epsilons``: which guarantee each logged epsilon column is (see
    :func:`epsilon_columns`); and ``guarantees``: ``statement`` (the run's privacy lines) or else
    the ledger's own description, one line per guarantee. Empty for a run without DP."""
    out: dict[str, Any] = {}
    lines = list(statement) if statement is not None else None
    mechanisms = [{"source": m.source, "placement": m.placement, "granularity": m.granularity,
                   "covers": list(m.covers), "noise_multiplier": m.noise_multiplier, "description": m.description}
                  for m in mechanisms]
    if ledger is not None and ledger.guarantees:
        for key in ("accountant", "delta", "budget"):
            if isinstance(getattr(ledger, key, None), _SIMPLE):
                out[key] = getattr(ledger, key)
        out["epsilons"] = epsilon_columns(ledger)
        if lines is None:
            lines = list(ledger.describe())
    if mechanisms:
        out["mechanisms"] = mechanisms
    if lines:
        out["guarantees"] = lines
    return out


def log_privacy_settings(loggers: Iterable[Any], settings: Mapping[str, Any]) -> None:
    """Add ``settings`` (see :func:`privacy_settings`) to every logger's hyperparameters under
    ``privacy`` (``hparams.yaml``; W&B config keys ``privacy.*``), and turn a W&B logger's timing
    channels off (:meth:`WandbLogger.protect_timing`). Nothing for empty settings (no DP)."""
    if not settings:
        return
    for lg in loggers:
        if isinstance(lg, WandbLogger):
            lg.protect_timing()
        lg.log_hyperparams({"privacy": dict(settings)})


def noise_multiplier_notes(ledger: Any, mechanisms: Iterable[Any]) -> list[str]:
    """Why a guarantee's noise multiplier differs from the one configured: under replace-one
    neighbours the sensitivity of a sum of ``C``-bounded updates is ``2C`` (std / 2C), and
    mechanisms released together (an update and a noisy count) are one Gaussian."""
    configured = sorted({float(m.noise_multiplier) for m in mechanisms if getattr(m, "noise_multiplier", None)})
    notes = []
    for g in getattr(ledger, "guarantees", None) or []:
        r = g.release
        z = r.noise_multiplier
        if z is None or any(math.isclose(z, c, rel_tol=1e-3) for c in configured):
            continue
        parts = []
        if r.relation == "replace_one":
            parts.append("replace-one neighbours: a replaced client moves the sum by up to 2C, so the multiplier "
                         "is std / 2C, half of std / C")
        if len(r.events) > 1:
            parts.append(f"{len(r.events)} mechanisms released together compose as one Gaussian")
        if parts:
            shown = ", ".join(f"{c:.4g}" for c in configured)
            notes.append(f"noise multiplier {z:.4g} {_towards(g.description)} (the mechanisms' own: {shown}): "
                         + "; ".join(parts))
    return notes


# ---------------------------------------------------------------------------------------- console
_BOOKKEEPING = ("round", "step", "round_time_s", "clients")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


def _order(keys: Iterable[str]) -> list[str]:
    """Metrics in the order a reader looks for them: global accuracy, epsilon, global loss, the rest."""
    def rank(k: str) -> int:
        main = k.startswith(("test_", "val_"))
        if "acc" in k:
            return 0 if main else 3
        if k == "epsilon":
            return 1
        if "loss" in k or k == "suboptimality":
            return 2 if main or k == "suboptimality" else 4
        if k.startswith("epsilon"):
            return 5
        return 6

    return sorted(keys, key=lambda k: (rank(k), k))


def metrics_line(metrics: Mapping[str, Any], keys: Sequence[str] | None = None,
                 notes: Mapping[str, str] | None = None) -> str:
    """``val_acc=0.7111  epsilon=1.534 (delta=1e-5, towards the server)  val_loss=1.193``: ``keys`` in
    order, or every metric but the bookkeeping ones (round, time, cohort size), accuracies first;
    ``notes`` follow their metric's value (see :func:`epsilon_notes`)."""
    notes = notes or {}
    shown = keys if keys is not None else _order(k for k in metrics if k not in _BOOKKEEPING)
    return "  ".join(f"{k}={_fmt(metrics[k])}" + (f" {notes[k]}" if k in notes else "") for k in shown if k in metrics)


def annotated_rows(rows: Mapping[str, Any], notes: Mapping[str, str]) -> dict[str, Any]:
    """Summary rows (see :func:`summary_rows`) with each epsilon's note after its value
    (``epsilon``, ``epsilon (round 3)``: ``1.534 (delta=1e-5, towards the server)``)."""
    out = dict(rows)
    for key, value in rows.items():
        note = notes.get(re.sub(r" \(round \d+\)$", "", key))
        if note is not None and isinstance(value, (int, float)):
            out[key] = f"{_fmt(float(value))} {note}"
    return out


class _ProgressWithMetrics(Progress):
    """A rich progress bar with the latest metrics below it, wrapped between metrics to the
    terminal's width (every metric stays visible; none is cut in the middle)."""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            text = task.fields.get("metrics", "")
            if text:
                yield Text(wrap_words(text, self.console.width, sep="  "), style="dim")


def wrap_words(text: str, width: int | None, indent: str = "", sep: str = " ") -> str:
    """``text`` broken into lines of at most ``width`` characters between the ``sep``-separated
    words (never inside one; a word longer than the line gets a line of its own), continuation
    lines starting with ``indent``. ``width=None``: one line."""
    if not width:
        return text
    lines: list[str] = []
    line = ""
    for word in text.split(sep):
        if not word:
            continue
        candidate = f"{line}{sep}{word}" if line else (indent if lines else "") + word
        if line and len(candidate) > width:
            lines.append(line)
            line = indent + word
        else:
            line = candidate
    lines.append(line)
    return "\n".join(lines)


def print_privacy_lines(lines: Iterable[str], console: Console | None = None) -> None:
    """The run's privacy statement (and release notes), one ``privacy: ...`` entry per line; on a
    terminal wrapped between words to its width with an indent, in a file or pipe one line each."""
    console = console or Console(stderr=True)
    width = console.width if console.is_terminal else None
    for line in lines:
        text = wrap_words(f"privacy: {line}", width, indent="  ")
        out = Text(text)
        out.stylize("bold", 0, len("privacy"))
        console.print(out, soft_wrap=True, highlight=False)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class RoundProgress:
    """Progress over rounds (rank 0, when enabled), on stderr.

    On a terminal: a rich bar (``round 12/60``, elapsed, remaining; drawn from the end of the first
    round on) and below it one line with the latest value of every metric, cut to the terminal's
    width. Otherwise (a file, a pipe, a batch job's log) plain lines without control characters:
    the first round, every ``every`` rounds (default: about 10 per run), every round that logged
    metrics the round before did not (an evaluation on an ``eval_every`` schedule) and the last.

    Args:
        total: the run's rounds; start: rounds already done (resumed run).
        enabled: ``False`` prints nothing.
        keys: the metrics to show (default: all but round, time and cohort size; accuracy and
            epsilon first).
        every: plain output only: a line every this many rounds.
        console: the rich console to draw on (default: stderr).
        notes: shown after a metric's value, e.g. each epsilon's delta and audience (see
            :func:`epsilon_notes`).

    :meth:`notice` prints a line above the live bar (a signal's notice); :meth:`close` stops the bar
    for good, so that what a stopping run prints last (the resume command) comes after it.
    """

    def __init__(self, total: int, start: int, enabled: bool, keys: list[str] | None = None,
                 every: int | None = None, console: Console | None = None,
                 notes: Mapping[str, str] | None = None) -> None:
        self.enabled = enabled
        self.keys = keys
        self.notes = dict(notes or {})
        self.total = total
        self.done = start
        self.every = every or max(1, math.ceil(total / 10))
        self._latest: dict[str, Any] = {}
        self._previous_keys: set[str] | None = None
        self._t0 = time.perf_counter()
        self._t0_monotonic = time.monotonic()  # rich's clock
        self._progress: Progress | None = None
        if not enabled:
            return
        self.console = console or Console(stderr=True)
        self.interactive = self.console.is_terminal

    def _start(self, line: str) -> None:
        # Started at the first round's end, not before: what the run prints when it starts (W&B,
        # the privacy statement) comes from other consoles, which would tear a live display.
        self._progress = _ProgressWithMetrics(
            TextColumn("round"), MofNCompleteColumn(), BarColumn(bar_width=None), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), console=self.console, transient=False, expand=True)
        self._task = self._progress.add_task("rounds", total=self.total, completed=self.done, metrics=line)
        for task in self._progress.tasks:  # elapsed time counts from the start of the run
            task.start_time = self._t0_monotonic
        self._progress.start()

    def update(self, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        self.done += 1
        self._latest.update({k: v for k, v in metrics.items()})
        if self.interactive:
            line = metrics_line(self._latest, self.keys, self.notes)
            if self._progress is None:
                self._start(line)
            else:
                self._progress.update(self._task, completed=self.done, metrics=line)
            return
        keys = set(metrics)
        new_keys = self._previous_keys is None or bool(keys - self._previous_keys)
        self._previous_keys = keys
        r = int(metrics.get("round", self.done))
        if new_keys or r % self.every == 0 or r >= self.total:
            line = metrics_line(metrics, self.keys, self.notes)
            width = len(str(self.total))
            print(f"round {r:>{width}}/{self.total}  {line}  [{_clock(time.perf_counter() - self._t0)}]".rstrip(),
                  file=self.console.file, flush=True)

    def notice(self, text: str) -> bool:
        """Print ``text`` above the live bar, wrapped between words to the terminal's width; ``False``
        (nothing printed) when no bar is live: the caller writes it itself."""
        live = self._progress
        if live is None:
            return False
        live.console.print(Text(text), highlight=False)
        return True

    def close(self) -> None:
        """Stop the bar (drawn once more, where it is); nothing is drawn after this."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# ---------------------------------------------------------------------------------------- summary
#: metrics summed over the run in the summary (counts per round).
TOTAL_KEYS = ("skipped_clients",)
#: metrics averaged over the run in the summary.
MEAN_KEYS = ("clients",)


def summary_rows(history: Sequence[Mapping[str, Any]], extra: Mapping[str, Any] | None = None,
                 totals: Sequence[str] = TOTAL_KEYS, means: Sequence[str] = MEAN_KEYS) -> dict[str, Any]:
    """The end-of-run table from the whole history (restored rounds of a resumed run included).

    ``rounds``; then ``extra`` (e.g. ``num_clients``, ``ranks``) in its order; ``seconds/round``
    (mean of ``round_time_s``); for every metric, in order of first appearance: ``<key> (total)``
    for ``totals`` (e.g. ``skipped_clients``: clients skipped over the run, not in the last round),
    ``<key> (mean)`` for ``means`` (the cohort size), else its last value, as ``<key>`` when the last
    round logged it and ``<key> (round r)`` when it was last logged at an earlier round r.
    """
    rows: dict[str, Any] = {}
    last_round = int(history[-1].get("round", len(history))) if history else 0
    rows["rounds"] = last_round
    rows.update(extra or {})
    times = [float(h["round_time_s"]) for h in history if h.get("round_time_s") is not None]
    if times:
        rows["seconds/round"] = sum(times) / len(times)
    keys: list[str] = []
    for h in history:
        keys.extend(k for k in h if k not in keys)
    for key in keys:
        if key in ("round", "step", "round_time_s"):
            continue
        values = [(int(h.get("round", i + 1)), h[key]) for i, h in enumerate(history) if key in h]
        if key in totals:
            rows[f"{key} (total)"] = sum(v for _, v in values)
        elif key in means:
            rows[f"{key} (mean)"] = sum(v for _, v in values) / len(values)
        else:
            r, v = values[-1]
            rows[key if r == last_round else f"{key} (round {r})"] = v
    return rows


def summary_table(title: str, rows: Mapping[str, Any]) -> Table:
    """The summary as a two-column table that fits the console (a long value, e.g. an epsilon with
    its note, wraps between words inside its cell)."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric", overflow="fold")
    table.add_column("value", justify="right", overflow="fold")
    for k, v in rows.items():
        table.add_row(k, _fmt(v))
    return table


def print_summary(title: str, rows: Mapping[str, Any], console: Console | None = None) -> None:
    """Print :func:`summary_table` (on stderr unless ``console`` is given)."""
    (console or Console(stderr=True)).print(summary_table(title, rows))
