"""``dpfl sweep SWEEP.yaml``: every configuration of a W&B sweep file as its own run, no W&B server
needed; the same file works with ``wandb sweep SWEEP.yaml`` + ``wandb agent`` when there is one.

The file is W&B's sweep format::

    name: lr-grid                   # optional; default: the file name
    method: grid                    # grid or random (bayes needs the W&B server)
    metric: {name: test_acc, goal: maximize}   # optional; shown in the table of runs
    run_cap: 20                     # random: how many runs (or --count)
    program: dpfl_lightning/__main__.py
    command:                        # a block list: ${...} is not allowed inside [...] in YAML
      - ${env}
      - ${interpreter}
      - -m
      - dpfl_lightning
      - fit
      - --config
      - configs/quickstart.yaml
      - ${args}
    parameters:
      trainer.seed: {values: [0, 1, 2]}
      model.init_args.lr: {distribution: log_uniform_values, min: 0.01, max: 1.0}
      trainer.rounds: {value: 20}

Parameter names are ``dpfl fit`` options: ``${args}`` turns them into ``--trainer.seed=1`` and so on,
after ``--config``, so every MPI rank parses the same values. A value may be a mapping, merged
into that section (``trainer: {values: [{local_steps: 1, rounds: 40}, {local_steps: 2, rounds: 20}]}``
varies two settings together), or a ``class_path``/``init_args`` mapping. Values are written as
``wandb agent`` writes them (``str(value)``), except ``null`` (the agent writes ``None``, which
``dpfl fit`` refuses: leave such parameters out of sweeps meant for the agent).

Supported: ``value``, ``values`` (with optional ``probabilities``), and the distributions
``constant``, ``categorical``, ``int_uniform``, ``uniform``, ``q_uniform``, ``log_uniform`` (min/max
are natural logs), ``log_uniform_values``, ``q_log_uniform_values``, ``normal``, ``q_normal``,
``log_normal``, ``q_log_normal``. Macros of ``command``: ``${env}``, ``${interpreter}`` (this Python;
``python -m mpi4py`` under ``--mpi``), ``${program}``, ``${args}``, ``${args_no_hyphens}``,
``${args_no_equals}``, ``${args_no_boolean_flags}``, ``${args_json}``, ``${args_json_file}``,
``${args_append_hydra}``, ``${args_override_hydra}`` and ``${envvar:NAME}``; without ``command``,
W&B's default ``${env} ${interpreter} ${program} ${args}``.

Under ``wandb sweep`` + ``wandb agent`` the agent runs the same command (``${interpreter}`` is
``python``) with ``WANDB_SWEEP_ID``, ``WANDB_RUN_ID`` and ``WANDB_SWEEP_PARAM_PATH`` set; the run's
:class:`~dpfl_lightning.tracking.loggers.WandbLogger` then joins the agent's W&B run, which is where the
sweep reads its ``metric`` (the last logged value). The shipped base configurations have one
(``dpfl fit`` adds one under an agent when a configuration has none).

The sweep's directory (``--dir``, default ``sweeps/<name>``) holds ``runs/<run>/version_0/``
(``--trainer.log_dir`` and ``--trainer.run_name`` are appended to each command; the run name is
made from the values of the parameters that vary, e.g. ``local_steps=2_rounds=40_seed=1``),
``logs/<run>.log`` (each run's console output), ``done/<run>.json`` (a run that exited 0) and
``failed/<run>.json``; these and the table of runs give a run's duration and end time only when it
is not a DP run (:func:`is_private_run`: how long its rounds took depends on its cohorts' data). Rerunning the sweep skips the runs in ``done/`` (unless their parameters
changed) and retries the failed ones: a failure is often the machine's (killed, out of memory),
and one that is not fails again in seconds and is reported again. A retried run's partial
directory is moved to ``failed/<run>.attempt<k>`` first (a finished run that is rerun because its
parameters changed: to ``old/<run>.<k>``), so ``runs/`` only holds the logs of the sweep's
current runs (what ``dpfl report`` reads). Each run's W&B run is named after it and
grouped under the sweep's name (``WANDB_RUN_GROUP``); ``project``/``entity`` of the file become
``WANDB_PROJECT``/``WANDB_ENTITY`` unless already set.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.tracking.run_files import final_metric, is_private_run, short_keys
from dpfl_lightning.tracking.sweep_privacy import metric_refusal
from dpfl_lightning.federated.placement import available_cpus

METHODS = ("grid", "random")
DISTRIBUTIONS = ("constant", "categorical", "int_uniform", "uniform", "q_uniform", "log_uniform", "log_uniform_values",
                 "q_log_uniform_values", "normal", "q_normal", "log_normal", "q_log_normal")
DEFAULT_COMMAND = ["${env}", "${interpreter}", "${program}", "${args}"]
_MACRO = re.compile(r"^\$\{([a-z_]+)\}$")
_ENVVAR = re.compile(r"\$\{envvar:([A-Za-z0-9_]*)\}")
_SAFE = re.compile(r"[^A-Za-z0-9._=+-]+")
MAX_NAME = 100


@dataclass
class Sweep:
    """A parsed, checked sweep file."""

    path: str
    name: str
    method: str
    parameters: dict[str, dict[str, Any]]
    command: list[str]
    program: str | None = None
    run_cap: int | None = None
    metric: str | None = None
    project: str | None = None
    entity: str | None = None
    notes: list[str] = field(default_factory=list)
    goal: str = "maximize"
    private_selection: Any = None  # the file's private_selection mapping (checked by private_sweep)


def _err(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"sweep {key}", value, problem, fix)


def _check_parameter(name: str, spec: Any, method: str) -> dict[str, Any]:
    where = f"parameters.{name}"
    if not isinstance(spec, dict):
        raise _err(where, spec, "must be a mapping", "write e.g. {values: [1, 2]} or {value: 3}")
    if "parameters" in spec:
        raise _err(where, "parameters", "nested parameters are not supported",
                   f"name the options with dots instead, e.g. {name}.rounds: {{values: [...]}}")
    spec = dict(spec)
    dist = spec.get("distribution")
    if dist is None:
        if "value" in spec:
            dist = "constant"
        elif "values" in spec:
            dist = "categorical"
        elif "min" in spec and "max" in spec:
            both_int = all(isinstance(spec[k], int) and not isinstance(spec[k], bool) for k in ("min", "max"))
            dist = "int_uniform" if both_int else "uniform"
        else:
            raise _err(where, spec, "has no value, values, or distribution with min/max",
                       "give value, values, or distribution + min + max")
        spec["distribution"] = dist
    if dist not in DISTRIBUTIONS:
        raise _err(where, dist, "this distribution is not supported by dpfl sweep",
                   f"use one of {', '.join(DISTRIBUTIONS)}")
    if dist == "constant" and "value" not in spec:
        raise _err(where, spec, "constant needs value", "add value: ...")
    if dist == "categorical":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise _err(where, values, "values must be a non-empty list", "write values: [a, b, ...]")
        probs = spec.get("probabilities")
        if probs is not None and (not isinstance(probs, list) or len(probs) != len(values)
                                  or any(not isinstance(p, (int, float)) or p < 0 for p in probs) or sum(probs) <= 0):
            raise _err(where, probs, "probabilities must be one non-negative number per value",
                       "give as many probabilities as values, or leave them out")
    if dist not in ("constant", "categorical"):
        if method == "grid":
            raise _err(where, dist, "a grid needs value or values (W&B's grid refuses distributions too)",
                       "list the values, or use method: random")
        if dist in ("normal", "q_normal", "log_normal", "q_log_normal"):
            for k, default in (("mu", 0.0), ("sigma", 1.0)):
                spec.setdefault(k, default)
                if not isinstance(spec[k], (int, float)) or isinstance(spec[k], bool):
                    raise _err(f"{where}.{k}", spec[k], "must be a number", f"set {k} to a number")
            if spec["sigma"] <= 0:
                raise _err(f"{where}.sigma", spec["sigma"], "must be > 0", "set sigma > 0")
        else:
            for k in ("min", "max"):
                if not isinstance(spec.get(k), (int, float)) or isinstance(spec.get(k), bool):
                    raise _err(f"{where}.{k}", spec.get(k), f"{dist} needs numeric min and max", "set min and max")
            if spec["min"] > spec["max"]:
                raise _err(where, [spec["min"], spec["max"]], "min is larger than max", "swap min and max")
            if dist in ("log_uniform_values", "q_log_uniform_values") and spec["min"] <= 0:
                raise _err(f"{where}.min", spec["min"], f"{dist} needs min > 0",
                           "set min > 0 (or use log_uniform, whose min/max are natural logs)")
            if dist == "int_uniform" and not all(isinstance(spec[k], int) for k in ("min", "max")):
                raise _err(where, [spec["min"], spec["max"]], "int_uniform needs integer min and max",
                           "use integers, or distribution: uniform")
        if dist.startswith("q_"):
            q = spec.setdefault("q", 1)
            if not isinstance(q, (int, float)) or isinstance(q, bool) or q <= 0:
                raise _err(f"{where}.q", q, "must be a number > 0", "set q > 0")
    return spec


def load_sweep(path: str) -> Sweep:
    """Read and check a sweep file; every problem is one :class:`ConfigError` naming the key."""
    if not os.path.isfile(path):
        raise _err("file", path, "no such file", "give the path of a sweep YAML file")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise _err("file", path, f"is not readable YAML ({' '.join(str(e).split())[:200]})", "fix the YAML") from e
    if not isinstance(raw, dict):
        raise _err("file", path, "is not a mapping of sweep keys", "write method:, parameters:, command: ...")
    method = raw.get("method")
    if method == "bayes":
        raise _err("method", method, "Bayesian search needs the W&B server",
                   "use method grid or random here, or run the file with wandb sweep + wandb agent")
    if method not in METHODS:
        raise _err("method", method, "unknown or missing search method", "set method: grid or method: random")
    params = raw.get("parameters")
    if not isinstance(params, dict) or not params:
        raise _err("parameters", params, "must be a non-empty mapping", "list the parameters to vary")
    checked = {str(k): _check_parameter(str(k), v, method) for k, v in params.items()}
    program = raw.get("program")
    command = raw.get("command")
    if command is None:
        if not program:
            raise _err("command", None, "neither command nor program is set",
                       "add a command list: ${env}, ${interpreter}, -m, dpfl_lightning, fit, --config, BASE.yaml, "
                       "${args} (one item per line)")
        command = list(DEFAULT_COMMAND)
    if not isinstance(command, list) or not command or not all(isinstance(c, (str, int, float)) for c in command):
        raise _err("command", command, "must be a list of strings", "write command: as a list, one item per line")
    command = [str(c) for c in command]
    if "${program}" in command and not program:
        raise _err("program", None, "the command uses ${program} but program is not set", "set program:")
    run_cap = raw.get("run_cap")
    if run_cap is not None and (not isinstance(run_cap, int) or run_cap < 1):
        raise _err("run_cap", run_cap, "must be a positive integer", "set run_cap: N")
    metric = raw.get("metric")
    metric_name = metric.get("name") if isinstance(metric, dict) else None
    goal = metric.get("goal", "maximize") if isinstance(metric, dict) else "maximize"
    if goal not in ("maximize", "minimize"):
        raise _err("metric.goal", goal, "unknown goal", "set goal: maximize or goal: minimize")
    name = str(raw.get("name") or os.path.splitext(os.path.basename(path))[0])
    notes = []
    if raw.get("early_terminate"):
        notes.append("early_terminate is a W&B server feature: dpfl sweep runs every configuration to the end")
    return Sweep(path=path, name=_SAFE.sub("-", name).strip("-") or "sweep", method=method, parameters=checked,
                 command=command, program=program, run_cap=run_cap, metric=metric_name,
                 project=raw.get("project"), entity=raw.get("entity"), notes=notes, goal=goal,
                 private_selection=raw.get("private_selection"))


# ---------------------------------------------------------------------------------------- configurations
def _quantize(x: float, q: float) -> float | int:
    v = round(x / q) * q
    if isinstance(q, int) or float(q).is_integer():
        return round(v)
    return float(v)


def _draw(spec: dict[str, Any], rng: Any) -> Any:
    dist = spec["distribution"]
    if dist == "constant":
        return spec["value"]
    if dist == "categorical":
        values, probs = spec["values"], spec.get("probabilities")
        p = None if probs is None else [x / sum(probs) for x in probs]
        return values[int(rng.choice(len(values), p=p))]
    lo, hi = spec.get("min"), spec.get("max")
    if dist == "int_uniform":
        return int(rng.integers(lo, hi + 1))
    if dist == "uniform":
        return float(rng.uniform(lo, hi))
    if dist == "q_uniform":
        return _quantize(rng.uniform(lo, hi), spec["q"])
    if dist == "log_uniform":
        return float(math.exp(rng.uniform(lo, hi)))
    if dist == "log_uniform_values":
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    if dist == "q_log_uniform_values":
        return _quantize(math.exp(rng.uniform(math.log(lo), math.log(hi))), spec["q"])
    mu, sigma = spec["mu"], spec["sigma"]
    if dist == "normal":
        return float(rng.normal(mu, sigma))
    if dist == "q_normal":
        return _quantize(rng.normal(mu, sigma), spec["q"])
    if dist == "log_normal":
        return float(math.exp(rng.normal(mu, sigma)))
    return _quantize(math.exp(rng.normal(mu, sigma)), spec["q"])  # q_log_normal


def configurations(sweep: Sweep, count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The parameter sets of the sweep, in order: the grid's product (last parameter fastest), or
    ``count`` (default ``run_cap``) random draws seeded by ``seed`` -- the same list every time, so
    a rerun finds the runs it already did. Duplicates (same values) appear once."""
    names = list(sweep.parameters)
    if sweep.method == "grid":
        axes = [[s["value"]] if s["distribution"] == "constant" else list(s["values"])
                for s in sweep.parameters.values()]
        configs = [dict(zip(names, combo)) for combo in itertools.product(*axes)]
        if count is not None:
            configs = configs[:count]
    else:
        import numpy as np

        n = count if count is not None else sweep.run_cap
        if n is None:
            raise _err("run_cap", None, "a random search needs a number of runs", "set run_cap: N or pass --count N")
        rng = np.random.default_rng(seed)
        configs = [{k: _draw(s, rng) for k, s in sweep.parameters.items()} for _ in range(n)]
    unique: dict[str, dict[str, Any]] = {}
    for c in configs:  # the same values once (by value, not by the lossy run name)
        unique.setdefault(_fingerprint(c), c)
    return list(unique.values())


def _fingerprint(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=repr)


def run_names(configs: list[dict[str, Any]], constant: tuple[str, ...] | list[str] = ()) -> list[str]:
    """:func:`run_name` of each configuration, made distinct: a configuration whose name an earlier
    one already took (values that differ only in characters a directory name cannot hold) gets a
    hash of its parameters appended."""
    names, taken = [], set()
    for c in configs:
        name = run_name(c, constant)
        if name in taken:
            name = f"{name[: MAX_NAME - 9]}-{hashlib.sha1(_fingerprint(c).encode()).hexdigest()[:8]}"
        taken.add(name)
        names.append(name)
    return names


# ---------------------------------------------------------------------------------------- names and commands
def _value_slug(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict):
        if "class_path" in v:
            head = str(v["class_path"]).rsplit(".", 1)[-1]
            args = v.get("init_args") or {}
            return head + "".join(f"-{k}{_value_slug(x)}" for k, x in args.items())
        return "-".join(f"{k}{_value_slug(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return "+".join(_value_slug(x) for x in v)
    s = str(v)
    if re.fullmatch(r"[\w.]+\.[A-Z]\w*", s):  # a class path: its class name
        s = s.rsplit(".", 1)[-1]
    elif "/" in s:  # a file: its name
        s = os.path.splitext(os.path.basename(s.rstrip("/")))[0]
    return s


def _tokens(key: str, v: Any) -> list[str]:
    """``key=value`` parts of a run name; a mapping value gives one part per entry (a
    ``class_path`` mapping: ``key=ClassName`` and its ``init_args``)."""
    if isinstance(v, dict) and "class_path" in v:
        return [f"{key}={_value_slug(v['class_path'])}"] + [f"{k}={_value_slug(x)}" for k, x in
                                                             (v.get("init_args") or {}).items()]
    if isinstance(v, dict):
        return [f"{k}={_value_slug(x)}" for k, x in v.items()]
    return [f"{key}={_value_slug(v)}"]


def run_name(params: dict[str, Any], constant: tuple[str, ...] | list[str] = ()) -> str:
    """A directory-safe name made from the parameter values (those in ``constant``, the same for
    every run, left out), e.g. ``local_steps=5_seed=1``; names longer than 100 characters are cut
    and end with a hash of all the parameters."""
    varying = {k: v for k, v in params.items() if k not in constant} or params
    short = short_keys(list(varying))
    name = "_".join(t for k, v in varying.items() for t in _tokens(short[k], v))
    name = _SAFE.sub("-", name).strip("-_") or "run"
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:8]
        name = name[: MAX_NAME - 9].rstrip("-_=") + "-" + digest
    return name


def constant_parameters(sweep: Sweep) -> list[str]:
    """Parameters with a single value: left out of run names."""
    return [k for k, s in sweep.parameters.items()
            if s["distribution"] == "constant" or (s["distribution"] == "categorical" and len(s["values"]) == 1)]


def format_value(v: Any) -> str:
    """A value as ``wandb agent`` writes it into ``--name=value`` (``str``), ``None`` as ``null``."""
    return "null" if v is None else str(v)


def _macros(params: dict[str, Any], sweep: Sweep, json_file: str | None, mpi: int | None) -> dict[str, list[str]]:
    flags = [f"{k}={format_value(v)}" for k, v in params.items()]
    no_bool = [f"--{k}" if v is True else f"--{k}={format_value(v)}" for k, v in params.items() if v is not False]
    interpreter = [sys.executable, "-m", "mpi4py"] if mpi else [sys.executable]
    return {
        "env": ["/usr/bin/env"] if os.name != "nt" and os.path.exists("/usr/bin/env") else [],
        "interpreter": interpreter,
        "program": [sweep.program] if sweep.program else [],
        "args": ["--" + f for f in flags],
        "args_no_hyphens": flags,
        "args_no_equals": [x for k, v in params.items() for x in (f"--{k}", format_value(v))],
        "args_no_boolean_flags": no_bool,
        "args_json": [json.dumps(params, default=str)],
        "args_json_file": [json_file] if json_file else [],
        "args_append_hydra": ["+" + f for f in flags],
        "args_override_hydra": ["++" + f for f in flags],
    }


def build_command(sweep: Sweep, params: dict[str, Any], *, mpi: int | None = None, log_dir: str | None = None,
                  name: str | None = None, json_file: str | None = None) -> list[str]:
    """The command line of one run: the sweep's ``command`` with its macros filled in, under
    ``mpiexec -n MPI`` when ``mpi`` is set, followed by ``--trainer.log_dir`` / ``--trainer.run_name``
    when given."""
    macros = _macros(params, sweep, json_file, mpi)
    out: list[str] = []
    for chunk in sweep.command:
        chunk = _ENVVAR.sub(lambda m: os.environ.get(m.group(1), m.group(1)), chunk)
        m = _MACRO.match(chunk)
        if m:
            if m.group(1) not in macros:
                raise _err("command", chunk, "unknown macro", f"use one of {', '.join('${' + k + '}' for k in macros)}")
            out.extend(macros[m.group(1)])
        else:
            out.append(chunk)
    if log_dir is not None:
        out.append(f"--trainer.log_dir={log_dir}")
    if name is not None:
        out.append(f"--trainer.run_name={name}")
    if mpi:
        mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
        if mpiexec is None:
            raise ConfigError("--mpi", mpi, "no mpiexec on PATH", "install an MPI (pip install mpich) or drop --mpi")
        out = [mpiexec, "-n", str(mpi), *out]
    return out


# ---------------------------------------------------------------------------------------- running
@dataclass
class RunResult:
    """One configuration's outcome; ``seconds`` is ``None`` for a DP run (see :func:`is_private_run`)."""

    name: str
    params: dict[str, Any]
    status: str  # done, skipped (done before), failed, dry-run
    seconds: float | None = None
    returncode: int | None = None
    message: str = ""
    metric: float | None = None
    refused: str = ""  # why the sweep's metric may not select among DP runs (see sweep_privacy)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _last_error_line(log_path: str) -> str:
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("dpfl: error") or "Error" in ln.split(":", 1)[0]]
    return (errors or lines or [""])[-1][:300]


def _threads(jobs: int, mpi: int | None) -> int:
    return max(1, available_cpus() // (jobs * (mpi or 1)))


def environment(sweep: Sweep, jobs: int, mpi: int | None) -> dict[str, str]:
    """The runs' environment: W&B group / project / entity from the sweep, threads per run."""
    env = dict(os.environ)
    env.setdefault("WANDB_RUN_GROUP", sweep.name)
    if sweep.project:
        env.setdefault("WANDB_PROJECT", str(sweep.project))
    if sweep.entity:
        env.setdefault("WANDB_ENTITY", str(sweep.entity))
    env.setdefault("OMP_NUM_THREADS", str(_threads(jobs, mpi)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _plan_runs(sweep: Sweep, directory: str, names: list[str], configs: list[dict[str, Any]], mpi: int | None,
               dry_run: bool, out: Any) -> tuple[dict[str, RunResult], list[tuple[str, dict[str, Any], list[str]]]]:
    """The runs done before (skipped) or only shown (dry run), and the ``(name, params, command)`` to run."""
    runs_dir = os.path.join(directory, "runs")
    results: dict[str, RunResult] = {}
    todo: list[tuple[str, dict[str, Any], list[str]]] = []
    for name, params in zip(names, configs):
        json_file = os.path.join(directory, "args", f"{name}.json")
        cmd = build_command(sweep, params, mpi=mpi, log_dir=runs_dir, name=name, json_file=json_file)
        done = read_json(os.path.join(directory, "done", f"{name}.json"))
        if done is not None and _same(done.get("params"), params):
            results[name] = RunResult(name, params, "skipped", done.get("seconds"), 0, "done before",
                                      final_metric(os.path.join(runs_dir, name), sweep.metric),
                                      (metric_refusal(os.path.join(runs_dir, name), sweep.metric) or "")
                                      if sweep.metric else "")
            continue
        if done is not None:
            print(f"dpfl sweep: {name}: the parameters differ from the finished run's (a constant of the sweep "
                  "changed?): running it again", file=out, flush=True)
        if dry_run:
            print(" ".join(quote(c) for c in cmd), file=out, flush=True)
            results[name] = RunResult(name, params, "dry-run")
            continue
        todo.append((name, params, cmd))
    return results, todo


def run(sweep_file: str, *, directory: str | None = None, mpi: int | None = None, jobs: int = 1,
        count: int | None = None, seed: int = 0, dry_run: bool = False, out: Any = None) -> list[RunResult]:
    """Run the sweep (see the module docstring); returns one :class:`RunResult` per configuration.

    Args:
        sweep_file: the W&B-format sweep YAML.
        directory: the sweep's directory (default ``sweeps/<name>``).
        mpi: run each configuration under ``mpiexec -n MPI`` (``${interpreter}`` becomes
            ``python -m mpi4py``, so an error on one rank ends all of them).
        jobs: configurations run at the same time (each gets ``cores / (jobs x ranks)`` threads
            unless ``OMP_NUM_THREADS`` is set).
        count: random: number of draws (default ``run_cap``); grid: at most this many runs.
        seed: seed of the random draws.
        dry_run: print the commands and run nothing.
        out: where progress lines go (default: stderr).
    """
    out = out or sys.stderr
    sweep = load_sweep(sweep_file)
    _check_arguments(jobs, mpi, count)
    directory = directory or os.path.join("sweeps", sweep.name)
    configs = configurations(sweep, count, seed)
    for note in sweep.notes:
        print(f"dpfl sweep: note: {note}", file=out, flush=True)
    names = run_names(configs, constant_parameters(sweep))
    results, todo = _plan_runs(sweep, directory, names, configs, mpi, dry_run, out)
    if not dry_run:
        _announce(sweep, directory, len(configs), results, todo, out)
        run_jobs(sweep, directory, todo, jobs, environment(sweep, jobs, mpi), results, out)
    ordered = [results[name] for name in names]
    if not dry_run:
        print_runs(ordered, sweep.metric, out)
    refuse_selection(sweep, ordered)
    return ordered


def refuse_selection(sweep: Sweep, results: list[RunResult]) -> None:
    """A DP sweep whose metric is computed from clients' data without noise is refused (one
    :class:`ConfigError`): selecting by it releases what no guarantee covers
    (:func:`~dpfl_lightning.tracking.sweep_privacy.metric_refusal`, from the release kinds the runs
    recorded). A sweep of runs without DP is not checked."""
    refused = next((r for r in results if r.refused), None)
    if refused is not None:
        raise ConfigError("sweep metric.name", sweep.metric, f"may not select among DP runs: {refused.refused}",
                          "select by a metric of the server's validation or test set (kind 'evaluation') or a DP "
                          "release already in the ledger (kind 'noised')")


def _check_arguments(jobs: int, mpi: int | None, count: int | None) -> None:
    if jobs < 1:
        raise ConfigError("--jobs", jobs, "must be >= 1", "set --jobs 1 or more")
    if mpi is not None and mpi < 1:
        raise ConfigError("--mpi", mpi, "must be >= 1", "give the number of ranks, e.g. --mpi 2")
    if count is not None and (not isinstance(count, int) or count < 1):
        raise ConfigError("--count", count, "must be a whole number >= 1", "set --count 1 or more, or leave it out")


def _announce(sweep: Sweep, directory: str, total: int, results: dict[str, RunResult], todo: list, out: Any) -> None:
    """What the sweep will do, and a copy of its file in its directory."""
    skipped = sum(r.status == "skipped" for r in results.values())
    print(f"dpfl sweep {sweep.name}: {total} configuration(s), {skipped} done before, {len(todo)} to run "
          f"in {directory}", file=out, flush=True)
    os.makedirs(os.path.join(directory, "logs"), exist_ok=True)
    try:
        with open(sweep.path) as src, open(os.path.join(directory, "sweep.yaml"), "w") as dst:
            dst.write(src.read())
    except OSError:  # pragma: no cover - informational copy only
        pass


def run_jobs(sweep: Sweep, directory: str, todo: list[tuple[str, dict[str, Any], list[str]]], jobs: int,
              env: dict[str, str], results: dict[str, RunResult], out: Any) -> None:
    """The job runner: ``todo``'s commands, ``jobs`` at a time; every run's result into ``results``
    (Ctrl-C ends the running ones)."""
    runs_dir = os.path.join(directory, "runs")
    running: list[tuple[str, dict[str, Any], list[str], subprocess.Popen, Any, float]] = []
    queue = list(todo)
    started = 0
    try:
        while queue or running:
            while queue and len(running) < jobs:
                name, params, cmd = queue.pop(0)
                started += 1
                print(f"[{started}/{len(todo)}] {name}: started", file=out, flush=True)
                launched = _start_run(sweep, directory, runs_dir, name, params, cmd, env)
                if isinstance(launched, RunResult):  # the launcher is missing: this run fails, the sweep goes on
                    results[name] = launched
                    print(f"{name}: failed to start: {launched.message}", file=out, flush=True)
                else:
                    running.append((name, params, cmd, *launched))
            time.sleep(0.2)
            for item in list(running):
                name, params, cmd, proc, log, t0 = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                log.close()
                results[name] = _finish_run(sweep, directory, runs_dir, name, params, cmd, proc.returncode, t0, out)
    except KeyboardInterrupt:
        for name, _, _, proc, log, _ in running:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                proc.kill()
            log.close()
        raise


def _start_run(sweep: Sweep, directory: str, runs_dir: str, name: str, params: dict[str, Any], cmd: list[str],
               env: dict[str, str]) -> tuple[subprocess.Popen, Any, float] | RunResult:
    """Start one run (its directory cleared, its log opened); ``(process, log, start time)``, or a
    failed :class:`RunResult` when the command cannot be started."""
    _prepare_run_dir(directory, runs_dir, name)
    done_marker = os.path.join(directory, "done", f"{name}.json")
    if os.path.exists(done_marker):
        os.remove(done_marker)
    if "${args_json_file}" in sweep.command:
        write_json(os.path.join(directory, "args", f"{name}.json"), params)
    log = open(os.path.join(directory, "logs", f"{name}.log"), "w")  # noqa: SIM115 - closed when the run ends
    log.write("$ " + " ".join(quote(c) for c in cmd) + "\n")
    log.flush()
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    except OSError as exc:
        log.close()
        message = f"could not start {cmd[0]!r}: {exc}"
        write_json(os.path.join(directory, "failed", f"{name}.json"),
                    {"name": name, "params": params, "command": cmd, "returncode": None, "error": message})
        return RunResult(name, params, "failed", None, 127, message)
    return proc, log, time.perf_counter()


def _finish_run(sweep: Sweep, directory: str, runs_dir: str, name: str, params: dict[str, Any], cmd: list[str],
                returncode: int, t0: float, out: Any) -> RunResult:
    """Record a run that ended: ``done/`` or ``failed/`` (with its duration and end time unless it is
    a DP run), and a progress line."""
    record = {"name": name, "params": params, "command": cmd, "returncode": returncode}
    seconds = None if is_private_run(os.path.join(runs_dir, name)) else time.perf_counter() - t0
    if seconds is not None:
        record.update(seconds=round(seconds, 3), finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    took = "" if seconds is None else f" in {seconds:.1f} s"
    log_path = os.path.join(directory, "logs", f"{name}.log")
    if returncode == 0:
        write_json(os.path.join(directory, "done", f"{name}.json"), record)
        failed = os.path.join(directory, "failed", f"{name}.json")
        if os.path.exists(failed):
            os.remove(failed)
        value = final_metric(os.path.join(runs_dir, name), sweep.metric)
        refused = metric_refusal(os.path.join(runs_dir, name), sweep.metric) if sweep.metric else None
        shown = f" ({sweep.metric}={value:.4g})" if value is not None else ""
        print(f"{name}: done{took}{shown}" + (f"; {sweep.metric} may not select: {refused}" if refused else ""),
              file=out, flush=True)
        return RunResult(name, params, "done", seconds, 0, "", value, refused or "")
    message = _last_error_line(log_path)
    record["error"] = message
    write_json(os.path.join(directory, "failed", f"{name}.json"), record)
    print(f"{name}: failed (exit {returncode}){took.replace(' in ', ' after ')}: {message} [log: {log_path}]",
          file=out, flush=True)
    return RunResult(name, params, "failed", seconds, returncode, message)


def _prepare_run_dir(directory: str, runs_dir: str, name: str) -> None:
    """Move what an earlier attempt left in ``runs/<name>`` to ``failed/<name>.attemptK`` (or, for
    a run that finished with other parameters, ``old/<name>.K``)."""
    path = os.path.join(runs_dir, name)
    if not os.path.exists(path):
        return
    finished = os.path.exists(os.path.join(directory, "done", f"{name}.json"))
    where, stem = ("old", f"{name}.") if finished else ("failed", f"{name}.attempt")
    k = 1
    while os.path.exists(os.path.join(directory, where, f"{stem}{k}")):
        k += 1
    os.makedirs(os.path.join(directory, where), exist_ok=True)
    shutil.move(path, os.path.join(directory, where, f"{stem}{k}"))


def quote(s: str) -> str:
    """``s`` as a shell word (for the commands shown and logged)."""
    if re.fullmatch(r"[\w@%+=:,./-]+", s):
        return s
    if not re.search(r'["$`\\!]', s):
        return f'"{s}"'
    return shlex.quote(s)


def print_runs(results: list[RunResult], metric: str | None = None, out: Any = None) -> None:
    """A table of the runs: name, parameters (one a line, under their shortest distinct names: ``lr``
    for ``model.init_args.lr``), status (and the sweep's metric). It fits the terminal, 80 columns in
    a file or a pipe (``COLUMNS`` wider): long cells wrap between words, a longer word folds."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out or sys.stderr)
    texts = [[_param_text(k, v) for k, v in r.params.items()] for r in results]
    names = short_keys(list(dict.fromkeys(k for t in texts for part in t for k, _ in part)))
    table = Table(title="sweep runs", show_header=True, header_style="bold")
    table.add_column("run", overflow="fold", ratio=3)
    table.add_column("parameters", overflow="fold", ratio=3)
    table.add_column("status", overflow="fold", ratio=3)
    if metric:
        table.add_column(metric, justify="right", no_wrap=True)
    for r, text in zip(results, texts):
        params = "\n".join(f"{names[k]}={v}" for part in text for k, v in part)
        took = "" if r.seconds is None else f" ({r.seconds:.0f} s)"
        status = {"done": f"done{took}", "skipped": "done before", "dry-run": "not run",
                  "failed": f"failed (exit {r.returncode}): {r.message}"}.get(r.status, r.status)
        row = [r.name, params, status]
        if metric:
            row.append("" if r.metric is None else f"{r.metric:.4g}")
        table.add_row(*row)
    console.print(table)


def _param_text(key: str, v: Any) -> list[tuple[str, str]]:
    """A parameter for the table of runs, as the ``(option, value)`` pairs it sets (a mapping: one
    per entry)."""
    if isinstance(v, dict) and "class_path" in v:
        args = v.get("init_args") or {}
        return [(key, _value_slug(v["class_path"]))] + [(f"{key}.{k}", format_value(x)) for k, x in args.items()]
    if isinstance(v, dict):
        return [(f"{key}.{k}", format_value(x)) for k, x in v.items()]
    return [(key, format_value(v))]


def run_from_cli(cfg: Any) -> int:
    """``dpfl sweep``: exit status 0 when every run finished, 1 when one failed."""
    results = run(cfg.sweep_file, directory=cfg.dir, mpi=cfg.mpi, jobs=cfg.jobs, count=cfg.count, seed=cfg.seed,
                  dry_run=cfg.dry_run)
    return 1 if any(r.status == "failed" for r in results) else 0
