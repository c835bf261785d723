"""``dpfl report RUNS_DIR``: plots and a table from the CSV logs of a set of runs.

Every ``metrics.csv`` below ``RUNS_DIR`` is a run (for a sweep's directory, the ones under its
``runs/``), with the ``hparams.yaml`` next to it. Runs are grouped by their configuration minus the
seeds (every ``seed`` key and ``seed_everything``, and what only names, places, shows or logs a run:
run name, log and checkpoint directories, loggers, threads, progress bar, ...:
``run_files.NOT_MODEL_SETTINGS``). Only distinct seeds are averaged:
of runs of a group with the same seeds (the same configuration run twice) the newest counts, and
the table says which were left out. Written to ``--out`` (default ``RUNS_DIR/report``), each file
named after what it plots:

- ``<metric>_vs_round.png``: the metric over rounds, one line per run, one colour per group. A
  metric logged only once per run (``test_acc`` after the last round) is drawn over rounds from its
  ``val_`` counterpart, in ``val_<name>_vs_round.png``;
- ``<epsilon column>_vs_round.png``: every epsilon the privacy ledger logged (``epsilon``, the
  run's main guarantee, and ``epsilon_<guarantee>`` for the others) over rounds;
- ``<metric>_vs_<epsilon column>.png``: the privacy-utility curve: each run's metric against that
  epsilon as training goes on, and each group's final point (mean and standard deviation over
  seeds);
- ``summary.md``: the final value of each metric and of every epsilon the ledger logged (the last
  logged value), mean and standard deviation (sample, ``n - 1``) over the distinct seeds of each
  group, then one row per run.

The metrics: ``--metric``, else the sweep's own (its ``sweep.yaml``, a private selection's
``selection.json``), else the first of :data:`PREFERRED` logged, else every one logged. A metric
with one value in every run and round (a clip norm or noise level the settings fix) is not plotted:
its plots would be flat lines; the tables keep it, and ``summary.md`` says it was left out.

Every epsilon axis and column says which guarantee it is: granularity, audience ("towards the
server", "towards anyone who sees the models") and delta, from the privacy settings each run saved
in its ``hparams.yaml``.

A private selection's release (``dpfl sweep``'s ``SWEEP/released``, the sweep's directory, or a
folder below ``released/runs``) is reported with the guarantee of the private selection, read from
its ``selection.json``: ``summary.md`` says it first, with the selected hyperparameters, and the
metric is plotted against it (``<metric>_vs_epsilon_tuned.png``), not against the released run's
own ledger, which leaves the selection out (its columns only when ``--epsilon`` names them).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import textwrap
from dataclasses import dataclass, field
from typing import Any

import yaml

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.tracking.run_files import is_model_setting, read_metrics, short_keys

SELECTION = "selection.json"  # what a private-selection sweep releases with its run (tracking.private_sweep)
#: default metric: the first of these that any run logged (else every metric)
PREFERRED = ("test_acc", "val_acc", "test_accuracy", "val_accuracy", "accuracy", "acc", "test_loss", "val_loss",
             "suboptimality", "loss")
_BOOKKEEPING = ("round", "step", "round_time_s", "clients", "skipped_clients")
#: the longest label a plot shows (a legend entry, a line of an axis label): a mixed directory's
#: configurations differ in many settings, and their full labels would run off the image; longer
#: ones are numbered and cut with an ellipsis (the full text in summary.md, under its number)
LABEL_MAX = 60


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _is_seed_key(key: str) -> bool:
    parts = [p for p in key.split(".") if p != "init_args"]
    return bool(parts) and parts[-1] in ("seed", "seed_everything")


def _is_run_key(key: str) -> bool:
    """A key that names, places or shows a run rather than defines it: a seed, a setting that never
    changes the model (:data:`~dpfl_lightning.tracking.run_files.NOT_MODEL_SETTINGS`), the privacy
    statement the run wrote of itself."""
    return _is_seed_key(key) or not is_model_setting(key) or key == "privacy" or key.startswith("privacy.")


@dataclass
class Run:
    """One run's log: its rows, its configuration (flattened), its seeds and group key.
    ``repeat_of``: the label of the newer run of its group with the same seeds (then this run is
    not averaged)."""

    label: str
    path: str
    rows: list[dict[str, float]]
    config: dict[str, Any]
    seeds: dict[str, Any] = field(default_factory=dict)
    group: str = ""
    repeat_of: str | None = None
    shown_seeds: list[str] = field(default_factory=list)  # the seed keys that differ between runs

    @property
    def seed(self) -> str:
        """The run's seeds for a table: those that differ between the runs reported (``trainer.seed``
        when none does), one value when they agree (``0``), else ``key=value`` each."""
        keys = self.shown_seeds or [k for k in ("trainer.seed",) if k in self.seeds] or sorted(self.seeds)[:1]
        values = {json.dumps(self.seeds.get(k), default=str) for k in keys}
        if len(values) <= 1:
            return str(self.seeds.get(keys[0])) if keys else "None"
        return ", ".join(f"{k.replace('.init_args', '')}={self.seeds.get(k)}" for k in keys)

    def guarantee(self, column: str) -> str | None:
        """Which guarantee the epsilon ``column`` is: granularity, audience and delta (from the
        privacy settings in ``hparams.yaml``), e.g. ``client-level, towards the server, delta=1e-06``."""
        info = f"privacy.epsilons.{column}."
        towards, granularity = self.config.get(info + "towards"), self.config.get(info + "granularity")
        delta = self.config.get(info + "delta", self.config.get("privacy.delta"))
        if towards is None:  # runs logged before the epsilon columns were described: the statement's lines
            lines = self.config.get("privacy.guarantees")
            if column != "epsilon" or not isinstance(lines, list) or not lines:
                return None
            m = re.search(r"towards ([^;(]+)", lines[0])
            towards = f"towards {m.group(1).strip()}" if m else None
            granularity = "record" if lines[0].startswith("record") else "client"
        parts = [f"{granularity}-level" if granularity else "", towards or "", f"delta={delta:g}"
                 if isinstance(delta, (int, float)) else ""]
        return ", ".join(p for p in parts if p) or None

    def series(self, metric: str) -> list[tuple[float, float]]:
        """``(round, value)`` of every round that logged ``metric``."""
        return [(r.get("round", r.get("step", i + 1)), r[metric]) for i, r in enumerate(self.rows) if metric in r]

    def final(self, metric: str) -> float | None:
        values = [r[metric] for r in self.rows if metric in r]
        return values[-1] if values else None

    @property
    def rounds(self) -> int:
        rs = [r.get("round", r.get("step", 0)) for r in self.rows]
        return int(max(rs)) if rs else 0


@dataclass
class Group:
    """Runs of one configuration; ``label`` says what sets it apart (in full), ``short`` is what a
    plot shows (``label``, or ``[3] ...`` when some group's label is longer than :data:`LABEL_MAX`)."""

    key: str
    label: str
    runs: list[Run] = field(default_factory=list)
    short: str = ""

    @property
    def counted(self) -> list[Run]:
        """The runs averaged: one per distinct set of seeds."""
        return [r for r in self.runs if r.repeat_of is None]

    def mark_repeats(self) -> None:
        """Of runs with the same seeds, keep the newest (its ``metrics.csv`` last written)."""
        newest: dict[str, Run] = {}
        for run in sorted(self.runs, key=lambda r: os.path.getmtime(r.path), reverse=True):
            key = json.dumps(run.seeds, sort_keys=True, default=str)
            if key in newest:
                run.repeat_of = newest[key].label
            else:
                newest[key] = run


@dataclass
class Release:
    """What a private-selection sweep released (``released/``, as ``dpfl sweep`` writes it):
    ``directory`` and its ``selection.json`` (the selected result's guarantee, metric and
    hyperparameters)."""

    directory: str
    selection: dict[str, Any]

    @property
    def guarantee(self) -> dict[str, Any]:
        return self.selection["guarantee"]

    def line(self) -> str:
        """The guarantee of what is released, said once for the report."""
        g = self.guarantee
        return (f"guarantee of the private selection: epsilon = {g['epsilon_selected']:.4g} at delta = "
                f"{g['delta']:g} ({g['granularity']}-level, {g['audience']}; the selection included)")


def private_release(runs_dir: str) -> Release | None:
    """The release of a private-selection sweep that ``runs_dir`` is (the sweep's directory, its
    ``released/``) or lies in (``released/runs``, ``released/runs/selected``, ...); ``None`` otherwise."""
    here = os.path.realpath(runs_dir)
    places = [os.path.join(runs_dir, "released"), runs_dir]
    up = runs_dir
    for _ in range(4):
        up = os.path.join(up, os.pardir)
        places.append(up)
    for place in places:
        path = os.path.join(place, SELECTION)
        inside = os.path.realpath(os.path.join(place, "runs"))
        if not os.path.isfile(path) or not (place in places[:2] or here == inside
                                            or here.startswith(inside + os.sep)):
            continue
        try:
            with open(path) as f:
                selection = json.load(f)
            selection["guarantee"]["epsilon_selected"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError("report RUNS_DIR", runs_dir, f"{path} is not a private selection's selection.json "
                              f"({type(exc).__name__}: {exc})", "report the released/ folder dpfl sweep "
                              "wrote, unchanged") from exc
        return Release(os.path.normpath(place), selection)
    return None


def _runs_root(runs_dir: str, release: Release | None) -> str:
    """Where the runs of ``runs_dir`` lie: a private selection's ``released/runs`` (or the part of
    it asked for), a plain sweep's ``runs/``, else ``runs_dir`` itself."""
    if release is not None:
        root = os.path.join(release.directory, "runs")
        if not os.path.isdir(root):
            raise ConfigError("report RUNS_DIR", runs_dir, "is a private-selection sweep that released nothing "
                              f"(see {os.path.join(release.directory, 'summary.md')})", "report another sweep")
        here = os.path.realpath(runs_dir)
        return runs_dir if here.startswith(os.path.realpath(root) + os.sep) else root
    if os.path.isfile(os.path.join(runs_dir, "sweep.yaml")) and os.path.isdir(os.path.join(runs_dir, "runs")):
        return os.path.join(runs_dir, "runs")
    return runs_dir


def find_runs(runs_dir: str) -> list[Run]:
    """Every run below ``runs_dir`` (a sweep directory: below its ``runs/``; a private selection's
    sweep directory or ``released/``: below ``released/runs``)."""
    if not os.path.isdir(runs_dir):
        raise ConfigError("report RUNS_DIR", runs_dir, "no such directory", "give the directory holding the runs")
    root = _runs_root(runs_dir, private_release(runs_dir))
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("wandb", "checkpoints", "report"))
        if "metrics.csv" in filenames:
            found.append(os.path.join(dirpath, "metrics.csv"))
    runs = []
    names = [os.path.relpath(os.path.dirname(p), root) for p in found]
    parents = [os.path.dirname(n) for n in names]
    for path, name, parent in zip(found, names, parents):
        base = os.path.basename(name)
        label = parent if re.fullmatch(r"version_\d+", base) and parents.count(parent) == 1 and parent else name
        hp_path = os.path.join(os.path.dirname(path), "hparams.yaml")
        config: dict[str, Any] = {}
        if os.path.isfile(hp_path):
            with open(hp_path) as f:
                loaded = yaml.safe_load(f)
            config = _flatten(loaded) if isinstance(loaded, dict) else {}
        rows = read_metrics(path)
        if not rows:
            continue
        seeds = {k: v for k, v in config.items() if _is_seed_key(k)}
        runs.append(Run(label=label.replace(os.sep, "/"), path=path, rows=rows, config=config, seeds=seeds))
    if not runs:
        raise ConfigError("report RUNS_DIR", runs_dir, "holds no metrics.csv with rows",
                          "point it at a log_dir of dpfl fit runs or a dpfl sweep directory")
    return runs


def _value_label(key: str, value: Any) -> str:
    if isinstance(value, str) and re.fullmatch(r"[\w.]+\.[A-Z]\w*", value):
        return value.rsplit(".", 1)[-1]
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=str)
    return str(value)


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs grouped by configuration minus the seed; each group labelled by the settings that
    differ between groups (``algorithm=DPNormFedAvg, scale=50``), sorted by label (numbers as
    numbers), its runs by seed."""

    def defining(run: Run) -> dict[str, Any]:
        return {k: v for k, v in run.config.items() if not _is_run_key(k)}

    seed_keys = sorted({k for r in runs for k in r.seeds})
    varying_seeds = [k for k in seed_keys if len({json.dumps(r.seeds.get(k), default=str) for r in runs}) > 1]
    groups: dict[str, Group] = {}
    for run in runs:
        run.shown_seeds = varying_seeds
        key = json.dumps(defining(run), sort_keys=True, default=str)
        run.group = key
        groups.setdefault(key, Group(key=key, label="")).runs.append(run)
    configs = [defining(g.runs[0]) for g in groups.values()]
    keys = sorted({k for c in configs for k in c})
    varying = [k for k in keys if len({json.dumps(c.get(k, "<unset>"), default=str) for c in configs}) > 1]
    names = {k: k.rsplit(".", 1)[0] if k.endswith(".class_path") else k for k in varying}
    short = short_keys(list(dict.fromkeys(names.values())))
    for g, c in zip(groups.values(), configs):
        parts = [f"{short[names[k]]}={_value_label(k, c[k])}" for k in varying if k in c]
        g.label = ", ".join(parts) if parts else (g.runs[0].label if len(groups) > 1 else "all runs")
        g.runs.sort(key=lambda r: _natural(f"{r.seed}/{r.label}"))
        g.mark_repeats()
    ordered = sorted(groups.values(), key=lambda g: _natural(g.label))
    for g, short in zip(ordered, short_labels([g.label for g in ordered])):
        g.short = short
    return ordered


def short_labels(labels: list[str], limit: int = LABEL_MAX) -> list[str]:
    """``labels`` as they are when each fits ``limit`` characters; else every one numbered
    (``[1] ``, ``[2] ``, ...: the key to its full text) and cut to ``limit`` with an ellipsis."""
    if all(len(label) <= limit for label in labels):
        return list(labels)
    out = []
    for i, label in enumerate(labels, 1):
        tag = f"[{i}] "
        room = limit - len(tag)
        out.append(tag + (label if len(label) <= room else label[:room - 1].rstrip(" ,") + "…"))
    return out


def _natural(text: str) -> list[Any]:
    """Sort key reading numbers as numbers (``steps=2`` before ``steps=16``)."""
    parts: list[Any] = []
    for tok in re.split(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)", text):
        try:
            parts.append((0, float(tok), ""))
        except ValueError:
            parts.append((1, 0.0, tok))
    return parts


def select_metrics(runs: list[Run], requested: str | list[str] | None = None, sweep_metric: str | None = None) -> list[str]:
    """``requested`` (comma-separated or a list), else the sweep's metric when it was logged, else
    the first of :data:`PREFERRED` that was logged, else every logged metric but bookkeeping and
    epsilon."""
    logged: list[str] = []
    for run in runs:
        for row in run.rows:
            logged.extend(k for k in row if k not in logged)
    if requested:
        return _requested("report --metric", requested, logged,
                          ", ".join(k for k in logged if k not in _BOOKKEEPING))
    for m in ([sweep_metric] if sweep_metric else []) + list(PREFERRED):
        if m in logged:
            return [m]
    return [k for k in logged if k not in _BOOKKEEPING and not k.startswith("epsilon")]


def constant_metrics(runs: list[Run], metrics: list[str]) -> dict[str, float]:
    """The metrics of ``metrics`` logged more than once (over rounds and runs) with one value every
    time (a clip norm, a noise level the settings fix), and that value: a plot of them is a flat
    line, so they are not plotted (the tables keep them)."""
    out = {}
    for m in metrics:
        values = [row[m] for r in runs for row in r.rows if m in row]
        if len(values) > 1 and len({v for v in values if v == v}) == 1 and all(v == v for v in values):
            out[m] = values[0]
    return out


def epsilon_columns(runs: list[Run], requested: str | list[str] | None = None) -> list[str]:
    """The epsilon columns to report: ``requested`` (comma-separated or a list), else every one
    logged (``epsilon`` first)."""
    logged = sorted({k for r in runs for row in r.rows for k in row if k == "epsilon" or k.startswith("epsilon_")},
                    key=lambda k: (k != "epsilon", k))
    if not requested:
        return logged
    return _requested("report --epsilon", requested, logged,
                      ", ".join(logged) or "(none: the runs have no privacy ledger)")


def _requested(setting: str, requested: str | list[str], logged: list[str], choices: str) -> list[str]:
    """The names in ``requested`` (comma-separated or a list); each must be among ``logged``."""
    names = [m.strip() for m in (requested.split(",") if isinstance(requested, str) else requested) if m.strip()]
    missing = [m for m in names if m not in logged]
    if missing:
        raise ConfigError(setting, ",".join(missing), "not logged by any run", f"use one of {choices}")
    return names


def guarantee_label(runs: list[Run], column: str) -> str:
    """What the epsilon ``column`` of these runs is (see :meth:`Run.guarantee`); says so when the
    runs' guarantees differ."""
    labels = sorted({g for g in (r.guarantee(column) for r in runs if r.series(column)) if g})
    if len(labels) == 1:
        return labels[0]
    if not labels:
        return "guarantee not recorded"
    return "the guarantee differs between runs: see summary.md"


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``None`` for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def _cell(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    mean, std = mean_std(values)
    return f"{mean:.4g}" if std is None else f"{mean:.4g} ± {std:.2g}"


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def release_markdown(release: Release) -> list[str]:
    """What a report of a private selection's release says first: the guarantee of what is released
    and the selected hyperparameters (never a setting that does not change the model)."""
    info = release.selection
    lines = [f"Released by a private selection ({os.path.join(release.directory, SELECTION)}): "
             f"**{release.line()}**. The run's own epsilon columns leave the selection out: they are not the "
             "guarantee of what is released.", ""]
    params = {k: v for k, v in (info.get("parameters") or {}).items() if is_model_setting(k)}
    if info.get("result") == "selected" and params:
        selected, calibrated = info.get("selected"), info.get("calibrated", [])
        how = {k: "calibrated" if k in calibrated else "selected" if selected is None or k in selected else "fixed"
               for k in params}
        lines += [f"Hyperparameters of the selected result (the best trial by `{info.get('metric')}`, goal "
                  f"{info.get('goal')}):", "", "| parameter | value | |", "|---|---|---|"]
        lines += [f"| {_md_escape(k)} | {_md_escape(json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v))}"
                  f" | {how[k]} |" for k, v in params.items()] + [""]
    return lines


def summary_markdown(runs_dir: str, groups: list[Group], metrics: list[str], eps: list[str] | None = None,
                     release: Release | None = None, constants: dict[str, float] | None = None) -> str:
    """The Markdown table of final values (see the module docstring); ``release``: the private
    selection whose release the runs are (its guarantee and hyperparameters first); ``constants``:
    the metrics not plotted for having one value (:func:`constant_metrics`)."""
    runs = [r for g in groups for r in g.runs]
    eps = epsilon_columns(runs) if eps is None else eps
    cols = ["rounds"] + [k for k in eps if k not in metrics] + metrics
    repeats = [r for r in runs if r.repeat_of is not None]
    lines = [f"# Report: {runs_dir}", ""] + (release_markdown(release) if release is not None else [])
    lines += [(f"{len(runs)} run(s) in {len(groups)} configuration(s). Final values (the last logged value of each "
               "run); mean ± sample standard deviation over the distinct seeds of a configuration."), ""]
    if eps:
        own = " (the run's own ledger, the selection left out)" if release is not None else ""
        lines += ["Epsilon columns (which guarantee each is):", ""]
        lines += [f"- `{k}`: {guarantee_label(runs, k)}{own}" for k in eps] + [""]
    if constants:
        lines += ["Not plotted (one value in every run and round): "
                  + ", ".join(f"`{k}` = {v:.4g}" for k, v in constants.items()) + ".", ""]
    if repeats:
        lines += [f"Not averaged (the same seeds as a newer run of their configuration): "
                  f"{', '.join(f'{r.label} (as {r.repeat_of})' for r in repeats)}.", ""]
    if any(g.short != g.label for g in groups):
        lines += ["Configurations (as the plots and the tables below number them):", ""]
        lines += [f"- {_md_escape(g.short.split(' ', 1)[0])} {_md_escape(g.label)}" for g in groups] + [""]
    lines += ["| configuration | seeds | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for g in groups:
        counted = g.counted
        seeds = ", ".join(r.seed for r in counted)
        rounds = {r.rounds for r in counted}
        cells = [str(rounds.pop()) if len(rounds) == 1 else _cell([float(r.rounds) for r in counted])]
        cells += [_cell([r.final(m) for r in counted]) for m in cols[1:]]
        left_out = len(g.runs) - len(counted)
        extra = f" +{left_out} repeated" if left_out else ""
        lines.append(f"| {_md_escape(g.short)} | {len(counted)} ({seeds}){extra} | " + " | ".join(cells) + " |")
    lines += ["", "## Runs", "", "| run | configuration | seed | " + " | ".join(cols) + " |",
              "|---|---|---|" + "---|" * len(cols)]
    for g in groups:
        for r in g.runs:
            cells = [str(r.rounds)] + [("-" if r.final(m) is None else f"{r.final(m):.4g}") for m in cols[1:]]
            seed = r.seed + (" (repeat: not averaged)" if r.repeat_of else "")
            lines.append(f"| {_md_escape(r.label)} | {_md_escape(g.short)} | {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- plots
def _plot_metric(runs: list[Run], metric: str) -> tuple[str, str | None]:
    """The metric to draw over rounds for ``metric`` (its ``val_`` twin when it is logged once)."""
    if all(len(r.series(metric)) <= 1 for r in runs) and metric.startswith("test_"):
        twin = "val_" + metric[len("test_"):]
        if any(len(r.series(twin)) > 1 for r in runs):
            return twin, f"{twin} vs round ({metric} is logged only after the last round)"
    return metric, None


def _colors(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _legend(ax: Any, n: int) -> None:
    if n > 1:
        ax.legend(fontsize="small", loc="best", frameon=False)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _epsilon_axis(runs: list[Run], column: str, note: str = "") -> str:
    """An epsilon axis label: the column, then its guarantee (and ``note``) in lines of at most
    :data:`LABEL_MAX`."""
    return f"{column}\n" + textwrap.fill(f"({guarantee_label(runs, column)}{note})", LABEL_MAX, break_long_words=False)


class _Figures:
    """Figures written to ``out`` as PNG, each once."""

    def __init__(self, out: str) -> None:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        self.plt, self.out, self.written = plt, out, []

    def new(self) -> tuple[Any, Any]:
        return self.plt.subplots(figsize=(7.5, 4.8))

    def save(self, fig: Any, name: str) -> None:
        path = os.path.join(self.out, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        self.plt.close(fig)
        if path not in self.written:
            self.written.append(path)


def _lines(ax: Any, groups: list[Group], colors: list[Any], x_of: Any, y: str, style: str = "o-",
           faint: bool = False) -> None:
    """One line per run (``x_of(run, y)`` gives its points), one colour per group, labelled once
    per group unless ``faint`` (then thin and pale: the training path behind final points)."""
    for g, c in zip(groups, colors):
        for i, r in enumerate(g.runs):
            pts = x_of(r, y)
            if not pts:
                continue
            alpha = (0.35 if faint else 0.85) * (1.0 if r.repeat_of is None else 0.4)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=c, ms=3, lw=0.8 if faint else 1.2,
                    alpha=alpha, label=g.short if i == 0 and not faint else None)


def _over_rounds(r: Run, y: str) -> list[tuple[float, float]]:
    return r.series(y)


def _final_points(ax: Any, groups: list[Group], colors: list[Any], column: str, metric: str) -> None:
    for g, c in zip(groups, colors):
        finals = [(r.final(column), r.final(metric)) for r in g.counted]
        finals = [(e, m) for e, m in finals if e is not None and m is not None]
        if finals:
            (ex, exs), (my, mys) = mean_std([e for e, _ in finals]), mean_std([m for _, m in finals])
            ax.errorbar([ex], [my], xerr=[exs or 0.0], yerr=[mys or 0.0], fmt="o", color=c, ms=6, capsize=3,
                        label=g.short)


def write_plots(groups: list[Group], metrics: list[str], out: str, eps: list[str] | None = None,
                own_ledger: bool = False) -> list[str]:
    """The plots over rounds and against each epsilon column (see the module docstring);
    ``own_ledger``: the runs are a private selection's release, whose columns leave the selection
    out (their axes say so)."""
    own = "; the run's own ledger, the selection left out" if own_ledger else ""
    figures = _Figures(out)
    colors = _colors(len(groups))
    runs = [r for g in groups for r in g.runs]
    eps = epsilon_columns(runs) if eps is None else eps
    for metric in metrics:
        shown, note = _plot_metric(runs, metric)
        fig, ax = figures.new()
        _lines(ax, groups, colors, _over_rounds, shown)
        ax.set(xlabel="round", ylabel=shown, title=note or f"{shown} vs round")
        ax.grid(alpha=0.3)
        _legend(ax, len(groups))
        figures.save(fig, f"{_safe(shown)}_vs_round.png")
    for column in eps:
        fig, ax = figures.new()
        _lines(ax, groups, colors, _over_rounds, column, "-")
        ax.set(xlabel="round", ylabel=_epsilon_axis(runs, column, own), title=f"{column} vs round (privacy ledger)")
        ax.grid(alpha=0.3)
        _legend(ax, len(groups))
        figures.save(fig, f"{_safe(column)}_vs_round.png")
        for metric in metrics:
            shown, _ = _plot_metric(runs, metric)

            def along(r: Run, y: str, column: str = column) -> list[tuple[float, float]]:
                at = dict(r.series(column))
                pts = [(at[x], v) for x, v in r.series(y) if x in at]
                return pts if len(pts) > 1 else []

            fig, ax = figures.new()
            _lines(ax, groups, colors, along, shown, "-", faint=True)
            _final_points(ax, groups, colors, column, metric)
            ax.set(xlabel=_epsilon_axis(runs, column, own), ylabel=metric)
            title = f"final {metric} (mean ± std over seeds) vs {column}"
            if shown != metric:
                title += f"\nlines: {shown} during training"
            ax.set_title(title, fontsize="medium")
            ax.grid(alpha=0.3)
            _legend(ax, len(groups))
            figures.save(fig, f"{_safe(metric)}_vs_{_safe(column)}.png")
    return figures.written


def write_report(runs_dir: str, metric: str | list[str] | None = None, out: str | None = None,
                 epsilon: str | list[str] | None = None, privacy: Any = None) -> dict[str, Any]:
    """Write the plots and ``summary.md``; returns ``{"plots": [...], "table": path, "metrics": [...],
    "epsilons": [...], "groups": [...], "privacy": ...}``.

    ``privacy(runs, runs_dir)`` (``dpfl report`` passes ``cli.sweep_command.report_privacy``) gives the
    epsilons of what the sweep releases (:func:`privacy_markdown`); ``epsilon`` may then name
    ``tuned``: the tuned result placed at the epsilon that includes its tuning (:func:`plot_tuned`),
    and only there when it names no epsilon column besides. A private selection's release (the
    sweep's directory, its ``released/`` or a folder in it: :func:`private_release`) carries the
    guarantee its ``selection.json`` gives, which the report says first and, unless ``epsilon``
    names columns, is the only epsilon it plots against (``tuned``)."""
    release = private_release(runs_dir) if os.path.isdir(runs_dir) else None
    runs = find_runs(runs_dir)
    sweep_name, goal = sweep_metric(runs_dir, release)
    metrics = select_metrics(runs, metric, sweep_name)
    constants = constant_metrics(runs, metrics)
    plotted = [m for m in metrics if m not in constants]
    names = [e.strip() for e in (epsilon.split(",") if isinstance(epsilon, str) else epsilon or []) if e.strip()]
    if release is not None and not names:  # what is released carries the selection's guarantee, not the run's
        names = ["tuned"]
    tuned = "tuned" in names
    columns = [e for e in names if e != "tuned"]
    eps = epsilon_columns(runs, columns) if columns else [] if tuned else epsilon_columns(runs)
    groups = group_runs(runs)
    out = out or os.path.join(runs_dir, "report")
    os.makedirs(out, exist_ok=True)
    plots = write_plots(groups, plotted, out, eps, own_ledger=release is not None)
    section = release_privacy(release) if release is not None else privacy(runs, runs_dir) if privacy else None
    if tuned:
        if section is None:
            raise ConfigError("report --epsilon", "tuned", "needs the runs' privacy (DP runs, planned by dpfl report)",
                              "report a sweep of DP runs with dpfl report")
        if plotted:
            plots += [plot_tuned(groups, plotted, out, section, goal)]
    table = os.path.join(out, "summary.md")
    with open(table, "w") as f:
        f.write(summary_markdown(runs_dir, groups, metrics, eps, release, constants)
                + (privacy_markdown(section) if section else ""))
    return {"plots": plots, "table": table, "metrics": metrics, "epsilons": eps, "groups": groups, "privacy": section}


def sweep_metric(runs_dir: str, release: Release | None = None) -> tuple[str | None, str]:
    """The sweep's metric and goal: a private selection's (its ``selection.json``), else a sweep
    directory's ``sweep.yaml``'s ``metric``; ``(None, "maximize")`` when there is none."""
    metric: Any = {"name": release.selection.get("metric"), "goal": release.selection.get("goal")} if release else {}
    if release is None:
        try:
            with open(os.path.join(runs_dir, "sweep.yaml")) as f:
                metric = (yaml.safe_load(f) or {}).get("metric") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            metric = {}
    if not isinstance(metric, dict):
        metric = {}
    name = metric.get("name")
    return (name if isinstance(name, str) and name else None), ("minimize" if metric.get("goal") == "minimize"
                                                               else "maximize")


def release_privacy(release: Release) -> dict[str, Any]:
    """The privacy section of a private selection's release, read from its ``selection.json`` (no
    run is planned again): the selected result's guarantee, and for comparison one run and a grid."""
    g = release.guarantee
    return {"runs": 1, "delta": g["delta"], "audience": f"{g['granularity']}-level, {g['audience']}",
            "one_run": g["epsilon_one_run"], "all_runs": g["epsilon_all_runs"], "grid_runs": g["grid_runs"],
            "selected": g["epsilon_selected"], "tuned": g["epsilon_selected"], "release": release.line()}


def privacy_markdown(section: dict[str, Any]) -> str:
    """The section of ``summary.md`` that says what the sweep's release costs: the selected result of
    a private selection (the guarantee of what it releases), one run, every run composed (each at its
    delta, towards whom)."""
    lines = ["", "## Privacy of what the sweep releases", "",
             f"{section['audience']}, delta={section['delta']:g}, dp_accounting:", "",
             "| what is released | epsilon |", "|---|---|"]
    if "selected" in section:
        lines += [f"| the selected result: guarantee of the private selection (the selection included) | "
                  f"{section['selected']:.4g} |",
                  f"| one run of the space (its own ledger, the selection left out) | {section['one_run']:.4g} |",
                  f"| every run of a grid of {section['grid_runs']} runs (the mean number of trials), composed | "
                  f"{section['all_runs']:.4g} |",
                  "", "`--epsilon tuned` (the default for a private selection) places the selected result at the "
                  "guarantee of the private selection."]
    else:
        lines += [f"| one run (its own ledger) | {section['one_run']:.4g} |",
                  f"| all {section['runs']} runs (or the best of them, chosen by looking at all), composed | "
                  f"{section['all_runs']:.4g} |",
                  "", "`--epsilon tuned` places the tuned result at the last of these."]
    return "\n".join(lines) + "\n"


def plot_tuned(groups: list[Group], metrics: list[str], out: str, section: dict[str, Any], goal: str) -> str:
    """``<metric>_vs_epsilon_tuned.png``: every configuration's final metric at one run's epsilon,
    and the tuned result (the best configuration by the metric's goal) at the epsilon that includes
    its tuning (``section["tuned"]``)."""
    figures = _Figures(out)
    metric = metrics[0]
    selection = "selected" in section
    colors = _colors(len(groups))
    fig, ax = figures.new()
    finals = []
    for g, c in zip(groups, colors):
        values = [r.final(metric) for r in g.counted if r.final(metric) is not None]
        if values:
            mean = statistics.fmean(values)
            finals.append(mean)
            ax.plot([section["one_run"]], [mean], "o", color=c, alpha=0.5, label=f"{g.short} (one run)" if not
                    selection else "one run of the space, its own ledger (the selection left out)")
    if finals:
        best = max(finals) if goal == "maximize" else min(finals)
        ax.plot([section["tuned"]], [best], "*", color="black", ms=14, label="tuned result (tuning included)" if not
                selection else "selected result: guarantee of the private selection")
    ax.set(xlabel=f"epsilon (delta={section['delta']:g}, {section['audience']})", ylabel=metric,
           title=f"final {metric}: one run vs the tuned result at its epsilon" if not selection else
           f"final {metric} of the selected result at the guarantee of the private selection")
    ax.grid(alpha=0.3)
    _legend(ax, 2)
    name = f"{_safe(metric)}_vs_epsilon_tuned.png"
    figures.save(fig, name)
    return os.path.join(out, name)


def run_from_cli(cfg: Any, privacy: Any = None) -> None:
    result = write_report(cfg.runs_dir, cfg.metric, cfg.out, cfg.epsilon, privacy)
    with open(result["table"]) as f:
        print(f.read())
    print(f"wrote {result['table']}")
    for p in result["plots"]:
        print(f"wrote {p}")
