"""Setting a run up: device, ranks, randomness, the module's flat layout, the plugins, the payload
layout, the privacy mechanisms and ledger, the release list, and the checks of a DP run.

:func:`build_run` does it once per ``fit``, in this order:

1. device, communicator, threads; the data split and the client sampler; the random source
   (secure mode: a fresh secret from rank 0);
2. the module's ``setup("fit")`` and ``configure_model()``, the plugins' ``configure_model``, the
   module's flat buffers (rank 0's initial model everywhere);
3. a default server optimizer; norm bounds; every plugin's ``setup`` (calibration happens here);
4. the mechanisms they declare; a privacy ledger when there is any (then the run is *private*);
5. the payload layout and the release list; the checks of a DP run (every payload segment covered
   by a mechanism, uniform weighting, no per-client evaluation, ...).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from dpfl_lightning import rng
from dpfl_lightning.federated import frozen
from dpfl_lightning.federated.placement import available_cpus
from dpfl_lightning.run.checkpoint_format import check_state_keys
from dpfl_lightning.plugins.contexts import ServerContext, SetupContext
from dpfl_lightning.plugins.metric_keys import undeclared_metrics, undeclared_warning
from dpfl_lightning.errors import require
from dpfl_lightning.tracking.loggers import noise_multiplier_notes, print_privacy_lines
from dpfl_lightning.federated.payload import UPDATE, PayloadLayout, Segment, check_coverage
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.federated.public_sizes import public_records
from dpfl_lightning.plugins.privacy_ledger import PrivacyLedger
from dpfl_lightning.plugins.sensitivity import SensitivityBound
from dpfl_lightning.plugins.server_optimizer import ServerOptimizer
from dpfl_lightning.plugins.setup_checks import check_pairings
from dpfl_lightning.privacy.guarantees import Guarantee, guarantees
from dpfl_lightning.privacy.planning import PrivacyPlanner
from dpfl_lightning.federated.releases import MetricRelease, ReleaseList
from dpfl_lightning.federated.sampling import ClientSampler

if TYPE_CHECKING:
    from dpfl_lightning.comm import Communicator
    from dpfl_lightning.run.settings import TrainerSettings


def _set_rank_zero(rank: int) -> None:
    """Lightning reads the rank from RANK/LOCAL_RANK/SLURM_PROCID only; under mpiexec every process
    would think it is rank 0 (two W&B runs). Set it from the communicator."""
    from lightning.fabric.utilities import rank_zero as fabric_rz
    from lightning.pytorch.utilities import rank_zero as pl_rz
    from lightning_utilities.core import rank_zero as util_rz

    for mod in (fabric_rz, pl_rz, util_rz):
        mod.rank_zero_only.rank = rank


@dataclass
class RunSetup:
    """What :func:`build_run` settled for one ``fit``."""

    device: torch.device
    sampler: ClientSampler
    random: rng.RandomSource
    ctx: SetupContext
    layout: PayloadLayout
    releases: ReleaseList
    ledger: PrivacyLedger | None
    plan_template: dict[str, Any]
    weighting: str
    notes: list[str] = field(default_factory=list)
    max_client_samples: float = 1.0
    plugins: list = field(default_factory=list)  # every plugin of the run, in order (with the defaults added)
    threads: int = 1  # torch threads of this rank
    allgather: Callable[[Any], list[Any]] = field(default=lambda obj: [obj])  # the ranks' collectives (ServerContext)
    alltoall: Callable[[list[Any]], list[Any]] = field(default=lambda objs: list(objs))

    @property
    def private(self) -> bool:
        return self.releases.private

    @property
    def gathers_client_logs(self) -> bool:
        """Whether what the module logs during local training is gathered and logged."""
        return self.releases.allows("unaccounted")

    def default_plan(self, round_idx: int) -> RoundPlan:
        """Round ``round_idx``'s plan before plugins edit it: the sampled cohort and the trainer's
        local-work settings."""
        cohort = tuple(self.sampler.sample(self.random, round_idx))
        t = self.plan_template
        return RoundPlan(round_idx, cohort, t["local_steps"], t["local_epochs"], t["batch_size"], "shuffle",
                         t["client_lr_decay"] ** round_idx, records_per_client=t["records_per_client"])

    def plan_round(self, round_idx: int, module: Any, client_state: Any, stop: Any,
                   clients_on_rank: Any) -> tuple[RoundPlan, ServerContext]:
        """Round ``round_idx``'s plan (the trainable parameters marked) and its server context
        (``clients_on_rank(plan)``: the clients of a plan this rank trains)."""
        plan = self.default_plan(round_idx)
        plan.trainable = frozen.trainable_mask(module.parameter_list, module.parameter_slices, module.num_parameters,
                                               self.device)
        last = self.ctx.rounds
        server = ServerContext(round_idx, plan, self.random, self.ctx.data.num_clients, module.global_params,
                               client_state=client_state, stop=stop,
                               next_plan=lambda: self.default_plan(round_idx + 1) if round_idx + 1 < last else None,
                               clients_on_rank=clients_on_rank, allgather=self.allgather, alltoall=self.alltoall)
        return plan, server

    def denominator(self, plan: RoundPlan, sums: dict[str, torch.Tensor]) -> float:
        """What the update sum is divided by: total weight, expected cohort (Poisson: the realised
        size is not public) or the cohort size."""
        if self.weighting == "samples":
            return float(sums["weight"][0])
        if not self.sampler.cohort_size_is_public:  # Poisson, amplified cyclic
            return self.sampler.expected_cohort
        return float(len(plan.cohort))

    def privacy_lines(self) -> list[str]:
        if self.ledger is None or not self.ledger.guarantees:
            return list(self.notes)
        return list(self.ledger.describe()) + noise_multiplier_notes(self.ledger, self.ctx.mechanisms) + self.notes

    def print_privacy_statement(self, verbose: bool) -> None:
        if verbose and self.private:
            print_privacy_lines(self.privacy_lines())

    def print_release_notes(self) -> None:
        if self.private:
            print_privacy_lines(self.releases.describe())


def _random_source(settings: TrainerSettings, comm: Communicator) -> rng.RandomSource:
    if not settings.secure:
        return rng.RandomSource(settings.seed)
    secret = rng.new_secret() if comm.rank == 0 else None
    secret = comm.broadcast_object(secret, root=0) if comm.size > 1 else secret
    return rng.RandomSource(settings.seed, secret)


def prepare_privacy(settings: TrainerSettings, comm: Communicator, data: Any, module: Any = None,
                    device: torch.device | None = None, num_parameters: int | None = None) -> SetupContext:
    """The data split, client sampler, random source and set-up context of a run (also used to
    plan privacy without a model: ``module=None``, with the model's ``num_parameters`` if known)."""
    data.setup()
    rate = settings.sampling_rate
    if settings.sampling == "poisson" and rate is None and settings.clients_per_round is not None:
        rate = settings.clients_per_round / data.num_clients
    sampler = ClientSampler(settings.sampling, data.num_clients, settings.clients_per_round, rate)
    random = _random_source(settings, comm)
    records = public_records(settings, data)
    plan = RoundPlan(0, (), settings.local_steps, settings.local_epochs, settings.batch_size,
                     records_per_client=records)
    participations = None if random.secure else (lambda rounds: sampler.participation_counts(random, rounds))
    planner = PrivacyPlanner(sampler.accounted(), settings.rounds, participations, plan.steps_for, records)
    ctx = SetupContext(module, data, sampler, plan, settings.rounds, random, planner, device or torch.device("cpu"),
                       comm.rank, comm.size, settings.enable_summary, settings.weighting,
                       settings.normalize_update_by_lr)
    ctx.num_parameters = num_parameters
    return ctx


def setup_plugins(plugins: list, ctx: SetupContext) -> tuple[list, PrivacyLedger | None]:
    """Every plugin's ``setup`` (bounds first known), then the declared mechanisms and the ledger;
    the run's plugins in order (with a default server optimizer and ledger where none is given)."""
    plugins = list(plugins)
    if ctx.module is not None and not any(isinstance(p, ServerOptimizer) for p in plugins):
        plugins.append(ServerOptimizer("sgd", lr=1.0))
    plugins.sort(key=lambda p: p.order)
    require(sum(isinstance(p, ServerOptimizer) for p in plugins) <= 1, "trainer.plugins",
            [type(p).__name__ for p in plugins], "more than one ServerOptimizer", "keep one ServerOptimizer")
    ctx.positions = {id(p): i for i, p in enumerate(plugins)}
    ctx.norm_bounds = [(i, p.segments, (lambda p=p: p.max_norm)) for i, p in enumerate(plugins)
                       if isinstance(p, SensitivityBound)]
    ctx.moving_bounds = [(i, p.segments, type(p).__name__) for i, p in enumerate(plugins)
                         if isinstance(p, SensitivityBound) and p.bound_moves]
    ledgers = [p for p in plugins if isinstance(p, PrivacyLedger)]
    for p in plugins:
        if p not in ledgers:
            p.setup(ctx=ctx)
    check_pairings(plugins, ctx)
    calibrate_targets(plugins, ctx)
    collect_mechanisms(plugins, ctx)
    ctx.redeclare = lambda: collect_mechanisms(plugins, ctx)
    if ctx.mechanisms and not ledgers:
        ledgers = [PrivacyLedger()]
        plugins.append(ledgers[0])
    for ledger in ledgers:
        ledger.setup(ctx=ctx)
    check_state_keys(plugins)
    return plugins, (ledgers[0] if ledgers else None)


def collect_mechanisms(plugins: list, ctx: SetupContext) -> list:
    """Every mechanism the plugins declare now (also after a resume restored calibrated noise, and
    every round, for the ledger's check that none has drifted)."""
    ctx.mechanisms = []  # in plugin order: a plugin sees the mechanisms of those before it (FedEXP's xi)
    for p in plugins:
        if not isinstance(p, PrivacyLedger):
            ctx.mechanisms.extend(p.privacy_mechanisms(ctx=ctx))
    return ctx.mechanisms


def calibrate_targets(plugins: list, ctx: SetupContext) -> None:
    """Give every plugin with a target epsilon (``plugin.calibration``) the smallest noise
    multiplier for which its guarantee -- composed with every other mechanism the run declares in
    that guarantee (an adaptive clip's noisy count, FedEXP's xi) -- stays within the target."""
    for p in plugins:
        target = getattr(p, "calibration", None)
        if target is None:
            continue
        epsilon, delta, accountant = target
        name = guarantees(p.privacy_mechanisms(ctx=ctx), ctx.sampler.accounted())[0].name

        def guarantee_at(z: float, p: Any = p, name: str = name) -> Guarantee:
            p.use_noise_multiplier(z)
            found = guarantees(collect_mechanisms(plugins, ctx), ctx.sampler.accounted())
            return next((g for g in found if g.name == name), None) or \
                next(g for g in found if g.granularity == "client")

        p.use_noise_multiplier(ctx.privacy.calibrate(guarantee_at, epsilon, delta, accountant))


def _payload(settings: TrainerSettings, plugins: list, ctx: SetupContext, d: int, private: bool,
             opt_in: bool) -> PayloadLayout:
    segments = [Segment(UPDATE, d, "model")]
    for p in plugins:
        segments += p.payload_segments(ctx=ctx)
    if settings.on_nonfinite == "raise":
        segments.append(Segment("nonfinite", 1, "control"))  # stops the run; never logged
    elif not private or opt_in:
        segments.append(Segment("skipped", 1, "data"))
    if settings.weighting == "samples":
        segments.append(Segment("weight", 1, "data"))
    return PayloadLayout(segments)


def _check_private_run(settings: TrainerSettings, ctx: SetupContext, layout: PayloadLayout, opt_in: bool) -> None:
    """What a DP run refuses: data-dependent weights, per-client evaluation and payload segments no
    mechanism covers (unless un-noised statistics are released knowingly)."""
    require(settings.weighting == "uniform", "trainer.weighting", settings.weighting,
            "weighting clients by their data size is a data-dependent, un-noised release and changes "
            "the sensitivity", "use weighting='uniform' with DP plugins")
    require(not settings.eval_per_client or opt_in, "trainer.eval_per_client", True,
            "per-client evaluation logs un-noised statistics of every client's data in a DP run",
            "set eval_per_client=False, or log_client_metrics=True to release them knowingly")
    covered: dict[str, list[str]] = {}
    for m in ctx.mechanisms:
        for seg in m.covers:
            covered.setdefault(seg, []).append(m.source)
    record_level = any(m.granularity == "record" for m in ctx.mechanisms)
    locally = {seg for m in ctx.mechanisms if m.placement == "local" for seg in m.covers}
    checked = PayloadLayout([s for s in layout.segments if s.source != "control" and not (opt_in and s.source == "data")])
    check_coverage(checked, covered, record_level, locally)


def warn_local_noise_without_local_guarantee(mechanisms: list) -> None:
    """Local noise next to a central mechanism buys no guarantee towards the server: the server sees
    the centrally noised segment of each client in the clear (``AdaptiveClip``'s clip bit with its
    default central count), so the run can report only the guarantee towards those who see the models
    (trusted aggregator). Said at set-up, naming the mechanisms; the ledger reports what is used."""
    client = [m for m in mechanisms if m.granularity == "client"]
    local = sorted({m.source for m in client if m.placement == "local"})
    central = [m for m in client if m.placement == "central"]
    if not local or not central:
        return
    clear = ", ".join(sorted({f"{m.source}'s {'/'.join(m.covers)}" for m in central}))
    warnings.warn(f"{', '.join(local)}: placement='local' gives no local DP in this run: {clear} "
                  f"{'is' if len(central) == 1 else 'are'} noised centrally, so each client sends {clear} to the "
                  "server un-noised and the ledger reports only client-level DP towards anyone who sees the models "
                  "(client_central, trusted aggregator), with no guarantee towards the server. For a guarantee "
                  "towards the server, noise every segment a client sends at the client: a fixed UpdateClipping "
                  "instead of AdaptiveClip (local DP), or AdaptiveClip(placement='distributed') (DP towards a server "
                  "that sees only the securely aggregated sum)",
                  RuntimeWarning, stacklevel=4)


def _notes(settings: TrainerSettings, data: Any, layout: PayloadLayout, opt_in: bool) -> list[str]:
    notes = []
    if settings.secure:
        notes.append("secure mode: noise and sampling come from a CSPRNG keyed by a secret that is neither logged "
                     "nor checkpointed (floating-point mitigation: sum of four Gaussians)")
    else:
        notes.append(f"simulation: cohorts, batches and noise are keyed by seed={settings.seed}, which is in the "
                     "config and the logs; the guarantee holds only towards someone who does not know the seed "
                     "(trainer.secure=true for data that must be protected)")
    if data.test_set_from_clients:
        notes.append(f"the evaluation set of {type(data).__name__} is drawn from the clients' own data: the logged "
                     "evaluation metrics are releases about those clients that no mechanism accounts for")
    unaccounted = [s.name for s in layout.segments if s.source == "data" and opt_in]
    if unaccounted:
        notes.append("payload statistics sent without noise (log_client_metrics=True), not accounted: "
                     + ", ".join(unaccounted))
    return notes


def _threads(settings: TrainerSettings, comm: Communicator) -> int:
    """Torch threads of this rank: the setting, else ``OMP_NUM_THREADS``, else this node's cores over
    its ranks; oversubscribing the node is warned about."""
    cpus, per_rank = available_cpus(), max(1, available_cpus() // comm.local_size)
    threads = settings.num_threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or per_rank
    if threads * comm.local_size > cpus and comm.local_rank == 0:
        warnings.warn(f"trainer.num_threads: {comm.local_size} rank(s) x {threads} torch thread(s) on a node with {cpus} "
                      f"core(s) oversubscribe it, and ranks waiting in the all-reduce compete with the ones computing "
                      f"(benchmarks/round_overhead.py measured up to 26x slower rounds); set num_threads (or "
                      f"OMP_NUM_THREADS) to at most {per_rank}, or leave both unset", RuntimeWarning, stacklevel=4)
    torch.set_num_threads(threads)
    return threads


def _device(settings: TrainerSettings, comm: Communicator) -> torch.device:
    if settings.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if settings.wants_cuda():
        device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _prepare_model(comm: Communicator, module: Any, data: Any, plugins: list, ctx: SetupContext,
                   device: torch.device) -> None:
    """The module's ``setup("fit")``/``configure_model()``, the plugins' ``configure_model``, the flat
    buffers; every rank starts from rank 0's initial parameters, whatever its random state was."""
    data.to(device)
    module.prepare("fit")  # the module's setup("fit") and configure_model(): layers they build are federated too
    for p in plugins:  # e.g. DP-SGD may replace layers Opacus cannot handle
        module.inner = p.configure_model(ctx=ctx, model=module.inner)
    module.setup(device, comm.rank, comm.size, comm.local_rank)
    comm.broadcast_(module.global_params, root=0)
    module.load_global()


def build_run(settings: TrainerSettings, comm: Communicator, module: Any, data: Any, plugins: list,
              algorithm: Any = None) -> RunSetup:
    """Set up one ``fit`` (see the module docstring)."""
    if algorithm is not None:
        algorithm.validate(settings)
    _set_rank_zero(comm.rank)
    threads = _threads(settings, comm)
    device = _device(settings, comm)
    # Lightning's prepare_data (downloads): on each node's local rank 0 first, the other ranks wait.
    if comm.local_rank == 0:
        data.prepare_data()
        if callable(getattr(module.inner, "prepare_data", None)):
            module.inner.prepare_data()
    comm.barrier()
    data.prepare_data(call=False)
    ctx = prepare_privacy(settings, comm, data, module, device)
    M = data.num_clients
    require(comm.size <= M, "mpiexec -n", comm.size, f"more ranks than clients (data.num_clients={M})",
            f"launch at most {M} ranks or use more clients")
    _prepare_model(comm, module, data, plugins, ctx, device)

    plugins, ledger = setup_plugins(plugins, ctx)
    private = bool(ctx.mechanisms)
    opt_in = bool(settings.log_client_metrics) if settings.log_client_metrics is not None else not private
    layout = _payload(settings, plugins, ctx, module.num_parameters, private, opt_in)
    releases = ReleaseList(private, opt_in)
    for p in plugins:
        releases.declare(*p.released_metrics(ctx=ctx))
    releases.declare(MetricRelease("round", "public", "trainer"))
    if private:
        _check_private_run(settings, ctx, layout, opt_in)
        if comm.rank == 0:
            warn_local_noise_without_local_guarantee(ctx.mechanisms)
    if private and not opt_in:  # what the plugins' code logs undeclared: withheld, so named once here
        missing, unread = undeclared_metrics(plugins, releases)
        releases.undeclared = sorted({k for keys in missing.values() for k in keys})
        message = undeclared_warning(missing, unread)
        if message and comm.rank == 0:
            warnings.warn(message, UserWarning, stacklevel=2)
    if comm.rank == 0:
        data.warn_nonfinite(private)
    notes = _notes(settings, data, layout, opt_in) if private else []
    template = {"local_steps": settings.local_steps, "local_epochs": settings.local_epochs,
                "batch_size": settings.batch_size, "client_lr_decay": settings.client_lr_decay,
                "records_per_client": ctx.plan.records_per_client}
    return RunSetup(device, ctx.sampler, ctx.random, ctx, layout, releases, ledger, template, settings.weighting, notes,
                    max_client_samples=float(max(data.client_num_samples(c) for c in range(data.num_clients))),
                    plugins=plugins, threads=threads, allgather=comm.allgather_object, alltoall=_alltoall(comm))


def _alltoall(comm: Communicator) -> Callable[[list[Any]], list[Any]]:
    """``alltoall(objs)``: ``objs[r]`` goes to rank ``r`` only (one gather to each rank in turn);
    returns what each rank sent this one, by rank (collective)."""

    def alltoall(objs: list[Any]) -> list[Any]:
        if len(objs) != comm.size:
            raise ValueError(f"alltoall: {len(objs)} objects for {comm.size} ranks (one per rank)")
        if comm.size == 1:
            return list(objs)
        received = None
        for root in range(comm.size):
            got = comm.gather_object(objs[root], root=root)
            if root == comm.rank:
                received = got
        return received

    return alltoall
