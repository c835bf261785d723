"""``dpfl sweep`` with private selection (Papernot & Steinke, ICLR 2022): a random number ``K`` of DP
runs whose hyperparameters are drawn from the sweep's space, of which only the best is released, with
a guarantee that includes the selection.

A sweep file asks for it with ``private_selection: {distribution: poisson, mean: 8}`` (or
``geometric``, ``logarithmic``, ``truncated_negative_binomial`` with ``shape``; the command line's
``--private_selection``), and names its ``metric`` (``name``, ``goal``). What happens:

1. **The space.** Every parameter lists its values (``value`` / ``values``): the space is their
   product (the worst case of the guarantee is taken over every point, so the points must be known).
   A trial draws one point uniformly at random, with replacement, independently of the others (a
   grid becomes uniform draws from the grid: the theorems need i.i.d. trials). ``trainer.seed`` may
   not be a parameter: each trial gets its own seed, drawn like ``K``.
2. **The guarantee, before any training.** Each point's run is planned by the privacy ledger (its main
   guarantee: audience, granularity, delta; the compositions of its release); the selected result is
   ``RepeatAndSelectDpEvent`` over the pointwise maximum of the points' RDP curves
   (:mod:`dpfl_lightning.privacy.selection_accounting`), which names the hyperparameter that set it.
   With ``--target_epsilon E --delta D`` the trials' noise is calibrated first so that the selected
   result meets ``(E, D)`` (refused where no noise does).
3. **The draw.** ``K``, each trial's point, seed and run name come from the CSPRNG streams of
   ``RandomSource(--seed, fresh secret)`` (purpose ``PrivateSelection.trials``), in simulation too:
   the selected trial's seed and name are released in its ``config.yaml``, and were they a function
   of ``--seed`` alone, trying the small seeds people use would find ``--seed`` and with it ``K``
   and every trial. They are kept in ``private/selection_state.json`` (mode 0600): a rerun of the
   sweep resumes the same trials and never redraws ``K`` (it could not: the secret is not saved).
   **That file, like all of ``private/``, is never to be released.**
4. **The trials** are ordinary ``dpfl fit`` runs under ``private/`` (``runs/``, ``logs/``, ``done/``,
   the progress lines in ``private/progress.log``); they do not log to W&B (``WANDB_MODE=disabled``:
   the W&B server would learn ``K`` and every trial) unless the sweep runs through W&B
   (``--wandb``). The console shows neither ``K`` nor any trial's result while they run. The metric
   must be a release the guarantee allows: checked on every point's set-up before anything is drawn
   (``Options.check_metric``: :mod:`dpfl_lightning.cli.selection_metric`), and on the kinds the
   first trial to finish recorded (:func:`~dpfl_lightning.tracking.sweep_privacy.metric_refusal`).
5. **The release**, in ``released/``: the best trial by the metric (``runs/selected/``: its logs,
   configuration and checkpoints), ``selection.json`` and ``summary.md`` (its hyperparameters: those
   selected, those fixed for every trial, those calibrated; never a display or logging setting; its
   metric, the guarantee of the selected result, and for comparison the epsilon of one run and of
   releasing every run of a grid of the mean number of trials). ``K`` and the other trials are not
   released: the pair (``K``, best result) is not covered by the theorems. ``K = 0`` (Poisson)
   releases nothing and says so; that outcome is part of the mechanism.

``--dry_run`` stops after step 2: it prints the guarantee and the plan (the distribution of ``K``,
the points, a trial's command, where the trials and the release would go) and draws, trains and
writes nothing, so the real run that follows draws ``K`` afresh.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.privacy.selection import (TRIALS, TrialCount, describe_trial_count, draw_trial_count,
                                              draw_trial_points, trial_count)
from dpfl_lightning.privacy.selection_accounting import (SelectedEpsilon, Trial, all_runs_epsilon, one_run_epsilon,
                                                         selected_epsilon)
from dpfl_lightning.tracking import sweep as sweeps
from dpfl_lightning.tracking.run_files import final_metric, is_model_setting
from dpfl_lightning.tracking.sweep_privacy import RunPrivacy, fit_arguments, metric_refusal

STATE = "selection_state.json"
SELECTION = "selection.json"
#: a planner: the fit arguments of a point and its label -> the point's RunPrivacy (None without DP)
Planner = Callable[[Sequence[str], str], "RunPrivacy | None"]


@dataclass
class Guarantee:
    """What the sweep releases about its privacy (the selected result's, and for comparison)."""

    selected: SelectedEpsilon
    one_run: SelectedEpsilon
    all_runs: float
    grid_runs: int
    audience: str
    granularity: str
    delta: float
    accountant: str
    secure: bool
    calibration: str = ""

    def lines(self) -> list[str]:
        s = self.selected
        worst = f"; worst case over the space: {s.worst}" if s.worst else "; no hyperparameter of the space changes the event"
        if s.worst and not s.exact:
            worst += f" (the pointwise maximum of {', '.join(s.attained_by)})"
        note = f" [{s.note}]" if s.note else ""
        return [f"selected result: epsilon = {s.epsilon:.4g} at delta = {self.delta:g} ({self.granularity}-level, "
                f"{self.audience}; {s.method} accountant, repeat-and-select over a {s.count.describe()}{worst}){note}",
                f"one run of the space: epsilon = {self.one_run.epsilon:.4g} (the run's own ledger, unchanged)",
                f"releasing every run of a grid of {self.grid_runs} runs (the mean number of trials), composed: "
                f"epsilon = {self.all_runs:.4g}"] + ([self.calibration] if self.calibration else [])

    def as_dict(self) -> dict[str, Any]:
        s = self.selected
        return {"epsilon_selected": s.epsilon, "epsilon_one_run": self.one_run.epsilon,
                "epsilon_all_runs": self.all_runs, "grid_runs": self.grid_runs, "delta": self.delta,
                "audience": self.audience, "granularity": self.granularity, "method": s.method, "note": s.note,
                "worst_case": s.worst, "attained_by": list(s.attained_by), "exact": s.exact,
                "trials": s.count.as_dict(), "accountant": self.accountant, "secure": self.secure,
                "calibration": self.calibration, "lines": self.lines()}


@dataclass
class Space:
    """The sweep's points (every parameter's listed values, their product) and their privacy."""

    points: list[dict[str, Any]]
    labels: list[str]
    privacy: list[RunPrivacy] = field(default_factory=list)


def selection_setting(sweep: sweeps.Sweep, override: Any = None) -> TrialCount | None:
    """The sweep's :class:`TrialCount`: ``override`` (the command line), else the file's
    ``private_selection``; ``None`` for an ordinary sweep."""
    raw = override if override is not None else sweep.private_selection
    if raw is None:
        return None
    count = trial_count(raw)
    if not sweep.metric:
        raise ConfigError("sweep metric", None, "private selection releases the best trial by the sweep's metric",
                          "add metric: {name: test_acc, goal: maximize} (a server-side evaluation metric)")
    return count


def space_of(sweep: sweeps.Sweep) -> Space:
    """The product of every parameter's values (see the module docstring)."""
    axes = []
    for name, spec in sweep.parameters.items():
        if name in ("trainer.seed", "seed"):
            raise ConfigError(f"sweep parameters.{name}", spec, "each private-selection trial draws its own seed",
                              f"leave {name} out of the parameters")
        if spec["distribution"] not in ("constant", "categorical"):
            raise ConfigError(f"sweep parameters.{name}", spec["distribution"], "private selection takes the worst "
                              "case of the guarantee over every point of the space, which must be listed",
                              "give the values to draw from: values: [...]")
        axes.append([spec["value"]] if spec["distribution"] == "constant" else list(spec["values"]))
    names = list(sweep.parameters)
    points = [dict(zip(names, combo)) for combo in itertools.product(*axes)]
    constant = sweeps.constant_parameters(sweep)
    labels = [", ".join(f"{k}={sweeps.format_value(v)}" for k, v in p.items() if k not in constant) or "every run"
              for p in points]
    return Space(points, labels)


def plan_space(sweep: sweeps.Sweep, space: Space, planner: Planner, extra: dict[str, Any]) -> None:
    """Each point's :class:`RunPrivacy` (``extra``: settings added to every point, e.g. the
    calibrated noise); a point without DP is refused."""
    space.privacy = []
    for point, label in zip(space.points, space.labels):
        planned = planner(fit_arguments(sweeps.build_command(sweep, {**point, **extra})), label)
        if planned is None:
            raise ConfigError("sweep private_selection", label, "this point of the space is not a DP run: private "
                              "selection bounds what the best of DP runs reveals", "configure a DP algorithm")
        space.privacy.append(planned)


def guarantee_of(space: Space, count: TrialCount, delta: float | None) -> Guarantee:
    """The guarantee of the selected result over ``space`` (planned), at ``delta`` (default: the
    points' ledgers', which must agree)."""
    privacy = space.privacy
    deltas = sorted({p.delta for p in privacy})
    if delta is None and len(deltas) > 1:
        raise ConfigError("--delta", None, f"the points' ledgers account at different deltas ({deltas})",
                          "give the sweep's delta: --delta D")
    delta = deltas[0] if delta is None else float(delta)
    audiences = sorted({(p.granularity, p.audience) for p in privacy})
    if len(audiences) > 1:
        raise ConfigError("sweep parameters", audiences, "the points' guarantees protect different units or hold "
                          "towards different parties", "keep the privacy model (placement, granularity) fixed")
    accountant = privacy[0].accountant
    trials: list[Trial] = [t for p in privacy for t in p.trials]
    selected = selected_epsilon(trials, count, delta, accountant)
    one = one_run_epsilon(trials, delta, accountant)
    worst = max(trials, key=lambda t: one_run_epsilon(t, delta, accountant).epsilon)
    runs = max(1, int(count.mean + 0.5))
    grid = all_runs_epsilon([worst] * runs, delta, accountant).epsilon
    return Guarantee(selected, one, grid, runs, audiences[0][1], audiences[0][0], delta, accountant,
                     any(p.secure for p in privacy))


# ------------------------------------------------------------------------------------------ state
def _fingerprint(sweep: sweeps.Sweep, count: TrialCount, seed: int, extra: dict[str, Any]) -> str:
    what = {"parameters": sweep.parameters, "command": sweep.command, "trials": count.as_dict(), "seed": seed,
            "extra": extra, "metric": sweep.metric}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def draw_state(source: rng.RandomSource, count: TrialCount, points: int) -> dict[str, Any]:
    """``K``, and each trial's point, seed and run name, from ``source``'s :data:`TRIALS` streams."""
    k = draw_trial_count(source, count)
    chosen = draw_trial_points(source, k, points)
    trials, names = [], set()
    for i, point in enumerate(chosen):
        words = source.stream(i, rng.SERVER_CLIENT, TRIALS, tag="seed").uniform(2)
        seed = int(float(words[0]) * 2**31)
        name = f"trial-{int(float(words[1]) * 2**40):010x}"
        while name in names:  # 2^-40 per pair; keep names distinct anyway
            name += "x"
        names.add(name)
        trials.append({"point": int(point), "seed": seed, "name": name})
    return {"count": k, "trials": trials}


def load_or_draw(private_dir: str, fingerprint: str, seed: int, count: TrialCount, points: int) -> dict[str, Any]:
    """The trials of this sweep: read from the private state file when it exists (a resumed sweep
    never redraws), else drawn from a fresh secret (never from ``seed`` alone: see the module
    docstring) and written there (mode 0600)."""
    path = os.path.join(private_dir, STATE)
    if os.path.isfile(path):
        with open(path) as f:
            state = json.load(f)
        if state.get("fingerprint") != fingerprint:
            raise ConfigError("sweep directory", private_dir, "holds the trials of another private-selection sweep "
                              "(its file, seed or noise changed since they were drawn); drawing again would "
                              "select among two draws of K", "use a new --dir for the changed sweep")
        return state
    source = rng.RandomSource(seed, rng.new_secret())
    state = {"fingerprint": fingerprint, **draw_state(source, count, points)}
    os.makedirs(private_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)
    return state


# ------------------------------------------------------------------------------------------ trials
def trial_todo(sweep: sweeps.Sweep, space: Space, state: dict[str, Any], private_dir: str, mpi: int | None,
               extra: dict[str, Any]) -> list[tuple[str, dict[str, Any], list[str]]]:
    """``(name, params, command)`` of every trial not done yet."""
    todo = []
    for t in state["trials"]:
        params = {**space.points[t["point"]], **extra, "trainer.seed": t["seed"]}
        if sweeps.read_json(os.path.join(private_dir, "done", f"{t['name']}.json")) is not None:
            continue
        cmd = sweeps.build_command(sweep, params, mpi=mpi, log_dir=os.path.join(private_dir, "runs"), name=t["name"])
        todo.append((t["name"], params, cmd))
    return todo


def run_trials(sweep: sweeps.Sweep, todo: list, private_dir: str, jobs: int, env: dict[str, str]) -> bool:
    """Run ``todo`` (the first alone, its metric checked before the others start); progress lines go
    to ``private/progress.log``. True when every trial finished."""
    results: dict[str, sweeps.RunResult] = {}
    os.makedirs(os.path.join(private_dir, "logs"), exist_ok=True)
    with open(os.path.join(private_dir, "progress.log"), "a") as progress:
        for batch in (todo[:1], todo[1:]):
            sweeps.run_jobs(sweep, private_dir, batch, jobs, env, results, progress)
            for name, _, _ in batch:
                if results[name].status == "done":
                    refuse = metric_refusal(os.path.join(private_dir, "runs", name), sweep.metric)
                    if refuse:
                        raise ConfigError("sweep metric.name", sweep.metric, f"may not select among DP runs: {refuse}",
                                          "select by a metric of the server's validation or test set (kind "
                                          "'evaluation') or a DP release in the ledger (kind 'noised')")
    return all(r.status == "done" for r in results.values())


def best_trial(sweep: sweeps.Sweep, state: dict[str, Any], private_dir: str) -> tuple[dict[str, Any], float] | None:
    """The trial with the best metric (the first of equals) and its value; ``None`` when no trial
    logged the metric."""
    best: tuple[dict[str, Any], float] | None = None
    sign = -1.0 if sweep.goal == "minimize" else 1.0
    for t in state["trials"]:
        value = final_metric(os.path.join(private_dir, "runs", t["name"]), sweep.metric)
        if value is not None and value == value and (best is None or sign * value > sign * best[1]):
            best = (t, value)
    return best


# ------------------------------------------------------------------------------------------ release
def release(sweep: sweeps.Sweep, directory: str, space: Space, state: dict[str, Any], guarantee: Guarantee,
            extra: dict[str, Any]) -> dict[str, Any]:
    """Write ``released/`` (see the module docstring); returns what ``selection.json`` holds."""
    private_dir = os.path.join(directory, "private")
    out_dir = os.path.join(directory, "released")
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    info: dict[str, Any] = {"sweep": sweep.name, "metric": sweep.metric, "goal": sweep.goal,
                            "guarantee": guarantee.as_dict()}
    best = best_trial(sweep, state, private_dir) if state["count"] else None
    if best is not None:
        t, value = best
        selected = os.path.join(out_dir, "runs", "selected")
        # file contents only: copied times would date the selected trial against the sweep's end,
        # a lower bound on how many trials ran after it
        shutil.copytree(os.path.join(private_dir, "runs", t["name"]), selected, copy_function=shutil.copyfile)
        info.update(result="selected", value=value, label=space.labels[t["point"]],
                    **selected_parameters(sweep, space.points[t["point"]], extra))
    else:
        # one text whatever the cause: K = 0, or K >= 1 trials none of which logged a finite metric
        # (a divergence that depends on the data); which one it was stays in private/
        info.update(result="nothing", why="no trial was selected")
        with open(os.path.join(private_dir, "nothing_selected.txt"), "w") as f:
            f.write("the number of trials drawn was 0\n" if not state["count"] else "no trial logged the metric\n")
    with open(os.path.join(out_dir, SELECTION), "w") as f:
        json.dump(info, f, indent=1, default=str)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(summary_markdown(info))
    _one_time(out_dir)
    return info


def selected_parameters(sweep: sweeps.Sweep, point: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """What ``selection.json`` says of the selected trial's settings: ``parameters``, the settings of
    its point that define the model (a display or logging setting the sweep file fixes, such as
    ``trainer.enable_progress_bar``, is no hyperparameter: ``run_files.NOT_MODEL_SETTINGS``) and the
    calibrated ones; ``selected``, those of them drawn from several values (the others are fixed for
    every trial); ``calibrated``, those ``--target_epsilon`` set."""
    constant = set(sweeps.constant_parameters(sweep))
    parameters = {k: v for k, v in point.items() if is_model_setting(k)}
    return {"parameters": {**parameters, **extra}, "selected": [k for k in parameters if k not in constant],
            "calibrated": list(extra)}


def _one_time(root: str) -> None:
    """Every file and folder under ``root`` dated at one time (now): the release's times say nothing
    of when each part was made."""
    now = time.time()
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files + dirs:
            os.utime(os.path.join(folder, name), (now, now))
    os.utime(root, (now, now))


def summary_markdown(info: dict[str, Any]) -> str:
    """``released/summary.md``: what the sweep releases and its guarantee."""
    g = info["guarantee"]
    lines = [f"# Private-selection sweep: {info['sweep']}", ""]
    if info["result"] == "selected":
        lines += [f"Selected result (the best trial by `{info['metric']}`, goal {info['goal']}): "
                  f"**{info['metric']} = {info['value']:.4g}**", "", "| parameter | value | |", "|---|---|---|"]
        selected, calibrated = info.get("selected", []), info.get("calibrated", [])
        lines += [f"| {k} | {v} | {'selected' if k in selected else 'calibrated' if k in calibrated else 'fixed'} |"
                  for k, v in info["parameters"].items()]
        lines += ["", "Its logs, configuration and checkpoints: `runs/selected/`.", ""]
    else:
        lines += [f"**Nothing is released**: {info['why']}. This outcome is part of the mechanism (its guarantee "
                  "covers it).", ""]
    lines += ["## Guarantee", "", "| what is released | epsilon | delta | audience |", "|---|---|---|---|",
              f"| the selected result (including the selection) | {g['epsilon_selected']:.4g} | {g['delta']:g} | "
              f"{g['granularity']}-level, {g['audience']} |",
              f"| one run of the space (its own ledger) | {g['epsilon_one_run']:.4g} | {g['delta']:g} | same |",
              f"| every run of a grid of {g['grid_runs']} runs, composed | {g['epsilon_all_runs']:.4g} | "
              f"{g['delta']:g} | same |", ""]
    lines += [f"- {line}" for line in g["lines"]]
    lines += ["", "Not released (the guarantee needs them secret): the number of trials and every trial but the "
              "selected one (their hyperparameters, metrics and models). The number of trials, each trial's point, "
              "seed and name came from a CSPRNG keyed by a fresh secret (never from the sweep's --seed)." +
              (" The trials ran in secure mode." if g["secure"] else " The trials ran as simulations: each trial's own "
               "noise is reproducible from its seed, and its guarantee holds towards someone who does not know it."),
              ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ budget
def calibrate_noise(sweep: sweeps.Sweep, space: Space, planner: Planner, count: TrialCount, target_epsilon: float,
                    delta: float, setting: str) -> tuple[dict[str, Any], str]:
    """The value of ``setting`` (the noise multiplier the trials' algorithm takes) for which the
    selected result meets ``(target_epsilon, delta)`` including selection: a search over a common
    scale ``s`` of every point's noise multiplier (``selection_calibration.calibrate_selection_at``
    on the worst case over the space), then the points planned again at the configured value
    ``s * base`` and ``s`` raised until the planned guarantee meets the target (a mechanism whose
    multiplier is not proportional to the setting, FedEXP's step-size noise say)."""
    from dpfl_lightning.privacy.selection_calibration import calibrate_selection_at

    if setting in sweep.parameters:
        raise ConfigError("--target_epsilon", target_epsilon, f"{setting} is a parameter of the space: one value is "
                          "calibrated for every trial", f"leave {setting} out of the parameters")
    base = {p.noise for p in space.privacy}
    if len(base) != 1 or None in base or not base or next(iter(base)) <= 0:
        raise ConfigError("--noise_setting", setting, f"does not give one positive value for every point ({base})",
                          "name the setting that holds the trials' noise multiplier, e.g. "
                          "trainer.algorithm.init_args.noise_multiplier")
    n0 = next(iter(base))

    def scaled(s: float) -> list[Trial]:
        return [Trial(tuple((r.with_noise_multiplier(r.noise_multiplier * s), n) for r, n in t.parts), t.label)
                for p in space.privacy for t in p.trials]

    s = calibrate_selection_at(scaled, count, target_epsilon, delta)
    for _ in range(40):
        extra = {setting: float(n0 * s)}
        plan_space(sweep, space, planner, extra)
        eps = guarantee_of(space, count, delta).selected.epsilon
        if eps <= target_epsilon:
            return extra, (f"calibrated: {setting} = {n0 * s:.6g} so that the selected result meets epsilon "
                           f"{target_epsilon:g} at delta {delta:g} (it reaches {eps:.4g})")
        s *= 1 + max(0.002, 0.5 * (eps / target_epsilon - 1))
    raise ConfigError("--target_epsilon", target_epsilon, "the calibration did not converge", "report this")


# ------------------------------------------------------------------------------------------ W&B
def wandb_sweep_config(sweep: sweeps.Sweep, space: Space, extra: dict[str, Any]) -> dict[str, Any]:
    """The W&B sweep of a private selection: ``method: random`` over the listed values (W&B's
    random search draws each categorical parameter uniformly and independently: i.i.d. draws from
    the grid, as the theorems need), without ``private_selection``."""
    parameters = {k: ({"value": v["value"]} if v["distribution"] == "constant" else {"values": list(v["values"])})
                  for k, v in sweep.parameters.items()}
    parameters.update({k: {"value": v} for k, v in extra.items()})
    config = {"name": sweep.name, "method": "random", "metric": {"name": sweep.metric, "goal": sweep.goal},
              "command": sweep.command, "parameters": parameters}
    if sweep.program:
        config["program"] = sweep.program
    return config


def start_wandb(sweep: sweeps.Sweep, space: Space, extra: dict[str, Any], count: int, env: dict[str, str]) -> str:
    """Create the W&B sweep and run ``wandb agent --count K`` on it (``K`` the drawn number of
    trials); returns the sweep's id."""
    import subprocess

    import wandb

    sweep_id = wandb.sweep(wandb_sweep_config(sweep, space, extra), project=sweep.project, entity=sweep.entity)
    path = "/".join(str(p) for p in (sweep.entity, sweep.project) if p) + ("/" if sweep.entity or sweep.project else "")
    if count:
        subprocess.run(["wandb", "agent", "--count", str(count), f"{path}{sweep_id}"], env=env, check=False)
    return sweep_id


def wandb_summary(sweep: sweeps.Sweep, info: dict[str, Any]) -> None:
    """The selected result and its guarantee as the summary of one W&B run of the sweep's group
    (``<sweep>-selected``): config the selected parameters, summary the metric and the epsilons."""
    import wandb

    g = info["guarantee"]
    run = wandb.init(project=sweep.project, entity=sweep.entity, group=sweep.name, name=f"{sweep.name}-selected",
                     job_type="private-selection", config=info.get("parameters") or {}, reinit=True)
    summary = {k: g[k] for k in ("epsilon_selected", "epsilon_one_run", "epsilon_all_runs", "delta", "audience",
                                 "granularity", "worst_case")}
    summary.update(result=info["result"], **({sweep.metric: info["value"]} if info["result"] == "selected" else {}))
    run.summary.update(summary)
    run.finish()


# ------------------------------------------------------------------------------------------ the sweep
@dataclass
class Options:
    """``dpfl sweep``'s settings that a private selection reads."""

    directory: str
    planner: Planner
    seed: int = 0
    jobs: int = 1
    mpi: int | None = None
    target_epsilon: float | None = None
    delta: float | None = None
    noise_setting: str = "trainer.algorithm.init_args.noise_multiplier"
    wandb: bool = False
    #: ``check_metric(fit arguments, label, metric)`` raises the ConfigError of a metric that may not
    #: select, from a point's set-up (``cli.selection_metric``); ``None``: judged after the first trial only
    check_metric: Callable[[Sequence[str], str, str], None] | None = None
    dry_run: bool = False  # print the plan: nothing drawn, trained or written


def plan_selection(sweep: sweeps.Sweep, count: TrialCount, options: Options) -> tuple[Space, dict[str, Any], Guarantee]:
    """Everything a private selection knows before it draws: the space, each point planned, the
    calibrated settings (``--target_epsilon``), the guarantee, and the metric checked on every
    point's set-up (``options.check_metric``). Draws, trains and writes nothing."""
    space = space_of(sweep)
    extra: dict[str, Any] = {}
    plan_space(sweep, space, options.planner, extra)
    calibration = ""
    if options.target_epsilon is not None:
        delta = options.delta if options.delta is not None else space.privacy[0].delta
        extra, calibration = calibrate_noise(sweep, space, options.planner, count, options.target_epsilon, delta,
                                             options.noise_setting)
    guarantee = guarantee_of(space, count, options.delta)
    guarantee.calibration = calibration
    if options.check_metric is not None:
        for point, label in zip(space.points, space.labels):
            options.check_metric(fit_arguments(sweeps.build_command(sweep, {**point, **extra})), label, sweep.metric)
    return space, extra, guarantee


def print_plan(sweep: sweeps.Sweep, space: Space, count: TrialCount, extra: dict[str, Any], options: Options,
               out: Any) -> None:
    """``--dry_run``: what a real run would draw and run, said without drawing (see :func:`run_private`)."""
    private_dir = os.path.join(options.directory, "private")
    point = {**space.points[0], **extra, "trainer.seed": "<drawn>"}
    command = sweeps.build_command(sweep, point, mpi=options.mpi, log_dir=os.path.join(private_dir, "runs"),
                                   name="trial-<drawn>")
    state = os.path.join(private_dir, STATE)
    if not os.path.isfile(state):
        then = "draws K and the trials from a fresh secret"
    elif _state_fingerprint(state) == _fingerprint(sweep, count, options.seed, extra):
        then = f"resumes the trials already drawn in {private_dir} (it never draws again)"
    else:
        then = f"is refused: {private_dir} holds the trials of another private-selection sweep (use a new --dir)"
    lines = [f"the number of trials K: {describe_trial_count(count)}",
             f"each trial: one of the {len(space.points)} point(s), uniformly at random with replacement, with its own "
             "seed and run name: " + "; ".join(space.labels),
             f"a trial's command (point 1): {' '.join(sweeps.quote(c) for c in command)}",
             f"the trials would run under {private_dir} (never release it); the selected result would be released in "
             f"{os.path.join(options.directory, 'released')}",
             f"dry run: nothing was drawn, trained or written; a real run {then}"]
    for line in lines:
        print(f"dpfl sweep: plan: {line}", file=out, flush=True)


def _state_fingerprint(path: str) -> str | None:
    try:
        with open(path) as f:
            return json.load(f).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def run_private(sweep: sweeps.Sweep, count: TrialCount, options: Options, out: Any) -> dict[str, Any] | None:
    """Run a private-selection sweep (the module docstring); returns what ``selection.json`` holds,
    or ``None`` when a trial failed (rerun the sweep: it resumes the same trials). With
    ``options.dry_run``: the plan (the space, the distribution of ``K``, the guarantee, a trial's
    command) is printed and ``{"result": "dry run", ...}`` returned; ``K`` is not drawn, no trial
    runs and nothing is written (a later real run draws afresh)."""
    space, extra, guarantee = plan_selection(sweep, count, options)
    print(f"dpfl sweep {sweep.name}: private selection over {len(space.points)} point(s), {count.describe()}; "
          f"the number of trials and their results stay in {os.path.join(options.directory, 'private')} "
          "(never release it)", file=out, flush=True)
    for line in guarantee.lines():
        print(f"dpfl sweep: guarantee: {line}", file=out, flush=True)
    if options.dry_run:
        print_plan(sweep, space, count, extra, options, out)
        return {"sweep": sweep.name, "metric": sweep.metric, "goal": sweep.goal, "guarantee": guarantee.as_dict(),
                "result": "dry run", "why": "--dry_run: nothing was drawn or trained"}
    private_dir = os.path.join(options.directory, "private")
    fingerprint = _fingerprint(sweep, count, options.seed, extra)
    state = load_or_draw(private_dir, fingerprint, options.seed, count, len(space.points))
    env = sweeps.environment(sweep, options.jobs, options.mpi)
    if options.wandb:
        start_wandb(sweep, space, extra, state["count"], env)
        info = {"sweep": sweep.name, "metric": sweep.metric, "goal": sweep.goal, "guarantee": guarantee.as_dict(),
                "result": "in W&B", "why": "the W&B sweep selects"}
        wandb_summary(sweep, info)
        return info
    env["WANDB_MODE"] = "disabled"  # the W&B server would learn K and every trial
    todo = trial_todo(sweep, space, state, private_dir, options.mpi, extra)
    if todo and not run_trials(sweep, todo, private_dir, options.jobs, env):
        # the same line whatever failed (a failure may depend on the data); the details are in private/
        print(f"dpfl sweep {sweep.name}: the sweep did not finish (see {private_dir}); nothing is released. Run "
              "the sweep again: it resumes the same trials", file=out, flush=True)
        return None
    info = release(sweep, options.directory, space, state, guarantee, extra)
    with open(os.path.join(options.directory, "released", "summary.md")) as f:
        print(f.read(), file=out, flush=True)
    return info
