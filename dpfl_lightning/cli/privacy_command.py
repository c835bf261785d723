"""``dpfl privacy ...``: epsilon of a configuration, calibration and round planning, without training."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from dpfl_lightning.errors import require
from dpfl_lightning.privacy.accountants import epsilon
from dpfl_lightning.privacy.calibrate import max_steps
from dpfl_lightning.privacy.guarantees import default_delta, guarantees
from dpfl_lightning.privacy.mechanisms import Mechanism
from dpfl_lightning.privacy.planning import PrivacyPlanner
from dpfl_lightning.privacy.theory import scaffnew_optimal

if TYPE_CHECKING:
    from dpfl_lightning.plugins.privacy_ledger import PrivacyLedger
    from dpfl_lightning.federated.sampling import ClientSampler

# `calibrate`, `plan` and `theory` import no torch or Lightning (seconds of start-up on a loaded
# machine); `epsilon` builds the configured trainer, data and model, and imports them where it does.


def plan_run(trainer: Any, data: Any, accountant: str | None = None, delta: float | None = None,
             model: Any = None) -> PrivacyLedger:
    """Set up what the privacy ledger needs (data split, sampler, the plugins' mechanisms and
    calibration) and return the ledger, without laying out the model or any training. ``model``
    (the user's module, as configured) gives the parameter count ``d`` that some mechanisms scale
    with (CDP-FedEXP's xi); without it they refuse to plan."""
    return plan_setup(trainer, data, accountant, delta, model)[2]


def plan_setup(trainer: Any, data: Any, accountant: str | None = None, delta: float | None = None,
               model: Any = None) -> tuple[list, Any, PrivacyLedger]:
    """:func:`plan_run`'s set-up: the run's plugins after their ``setup``, the set-up context they
    saw, and the ledger."""
    from dpfl_lightning.comm import LocalCommunicator
    from dpfl_lightning.plugins.privacy_ledger import PrivacyLedger
    from dpfl_lightning.run.setup import prepare_privacy, setup_plugins

    plugins = list(trainer.plugins)  # the trainer is read, not changed
    ledger = next((p for p in plugins if isinstance(p, PrivacyLedger)), None)
    if ledger is None and (accountant is not None or delta is not None):
        ledger = PrivacyLedger()
        plugins.append(ledger)
    if accountant is not None:
        ledger.accountant = accountant
    if delta is not None:
        ledger.delta = delta
    d = sum(p.numel() for p in model.parameters()) if model is not None else 0
    ctx = prepare_privacy(trainer.settings, trainer.comm or LocalCommunicator(), data, num_parameters=d or None)
    plugins, ledger = setup_plugins(plugins, ctx)
    return plugins, ctx, ledger or PrivacyLedger()


def _print_epsilon(trainer: Any, ledger: PrivacyLedger) -> None:
    if not ledger.guarantees:
        print("no DP mechanism is configured: no privacy guarantee (epsilon = inf)")
        return
    eps = ledger.planned_epsilons(trainer.rounds)
    for g, line in zip(ledger.guarantees, ledger.describe()):
        note = ledger.method_notes.get(g.name, "")
        shown = note and note not in line  # the line may give the reason already (the accountant used)
        print(f"epsilon = {eps[g.name]:.4f} after {trainer.rounds} rounds: {line}" + (f" [{note}]" if shown else ""))


def _sampler(cfg: Any) -> ClientSampler:
    from dpfl_lightning.federated.sampling import ClientSampler

    kind = cfg.sampling or ("uniform" if cfg.clients_per_round else "poisson" if cfg.sampling_rate else "full")
    return ClientSampler(kind, cfg.clients, cfg.clients_per_round, cfg.sampling_rate)


def _random(cfg: Any) -> Any:
    """The seed's random source: which clients take part when (planned local or distributed noise;
    it imports torch, which central noise never needs)."""
    from dpfl_lightning.rng import RandomSource

    return RandomSource(cfg.seed)


def _calibrate(cfg: Any) -> None:
    sampler = _sampler(cfg)
    require(0 < cfg.delta < 1.0 / cfg.clients, "--delta", cfg.delta,
            f"client-level DP over {cfg.clients} clients needs delta well below 1/{cfg.clients} (a mechanism that "
            f"publishes one client in full would meet delta >= 1/{cfg.clients})", f"set --delta <= {default_delta(cfg.clients):g}")
    planner = PrivacyPlanner(sampler.accounted(), cfg.rounds,
                             None if cfg.secure else (lambda rounds: sampler.participation_counts(_random(cfg), rounds)),
                             lambda n: 1, None)

    def main(z: float):
        return guarantees([Mechanism.gaussian("cli", z, 1.0, cfg.placement, ("update",))], sampler.accounted(),
                          secure=cfg.secure)[0]

    t0 = time.perf_counter()
    z = planner.calibrate(main, cfg.epsilon, cfg.delta, cfg.accountant)
    took = time.perf_counter() - t0
    g = main(z)
    steps = planner.compositions(g, g.profiles[0], cfg.delta)
    achieved = epsilon(g.release, steps, cfg.delta - planner.tail(cfg.delta), cfg.accountant)
    print(f"noise_multiplier = {z:.6g}  (sigma = z * C; epsilon {achieved.epsilon:.4f} at delta "
          f"{cfg.delta:g} after {cfg.rounds} rounds, {achieved.method}; {g.description}; {took:.3f} s)")


def _plan_selection(cfg: Any) -> None:
    """``dpfl privacy plan --selection FIT.yaml``: epsilon of the selected result of a private-selection
    sweep of that run against the mean number of trials (and of one run, and of a grid of that many)."""
    from dpfl_lightning.cli.sweep_command import plan_fit
    from dpfl_lightning.privacy.selection_calibration import format_plan, selection_plan

    planned = plan_fit(["--config", cfg.selection], cfg.selection)
    require(planned is not None, "--selection", cfg.selection, "is not a DP run (no privacy guarantee)",
            "give the config of a DP run")
    one = max(planned.trials, key=lambda t: float(t.rdp().max()))  # a run of several profiles: its worst
    rows = selection_plan(one, cfg.delta, cfg.distribution, cfg.shape, cfg.means,
                          cfg.accountant)
    own = "" if planned.delta == cfg.delta else f" (the run's own ledger is at delta={planned.delta:g})"
    print(f"{cfg.selection}: {planned.granularity}-level, {planned.audience}, at --delta={cfg.delta:g}{own}")
    print(format_plan(rows, cfg.delta, cfg.distribution))


def _plan(cfg: Any) -> None:
    if cfg.selection:
        return _plan_selection(cfg)
    require(cfg.epsilon is not None and cfg.noise, "--epsilon / --noise", None, "the rounds table needs both",
            "give --epsilon E --noise [z1,z2,...], or --selection FIT.yaml")
    require(0 < cfg.delta < 1.0 / cfg.records, "--delta", cfg.delta,
            f"record-level DP over {cfg.records} records per client needs delta well below 1/{cfg.records}",
            f"set --delta <= {default_delta(cfg.records):g} (or give --records, the records per client)")
    require(all(k >= 1 for k in cfg.local_steps), "--local_steps", cfg.local_steps, "must be >= 1", "give positive K")
    table = Table(title=f"largest number of rounds a client can take part in at epsilon={cfg.epsilon:g}, "
                        f"delta={cfg.delta:g} (record-level DP-SGD, Poisson rate {cfg.record_rate:g}, {cfg.accountant})")
    table.add_column("noise multiplier", justify="right")
    for k in cfg.local_steps:
        table.add_column(f"K={k}", justify="right")
    for z in cfg.noise:
        steps = max_steps(z, cfg.epsilon, cfg.delta, cfg.record_rate, accountant=cfg.accountant)
        table.add_row(f"{z:g}", *[str(steps // k) for k in cfg.local_steps])
    Console().print(table)
    if cfg.paper001:
        _plan_paper001(cfg)


def _plan_paper001(cfg: Any) -> None:
    """Paper 001's Table 1 trade-off: its own accountant next to dp_accounting's, same settings."""
    from dpfl_lightning.privacy import paper001

    args = dict(l=cfg.client_rate, s=cfg.record_rate, R=cfg.records, M=cfg.clients, delta=cfg.delta)
    table = Table(title=f"rounds T at epsilon={cfg.epsilon:g}, delta={cfg.delta:g}: paper 001's accountant "
                        f"(third party, l={cfg.client_rate:g}, s={cfg.record_rate:g}, M={cfg.clients}, R={cfg.records}) "
                        "/ dp_accounting, user sample revealed")
    table.add_column("sigma_g", justify="right")
    for k in cfg.local_steps:
        table.add_column(f"K={k}", justify="right")
    for z in cfg.noise:
        cells = [f"{paper001.max_rounds(cfg.epsilon, z, k, **args)} / "
                 f"{paper001.modern_max_rounds(cfg.epsilon, z, k, method='participation', **args)}"
                 for k in cfg.local_steps]
        table.add_row(f"{z:g}", *cells)
    Console().print(table)


def run(parser: Any, cfg: Any) -> None:
    pcfg = cfg.privacy
    if pcfg.privacy_command == "epsilon":
        from dpfl_lightning.cli.run_objects import federated_data

        sub = pcfg.epsilon
        init = parser.instantiate_classes(cfg).privacy.epsilon
        data = federated_data(init.data, sub.split)  # a plain LightningDataModule is split as `dpfl fit` splits it
        ledger = plan_run(init.trainer, data, sub.accountant, sub.delta, getattr(init, "model", None))
        _print_epsilon(init.trainer, ledger)
    elif pcfg.privacy_command == "calibrate":
        _calibrate(pcfg.calibrate)
    elif pcfg.privacy_command == "theory":
        t = pcfg.theory
        print(scaffnew_optimal(t.mu, t.L, t.epsilon, t.delta, t.C, t.N, t.d, t.psi0, t.v).describe())
    else:
        _plan(pcfg.plan)
