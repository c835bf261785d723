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

Other subcommands: ``dpfl privacy ...`` (accounting without training), ``dpfl sweep SWEEP.yaml``
(every configuration of a W&B-format sweep file as its own run, see :mod:`dpfl_lightning.sweep`)
and ``dpfl report RUNS_DIR`` (plots and tables from the runs' CSV logs, see
:mod:`dpfl_lightning.reporting`).
"""

from __future__ import annotations

import inspect
import re
import sys
import traceback
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

from dpfl_lightning.comm import launched_with_mpi
from dpfl_lightning.errors import ConfigError, NonFiniteUpdateError

EXIT_CONFIG = 2
EXIT_FAILURE = 1


# ---------------------------------------------------------------------------------------- help text
_ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|attr|obj|data|exc|ref|doc):`(~?)([^`<]*?)(?:\s*<([^>]*)>)?`")


def clean_doc(text: str | None) -> str | None:
    """Docstring markup as plain text for ``--help``: ``:class:`~a.b.C``` -> ``C``,
    ``:mod:`a.b``` -> ``a.b``, double and single backquotes dropped."""
    if not text:
        return text

    def role(m: re.Match) -> str:
        target = (m.group(3) or m.group(2)).strip()
        return target.rsplit(".", 1)[-1] if m.group(1) else target

    text = _ROLE.sub(role, text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"(?<![\w`])`([^`]+)`(?![\w`])", r"\1", text)


def _doc_args(cls: type) -> dict[str, str]:
    """``name: text`` entries of the ``Args:`` sections of ``cls`` and its bases, including entries
    documenting several parameters at once (``local_epochs / local_steps: ...``), which the
    docstring parser jsonargparse uses leaves out."""
    out: dict[str, str] = {}
    for klass in inspect.getmro(cls):
        doc = inspect.getdoc(klass) or ""
        lines = doc.splitlines()
        try:
            start = next(i for i, ln in enumerate(lines) if ln.strip() in ("Args:", "Arguments:", "Parameters:"))
        except StopIteration:
            continue
        entries: list[tuple[list[str], list[str]]] = []
        indent = None
        for ln in lines[start + 1:]:
            if not ln.strip():
                continue
            width = len(ln) - len(ln.lstrip())
            if indent is None:
                indent = width
            if width < indent:
                break
            m = re.match(r"\s*([\w\s/,*]+?):\s*(.*)$", ln) if width == indent else None
            if m:
                names = [n.strip().lstrip("*") for n in re.split(r"[/,]", m.group(1)) if n.strip()]
                entries.append((names, [m.group(2)]))
            elif entries:
                entries[-1][1].append(ln.strip())
        for names, text in entries:
            joined = " ".join(" ".join(text).split())
            for name in names:
                out.setdefault(name, joined)
    return out


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's formatter, with docstring markup turned into plain text."""

    def _expand_help(self, action) -> str:
        return clean_doc(super()._expand_help(action)) or ""

    def start_section(self, heading: str | None) -> None:
        super().start_section(clean_doc(heading))

    def add_text(self, text: str | None) -> None:
        super().add_text(clean_doc(text))


class DpflArgumentParser(ArgumentParser):
    """An ArgumentParser whose help is plain text and whose class options all have a description
    (also in the ``--data.help CLASS`` / ``--model.help CLASS`` pages, which jsonargparse builds
    with the parser's own type)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_class_arguments(self, class_type: type, nested_key: str | None = None, *args: Any, **kwargs: Any):
        added = super().add_class_arguments(class_type, nested_key, *args, **kwargs)
        if inspect.isclass(class_type):
            docs = _doc_args(class_type)
            prefix = f"{nested_key}." if nested_key else ""
            for action in self._actions:
                dest = getattr(action, "dest", "") or ""
                if dest.startswith(prefix) and not action.help:
                    name = dest[len(prefix):].split(".")[-1]
                    if name in docs:
                        action.help = docs[name]
        return added


# ---------------------------------------------------------------------------------------- fit
def _model_bases() -> tuple[type, ...]:
    import lightning

    bases: list[type] = [lightning.LightningModule]
    try:  # users of the standalone package
        import pytorch_lightning

        bases.append(pytorch_lightning.LightningModule)
    except ImportError:  # pragma: no cover
        pass
    return tuple(bases)


def bundled_models() -> list[str]:
    """The LightningModules of :mod:`dpfl_lightning.models` (importing it makes them known to
    ``--model`` and ``--model.help`` by their short names)."""
    import lightning

    from dpfl_lightning import models

    return [name for name, obj in vars(models).items()
            if inspect.isclass(obj) and issubclass(obj, lightning.LightningModule)
            and obj.__module__ == models.__name__]


def fit_parser() -> ArgumentParser:
    from dpfl_lightning.data.module import FederatedDataModule
    from dpfl_lightning.trainer import FederatedTrainer

    p = DpflArgumentParser(description="Train a LightningModule with federated (DP) training.")
    p.add_argument("--config", action=ActionConfigFile, help="YAML file with trainer/model/data sections")
    p.add_class_arguments(FederatedTrainer, "trainer", fail_untyped=False)
    models = bundled_models()
    p.add_subclass_arguments(_model_bases(), "model", required=True,
                             help="The model: any LightningModule subclass, by class path or, for the bundled "
                                  f"ones, by name ({', '.join(models)}), with its init_args.")
    p.add_subclass_arguments(FederatedDataModule, "data", required=True)
    p.add_argument("--resume", type=str | None, default=None, help="continue from this checkpoint")
    groups = getattr(p, "groups", {}) or {}
    if "trainer" in groups:
        groups["trainer"].title = "trainer (FederatedTrainer, the round loop)"
    if "model" in groups:
        groups["model"].title = "model (a LightningModule)"
        groups["model"].description = (f"Bundled in dpfl_lightning.models: {', '.join(models)}. "
                                       "Use --model.help CLASS for a model's options.")
    if "data" in groups:
        groups["data"].title = "data (a FederatedDataModule)"
        groups["data"].description = ("A training set split over clients, plus a global test set. "
                                      "Use --data.help CLASS for a source's options.")
    return p


def add_privacy_subcommands(p: ArgumentParser) -> None:
    """``privacy epsilon | calibrate | plan`` (jsonargparse wants the parent added first)."""
    sub = p.add_subcommands(dest="privacy_command")
    eps = fit_parser()
    eps.add_argument("--accountant", type=str | None, default=None, help="rdp, pld or prv (default: the ledger's)")
    eps.add_argument("--delta", type=float | None, default=None, help="default: the ledger's")
    sub.add_subcommand("epsilon", eps, help="epsilon a fit config would reach, without training")
    cal = DpflArgumentParser()
    cal.add_argument("--epsilon", type=float, required=True)
    cal.add_argument("--delta", type=float, required=True)
    cal.add_argument("--rounds", type=int, required=True)
    _sampling_arguments(cal)
    cal.add_argument("--placement", type=str, default="central", help="central, distributed or local")
    cal.add_argument("--accountant", type=str, default="rdp")
    cal.add_argument("--secure", type=bool, default=False,
                     help="cohorts unknown in advance: bound participations with a binomial tail (local/distributed)")
    sub.add_subcommand("calibrate", cal, help="noise multiplier for a target (epsilon, delta)")
    plan = DpflArgumentParser()
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
    theory = DpflArgumentParser(description="Paper 000 Corollary 1: the step size, communication probability and "
                                "iterations that minimise DP-ScaffNew's Theorem 1 bound.")
    theory.add_argument("--mu", type=float, required=True, help="strong convexity of every client's loss")
    theory.add_argument("--L", type=float, required=True, help="smoothness of every client's loss (L > mu)")
    theory.add_argument("--epsilon", type=float, required=True, help="the local DP budget epsilon")
    theory.add_argument("--delta", type=float, required=True, help="the local DP budget delta")
    theory.add_argument("--C", type=float, required=True, help="the clipping threshold")
    theory.add_argument("--N", type=int, required=True, help="number of clients")
    theory.add_argument("--d", type=int, required=True, help="number of parameters")
    theory.add_argument("--psi0", type=float, required=True, help="the initial Lyapunov value psi_0")
    theory.add_argument("--v", type=float, default=1.0, help="Lemma 1's constant (the paper leaves it open)")
    sub.add_subcommand("theory", theory, help="DP-ScaffNew's optimal eta, p and T (paper 000 Corollary 1)")


def _sampling_arguments(p: ArgumentParser) -> None:
    p.add_argument("--clients", type=int, required=True, help="number of clients M")
    p.add_argument("--clients_per_round", type=int | None, default=None, help="m (uniform sampling)")
    p.add_argument("--sampling", type=str | None, default=None, help="uniform, poisson or full")
    p.add_argument("--sampling_rate", type=float | None, default=None, help="Poisson rate q")
    p.add_argument("--seed", type=int, default=0, help="for local noise: which clients the seed samples")


# ---------------------------------------------------------------------------------------- sweep, report
def sweep_parser() -> ArgumentParser:
    p = DpflArgumentParser(description="Run every configuration of a W&B-format sweep file (method grid or "
                                       "random) as its own `dpfl fit` run (--jobs at a time), no W&B server "
                                       "needed; a rerun skips the runs that finished and retries the ones that "
                                       "failed. Then: dpfl report on the sweep's directory.")
    p.add_argument("sweep_file", type=str, help="the sweep YAML (W&B format: method, parameters, command, ...)")
    p.add_argument("--dir", type=str | None, default=None,
                   help="the sweep's directory: runs/, logs/, done/ (default: sweeps/<sweep name>)")
    p.add_argument("--mpi", type=int | None, default=None,
                   help="run each configuration under `mpiexec -n MPI python -m mpi4py`")
    p.add_argument("--jobs", type=int, default=1, help="configurations run at the same time")
    p.add_argument("--count", type=int | None, default=None,
                   help="random search: number of runs (default: run_cap of the file); grid: run at most this many")
    p.add_argument("--seed", type=int, default=0, help="random search: seed of the parameter draws")
    p.add_argument("--dry_run", type=bool, default=False, help="print the commands, run nothing")
    return p


def report_parser() -> ArgumentParser:
    p = DpflArgumentParser(description="Plots (PNG) and a Markdown table from the CSV logs of a set of runs.")
    p.add_argument("runs_dir", type=str, help="directory searched for <run>/version_N/metrics.csv "
                                              "(a sweep directory: its runs/)")
    p.add_argument("--metric", type=str | None, default=None,
                   help="metric(s) to report, comma-separated (default: the first of test_acc, val_acc, "
                        "test_loss, val_loss, ... that was logged; else all)")
    p.add_argument("--out", type=str | None, default=None, help="output directory (default: RUNS_DIR/report)")
    return p


def build_parser() -> ArgumentParser:
    parser = DpflArgumentParser(prog="dpfl",
                                description="Differentially private federated learning on Lightning modules.")
    sub = parser.add_subcommands(dest="command")
    sub.add_subcommand("fit", fit_parser(), help="train")
    privacy = DpflArgumentParser(description="Privacy accounting without training.")
    sub.add_subcommand("privacy", privacy, help="epsilon, calibration and round planning")
    add_privacy_subcommands(privacy)
    sub.add_subcommand("sweep", sweep_parser(), help="run the configurations of a W&B-format sweep file")
    sub.add_subcommand("report", report_parser(), help="plots and tables from the CSV logs of runs")
    from dpfl_lightning.audit_cli import audit_parser  # (audit_cli imports this module)

    sub.add_subcommand("audit", audit_parser(), help="empirical privacy audit of a fit config with canary clients")
    return parser


def expect_model_labels(model: Any, data: Any) -> None:
    """A classifier's ``num_classes`` bounds the labels: have the data check them when it is set up
    (one line naming the data and the setting) instead of failing mid-training."""
    hp = getattr(model, "hparams", None)
    n = hp.get("num_classes") if hasattr(hp, "get") else getattr(model, "num_classes", None)
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1 and hasattr(data, "expect_labels"):
        data.expect_labels(n, "model.init_args.num_classes")


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
    expect_model_labels(fit.model, fit.data)
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
            from dpfl_lightning import privacy_cli

            privacy_cli.run(parser, cfg)
        elif cfg.command == "sweep":
            from dpfl_lightning import sweep

            code = sweep.run_from_cli(cfg.sweep)
            if code:
                sys.exit(code)
        elif cfg.command == "report":
            from dpfl_lightning import reporting

            reporting.run_from_cli(cfg.report)
        elif cfg.command == "audit":
            from dpfl_lightning import audit_cli

            code = audit_cli.run(parser, cfg)
            if code:
                sys.exit(code)
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
