"""The ``dpfl`` command: ``dpfl fit --config run.yaml`` and friends.

Configuration follows LightningCLI's YAML layout, parsed with jsonargparse (LightningCLI itself
only accepts ``lightning.Trainer``)::

    seed_everything: 0  # the model's initialisation (default: trainer.seed)
    trainer:            # FederatedTrainer arguments; plugins / algorithm / loggers as class_path + init_args
      rounds: 50
      plugins:
        - class_path: dpfl_lightning.plugins.UpdateClipping
          init_args: {max_norm: 1.0}
    model:              # any LightningModule
      class_path: dpfl_lightning.models.MLPClassifier
      init_args: {in_features: 64}
    data:               # a FederatedDataModule, or any LightningDataModule (split as `split:` says)
      class_path: dpfl_lightning.data.Digits
      init_args: {num_clients: 100}

``-c`` / ``--config`` reads a file, ``--print_config`` prints the resolved configuration, dotted
overrides such as ``--trainer.rounds 10`` or ``--model.init_args.lr 0.05`` apply after the file.
Every fit saves ``config.yaml`` next to its ``metrics.csv``: ``dpfl fit --config`` that file reruns
the run exactly. ``dpfl validate | test | predict --ckpt_path RUN`` evaluates a trained run (a run
directory, or a checkpoint with ``--config``) under ``lightning.Trainer``, see
:mod:`dpfl_lightning.run.lightning_eval`. Bad input ends with one line naming the setting, what is wrong
and the fix (the closest valid option or class), and exit status 2 (:mod:`dpfl_lightning.cli.parse_errors`).

Start-up: ``main`` builds only the parser of the subcommand named (the parsers of ``fit``,
``validate``, ``test``, ``predict``, ``audit`` and ``privacy epsilon`` come from signatures and
import torch and Lightning); ``dpfl --version``, every ``dpfl SUB --help`` (from
:mod:`dpfl_lightning.cli.help`) and ``dpfl privacy calibrate | plan | theory`` import neither.

Other subcommands: ``dpfl privacy ...`` (accounting without training), ``dpfl sweep SWEEP.yaml``
(every configuration of a W&B-format sweep file as its own run, see :mod:`dpfl_lightning.tracking.sweep`)
and ``dpfl report RUNS_DIR`` (plots and tables from the runs' CSV logs, see
:mod:`dpfl_lightning.tracking.report`).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from typing import Any

import yaml
from jsonargparse import ArgumentParser

from dpfl_lightning import errors
from dpfl_lightning.cli.run_objects import expect_model_labels, federated_data, run_config_text, seed_model
from dpfl_lightning.cli.parsers import build_parser, command_of, fit_parser, parse_error_line
from dpfl_lightning.errors import ONE_LINE_ERRORS, ConfigError, require

__all__ = ["build_parser", "expect_model_labels", "federated_data", "fit_parser", "main", "parse", "run_config_text",
           "run_fit", "run_stage", "seed_model"]

EXIT_CONFIG = 2
EXIT_FAILURE = 1


def _save_run_config(trainer: Any, text: str) -> None:
    """``config.yaml`` in the run's directory (rank 0; the directory exists once the loggers do)."""
    run_dir = getattr(trainer, "csv_log_dir", None)
    if not run_dir or not os.path.isdir(run_dir):
        return
    from dpfl_lightning.run.lightning_eval import CONFIG_FILE

    path = os.path.join(run_dir, CONFIG_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _sweep_logger(trainer: Any) -> None:
    """Under ``wandb agent`` (``WANDB_SWEEP_ID`` set) a run logs to W&B, or the sweep never sees its
    metric: add a :class:`~dpfl_lightning.tracking.loggers.WandbLogger` when the configuration has none."""
    if not os.environ.get("WANDB_SWEEP_ID"):
        return
    from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

    if any(isinstance(lg, LightningWandbLogger) for lg in trainer.extra_loggers):
        return
    from dpfl_lightning.tracking.loggers import WandbLogger

    trainer.extra_loggers.append(WandbLogger(mode="auto"))
    if _world()[0] == 0:
        print(f"dpfl: note: run of W&B sweep {os.environ['WANDB_SWEEP_ID']}: logging to W&B (trainer.loggers "
              "had no WandbLogger)", file=sys.stderr, flush=True)


def run_fit(parser: ArgumentParser, cfg: Any) -> Any:
    section = cfg.fit
    require(not (section.ckpt_path and section.resume), "--ckpt_path", section.ckpt_path,
            "given together with --resume (the same setting)", "give one of them")
    # The model is built from the config: seed its initialisation (seed_everything, default the run's
    # seed), so the same config gives the same run (ranks then take rank 0's parameters).
    seed = seed_model(section)
    fit = parser.instantiate_classes(cfg).fit
    trainer = fit.trainer
    data = federated_data(fit.data, section.split)
    text = run_config_text(parser.dpfl_subcommands["fit"], section, seed)
    trainer.config = yaml.safe_load(text)
    _sweep_logger(trainer)
    expect_model_labels(fit.model, data)
    try:
        with warnings.catch_warnings():
            if seed != section.trainer.seed:  # seed_everything chose the model's seed, and config.yaml keeps it
                warnings.filterwarnings("ignore", message=r"trainer\.seed=.*torch's global random generator")
            trainer.fit(fit.model, data, ckpt_path=section.ckpt_path or section.resume)
    finally:
        _save_run_config(trainer, text)
    return trainer


def run_stage(parser: ArgumentParser, cfg: Any, stage: str) -> Any:
    """``dpfl validate | test | predict``: the trained run's global model under lightning.Trainer."""
    from dpfl_lightning.run import lightning_eval as evaluation

    section = getattr(cfg, stage)
    seed_model(section)
    init = getattr(parser.instantiate_classes(cfg), stage)
    data = federated_data(init.data, section.split)
    ckpt = section.ckpt_path or evaluation.default_checkpoint(init.trainer)
    result = evaluation.evaluate(stage, init.model, data, ckpt, init.trainer.accelerator)
    if stage == "predict":
        path = evaluation.save_predictions(result, ckpt, section.out)
        print(f"wrote the predictions of {len(result or [])} batches to {path}")
    return result


def _world() -> tuple[int, int, Any]:
    if "torch" not in sys.modules:  # a light subcommand (no torch, so no communicator): no rank waits on this one
        return 0, 1, None
    from dpfl_lightning.comm import launched_with_mpi

    if not launched_with_mpi():
        return 0, 1, None
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.Get_rank(), comm.Get_size(), comm


def _fail(message: str, code: int, reported: bool = False) -> None:
    rank, size, comm = _world()
    if not reported:  # the trainer may have written this rank's line already
        prefix = f"dpfl: error{f' (rank {rank})' if size > 1 else ''}: "
        print(prefix + message, file=sys.stderr, flush=True)
    if size > 1:
        errors.drain_output()  # the line must reach the job's output before the abort ends the launcher
        comm.Abort(code)  # the other ranks may be waiting in a collective: end them too
    sys.exit(code)


def _root_cause(exc: BaseException) -> BaseException:
    """jsonargparse wraps errors raised in constructors; show the user's error, not the wrapper."""
    seen = exc
    while seen.__cause__ is not None or (seen.__context__ is not None and not seen.__suppress_context__):
        nxt = seen.__cause__ or seen.__context__
        if isinstance(nxt, ONE_LINE_ERRORS):
            return nxt
        seen = nxt
    return exc


def _search_working_directory() -> None:
    """Classes in the working directory (``mydata.MyDataModule``) import as under ``python -m``;
    appended, so they never shadow an installed package."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.append(here)


def parse(parser: ArgumentParser, argv: list[str] | None = None) -> Any:
    """Parse ``argv`` (default: the command line); a bad command line ends with one line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _search_working_directory()
    try:
        args = argv
        if argv and argv[0] in ("validate", "test", "predict"):  # a run directory as --ckpt_path
            from dpfl_lightning.run import lightning_eval as evaluation

            args = evaluation.rewrite_arguments(argv)
        return parser.parse_args(args)
    except argparse.ArgumentError as exc:
        _fail(parse_error_line(parser, argv, exc.message), EXIT_CONFIG)
    except ConfigError as exc:
        _fail(str(exc), EXIT_CONFIG)


def _asks_help(argv: list[str]) -> bool:
    words = argv[:argv.index("--")] if "--" in argv else argv
    return "-h" in words or "--help" in words


def main(argv: list[str] | None = None) -> None:
    """``dpfl ...``: parse the command line (building only the parser of the subcommand it names)
    and run the subcommand. ``--help`` of a subcommand whose parser is built from signatures is
    printed from :mod:`dpfl_lightning.cli.help`, without importing torch or Lightning."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = command_of(argv)
    if _asks_help(argv):
        if argv[0] in ("-h", "--help"):
            build_parser(light=True).print_help()  # the subcommands' list, in a fraction of a second
            return
        from dpfl_lightning.cli import help as cli_help

        if cli_help.print_help(command):
            return
    parser = build_parser(light=not command, command=command)
    cfg = parse(parser, argv)
    try:
        if cfg.command == "fit":
            run_fit(parser, cfg)
        elif cfg.command in ("validate", "test", "predict"):
            run_stage(parser, cfg, cfg.command)
        elif cfg.command == "privacy":
            from dpfl_lightning.cli import privacy_command as privacy_cli

            privacy_cli.run(parser, cfg)
        elif cfg.command == "sweep":
            from dpfl_lightning.cli import sweep_command

            code = sweep_command.run_sweep(cfg.sweep)
            if code:
                sys.exit(code)
        elif cfg.command == "report":
            from dpfl_lightning.cli import sweep_command

            sweep_command.run_report(cfg.report)
        elif cfg.command == "audit":
            from dpfl_lightning.cli import audit_command as audit_cli

            code = audit_cli.run(parser, cfg)
            if code:
                sys.exit(code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line and a status
        cause = _root_cause(exc)
        reported = errors.was_reported(exc) or errors.was_reported(cause)
        if isinstance(cause, ConfigError):
            _fail(str(cause), EXIT_CONFIG, reported)
        if isinstance(cause, ONE_LINE_ERRORS):  # a non-finite update, a plugin writing to the release
            _fail(str(cause), EXIT_FAILURE, reported)
        traceback.print_exc()
        _fail(f"{type(cause).__name__}: {cause}", EXIT_FAILURE, reported)


if __name__ == "__main__":  # pragma: no cover
    main()
