"""What ``FederatedTrainer.fit | validate | test | predict`` take, read as ``lightning.Trainer``'s
methods read it, and the evaluation stages themselves.

``validate``, ``test`` and ``predict`` run the module's own ``validation_step`` / ``test_step`` /
``predict_step`` under ``lightning.Trainer`` on one device, as ``dpfl validate | test | predict`` do
(:func:`dpfl_lightning.run.lightning_eval.run_lightning_stage`), and return what Lightning returns: one dict
of metrics per dataloader, or the list of ``predict_step`` outputs.

- The model: the one given (a LightningModule, or the :class:`FederatedLightningModule` ``fit``
  returned), else the fitted one; after a fit it holds the final global model (what plugins'
  ``evaluation_params``, e.g. an average of iterates, showed the rounds' evaluations is not kept).
- The data: ``datamodule`` / ``dataloaders`` as Lightning takes them; a
  :class:`~dpfl_lightning.data.FederatedDataModule` gives its global sets (validation: the set
  every round validated on; test; predict: a wrapped DataModule's ``predict_dataloader``, else the
  test set). Given neither, the fit's data.
- The weights (``ckpt_path``): ``None``, the model's own (without a model, as Lightning: the best of
  a ``ModelCheckpoint`` callback if one saved a best model, else the final global model); ``"best"``:
  the ``ModelCheckpoint`` callback's best; ``"last"``: the run's ``last.ckpt`` (a warning and the
  model's own weights when there is none, as in Lightning); else a checkpoint file (a run's
  ``round-*.ckpt``, ``last.ckpt`` or ``final.ckpt``, or Lightning's).

On the model of a DP run (this trainer's fit, or a checkpoint in a DP run's directory) the stage
prints the run's privacy statement before its results, as ``fit`` did, and says when the data it
evaluates is drawn from the clients' own data (its results are then releases no mechanism accounts for).

Under ``mpiexec`` every rank runs the stage on its own copy of the global model (the same on every
rank) and returns the same result; rank 0 prints it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from dpfl_lightning.tracking import run_files
from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.run.lightning_eval import privacy_statement, run_lightning_stage
from dpfl_lightning.module import FederatedLightningModule, is_lightning_module
from dpfl_lightning.run.settings import TrainerSettings


def fit_inputs(module: Any, data: Any) -> FederatedLightningModule:
    """``fit``'s module (a LightningModule is wrapped) after checking both it and the data."""
    if not isinstance(module, FederatedLightningModule):
        if not is_lightning_module(module):
            raise ConfigError("module", type(module).__name__, "is not a LightningModule",
                              "wrap it: FederatedLightningModule(model, loss_fn=...)")
        module = FederatedLightningModule(module)
    require(isinstance(data, FederatedDataModule), "data", type(data).__name__, "is not a FederatedDataModule",
            "wrap it: FederatedDataModule.from_datamodule(dm, num_clients=...)")
    return module


def stage_model(stage: str, model: Any, fitted: FederatedLightningModule | None) -> Any:
    """The LightningModule a stage evaluates: ``model`` (unwrapped), else the fitted one."""
    if model is None:
        require(fitted is not None, "model", None, "not given, and this trainer has not fit a model",
                f"pass the LightningModule: trainer.{stage}(model, datamodule=..., ckpt_path=...)")
        model = fitted
    if isinstance(model, FederatedLightningModule):
        model = model.inner
    require(is_lightning_module(model), "model", type(model).__name__, "is not a LightningModule",
            f"pass a LightningModule (or the module fit returned) to trainer.{stage}")
    return model


def _best(callbacks: list[Any]) -> str | None:
    """The best model path of the first ``ModelCheckpoint`` callback (as Lightning), if it saved one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saving = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    return (saving[0].best_model_path or None) if saving else None


def stage_checkpoint(stage: str, ckpt_path: str | None, model_given: bool, checkpoint_dir: str,
                     callbacks: list[Any]) -> str | None:
    """The checkpoint whose weights a stage loads (``None``: the model's own); see the module docstring."""
    if ckpt_path is None:
        return None if model_given else _best(callbacks)
    if ckpt_path == "best":
        best = _best(callbacks)
        require(best is not None, "ckpt_path", "best", "no ModelCheckpoint callback saved a best model",
                f"pass trainer.callbacks=[ModelCheckpoint(monitor=...)] to fit, or {stage}(ckpt_path='last' or a file)")
        return best
    if ckpt_path == "last":
        last = os.path.join(checkpoint_dir, run_files.LAST)
        if os.path.isfile(last):
            return last
        warnings.warn(f'{stage}(ckpt_path="last"): there is no last checkpoint ({last}); no checkpoint is loaded. '
                      "Set checkpoint_every to write one", UserWarning, stacklevel=4)
        return None
    require(os.path.isfile(str(ckpt_path)), "ckpt_path", ckpt_path, "no such checkpoint file",
            "pass a checkpoint file, 'last' (the run's last.ckpt), 'best' (a ModelCheckpoint's) or None")
    return str(ckpt_path)


def stage_privacy(path: str | None, module: Any, fitted: FederatedLightningModule | None, run: Any,
                  checkpoints: str, callbacks: list[Any]) -> list[str] | None:
    """The privacy statement a stage prints before its results: that of the DP run that wrote the
    checkpoint it loads (its ``hparams.yaml``), else, for this trainer's fitted model or one of its
    checkpoints, this fit's (``run``: its :class:`~dpfl_lightning.run.setup.RunSetup`, if it was a DP run);
    ``None`` for weights of unknown origin."""
    found = privacy_statement(path)
    if found or run is None or not run.private:
        return found
    if path is None:
        ours = fitted is not None and module is fitted.inner
    else:
        where = os.path.abspath(path)
        ours = where.startswith(os.path.abspath(checkpoints) + os.sep) or path == _best(callbacks)
    return run.privacy_lines() if ours else None


def run_stage(stage: str, model: Any, dataloaders: Any, datamodule: Any, ckpt_path: str | None, *,
              settings: TrainerSettings, fitted: FederatedLightningModule | None, data: FederatedDataModule | None,
              checkpoints: str, callbacks: list[Any], rank: int, run: Any = None, **options: Any) -> Any:
    """``validate``, ``test`` or ``predict`` (see the module docstring; ``checkpoints``: the run's checkpoint
    directory; ``run``: the fit's set-up, for its privacy statement); ``options``: ``verbose`` or
    ``return_predictions``, as Lightning takes them. On the model of a DP run the stage first prints the
    run's privacy statement, as ``fit`` did (:func:`stage_privacy`)."""
    module = stage_model(stage, model, fitted)
    path = stage_checkpoint(stage, ckpt_path, model is not None, checkpoints, callbacks)
    privacy = stage_privacy(path, module, fitted, run, checkpoints, callbacks)
    if dataloaders is None and datamodule is None:
        require(data is not None, "datamodule", None, "not given, and this trainer has not fit on any data",
                f"pass the data: trainer.{stage}(model, datamodule=...)")
        datamodule = data
    if "verbose" in options:
        options["verbose"] = options["verbose"] and rank == 0
    return run_lightning_stage(stage, module, datamodule=datamodule, dataloaders=dataloaders, ckpt_path=path,
                               accelerator=settings.accelerator, privacy=privacy, announce=rank == 0,
                               progress_bar=settings.enable_progress_bar and rank == 0, **options)
