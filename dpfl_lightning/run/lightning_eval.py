"""A trained run's global model under ``lightning.Trainer``: ``dpfl validate | test | predict``.

:class:`EvaluationData` gives the global evaluation sets of a :class:`FederatedDataModule` (every
bundled data source, or one built from a LightningDataModule) as a ``LightningDataModule``, so
``lightning.Trainer().test(model, datamodule=EvaluationData(Digits()))`` runs the module's own
``test_step`` on them, with Lightning's loop, logging and result table.

A run directory (``runs/quickstart`` or ``runs/quickstart/version_0``) names both what to build
(the ``config.yaml`` every ``dpfl fit`` saves next to its ``metrics.csv``) and the weights (the
version's ``checkpoints/final.ckpt``, else ``last.ckpt``; ``runs/quickstart``: its newest version
that has both): :func:`resolve_run` finds them. :func:`run_lightning_stage` is also what
``FederatedTrainer.validate | test | predict`` run.
:func:`load_weights` loads a checkpoint's ``state_dict`` (a ``final.ckpt``, or the run's own
checkpoints) into the model, as ``MyModule.load_from_checkpoint`` would.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning
import torch
import yaml

from dpfl_lightning.tracking import run_files
from dpfl_lightning.errors import ConfigError, require

CONFIG_FILE = "config.yaml"
STAGES = ("validate", "test", "predict")


class _Batches:
    """A re-iterable view of a generator function (every ``iter`` starts a new pass)."""

    def __init__(self, make: Callable[[], Iterator[Any]]) -> None:
        self._make = make

    def __iter__(self) -> Iterator[Any]:
        return iter(self._make())


def _inputs(batch: Any) -> Any:
    """What Lightning's default ``predict_step`` (``self(batch)``) can take: the inputs of an
    ``(inputs, labels)`` batch; other batches as they are."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return batch


class EvaluationData(lightning.LightningDataModule):
    """The evaluation sets of a :class:`~dpfl_lightning.data.FederatedDataModule` as a LightningDataModule.

    Args:
        data: the federated data module (its global sets, not the clients').
        predict_inputs_only: ``predict_dataloader`` yields the inputs of ``(inputs, labels)``
            batches (for modules that keep Lightning's default ``predict_step``, ``self(batch)``).

    ``val_dataloader``: the set every round validated on (a DataModule's validation set, else the
    test set); ``test_dataloader``: the test set (else the validation set); ``predict_dataloader``:
    a wrapped DataModule's own ``predict_dataloader`` if it has one, else the test set.
    """

    def __init__(self, data: Any, predict_inputs_only: bool = False) -> None:
        super().__init__()
        self.data = data
        self.predict_inputs_only = predict_inputs_only

    def prepare_data(self) -> None:
        self.data.prepare_data()

    def setup(self, stage: str) -> None:
        self.data.setup()

    def val_dataloader(self) -> Any:
        require(self.data.has_val_set, "data", type(self.data).__name__, "has no validation or test set",
                "use a data source with a test set")
        return _Batches(self.data.val_batches)

    def test_dataloader(self) -> Any:
        require(self.data.has_test_set, "data", type(self.data).__name__, "has no test set",
                "use dpfl validate (the set every round is validated on), or a data source with a test set")
        return _Batches(self.data.test_batches)

    def predict_dataloader(self) -> Any:
        inner = getattr(self.data, "datamodule", None)
        if inner is not None and type(inner).predict_dataloader is not lightning.LightningDataModule.predict_dataloader:
            return inner.predict_dataloader()
        batches = self.test_dataloader()
        if not self.predict_inputs_only:
            return batches
        return _Batches(lambda: (_inputs(b) for b in batches))


# ---------------------------------------------------------------------------------------- run files
def _versions(directory: str) -> list[str]:
    """The ``version_N`` directories of a run root that hold a ``config.yaml``, oldest first."""
    return [d for d in (os.path.join(directory, f"version_{n}") for n in run_files.versions(directory))
            if os.path.isfile(os.path.join(d, CONFIG_FILE))]


def run_directory(path: str) -> str | None:
    """The run directory ``path`` names: itself when it holds ``config.yaml``, else its newest
    ``version_N`` that does and has a checkpoint (else its newest that does); for a checkpoint file,
    the version whose ``checkpoints/`` holds it (a checkpoint in an older run's shared
    ``<run>/checkpoints``: that run's newest version)."""
    if os.path.isfile(path):
        path = os.path.dirname(os.path.dirname(os.path.abspath(path)))  # <run>/version_N/checkpoints/x -> version_N
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return path
    versions = _versions(path)
    with_checkpoint = [v for v in versions if run_checkpoint(v) is not None]
    return (with_checkpoint or versions or [None])[-1]


def run_checkpoint(run_dir: str, checkpoint_dir: str | None = None) -> str | None:
    """``final.ckpt``, else ``last.ckpt``, of the run in ``run_dir`` (in ``checkpoint_dir`` when
    the run set one, else in the version's ``checkpoints/``, else in the shared ``checkpoints/``
    beside its ``version_N`` where runs kept them before checkpoints were per version)."""
    run_dir = os.path.abspath(run_dir)
    places = [checkpoint_dir, os.path.join(run_dir, run_files.CHECKPOINTS)]
    if re.fullmatch(r"version_\d+", os.path.basename(run_dir)):
        places.append(os.path.join(os.path.dirname(run_dir), run_files.CHECKPOINTS))
    for directory in filter(None, places):
        for name in (run_files.FINAL, run_files.LAST):
            if os.path.isfile(os.path.join(directory, name)):
                return os.path.join(directory, name)
    return None


def resolve_run(ckpt_path: str) -> tuple[str | None, str | None]:
    """``(config file, checkpoint)`` for ``--ckpt_path``: a run directory or a checkpoint file."""
    run_dir = run_directory(ckpt_path)
    config = os.path.join(run_dir, CONFIG_FILE) if run_dir else None
    if os.path.isfile(ckpt_path):
        return config, ckpt_path
    return config, run_checkpoint(run_dir) if run_dir else None


def rewrite_arguments(argv: list[str]) -> list[str]:
    """``dpfl validate|test|predict --ckpt_path RUN`` with a run directory (or a checkpoint of a
    run) and no ``--config``: the run's ``config.yaml`` is added as ``--config`` and ``--ckpt_path``
    points at its checkpoint. Other command lines are returned as they are."""
    if not argv or argv[0] not in STAGES:
        return argv
    args = list(argv)
    value_at = next((i + 1 for i, a in enumerate(args) if a == "--ckpt_path" and i + 1 < len(args)), None)
    inline = next((i for i, a in enumerate(args) if a.startswith("--ckpt_path=")), None)
    if value_at is None and inline is None:
        return args
    path = args[value_at] if value_at is not None else args[inline].split("=", 1)[1]
    require(os.path.exists(path), "--ckpt_path", path, "no such file or directory",
            "give a checkpoint file or a run directory (runs/<run name> or runs/<run name>/version_N)")
    config, checkpoint = resolve_run(path)
    if os.path.isdir(path):
        if checkpoint is None:
            raise ConfigError("--ckpt_path", path, "holds no run with a checkpoint (final.ckpt or last.ckpt in a "
                              "version_N/checkpoints beside its config.yaml)", "fit with trainer.final_checkpoint: "
                              "true, or pass the checkpoint file and --config")
        if value_at is not None:
            args[value_at] = checkpoint
        else:
            args[inline] = f"--ckpt_path={checkpoint}"
    has_config = any(a in ("-c", "--config") or a.startswith("--config=") for a in args)
    if not has_config and config is not None:
        args[1:1] = ["--config", config]
    return args


def default_checkpoint(trainer: Any) -> str:
    """The checkpoint the newest fit with this configuration left: ``final.ckpt``, else ``last.ckpt``
    (in ``trainer.checkpoint_dir`` if set, else in the run's newest version that has one)."""
    root = run_files.run_root(trainer.log_dir, trainer.run_name)
    found = run_files.newest_checkpoint(root, (run_files.FINAL, run_files.LAST), trainer.settings.checkpoint_dir)
    if found is None:
        where = trainer.settings.checkpoint_dir or os.path.join(root, "version_*", run_files.CHECKPOINTS)
        raise ConfigError("--ckpt_path", None, f"not given, and the configuration's run left no checkpoint in {where}",
                          "pass --ckpt_path (a checkpoint file or a run directory such as runs/quickstart), or fit "
                          "first")
    return found


def load_weights(model: torch.nn.Module, path: str) -> dict[str, Any]:
    """Load the ``state_dict`` of the checkpoint at ``path`` into ``model`` (after the module's
    ``on_load_checkpoint``, as ``load_from_checkpoint`` does); returns the checkpoint."""
    require(os.path.isfile(path), "--ckpt_path", path, "no such file", "give a checkpoint file or a run directory")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file
        raise ConfigError("--ckpt_path", path, f"cannot be read as a checkpoint ({type(exc).__name__})",
                          "give a checkpoint written by dpfl fit or lightning") from exc
    require(isinstance(ckpt, dict) and "state_dict" in ckpt, "--ckpt_path", path,
            "holds no model weights (state_dict)", "use the run's final.ckpt (trainer.final_checkpoint: true)")
    hook = getattr(model, "on_load_checkpoint", None)
    if callable(hook):
        hook(ckpt)
    missing, unexpected = model.load_state_dict(ckpt["state_dict"], strict=False)
    if missing or unexpected:
        raise ConfigError("--ckpt_path", path, f"does not fit {type(model).__name__} (missing: {missing[:5]}, "
                          f"unexpected: {unexpected[:5]})", "use the configuration the checkpoint was trained with "
                          "(--config <run directory>/config.yaml)")
    return ckpt


@contextmanager
def _quiet_lightning():
    """Lightning's start-up lines (GPU available, a tip) at warning level only, and without the
    deprecation warning its pytree helper raises under this torch."""
    names = [f"{pkg}.utilities.rank_zero" for pkg in ("lightning.pytorch", "pytorch_lightning")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def privacy_statement(ckpt_path: str | None) -> list[str] | None:
    """The privacy statement of the DP run that wrote ``ckpt_path`` (the lines its fit printed and
    logged under ``privacy.guarantees`` in the version's ``hparams.yaml``); ``None`` when the
    checkpoint is not in a run directory that says it was a DP run."""
    if not ckpt_path or not os.path.exists(ckpt_path):
        return None
    # <run>/version_N/checkpoints/x.ckpt -> version_N (with or without the CLI's config.yaml)
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_path))) if os.path.isfile(ckpt_path) \
        else run_directory(ckpt_path)
    hparams = os.path.join(run_dir, "hparams.yaml") if run_dir else None
    if not hparams or not os.path.isfile(hparams):
        return None
    try:
        with open(hparams) as f:
            privacy = (yaml.safe_load(f) or {}).get("privacy")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    lines = privacy.get("guarantees") if isinstance(privacy, dict) else None
    return [str(line) for line in lines] if lines else None


def stage_privacy_lines(stage: str, statement: list[str], data: Any) -> list[str]:
    """What a stage on a DP run's model prints before its results: the run's statement (what ``fit``
    printed) and, where the evaluation set is drawn from the clients' own data, that the stage's
    results are releases about those clients that no mechanism accounts for."""
    lines = [f"{stage} evaluates the model of a DP run; its guarantee and what it does not cover:", *statement]
    if getattr(data, "test_set_from_clients", False):
        lines.append(f"this {stage}'s data ({type(data).__name__}) is drawn from the clients' own data: its results "
                     "are releases about those clients that no mechanism accounts for; keep them as private as the "
                     "data, or evaluate on data of people outside the run")
    return lines


def evaluate(stage: str, model: Any, data: Any, ckpt_path: str, accelerator: str = "auto") -> Any:
    """Run ``lightning.Trainer.<stage>`` (validate, test or predict) on the global model of
    ``ckpt_path``; returns Lightning's result (metrics, or the predictions). A DP run's checkpoint
    carries its privacy statement (:func:`privacy_statement`), printed before the results."""
    return run_lightning_stage(stage, model, datamodule=data, ckpt_path=ckpt_path, accelerator=accelerator,
                               privacy=privacy_statement(ckpt_path))


def run_lightning_stage(stage: str, model: Any, *, datamodule: Any = None, dataloaders: Any = None,
                        ckpt_path: str | None = None, accelerator: str = "auto", verbose: bool = True,
                        progress_bar: bool = False, return_predictions: bool | None = None,
                        privacy: list[str] | None = None, announce: bool = True) -> Any:
    """``lightning.Trainer(...).<stage>(model, dataloaders, datamodule=...)`` (validate, test or
    predict) on one device, without a logger or checkpoints, after loading ``ckpt_path``'s weights
    (if given) into ``model``. A :class:`FederatedDataModule` (as ``datamodule`` or ``dataloaders``)
    gives its global sets (:class:`EvaluationData`); other data goes to Lightning as it is. Returns
    Lightning's result: one dict of metrics per dataloader, or the ``predict_step`` outputs.
    ``privacy``: the statement of the DP run whose model this is, printed (when ``announce``) before
    the results with :func:`stage_privacy_lines`."""
    from dpfl_lightning.data.module import FederatedDataModule
    from dpfl_lightning.module import is_overridden

    require(stage in STAGES, "stage", stage, "unknown stage", f"use one of {', '.join(STAGES)}")
    step = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}[stage]
    if stage != "predict":
        require(is_overridden(model, step), "model", type(model).__name__, f"defines no {step}",
                f"define {step}" + (", or use dpfl validate" if stage == "test" else ""))
    if isinstance(dataloaders, FederatedDataModule) and datamodule is None:
        dataloaders, datamodule = None, dataloaders
    if privacy and announce:
        from dpfl_lightning.tracking.loggers import print_privacy_lines

        given = datamodule if datamodule is not None else dataloaders
        print_privacy_lines(stage_privacy_lines(stage, privacy, given))
    if isinstance(datamodule, FederatedDataModule):
        datamodule.warn_nonfinite(private=bool(privacy))
        datamodule = EvaluationData(datamodule, predict_inputs_only=not is_overridden(model, "predict_step"))
    if ckpt_path is not None:
        load_weights(model, ckpt_path)
    accelerator = {"cuda": "gpu"}.get(accelerator, accelerator)
    options = {"verbose": verbose} if stage != "predict" else {"return_predictions": return_predictions}
    with _quiet_lightning():
        trainer = lightning.Trainer(accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
                                    enable_model_summary=False, enable_progress_bar=progress_bar)
        return getattr(trainer, stage)(model, dataloaders=dataloaders, datamodule=datamodule, **options)


def save_predictions(predictions: Any, ckpt_path: str, out: str | None) -> str:
    """Write the predictions (``torch.save``) to ``out``, default ``predictions.pt`` beside the checkpoint."""
    path = out or os.path.join(os.path.dirname(os.path.abspath(ckpt_path)), "predictions.pt")
    from dpfl_lightning.run.checkpoint_format import save_atomic

    save_atomic(predictions, path)
    return path
