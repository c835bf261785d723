"""The ``dpfl`` command: ``dpfl fit --config run.yaml`` and friends.

Configuration follows LightningCLI's YAML layout, parsed with jsonargparse (LightningCLI itself
only accepts ``lightning.Trainer``)::

    trainer:            # FederatedTrainer arguments; plugins / algorithm / loggers as class_path + init_args
      rounds: 50
      plugins:
        - class_path: dpfl_lightning.plugins.UpdateClipping
          init_args: {max_norm: 1.0}
    model:              # any LightningModule
      class_path: dpfl_lightning.models.MLPClassifier
      init_args: {in_features: 64}
    data:               # a FederatedDataModule (built-in source or from_datamodule-style)
      class_path: dpfl_lightning.data.Digits
      init_args: {num_clients: 100}

``--print_config`` prints the resolved configuration; dotted overrides such as
``--trainer.rounds 10`` or ``--model.init_args.lr 0.05`` apply after the file. Bad input ends
with one line naming the setting and the fix, and exit status 2.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser

from dpfl_lightning.comm import launched_with_mpi
from dpfl_lightning.errors import ConfigError, NonFiniteUpdateError

EXIT_CONFIG = 2
EXIT_FAILURE = 1


def _model_bases() -> tuple[type, ...]:
    import lightning

    bases: list[type] = [lightning.LightningModule]
    try:  # users of the standalone package
        import pytorch_lightning

        bases.append(pytorch_lightning.LightningModule)
    except ImportError:  # pragma: no cover
        pass
    return tuple(bases)


def fit_parser() -> ArgumentParser:
    from dpfl_lightning.data.module import FederatedDataModule
    from dpfl_lightning.trainer import FederatedTrainer

    p = ArgumentParser(description="Train a LightningModule with federated (DP) training.")
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with trainer/model/data sections")
    p.add_class_arguments(FederatedTrainer, "trainer", fail_untyped=False)
    p.add_subclass_arguments(_model_bases(), "model", required=True)
    p.add_subclass_arguments(FederatedDataModule, "data", required=True)
    p.add_argument("--resume", type=str | None, default=None, help="continue from this checkpoint")
    return p


def add_privacy_subcommands(p: ArgumentParser) -> None:
    """``privacy epsilon | calibrate | plan`` (jsonargparse wants the parent added first)."""
    sub = p.add_subcommands(dest="privacy_command")
    eps = fit_parser()
    eps.add_argument("--accountant", type=str | None, default=None, help="rdp, pld or prv (default: the ledger's)")
    eps.add_argument("--delta", type=float | None, default=None, help="default: the ledger's")
    sub.add_subcommand("epsilon", eps, help="epsilon a fit config would reach, without training")
    cal = ArgumentParser()
    cal.add_argument("--epsilon", type=float, required=True)
    cal.add_argument("--delta", type=float, required=True)
    cal.add_argument("--rounds", type=int, required=True)
    _sampling_arguments(cal)
    cal.add_argument("--placement", type=str, default="central", help="central, distributed or local")
    cal.add_argument("--accountant", type=str, default="rdp")
    sub.add_subcommand("calibrate", cal, help="noise multiplier for a target (epsilon, delta)")
    plan = ArgumentParser()
    plan.add_argument("--epsilon", type=float, required=True)
    plan.add_argument("--delta", type=float, required=True)
    plan.add_argument("--noise", type=list[float], required=True, help="noise multipliers, e.g. [10,20,40,80]")
    plan.add_argument("--local_steps", type=list[int], default=[1, 5, 10, 20, 40])
    plan.add_argument("--record_rate", type=float, default=1.0, help="DP-SGD's Poisson rate of records per step")
    plan.add_argument("--accountant", type=str, default="rdp")
    plan.add_argument("--paper001", type=bool, default=False,
                      help="also paper 001's accountant (towards a third party, user sampling without replacement)")
    plan.add_argument("--clients", type=int, default=100, help="paper 001: users M")
    plan.add_argument("--records", type=int, default=4000, help="paper 001: records per user R")
    plan.add_argument("--client_rate", type=float, default=0.05, help="paper 001: user sampling ratio l")
    sub.add_subcommand("plan", plan, help="largest number of rounds for each (noise, local steps) at a target epsilon")


def _sampling_arguments(p: ArgumentParser) -> None:
    p.add_argument("--clients", type=int, required=True, help="number of clients M")
    p.add_argument("--clients_per_round", type=int | None, default=None, help="m (uniform sampling)")
    p.add_argument("--sampling", type=str | None, default=None, help="uniform, poisson or full")
    p.add_argument("--sampling_rate", type=float | None, default=None, help="Poisson rate q")
    p.add_argument("--seed", type=int, default=0, help="for local noise: which clients the seed samples")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="dpfl", description="Differentially private federated learning on Lightning modules.")
    sub = parser.add_subcommands(dest="command")
    sub.add_subcommand("fit", fit_parser(), help="train")
    privacy = ArgumentParser(description="Privacy accounting without training.")
    sub.add_subcommand("privacy", privacy, help="epsilon, calibration and round planning")
    add_privacy_subcommands(privacy)
    return parser


def run_fit(parser: ArgumentParser, cfg: Any) -> Any:
    import lightning

    # The model is built from the config: seed its initialisation with the run's seed, so the same
    # config gives the same run (ranks then take rank 0's parameters).
    lightning.seed_everything(cfg.fit.trainer.seed, verbose=False)
    init = parser.instantiate_classes(cfg)
    fit = init.fit
    trainer = fit.trainer
    trainer.config = cfg.fit.clone().as_dict()
    trainer.config.pop("config", None)
    trainer.config.pop("resume", None)
    trainer.fit(fit.model, fit.data, ckpt_path=cfg.fit.resume)
    return trainer


def _world() -> tuple[int, int, Any]:
    if not launched_with_mpi():
        return 0, 1, None
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.Get_rank(), comm.Get_size(), comm


def _fail(message: str, code: int) -> None:
    rank, size, comm = _world()
    prefix = f"dpfl: error{f' (rank {rank})' if size > 1 else ''}: "
    print(prefix + message, file=sys.stderr, flush=True)
    if size > 1:
        comm.Abort(code)  # the other ranks may be waiting in a collective: end them too
    sys.exit(code)


def _root_cause(exc: BaseException) -> BaseException:
    """jsonargparse wraps errors raised in constructors; show the user's error, not the wrapper."""
    seen = exc
    while seen.__cause__ is not None or (seen.__context__ is not None and not seen.__suppress_context__):
        nxt = seen.__cause__ or seen.__context__
        if isinstance(nxt, (ConfigError, NonFiniteUpdateError)):
            return nxt
        seen = nxt
    return exc


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    cfg = parser.parse_args(argv)  # jsonargparse prints its own usage error and exits 2
    try:
        if cfg.command == "fit":
            run_fit(parser, cfg)
        elif cfg.command == "privacy":
            from dpfl_lightning.privacy import report

            report.run(parser, cfg)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear line and a status
        cause = _root_cause(exc)
        if isinstance(cause, ConfigError):
            _fail(str(cause), EXIT_CONFIG)
        if isinstance(cause, NonFiniteUpdateError):
            _fail(str(cause), EXIT_FAILURE)
        traceback.print_exc()
        _fail(f"{type(cause).__name__}: {cause}", EXIT_FAILURE)


if __name__ == "__main__":  # pragma: no cover
    main()
