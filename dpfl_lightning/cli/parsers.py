"""The ``dpfl`` command line's parsers: help text from the classes' docstrings, the ``fit`` parser
(also ``validate``, ``test``, ``predict``, ``privacy epsilon`` and ``audit``), the other subcommands'
parsers and the one-line report of a parse error. Building them runs nothing."""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

from dpfl_lightning.cli import parse_errors as cli_errors

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
    usage: :func:`main` turns them into one line (:mod:`dpfl_lightning.cli.parse_errors`)."""

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
_EPSILON_HELP = ("The epsilon a fit configuration would reach (the privacy ledger's guarantees after trainer.rounds), "
                 "without training: the configuration of dpfl fit.")
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


def add_privacy_subcommands(p: ArgumentParser, epsilon: bool = True) -> dict[str, ArgumentParser]:
    """``privacy epsilon | calibrate | plan | theory`` (jsonargparse wants the parent added first);
    returns their parsers by name. ``epsilon=False``: an empty ``epsilon`` parser (the others import
    nothing of torch or Lightning; ``epsilon`` builds the fit parser, which does)."""
    sub = p.add_subcommands(dest="privacy_command")
    eps = fit_parser() if epsilon else DpflArgumentParser()
    eps.description = _EPSILON_HELP
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
    plan.add_argument("--epsilon", type=float | None, default=None, help="the target (the rounds table)")
    plan.add_argument("--delta", type=float, required=True)
    plan.add_argument("--noise", type=list[float] | None, default=None,
                      help="noise multipliers, e.g. [10,20,40,80] (the rounds table)")
    plan.add_argument("--selection", type=str | None, default=None,
                      help="a dpfl fit config: instead of the rounds table, epsilon of the selected result of a "
                           "private-selection sweep of that run against the mean number of trials")
    plan.add_argument("--distribution", type=str, default="poisson",
                      help="--selection: the distribution of the number of trials")
    plan.add_argument("--shape", type=float | None, default=None, help="--selection: truncated_negative_binomial's")
    plan.add_argument("--means", type=list[float], default=[1, 2, 4, 8, 16, 32],
                      help="--selection: the mean numbers of trials shown")
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
    p.add_argument("--dry_run", type=bool, default=False,
                   help="print the commands, run nothing (a private selection: its plan and guarantee; nothing "
                        "drawn, trained or written)")
    p.add_argument("--private_selection", type=dict | None, default=None,
                   help="private selection (Papernot & Steinke): e.g. '{distribution: poisson, mean: 8}' (also "
                        "geometric, logarithmic, truncated_negative_binomial with shape); overrides the file's")
    p.add_argument("--target_epsilon", type=float | None, default=None,
                   help="private selection: calibrate the trials' noise (--noise_setting) so that the selected "
                        "result meets (target_epsilon, delta) including selection")
    p.add_argument("--delta", type=float | None, default=None,
                   help="private selection: the delta of the guarantee (default: the trials' ledger's)")
    p.add_argument("--noise_setting", type=str | None, default=None,
                   help="the setting --target_epsilon calibrates (default: trainer.algorithm.init_args.noise_multiplier)")
    p.add_argument("--wandb", type=bool, default=False,
                   help="private selection: create the W&B sweep and run `wandb agent --count K` with the drawn K "
                        "(the W&B server then learns K and every trial)")
    return p


def report_parser() -> ArgumentParser:
    p = DpflArgumentParser(description="Plots (PNG) and a Markdown table from the CSV logs of a set of runs.")
    p.add_argument("runs_dir", type=str, help="directory searched for <run>/version_N/metrics.csv "
                                              "(a sweep directory: its runs/)")
    p.add_argument("--metric", type=str | None, default=None,
                   help="metric(s) to report, comma-separated (default: the sweep's metric; else the first of "
                        "test_acc, val_acc, test_loss, val_loss, ... that was logged; else all). A metric with one "
                        "value in every run and round is tabled, not plotted")
    p.add_argument("--epsilon", type=str | None, default=None,
                   help="the guarantee(s) to plot against, comma-separated epsilon columns (epsilon, "
                        "epsilon_client_distributed_models, ...; default: every one the runs logged), or tuned: "
                        "the tuned result at the epsilon that includes its tuning (the default for a private "
                        "selection's release, whose guarantee its selection.json gives)")
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


PRIVACY_SUBCOMMANDS = ("epsilon", "calibrate", "plan", "theory")

#: the subcommands whose parser is built from the trainer's, the models' and the data modules'
#: signatures (importing torch and Lightning); the others' parsers import neither
SIGNATURE_PARSERS = ("fit", "validate", "test", "predict", "audit", "privacy epsilon")


def _subcommand_parser(name: str) -> ArgumentParser:
    if name in ("fit", "validate", "test", "predict"):
        return fit_parser(name)
    if name == "privacy":
        return DpflArgumentParser(description="Privacy accounting without training.")
    return {"sweep": sweep_parser, "report": report_parser, "audit": audit_parser}[name]()


def command_of(argv: list[str]) -> str:
    """The subcommand a command line names (``fit``, ``privacy calibrate``, ``privacy``), or ``""``:
    the first word if it is a subcommand, and for ``privacy`` the next word if it is one of its own."""
    if not argv or argv[0] not in SUBCOMMANDS:  # the top level has no options before the subcommand
        return ""
    if argv[0] == "privacy" and len(argv) > 1 and argv[1] in PRIVACY_SUBCOMMANDS:
        return f"privacy {argv[1]}"
    return argv[0]


def version() -> str:
    """The installed package's version (its metadata), or the source's when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("dpfl_lightning")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        from dpfl_lightning import __version__

        return __version__


def build_parser(light: bool = False, command: str | None = None) -> ArgumentParser:
    """The ``dpfl`` parser; ``parser.dpfl_subcommands`` maps each subcommand (``fit``,
    ``privacy calibrate``, ...) to its parser. ``light``: empty subcommands, enough for ``dpfl --help``
    and ``--version`` (nothing of the trainer, Lightning or the accountants is imported). ``command``
    (see :func:`command_of`): build that subcommand's parser only, the others empty, so that
    ``dpfl privacy calibrate`` or ``dpfl sweep`` import no torch and ``dpfl fit`` builds one
    signature parser, not six."""
    parser = DpflArgumentParser(prog="dpfl",
                                description="Differentially private federated learning on Lightning modules.")
    parser.add_argument("--version", action="version", version=f"dpfl_lightning {version()}",
                        help="print the installed dpfl_lightning version and exit")
    sub = parser.add_subcommands(dest="command")
    top = (command or "").split(" ")[0]
    full = {name for name in SUBCOMMANDS if not light and (command is None or name == top)}
    parsers = {name: _subcommand_parser(name) if name in full else DpflArgumentParser() for name in SUBCOMMANDS}
    commands: dict[str, ArgumentParser] = {}
    for name, text in SUBCOMMANDS.items():
        sub.add_subcommand(name, parsers[name], help=text)
        commands[name] = parsers[name]
    if "privacy" in full:
        built = add_privacy_subcommands(parsers["privacy"], epsilon=command in (None, "privacy epsilon"))
        commands.update({f"privacy {k}": v for k, v in built.items()})
    parser.dpfl_subcommands = commands
    return parser


def parse_error_line(parser: ArgumentParser, argv: list[str], message: str) -> str:
    """The one line for a parse error (see :mod:`dpfl_lightning.cli.parse_errors`)."""
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


def audit_parser() -> ArgumentParser:
    p = fit_parser()
    p.description = ("Audit a fit configuration with canary clients: the ledger's privacy curve tested against "
                     "what canaries show. Exit status 0 consistent, 3 violated (the ledger is refuted), 4 suspect "
                     "(the Gaussian fit's lower confidence bound lies above the ledger), 5 this audit cannot detect a "
                     "violation here (with the settings that would).")
    p.add_argument("--canaries", type=int | None, default=None,
                   help="canary clients of the one-run audit, each inserted with probability 1/2 "
                        "(default: min(1000, clients / 2); at most the number of clients)")
    p.add_argument("--trials", type=int | None, default=None,
                   help="many-run audit instead: N runs with one canary and N without, in secure mode")
    p.add_argument("--confidence", type=float, default=0.95, help="joint confidence of the lower bounds")
    return p
