"""A neighbouring-dataset harness: run one DP configuration on two datasets that differ in one
client's data and compare everything the run writes, except the released, accounted values.

The rule it tests is the release list's (:mod:`dpfl_lightning.federated.releases`): in a DP run nothing printed
or saved may depend on one client's data unless a mechanism accounts for it. :func:`written` runs a
fit and collects what an observer of the run gets:

- every warning (category and text), captured with ``simplefilter("always")``;
- stdout and stderr (the privacy statement, the summary, progress lines);
- the error's type and message when the fit fails;
- every file under the run's directory: ``metrics.csv`` (columns, which rows hold a value, and the
  values of public columns), ``hparams.yaml`` and ``config.yaml`` as written, and every checkpoint's
  entries (keys, types, shapes, and values except the released ones).

Released, accounted values are left out of the comparison (they are what the guarantee covers):
the model's parameters (``state_dict``, the flat global model) and the values of metrics a DP run
releases as ``noised`` or ``evaluation`` (their *presence* is still compared), and numbers on a
printed line that names such a metric. Everything else must be equal: :func:`differences` lists
what is not.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import yaml

#: metrics whose values are released and accounted in a DP run (noised statistics, evaluations of the
#: noised model); their values are masked, their presence compared
RELEASED_VALUES = re.compile(r"^(val_|test_|my_val_|unclipped_fraction$|clip_norm$|snr$|eta_g$|noise_std$)")
#: checkpoint entries that hold the released model, or state driven by noised releases only
RELEASED_ENTRIES = re.compile(r"(state_dict|global_params|params|max_norm|server_optimizer|momentum|ServerOptimizer)")
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


@dataclass
class Written:
    """Everything one fit wrote, in comparable form."""

    warnings: list[str] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    files: dict[str, Any] = field(default_factory=dict)


def _mask_line(line: str, released: set[str]) -> str:
    """A printed line with the numbers masked where it names a released metric (or a clock), and the
    padding of table cells and rules collapsed (a cell's width follows the widest released value)."""
    if any(key in line for key in released) or "elapsed" in line or re.search(r"\d+:\d\d:\d\d", line):
        line = _NUMBER.sub("#", line)
    return re.sub(r"([ ━─═])\1+", r"\1", line)


def _text(text: str, log_dir: str, released: set[str]) -> list[str]:
    text = text.replace(log_dir, "<log_dir>")
    return [_mask_line(line.rstrip(), released) for line in text.splitlines() if line.strip()]


def _csv(path: str) -> dict[str, Any]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    columns = list(rows[0]) if rows else []
    out = {"columns": columns, "rows": []}
    for row in rows:
        out["rows"].append({k: ("<released>" if v and RELEASED_VALUES.match(k) else v) for k, v in row.items()})
    return out


def _value(obj: Any, path: str, log_dir: str) -> Any:
    """A checkpoint entry in comparable form: released entries by type and shape only."""
    if isinstance(obj, dict):
        return {str(k): _value(v, f"{path}/{k}", log_dir) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_value(v, f"{path}/{i}", log_dir) for i, v in enumerate(obj)]
    if isinstance(obj, str):
        return obj.replace(log_dir, "<log_dir>")
    released = bool(RELEASED_ENTRIES.search(path) or RELEASED_VALUES.match(path.rsplit("/", 1)[-1]))
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), str(obj.dtype)) if released else ("tensor", obj.tolist())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__name__, _value(vars(obj), path, log_dir))
    if released and isinstance(obj, float):
        return ("float", "<released>")
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else repr(type(obj))


def _files(log_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for root, _, names in os.walk(log_dir):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, log_dir)
            if name.endswith(".csv"):
                out[rel] = _csv(path)
            elif name.endswith((".yaml", ".yml", ".txt", ".json", ".log")):
                with open(path) as f:
                    out[rel] = f.read().replace(log_dir, "<log_dir>")
            elif name.endswith(".ckpt"):
                out[rel] = _value(torch.load(path, map_location="cpu", weights_only=False), "", log_dir)
            else:
                out[rel] = "<file>"
    return out


def written(log_dir: str, fit: Callable[[str], Any]) -> Written:
    """What ``fit(log_dir)`` (one DP fit writing under ``log_dir``) writes: warnings, console, error, files."""
    out, err = io.StringIO(), io.StringIO()
    result = Written()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        try:
            fit(log_dir)
        except Exception as exc:  # noqa: BLE001 - an error message is a release too
            result.error = f"{type(exc).__name__}: {str(exc).replace(log_dir, '<log_dir>')}"
    files = _files(log_dir) if os.path.isdir(log_dir) else {}
    released = {c for f in files.values() if isinstance(f, dict) and "columns" in f for c in f["columns"]
                if RELEASED_VALUES.match(c)}
    result.files = files
    result.warnings = [f"{w.category.__name__}: {str(w.message).replace(log_dir, '<log_dir>')}" for w in caught]
    result.stdout = "\n".join(_text(out.getvalue(), log_dir, released))
    result.stderr = "\n".join(_text(err.getvalue(), log_dir, released))
    return result


def differences(a: Written, b: Written) -> list[str]:
    """What differs between two neighbours' runs (empty: nothing an observer could tell apart)."""
    found = []
    for name in ("warnings", "stdout", "stderr", "error"):
        if getattr(a, name) != getattr(b, name):
            found.append(f"{name}: {getattr(a, name)!r} != {getattr(b, name)!r}")
    for path in sorted(set(a.files) | set(b.files)):
        fa, fb = a.files.get(path, "<missing>"), b.files.get(path, "<missing>")
        if fa != fb:
            found.append(f"{path}: {_first_difference(fa, fb)}")
    return found


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k, "<missing>") != b.get(k, "<missing>"):
                return _first_difference(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{where}/{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}[{i}]")
    return f"{where}: {str(a)[:300]} != {str(b)[:300]}"
