"""``dpfl report RUNS_DIR``: plots and a table from the CSV logs of a set of runs.

Every ``metrics.csv`` below ``RUNS_DIR`` is a run (for a sweep's directory, the ones under its
``runs/``), with the ``hparams.yaml`` next to it. Runs are grouped by their configuration minus the
seed (every ``seed`` key, and what only names or places a run: run name, log and checkpoint
directories, loggers, threads, progress bar). Written to ``--out`` (default ``RUNS_DIR/report``):

- ``<metric>_vs_round.png``: the metric over rounds, one line per run, one colour per group;
- ``epsilon_vs_round.png``: the privacy ledger's epsilon over rounds;
- ``<metric>_vs_epsilon.png``: the privacy-utility curve: each run's metric against its epsilon
  as training goes on, and each group's final point (mean and standard deviation over seeds);
- ``summary.md``: the final value of each metric and of every epsilon the ledger logged (the
  last logged value), mean and standard deviation (sample, ``n - 1``) over the seeds of each
  group, then one row per run.

A metric logged only once per run (``test_acc`` after the last round) is drawn over rounds from its
``val_`` counterpart when there is one; the table always uses the metric itself.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

import yaml

from dpfl_lightning.errors import ConfigError

#: default metric: the first of these that any run logged (else every metric)
PREFERRED = ("test_acc", "val_acc", "test_accuracy", "val_accuracy", "accuracy", "acc", "test_loss", "val_loss",
             "suboptimality", "loss")
_BOOKKEEPING = ("round", "step", "round_time_s", "clients", "skipped_clients")
#: configuration keys that name or place a run rather than define it (besides any ``seed``)
_NOT_CONFIG = ("trainer.run_name", "trainer.log_dir", "trainer.checkpoint_dir", "trainer.checkpoint_every",
               "trainer.loggers", "trainer.enable_progress_bar", "trainer.enable_summary", "trainer.num_threads",
               "privacy")


def read_metrics(path: str) -> list[dict[str, float]]:
    """The rows of a ``metrics.csv`` as ``{column: float}`` without empty cells, one per round
    (sorted; a round logged twice keeps its last row)."""
    by_round: dict[float, dict[str, float]] = {}
    extra: list[dict[str, float]] = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values: dict[str, float] = {}
            for k, v in row.items():
                if k is None or v in (None, ""):
                    continue
                try:
                    values[k] = float(v)
                except ValueError:
                    continue
            r = values.get("round", values.get("step"))
            if r is None:
                extra.append(values)
            else:
                by_round[r] = values
    return [by_round[r] for r in sorted(by_round)] + extra


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _is_run_key(key: str) -> bool:
    parts = [p for p in key.split(".") if p != "init_args"]
    if parts and parts[-1] == "seed":
        return True
    return any(key == k or key.startswith(k + ".") for k in _NOT_CONFIG)


@dataclass
class Run:
    """One run's log: its rows, its configuration (flattened), its seed and group key."""

    label: str
    path: str
    rows: list[dict[str, float]]
    config: dict[str, Any]
    seed: Any = None
    group: str = ""

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
    key: str
    label: str
    runs: list[Run] = field(default_factory=list)


def find_runs(runs_dir: str) -> list[Run]:
    """Every run below ``runs_dir`` (a sweep directory: below its ``runs/``)."""
    if not os.path.isdir(runs_dir):
        raise ConfigError("report RUNS_DIR", runs_dir, "no such directory", "give the directory holding the runs")
    root = runs_dir
    if os.path.isfile(os.path.join(runs_dir, "sweep.yaml")) and os.path.isdir(os.path.join(runs_dir, "runs")):
        root = os.path.join(runs_dir, "runs")
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
        seed = config.get("trainer.seed")
        runs.append(Run(label=label.replace(os.sep, "/"), path=path, rows=rows, config=config, seed=seed))
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
    from dpfl_lightning.sweep import _short_keys

    def defining(run: Run) -> dict[str, Any]:
        return {k: v for k, v in run.config.items() if not _is_run_key(k)}

    groups: dict[str, Group] = {}
    for run in runs:
        key = json.dumps(defining(run), sort_keys=True, default=str)
        run.group = key
        groups.setdefault(key, Group(key=key, label="")).runs.append(run)
    configs = [defining(g.runs[0]) for g in groups.values()]
    keys = sorted({k for c in configs for k in c})
    varying = [k for k in keys if len({json.dumps(c.get(k, "<unset>"), default=str) for c in configs}) > 1]
    names = {k: k.rsplit(".", 1)[0] if k.endswith(".class_path") else k for k in varying}
    short = _short_keys(list(dict.fromkeys(names.values())))
    for g, c in zip(groups.values(), configs):
        parts = [f"{short[names[k]]}={_value_label(k, c[k])}" for k in varying if k in c]
        g.label = ", ".join(parts) if parts else (g.runs[0].label if len(groups) > 1 else "all runs")
        g.runs.sort(key=lambda r: _natural(f"{r.seed}/{r.label}"))
    return sorted(groups.values(), key=lambda g: _natural(g.label))


def _natural(text: str) -> list[Any]:
    """Sort key reading numbers as numbers (``steps=2`` before ``steps=16``)."""
    parts: list[Any] = []
    for tok in re.split(r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)", text):
        try:
            parts.append((0, float(tok), ""))
        except ValueError:
            parts.append((1, 0.0, tok))
    return parts


def select_metrics(runs: list[Run], requested: str | list[str] | None = None) -> list[str]:
    """``requested`` (comma-separated or a list), else the first of :data:`PREFERRED` that was
    logged, else every logged metric but bookkeeping and epsilon."""
    logged: list[str] = []
    for run in runs:
        for row in run.rows:
            logged.extend(k for k in row if k not in logged)
    if requested:
        names = [m.strip() for m in (requested.split(",") if isinstance(requested, str) else requested) if m.strip()]
        missing = [m for m in names if m not in logged]
        if missing:
            raise ConfigError("report --metric", ",".join(missing), "not logged by any run",
                              f"use one of {', '.join(k for k in logged if k not in _BOOKKEEPING)}")
        return names
    for m in PREFERRED:
        if m in logged:
            return [m]
    return [k for k in logged if k not in _BOOKKEEPING and not k.startswith("epsilon")]


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


def summary_markdown(runs_dir: str, groups: list[Group], metrics: list[str]) -> str:
    """The Markdown table of final values (see the module docstring)."""
    logged = {k for g in groups for r in g.runs for row in r.rows for k in row}
    eps = (["epsilon"] if "epsilon" in logged else []) + sorted(k for k in logged if k.startswith("epsilon_"))
    cols = ["rounds"] + [k for k in eps if k not in metrics] + metrics
    n_runs = sum(len(g.runs) for g in groups)
    lines = [f"# Report: {runs_dir}", "",
             (f"{n_runs} run(s) in {len(groups)} configuration(s). Final values (the last logged value of each "
              "run); mean ± sample standard deviation over the seeds of a configuration."), "",
             "| configuration | seeds | " + " | ".join(cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for g in groups:
        seeds = sorted({str(r.seed) for r in g.runs})
        rounds = {r.rounds for r in g.runs}
        cells = [str(rounds.pop()) if len(rounds) == 1 else _cell([float(r.rounds) for r in g.runs])]
        cells += [_cell([r.final(m) for r in g.runs]) for m in cols[1:]]
        lines.append(f"| {_md_escape(g.label)} | {len(g.runs)} ({', '.join(seeds)}) | " + " | ".join(cells) + " |")
    lines += ["", "## Runs", "", "| run | configuration | seed | " + " | ".join(cols) + " |",
              "|---|---|---|" + "---|" * len(cols)]
    for g in groups:
        for r in g.runs:
            cells = [str(r.rounds)] + [("-" if r.final(m) is None else f"{r.final(m):.4g}") for m in cols[1:]]
            lines.append(f"| {_md_escape(r.label)} | {_md_escape(g.label)} | {r.seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- plots
def _plot_metric(runs: list[Run], metric: str) -> tuple[str, str | None]:
    """The metric to draw over rounds for ``metric`` (its ``val_`` twin when it is logged once)."""
    if all(len(r.series(metric)) <= 1 for r in runs) and metric.startswith("test_"):
        twin = "val_" + metric[len("test_"):]
        if any(len(r.series(twin)) > 1 for r in runs):
            return twin, f"{twin} ({metric} is logged only after the last round)"
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


def write_plots(groups: list[Group], metrics: list[str], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    written: list[str] = []
    colors = _colors(len(groups))
    runs = [r for g in groups for r in g.runs]
    has_eps = any(r.series("epsilon") for r in runs)

    def save(fig: Any, name: str) -> None:
        path = os.path.join(out, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    for metric in metrics:
        shown, note = _plot_metric(runs, metric)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for g, c in zip(groups, colors):
            for i, r in enumerate(g.runs):
                s = r.series(shown)
                if s:
                    ax.plot([x for x, _ in s], [y for _, y in s], "o-", color=c, ms=3, lw=1.2, alpha=0.85,
                            label=g.label if i == 0 else None)
        ax.set_xlabel("round")
        ax.set_ylabel(shown)
        ax.set_title(note or f"{shown} vs round")
        ax.grid(alpha=0.3)
        _legend(ax, len(groups))
        save(fig, f"{_safe(metric)}_vs_round.png")

    if has_eps:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for g, c in zip(groups, colors):
            for i, r in enumerate(g.runs):
                s = r.series("epsilon")
                if s:
                    ax.plot([x for x, _ in s], [y for _, y in s], "-", color=c, lw=1.2, alpha=0.85,
                            label=g.label if i == 0 else None)
        ax.set_xlabel("round")
        ax.set_ylabel("epsilon")
        ax.set_title("epsilon vs round (privacy ledger)")
        ax.grid(alpha=0.3)
        _legend(ax, len(groups))
        save(fig, "epsilon_vs_round.png")

        for metric in metrics:
            shown, _ = _plot_metric(runs, metric)
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for g, c in zip(groups, colors):
                for r in g.runs:
                    eps = {x: y for x, y in r.series("epsilon")}
                    pts = [(eps[x], y) for x, y in r.series(shown) if x in eps]
                    if len(pts) > 1:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=c, lw=0.8, alpha=0.4)
                finals = [(r.final("epsilon"), r.final(metric)) for r in g.runs]
                finals = [(e, m) for e, m in finals if e is not None and m is not None]
                if finals:
                    (ex, exs), (my, mys) = mean_std([e for e, _ in finals]), mean_std([m for _, m in finals])
                    ax.errorbar([ex], [my], xerr=[exs or 0.0], yerr=[mys or 0.0], fmt="o", color=c, ms=6, capsize=3,
                                label=g.label)
            ax.set_xlabel("epsilon")
            ax.set_ylabel(metric)
            title = f"{metric} vs epsilon: final mean ± std over seeds"
            if shown != metric:
                title += f"; lines: {shown} during training"
            ax.set_title(title, fontsize="medium")
            ax.grid(alpha=0.3)
            _legend(ax, len(groups))
            save(fig, f"{_safe(metric)}_vs_epsilon.png")
    return written


def write_report(runs_dir: str, metric: str | list[str] | None = None, out: str | None = None) -> dict[str, Any]:
    """Write the plots and ``summary.md``; returns ``{"plots": [...], "table": path, "metrics": [...],
    "groups": [...]}``."""
    runs = find_runs(runs_dir)
    metrics = select_metrics(runs, metric)
    groups = group_runs(runs)
    out = out or os.path.join(runs_dir, "report")
    os.makedirs(out, exist_ok=True)
    plots = write_plots(groups, metrics, out)
    table = os.path.join(out, "summary.md")
    with open(table, "w") as f:
        f.write(summary_markdown(runs_dir, groups, metrics))
    return {"plots": plots, "table": table, "metrics": metrics, "groups": groups}


def run_from_cli(cfg: Any) -> None:
    result = write_report(cfg.runs_dir, cfg.metric, cfg.out)
    with open(result["table"]) as f:
        print(f.read())
    print(f"wrote {result['table']}")
    for p in result["plots"]:
        print(f"wrote {p}")
