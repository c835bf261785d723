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
:mod:`dpfl_lightning.evaluation`. Bad input ends with one line naming the setting, what is wrong
and the fix (the closest valid option or class), and exit status 2 (:mod:`dpfl_lightning.cli_errors`).

Other subcommands: ``dpfl privacy ...`` (accounting without training), ``dpfl sweep SWEEP.yaml``
(every configuration of a W&B-format sweep file as its own run, see :mod:`dpfl_lightning.sweep`)
and ``dpfl report RUNS_DIR`` (plots and tables from the runs' CSV logs, see
:mod:`dpfl_lightning.reporting`).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
import traceback
import warnings
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

from dpfl_lightning import cli_errors, errors
from dpfl_lightning.errors import ConfigError, NonFiniteUpdateError, require

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
    with the parser's own type). Errors are raised (``exit_on_error=False``), not printed with the
    usage: :func:`main` turns them into one line (:mod:`dpfl_lightning.cli_errors`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)

    def _document(self, cls: type, nested_key: str | None) -> None:
        docs = _doc_args(cls)
        prefix = f"{nested_key}." if nested_key else ""
        for action in self._actions:
            dest = getattr(action, "dest", "") or ""
            if dest.startswith(prefix) and not action.help:
                name = dest[len(prefix):].split(".")[-1]
                if name in docs:
                    action.help = docs[name]

    def add_class_arguments(self, class_type: type, nested_key: str | None = None, *args: Any, **kwargs: Any):
        added = super().add_class_arguments(class_type, nested_key, *args, **kwargs)
        if inspect.isclass(class_type):
            self._document(class_type, nested_key)
        return added

    def add_method_arguments(self, theclass: type, themethod: str, nested_key: str | None = None, *args: Any,
                             **kwargs: Any):
        added = super().add_method_arguments(theclass, themethod, nested_key, *args, **kwargs)
        self._document(theclass, nested_key)
        return added

    def option_keys(self) -> list[str]:
        """The dotted keys this parser accepts (``trainer.rounds``, ``model``, ...)."""
        return [a.dest for a in self._actions if getattr(a, "dest", None) and a.dest not in ("help", "==SUPPRESS==")]


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


_STAGE_HELP = {
    "fit": "Train a LightningModule with federated (DP) training.",
    "validate": "Run the module's validation_step on the validation set (else the test set) with the global model "
                "of a trained run, under lightning.Trainer.",
    "test": "Run the module's test_step on the test set with the global model of a trained run, under "
            "lightning.Trainer.",
    "predict": "Run the module's predict_step on the test set (or a DataModule's predict_dataloader) with the global "
               "model of a trained run, under lightning.Trainer; the predictions are saved with torch.save.",
}
_CKPT_HELP = {
    "fit": "continue from this checkpoint (a round-*.ckpt or last.ckpt of the run)",
    "validate": "the trained run: a checkpoint (final.ckpt, last.ckpt) or a run directory (runs/quickstart or "
                "runs/quickstart/version_0, whose config.yaml is then the configuration unless -c is given); "
                "default: the checkpoint the configuration's run left",
}


_SPLIT_HELP = {
    "split.alpha": "partition dirichlet: concentration of the class proportions (smaller: more heterogeneous)",
    "split.shards_per_client": "partition shards: at most this many classes per client",
    "split.iid_fraction": "partition label_sorted: the fraction of each client's data drawn i.i.d.",
}


def fit_parser(stage: str = "fit") -> ArgumentParser:
    """The parser of ``dpfl fit`` (and, with ``stage``, of ``validate`` / ``test`` / ``predict``,
    which take the same configuration)."""
    import lightning

    from dpfl_lightning.data.module import FederatedDataModule
    from dpfl_lightning.trainer import FederatedTrainer

    p = DpflArgumentParser(description=_STAGE_HELP[stage])
    p.add_argument("-c", "--config", action=ActionConfigFile, help="YAML file with trainer/model/data sections")
    p.add_argument("--seed_everything", type=int | bool | None, default=None,
                   help="seed of the model's initialisation (lightning.seed_everything): an integer, true (a "
                        "random seed, saved in the run's config.yaml), false (none); default: trainer.seed")
    p.add_class_arguments(FederatedTrainer, "trainer", fail_untyped=False)
    p.set_defaults({"trainer.final_checkpoint": True})  # dpfl test / validate / predict read it
    models = bundled_models()
    p.add_subclass_arguments(_model_bases(), "model", required=True,
                             help="The model: any LightningModule subclass, by class path or, for the bundled "
                                  f"ones, by name ({', '.join(models)}), with its init_args.")
    p.add_subclass_arguments((FederatedDataModule, lightning.LightningDataModule), "data", required=True)
    p.add_method_arguments(FederatedDataModule, "__init__", "split", skip={"datamodule"})
    for action in p._actions:
        action.help = action.help or _SPLIT_HELP.get(getattr(action, "dest", ""))
    p.add_argument("--ckpt_path", type=str | None, default=None, help=_CKPT_HELP.get(stage, _CKPT_HELP["validate"]))
    if stage == "fit":
        p.add_argument("--resume", type=str | None, default=None, help="the same as --ckpt_path")
    if stage == "predict":
        p.add_argument("--out", type=str | None, default=None,
                       help="where to save the predictions (default: predictions.pt beside the checkpoint)")
    _titles(p, models)
    return p


def _titles(p: ArgumentParser, models: list[str]) -> None:
    groups = getattr(p, "groups", {}) or {}
    if "trainer" in groups:
        groups["trainer"].title = "trainer (FederatedTrainer, the round loop)"
    if "model" in groups:
        groups["model"].title = "model (a LightningModule)"
        groups["model"].description = (f"Bundled in dpfl_lightning.models: {', '.join(models)}. "
                                       "Use --model.help CLASS for a model's options.")
    if "data" in groups:
        groups["data"].title = "data (a FederatedDataModule or a LightningDataModule)"
        groups["data"].description = ("A training set split over clients, plus a global test set: a bundled source "
                                      "(Digits, ...), or any LightningDataModule, whose training set is split over "
                                      "clients as split: says. Use --data.help CLASS for a source's options.")
    if "split" in groups:
        groups["split"].title = "split (how a LightningDataModule under data: is split over clients)"
        groups["split"].description = ("FederatedDataModule.from_datamodule's options; a bundled source (a "
                                       "FederatedDataModule) takes them in its own init_args instead.")


def add_privacy_subcommands(p: ArgumentParser) -> dict[str, ArgumentParser]:
    """``privacy epsilon | calibrate | plan | theory`` (jsonargparse wants the parent added first);
    returns their parsers by name."""
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
    return {"epsilon": eps, "calibrate": cal, "plan": plan, "theory": theory}


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
    p.add_argument("--epsilon", type=str | None, default=None,
                   help="the guarantee(s) to plot against, comma-separated epsilon columns (epsilon, "
                        "epsilon_client_distributed_models, ...; default: every one the runs logged)")
    p.add_argument("--out", type=str | None, default=None, help="output directory (default: RUNS_DIR/report)")
    return p


SUBCOMMANDS = {
    "fit": "train",
    "validate": "validate a trained run's global model (lightning.Trainer.validate)",
    "test": "test a trained run's global model (lightning.Trainer.test)",
    "predict": "predict with a trained run's global model (lightning.Trainer.predict)",
    "privacy": "epsilon, calibration and round planning",
    "sweep": "run the configurations of a W&B-format sweep file",
    "report": "plots and tables from the CSV logs of runs",
    "audit": "empirical privacy audit of a fit config with canary clients",
}


def _subcommand_parsers() -> dict[str, ArgumentParser]:
    from dpfl_lightning.audit_cli import audit_parser  # (audit_cli imports this module)

    return {"fit": fit_parser(), "validate": fit_parser("validate"), "test": fit_parser("test"),
            "predict": fit_parser("predict"),
            "privacy": DpflArgumentParser(description="Privacy accounting without training."),
            "sweep": sweep_parser(), "report": report_parser(), "audit": audit_parser()}


def build_parser(light: bool = False) -> ArgumentParser:
    """The ``dpfl`` parser; ``parser.dpfl_subcommands`` maps each subcommand (``fit``,
    ``privacy calibrate``, ...) to its parser. ``light``: empty subcommands, enough for ``dpfl --help``
    (nothing of the trainer, Lightning or the accountants is imported)."""
    parser = DpflArgumentParser(prog="dpfl",
                                description="Differentially private federated learning on Lightning modules.")
    sub = parser.add_subcommands(dest="command")
    parsers = {name: DpflArgumentParser() for name in SUBCOMMANDS} if light else _subcommand_parsers()
    commands: dict[str, ArgumentParser] = {}
    for name, text in SUBCOMMANDS.items():
        sub.add_subcommand(name, parsers[name], help=text)
        commands[name] = parsers[name]
    if not light:
        commands.update({f"privacy {k}": v for k, v in add_privacy_subcommands(parsers["privacy"]).items()})
    parser.dpfl_subcommands = commands
    return parser


def parse_error_line(parser: ArgumentParser, argv: list[str], message: str) -> str:
    """The one line for a parse error (see :mod:`dpfl_lightning.cli_errors`)."""
    commands = getattr(parser, "dpfl_subcommands", {})
    words = [a for a in argv if not a.startswith("-")]
    command = next((f"{w} {n}" for w, n in zip(words, words[1:]) if f"{w} {n}" in commands), None) or \
        next((w for w in words if w in commands), "")
    sub = commands.get(command)
    options = sub.option_keys() if isinstance(sub, DpflArgumentParser) else []
    configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-c", "--config")]
    configs += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    line = cli_errors.one_line(message, command, options, [c for c in commands if " " not in c],
                               [c for c in configs if os.path.isfile(c)], argv)
    return f"{command}: {line}" if command else line


def expect_model_labels(model: Any, data: Any) -> None:
    """A classifier's ``num_classes`` bounds the labels: have the data check them when it is set up
    (one line naming the data and the setting) instead of failing mid-training."""
    hp = getattr(model, "hparams", None)
    n = hp.get("num_classes") if hasattr(hp, "get") else getattr(model, "num_classes", None)
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1 and hasattr(data, "expect_labels"):
        data.expect_labels(n, "model.init_args.num_classes")


def _split_defaults() -> dict[str, Any]:
    from dpfl_lightning.data.module import FederatedDataModule

    params = inspect.signature(FederatedDataModule.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def federated_data(data: Any, split: Any) -> Any:
    """``data`` as a :class:`FederatedDataModule`: a plain LightningDataModule is split over clients
    as ``split`` says (``FederatedDataModule.from_datamodule``); a FederatedDataModule is kept, and
    ``split`` options set for it are refused (it takes them in its own init_args)."""
    from dpfl_lightning.data.module import FederatedDataModule

    split = split.as_dict() if hasattr(split, "as_dict") else dict(split or {})
    if isinstance(data, FederatedDataModule):
        defaults = _split_defaults()
        changed = sorted(k for k, v in split.items() if k in defaults and v != defaults[k])
        require(not changed, f"split.{changed[0] if changed else ''}", split.get(changed[0]) if changed else None,
                f"split: applies to a plain LightningDataModule under data:, and {type(data).__name__} is split "
                "by its own init_args", f"set data.init_args.{changed[0] if changed else ''} instead")
        return data
    return FederatedDataModule.from_datamodule(data, **split)


def seed_model(section: Any) -> int | bool:
    """Seed the model's initialisation as ``seed_everything`` says (default ``trainer.seed``);
    returns the seed used (``False``: none)."""
    import lightning

    seed = section.seed_everything
    if seed is None:
        seed = section.trainer.seed
    if seed is False:
        return False
    return lightning.seed_everything(None if seed is True else int(seed), verbose=False)


def run_config_text(fit: ArgumentParser, section: Any, seed: int | bool) -> str:
    """The run's configuration as YAML that ``dpfl fit --config`` accepts: what was parsed, with
    ``seed_everything`` resolved, without the config files and checkpoint it was given."""
    ns = section.clone()
    for key in ("config", "ckpt_path", "resume", "__path__"):
        if key in ns:
            del ns[key]
    ns.seed_everything = seed
    return fit.dump(ns, skip_none=False, skip_check=True)


def _save_run_config(trainer: Any, text: str) -> None:
    """``config.yaml`` in the run's directory (rank 0; the directory exists once the loggers do)."""
    run_dir = getattr(trainer, "csv_log_dir", None)
    if not run_dir or not os.path.isdir(run_dir):
        return
    from dpfl_lightning.evaluation import CONFIG_FILE

    path = os.path.join(run_dir, CONFIG_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _sweep_logger(trainer: Any) -> None:
    """Under ``wandb agent`` (``WANDB_SWEEP_ID`` set) a run logs to W&B, or the sweep never sees its
    metric: add a :class:`~dpfl_lightning.loggers.WandbLogger` when the configuration has none."""
    if not os.environ.get("WANDB_SWEEP_ID"):
        return
    from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

    if any(isinstance(lg, LightningWandbLogger) for lg in trainer.extra_loggers):
        return
    from dpfl_lightning.loggers import WandbLogger

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
    from dpfl_lightning import evaluation

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
    from dpfl_lightning.comm import launched_with_mpi  # (torch: not for `dpfl --help`)

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
        if isinstance(nxt, (ConfigError, NonFiniteUpdateError)):
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
    from dpfl_lightning import evaluation

    argv = list(sys.argv[1:] if argv is None else argv)
    _search_working_directory()
    try:
        return parser.parse_args(evaluation.rewrite_arguments(argv))
    except argparse.ArgumentError as exc:
        _fail(parse_error_line(parser, argv, exc.message), EXIT_CONFIG)
    except ConfigError as exc:
        _fail(str(exc), EXIT_CONFIG)


def main(argv: list[str] | None = None) -> None:
    if list(sys.argv[1:] if argv is None else argv) in (["-h"], ["--help"]):
        build_parser(light=True).print_help()  # the subcommands' list, in a fraction of a second
        return
    parser = build_parser()
    cfg = parse(parser, argv)
    try:
        if cfg.command == "fit":
            run_fit(parser, cfg)
        elif cfg.command in ("validate", "test", "predict"):
            run_stage(parser, cfg, cfg.command)
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
        reported = errors.was_reported(exc) or errors.was_reported(cause)
        if isinstance(cause, ConfigError):
            _fail(str(cause), EXIT_CONFIG, reported)
        if isinstance(cause, NonFiniteUpdateError):
            _fail(str(cause), EXIT_FAILURE, reported)
        traceback.print_exc()
        _fail(f"{type(cause).__name__}: {cause}", EXIT_FAILURE, reported)


if __name__ == "__main__":  # pragma: no cover
    main()
