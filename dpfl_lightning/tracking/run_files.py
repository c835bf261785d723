"""What runs leave on disk, and reading it back: shared by ``fit``, ``dpfl validate | test | predict``,
``dpfl sweep`` and ``dpfl report``, and the short names of configuration keys.

A run named ``<run_name>`` under ``<log_dir>`` (its *root*, ``<log_dir>/<run_name>``) writes one
``version_N`` per fit, as Lightning's loggers do: ``metrics.csv``, ``hparams.yaml``, the CLI's
``config.yaml`` and ``checkpoints/`` (``round-XXXXXX.ckpt``, ``last.ckpt``, ``final.ckpt``), so a
second fit of the same name keeps the first one's files. A resumed fit continues the version of the
checkpoint it resumes. Runs written before checkpoints were per version kept them in
``<root>/checkpoints``; that place is still read (as older than every version)."""

from __future__ import annotations

import csv
import glob
import os
import re

import yaml

CHECKPOINTS = "checkpoints"
#: trainer settings that name, place, show or log a run and never change its model: a report groups
#: runs without them and a private selection never lists them among the hyperparameters it selected
#: (``eval_every`` is not among them: a ``ReduceLROnPlateau`` schedule follows the validations)
NOT_MODEL_SETTINGS = ("trainer.run_name", "trainer.log_dir", "trainer.checkpoint_dir", "trainer.checkpoint_every",
                      "trainer.final_checkpoint", "trainer.loggers", "trainer.enable_progress_bar",
                      "trainer.enable_summary", "trainer.num_threads", "trainer.log_client_metrics",
                      "trainer.eval_per_client", "trainer.test_after_fit")
LAST, FINAL = "last.ckpt", "final.ckpt"
_VERSION = re.compile(r"version_(\d+)")


def is_model_setting(key: str) -> bool:
    """False for a setting of :data:`NOT_MODEL_SETTINGS` (or a key below one), else True."""
    return not any(key == k or key.startswith(k + ".") for k in NOT_MODEL_SETTINGS)


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


# ---------------------------------------------------------------------------------------- run layout
def run_root(log_dir: str, run_name: str) -> str:
    """``<log_dir>/<run_name>``: where every version of the run lives."""
    return os.path.join(log_dir, run_name)


def versions(root: str) -> list[int]:
    """The ``N`` of every ``<root>/version_N`` directory, in increasing order."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_VERSION.fullmatch, os.listdir(root))
                  if m and os.path.isdir(os.path.join(root, m.group(0))))


def version_checkpoint_dir(root: str, version: int) -> str:
    """``<root>/version_N/checkpoints``: where version ``N`` writes its checkpoints."""
    return os.path.join(root, f"version_{version}", CHECKPOINTS)


def claim_version(root: str) -> int:
    """A new version of the run: the next ``N`` after every existing ``version_N`` (as Lightning's
    loggers count), its directory created here with ``os.mkdir``, which fails when another process
    took that ``N`` first; then the next one is tried. Two fits of one name never share a version."""
    os.makedirs(root, exist_ok=True)
    n = (versions(root) or [-1])[-1] + 1
    while True:
        try:
            os.mkdir(os.path.join(root, f"version_{n}"))
            return n
        except FileExistsError:
            n += 1


def checkpoint_version(path: str, root: str) -> int | None:
    """``N`` when the checkpoint ``path`` lies in ``<root>/version_N/checkpoints``, else ``None``."""
    directory = os.path.dirname(os.path.abspath(path))
    m = _VERSION.fullmatch(os.path.basename(os.path.dirname(directory)))
    if os.path.basename(directory) != CHECKPOINTS or m is None or not os.path.isdir(root):
        return None
    return int(m.group(1)) if os.path.samefile(os.path.dirname(os.path.dirname(directory)), root) else None


def newest_checkpoint(root: str, names: tuple[str, ...] = (LAST,), checkpoint_dir: str | None = None) -> str | None:
    """The first of ``names`` in ``checkpoint_dir`` when the run set one; else in the newest
    ``<root>/version_N/checkpoints`` that holds one of them, else in the shared ``<root>/checkpoints``
    of runs written before checkpoints were per version; ``None`` if there is none."""
    if checkpoint_dir is not None:
        places = [checkpoint_dir]
    else:
        places = [version_checkpoint_dir(root, n) for n in reversed(versions(root))] + [os.path.join(root, CHECKPOINTS)]
    for directory in places:
        for name in names:
            if os.path.isfile(os.path.join(directory, name)):
                return os.path.join(directory, name)
    return None
