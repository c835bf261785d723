"""Reading what runs left on disk (``<run>/version_N/metrics.csv`` and ``hparams.yaml``), and the short
names of configuration keys: shared by ``dpfl sweep`` and ``dpfl report``."""

from __future__ import annotations

import csv
import glob
import os
import re

import yaml


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


def is_private_run(run_dir: str) -> bool:
    """Whether the run in ``run_dir`` is a DP run (its ``hparams.yaml`` holds privacy settings);
    a run that wrote none (it failed early) counts as one. How long a DP run's rounds took depends
    on its cohorts' data, and no mechanism covers it: the sweep then records no duration or end time."""
    found = sorted(glob.glob(os.path.join(run_dir, "version_*", "hparams.yaml")))
    if not found:
        return True
    try:
        with open(found[-1]) as f:
            hparams = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return True
    return bool(hparams.get("privacy")) if isinstance(hparams, dict) else True


def final_metric(run_dir: str, metric: str | None) -> float | None:
    """The last logged value of ``metric`` in the newest ``version_N/metrics.csv`` of ``run_dir``."""
    if not metric:
        return None
    versions = sorted((d for d in os.listdir(run_dir) if re.fullmatch(r"version_\d+", d)),
                      key=lambda d: int(d.split("_")[1])) if os.path.isdir(run_dir) else []
    for d in reversed(versions):
        path = os.path.join(run_dir, d, "metrics.csv")
        if os.path.isfile(path):
            values = [row[metric] for row in read_metrics(path) if metric in row]
            return values[-1] if values else None
    return None


def short_keys(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix of each key that is unique among ``keys`` (``trainer.seed`` ->
    ``seed``, unless ``data.init_args.seed`` is also there)."""
    out = {}
    for k in keys:
        parts = [p for p in k.split(".") if p != "init_args"]
        for n in range(1, len(parts) + 1):
            cand = ".".join(parts[-n:])
            clash = [o for o in keys if o != k and ".".join([p for p in o.split(".") if p != "init_args"][-n:]) == cand]
            if not clash:
                out[k] = cand
                break
        else:
            out[k] = k
    return out
