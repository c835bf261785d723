"""FederatedTrainer: the round loop.

One round ``t``:

1. sample the cohort ``S_t`` (same on every rank: keyed by (seed, t));
2. each rank trains the clients of ``S_t`` it owns (client ``c`` lives on rank ``c mod P``) from the
   global model, through the executor; each client's update is a row of one buffer;
3. ``on_client_end`` plugins bound and noise each row; non-finite rows are caught here;
4. one order-independent all-reduce sums the rows (and per-client scalars) over all ranks;
5. ``on_aggregate`` plugins (central noise), mean update, ``on_server_update`` (step sizes, the
   server optimizer moves the global model);
6. evaluation, ``on_round_end``, logging, checkpoint.

Everything random is keyed by (seed, round, client), and the all-reduce is exact, so ``mpiexec -n 1``,
``-n 2`` and ``-n 4`` give bit-identical models for the same seed and threads per rank.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
from lightning.pytorch.loggers import Logger

from dpfl_lightning import checkpoint as ckpt
from dpfl_lightning.algorithms import Algorithm
from dpfl_lightning.comm import Communicator, ExactSum, FloatSum, make_communicator
from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import ConfigError, NonFiniteUpdateError, require
from dpfl_lightning.executor import Executor, SequentialExecutor, VmapExecutor
from dpfl_lightning.logged_metrics import merge
from dpfl_lightning.loggers import RoundProgress, make_csv_logger, print_summary
from dpfl_lightning.module import FederatedLightningModule, is_lightning_module
from dpfl_lightning.plugins.base import Aggregate, ClientUpdate, FederatedCallback
from dpfl_lightning.plugins.server_optimizer import ServerOptimizer
from dpfl_lightning.privacy.ledger import PrivacyLedger
from dpfl_lightning.sampling import ClientSampler

HOOKS = ("before_round", "on_round_start", "on_client_start", "on_before_optimizer_step", "wrap_optimizer", "on_client_end", "on_aggregate",
         "on_server_update", "on_round_end", "on_fit_start", "on_fit_end")
_BUILTIN_SCALARS = ("weight", "nonfinite")
EXECUTORS = {"sequential": SequentialExecutor, "vmap": VmapExecutor}


def _set_rank_zero(rank: int) -> None:
    """Lightning reads the rank from RANK/LOCAL_RANK/SLURM_PROCID only; under mpiexec every process
    would think it is rank 0 (two W&B runs). Set it from the communicator."""
    from lightning.fabric.utilities import rank_zero as fabric_rz
    from lightning.pytorch.utilities import rank_zero as pl_rz
    from lightning_utilities.core import rank_zero as util_rz

    for mod in (fabric_rz, pl_rz, util_rz):
        mod.rank_zero_only.rank = rank


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class FederatedTrainer:
    """Run federated training of a :class:`FederatedLightningModule` on a :class:`FederatedDataModule`.

    Args:
        rounds: communication rounds ``T``.
        clients_per_round: cohort size ``m`` (``None``: full participation).
        sampling: ``uniform`` (``m`` without replacement; default with ``clients_per_round``),
            ``poisson`` (rate ``sampling_rate``, default ``m / M``) or ``full`` (default without it).
        sampling_rate: Poisson rate ``q``.
        local_epochs / local_steps: local work per client per round (one of them; default 1 epoch).
        batch_size: local batch size; ``None`` for full-batch (full local gradient) steps.
        client_lr_decay: the client learning rate of round ``t`` is ``lr * client_lr_decay**t``
            (paper 003 App. H uses 0.99).
        normalize_update_by_lr: send ``(local - global) / lr`` instead of ``local - global``
            (paper 003 Alg. 1 line 9: clip/normalize in units of gradients).
        weighting: ``uniform`` (every client counts once; required with DP noise) or ``samples``
            (FedAvg's weighting by local dataset size).
        algorithm: a preset from :mod:`dpfl_lightning.algorithms`; its plugins run before ``plugins``.
        plugins: :class:`~dpfl_lightning.plugins.FederatedCallback` instances.
        eval_every: evaluate the global model every this many rounds (and after the last).
        eval_per_client: also evaluate on every client's own data (mean and 10th percentile).
        seed: keys all randomness: (seed, round, client).
        accelerator: ``auto``, ``cpu`` or ``cuda`` (rank ``r`` uses ``cuda:(local_rank % n_gpus)``).
        communicator: ``auto``, ``local``, ``mpi``, ``nccl`` or ``gloo``.
        num_threads: torch threads per rank (default: cores / ranks on this node).
        exact_aggregation: order-independent fixed-point sum (bit-identical for any number of
            ranks); ``False`` uses a float64 all-reduce.
        deterministic: ``torch.use_deterministic_algorithms(True)`` (for CUDA kernels).
        on_nonfinite: ``raise`` (stop; nothing of the round is applied) or ``skip`` (the client's
            update counts as zero, and the round goes on).
        log_dir / run_name: where the CSV log (and checkpoints) go.
        loggers: extra Lightning loggers, e.g. :class:`~dpfl_lightning.loggers.WandbLogger`.
        enable_progress_bar / enable_summary: the console progress bar and end-of-run table.
        checkpoint_every: write a checkpoint every this many rounds (and after the last); ``None``: never.
        checkpoint_dir: default ``<log_dir>/<run_name>/checkpoints``.
        executor: ``sequential`` (every hook, any module) or ``vmap`` (clients of a rank trained
            together with ``torch.func.vmap``; see :class:`~dpfl_lightning.executor.VmapExecutor`).
        log_client_metrics: log what the module's ``training_step`` records (e.g. the training
            loss, averaged over the cohort) and allow ``eval_per_client``. These are statistics of
            raw client data with no noise: ``None`` (default) logs them only when no plugin
            declares a DP mechanism; ``True`` with DP is an explicit, unaccounted release.
    """

    def __init__(
        self,
        rounds: int = 10,
        clients_per_round: int | None = None,
        sampling: str | None = None,
        sampling_rate: float | None = None,
        local_epochs: int | None = None,
        local_steps: int | None = None,
        batch_size: int | None = 32,
        client_lr_decay: float = 1.0,
        normalize_update_by_lr: bool = False,
        weighting: str = "uniform",
        algorithm: Algorithm | None = None,
        plugins: list[FederatedCallback] | None = None,
        eval_every: int = 1,
        eval_per_client: bool = False,
        seed: int = 0,
        accelerator: str = "auto",
        communicator: str = "auto",
        num_threads: int | None = None,
        exact_aggregation: bool = True,
        deterministic: bool = False,
        on_nonfinite: str = "raise",
        log_dir: str = "runs",
        run_name: str | None = None,
        loggers: list[Logger] | None = None,
        enable_progress_bar: bool = True,
        enable_summary: bool = True,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | None = None,
        executor: str = "sequential",
        log_client_metrics: bool | None = None,
    ) -> None:
        self.hparams = {k: v for k, v in locals().items() if k not in ("self", "plugins", "loggers", "algorithm")}
        self.hparams["plugins"] = [repr(p) for p in plugins or []]
        self.hparams["algorithm"] = repr(algorithm) if algorithm is not None else None
        require(isinstance(rounds, int) and rounds >= 1, "trainer.rounds", rounds, "must be an integer >= 1", "set rounds >= 1")
        require(local_epochs is None or local_steps is None, "trainer.local_steps", local_steps,
                "local_epochs and local_steps are both set", "set only one of them")
        if local_epochs is None and local_steps is None:
            local_epochs = 1
        if local_epochs is not None:
            require(local_epochs >= 1, "trainer.local_epochs", local_epochs, "must be >= 1", "set local_epochs >= 1")
        if local_steps is not None:
            require(local_steps >= 1, "trainer.local_steps", local_steps, "must be >= 1", "set local_steps >= 1")
        require(batch_size is None or batch_size >= 1, "trainer.batch_size", batch_size, "must be >= 1 or None",
                "set a positive batch size (None: full batch)")
        require(clients_per_round is None or clients_per_round >= 1, "trainer.clients_per_round", clients_per_round,
                "must be >= 1", "set clients_per_round >= 1 (or leave it unset for full participation)")
        require(0 < client_lr_decay <= 1, "trainer.client_lr_decay", client_lr_decay, "must be in (0, 1]",
                "set e.g. 0.99")
        require(weighting in ("uniform", "samples"), "trainer.weighting", weighting, "unknown weighting",
                "use 'uniform' or 'samples'")
        require(eval_every >= 1, "trainer.eval_every", eval_every, "must be >= 1", "set eval_every >= 1")
        require(on_nonfinite in ("raise", "skip"), "trainer.on_nonfinite", on_nonfinite, "unknown policy",
                "use 'raise' or 'skip'")
        require(accelerator in ("auto", "cpu", "cuda", "gpu"), "trainer.accelerator", accelerator,
                "unknown accelerator", "use auto, cpu or cuda")
        require(num_threads is None or num_threads >= 1, "trainer.num_threads", num_threads, "must be >= 1",
                "set num_threads >= 1 or leave it unset")
        require(checkpoint_every is None or checkpoint_every >= 1, "trainer.checkpoint_every", checkpoint_every,
                "must be >= 1", "set checkpoint_every >= 1 or leave it unset")
        if sampling is None:
            sampling = "full" if clients_per_round is None and sampling_rate is None else (
                "poisson" if sampling_rate is not None and clients_per_round is None else "uniform")
        self.rounds = rounds
        self.clients_per_round = clients_per_round
        self.sampling = sampling
        self.sampling_rate = sampling_rate
        self.local_epochs = local_epochs
        self.local_steps = local_steps
        self.batch_size = batch_size
        self.client_lr_decay = float(client_lr_decay)
        self.algorithm = algorithm
        self.normalize_update_by_lr = bool(normalize_update_by_lr or getattr(algorithm, "normalize_update_by_lr", False))
        self.weighting = weighting
        self.eval_every = eval_every
        self.eval_per_client = eval_per_client
        self.seed = int(seed)
        self.accelerator = accelerator
        self.communicator_kind = communicator
        self.num_threads = num_threads
        self.exact_aggregation = exact_aggregation
        self.deterministic = deterministic
        self.on_nonfinite = on_nonfinite
        self.log_dir = log_dir
        self.run_name = run_name or (getattr(algorithm, "name", None) or "dpfl")
        self.extra_loggers = list(loggers or [])
        self.enable_progress_bar = enable_progress_bar
        self.enable_summary = enable_summary
        self.checkpoint_every = checkpoint_every
        self.checkpoint_dir = checkpoint_dir or os.path.join(log_dir, self.run_name, "checkpoints")
        user_plugins = list(plugins or [])
        preset = list(algorithm.plugins()) if algorithm is not None else []
        self.plugins: list[FederatedCallback] = sorted(preset + user_plugins, key=lambda p: p.order)
        require(executor in EXECUTORS, "trainer.executor", executor, "unknown executor", f"use one of {', '.join(EXECUTORS)}")
        self.executor: Executor = EXECUTORS[executor]()
        self.batch_sampling = "shuffle"  # DP-SGD switches to the independent batches it accounts for
        self._log_client_metrics = log_client_metrics
        self.private = False
        self.config: dict[str, Any] | None = None  # the resolved run configuration, set by the CLI
        self.comm: Communicator | None = None
        self.history: list[dict[str, float]] = []
        self.client_states: dict[int, dict[str, Any]] = {}
        self.current_round = 0
        self.last_aggregate: Aggregate | None = None
        self.should_stop = False
        self.stop_reason: str | None = None

    # ------------------------------------------------------------------ public helpers
    def owner(self, client: int) -> int:
        """The rank that trains ``client`` and keeps its state."""
        return client % self.world_size

    @property
    def world_size(self) -> int:
        return self.comm.size if self.comm is not None else 1

    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    def client_state(self, client: int) -> dict[str, Any]:
        """Mutable per-client state (e.g. control variates), kept by the owning rank and checkpointed
        by client id."""
        return self.client_states.setdefault(client, {})

    def call_hook(self, name: str, **kwargs: Any) -> None:
        for p in self._hooks[name]:
            getattr(p, name)(trainer=self, **kwargs)

    def step_hook(self, client: int):
        """The ``on_before_optimizer_step`` dispatch for ``client`` (``None`` when no plugin needs it)."""
        plugins = self._hooks["on_before_optimizer_step"]
        if not plugins:
            return None

        def hook(optimizer: torch.optim.Optimizer) -> None:
            for p in plugins:
                p.on_before_optimizer_step(trainer=self, client=client, optimizer=optimizer)

        return hook

    def optimizer_wrapper(self, client: int, round_idx: int):
        """The ``wrap_optimizer`` chain for ``client`` (``None`` when no plugin wraps optimizers)."""
        plugins = self._hooks["wrap_optimizer"]
        if not plugins:
            return None

        def wrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            for p in plugins:
                optimizer = p.wrap_optimizer(trainer=self, client=client, round_idx=round_idx, optimizer=optimizer)
            return optimizer

        return wrap

    def stop(self, reason: str) -> None:
        """Ask the trainer to stop before the next round (all ranks must call it alike)."""
        self.should_stop = True
        self.stop_reason = reason

    # ------------------------------------------------------------------ set-up
    def _device_type(self) -> str:
        if self.accelerator in ("cuda", "gpu"):
            if not torch.cuda.is_available():
                raise ConfigError("trainer.accelerator", self.accelerator, "CUDA is not available on this machine",
                                  "use accelerator=auto or cpu")
            return "cuda"
        if self.accelerator == "auto" and torch.cuda.is_available():
            return "cuda"
        return "cpu"

    def prepare_sampling(self, data: FederatedDataModule) -> None:
        """Split the data and build the client sampler (also used to plan privacy without training)."""
        data.setup()
        self.data = data
        rate = self.sampling_rate
        if self.sampling == "poisson" and rate is None and self.clients_per_round is not None:
            rate = self.clients_per_round / data.num_clients
        self.sampler = ClientSampler(self.sampling, data.num_clients, self.clients_per_round, rate)

    def _setup(self, module: FederatedLightningModule, data: FederatedDataModule) -> None:
        if self.algorithm is not None:
            self.algorithm.validate(self)
        device_type = self._device_type()
        if self.comm is None:
            self.comm = make_communicator(self.communicator_kind, device_type)
        comm = self.comm
        _set_rank_zero(comm.rank)
        threads = self.num_threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, _cpus() // comm.local_size)
        torch.set_num_threads(threads)
        self.threads = threads
        if self.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if device_type == "cuda":
            self.device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

        self.prepare_sampling(data)
        M = data.num_clients
        require(comm.size <= M, "mpiexec -n", comm.size, f"more ranks than clients (data.num_clients={M})",
                f"launch at most {M} ranks or use more clients")
        data.to(self.device)
        for p in self.plugins:  # e.g. DP-SGD may swap in a DP-compatible copy of the model
            module.inner = p.configure_model(trainer=self, model=module.inner)
        module.setup(self.device, comm.rank, comm.size, comm.local_rank)
        # Every rank must start from the same global model, whatever its random state was when the
        # model was built: rank 0's initial parameters are the global model.
        comm.broadcast_(module.global_params, root=0)
        module.load_global()
        self.module, self.data = module, data
        self.aggregator = ExactSum() if self.exact_aggregation else FloatSum()

        if not any(isinstance(p, ServerOptimizer) for p in self.plugins):
            self.plugins.append(ServerOptimizer("sgd", lr=1.0))
        declares = any(type(p).privacy_mechanism is not FederatedCallback.privacy_mechanism for p in self.plugins)
        if declares and not any(isinstance(p, PrivacyLedger) for p in self.plugins):
            self.plugins.append(PrivacyLedger())
        self.plugins.sort(key=lambda p: p.order)
        self.private = declares
        self.log_client_metrics = (not declares) if self._log_client_metrics is None else self._log_client_metrics
        if declares:
            require(self.weighting == "uniform", "trainer.weighting", self.weighting,
                    "weighting clients by their data size is a data-dependent, un-noised release and changes "
                    "the sensitivity", "use weighting='uniform' with DP plugins")
            require(not self.eval_per_client or self.log_client_metrics, "trainer.eval_per_client", True,
                    "per-client evaluation logs un-noised statistics of every client's data in a DP run",
                    "set eval_per_client=False, or log_client_metrics=True to release them knowingly")
        require(sum(isinstance(p, ServerOptimizer) for p in self.plugins) == 1, "trainer.plugins",
                [type(p).__name__ for p in self.plugins], "more than one ServerOptimizer", "keep one ServerOptimizer")
        for p in self.plugins:
            p.setup(trainer=self, module=module)
        self._hooks = {h: [p for p in self.plugins if getattr(type(p), h) is not getattr(FederatedCallback, h)]
                       for h in HOOKS}
        self._scalar_names = list(_BUILTIN_SCALARS)
        for p in self.plugins:
            for name in p.aggregated_scalars:
                require(name not in self._scalar_names, f"{type(p).__name__}.aggregated_scalars", name,
                        "two plugins aggregate a scalar of the same name", "rename one of them")
                self._scalar_names.append(name)
        self._rows = torch.empty(0, module.num_parameters, device=self.device)
        self.executor.setup(self)

    # ------------------------------------------------------------------ fit
    def fit(self, module: Any, data: FederatedDataModule, ckpt_path: str | None = None) -> FederatedLightningModule:
        """Train for ``rounds`` rounds (continuing from ``ckpt_path`` if given); returns the module,
        whose wrapped LightningModule then holds the final global model."""
        if not isinstance(module, FederatedLightningModule):
            if not is_lightning_module(module):
                raise ConfigError("module", type(module).__name__, "is not a LightningModule",
                                  "wrap it: FederatedLightningModule(model, loss_fn=...)")
            module = FederatedLightningModule(module)
        require(isinstance(data, FederatedDataModule), "data", type(data).__name__, "is not a FederatedDataModule",
                "wrap it: FederatedDataModule.from_datamodule(dm, num_clients=...)")
        state = ckpt.load(ckpt_path) if ckpt_path else None
        self._setup(module, data)
        start = self._restore(state) if state is not None else 0
        loggers = self._make_loggers()
        progress = RoundProgress(self.rounds, start, self.enable_progress_bar and self.is_global_zero)
        self.call_hook("on_fit_start")
        t_fit = time.perf_counter()
        try:
            for r in range(start, self.rounds):
                cohort = self.sampler.sample(self.seed, r)
                self.call_hook("before_round", round_idx=r, cohort=cohort)
                if self.should_stop:
                    break
                self.current_round = r
                metrics = self._round(r, cohort)
                self.call_hook("on_round_end", round_idx=r, metrics=metrics)
                if r + 1 == self.rounds or self.should_stop:
                    metrics.update(self._final_test())
                self.history.append(metrics)
                if self.is_global_zero:
                    for lg in loggers:
                        lg.log_metrics(metrics, step=r + 1)
                        lg.save()
                progress.update(metrics)
                if self.checkpoint_every and ((r + 1) % self.checkpoint_every == 0 or r + 1 == self.rounds):
                    self.save_checkpoint(os.path.join(self.checkpoint_dir, f"round-{r + 1:06d}.ckpt"), r + 1)
        finally:
            progress.close()
            module.load_global()  # on failure too: the module shows the global model, not a client's
        self.call_hook("on_fit_end")
        if self.is_global_zero:
            for lg in loggers:
                lg.finalize("success")
        self.final_metrics = dict(self.history[-1]) if self.history else {}
        if self.enable_summary and self.is_global_zero:
            rows = {"rounds": len(self.history), "num_clients": self.data.num_clients, "ranks": self.world_size,
                    "seconds/round": (time.perf_counter() - t_fit) / max(len(self.history) - start, 1)}
            rows.update({k: v for k, v in self.final_metrics.items() if k not in ("round", "round_time_s")})
            if self.stop_reason:
                rows["stopped"] = self.stop_reason
            print_summary(f"{self.run_name}: done", rows)
        module.load_global()
        return module

    def _make_loggers(self) -> list[Any]:
        if not self.is_global_zero:
            return []
        loggers = [make_csv_logger(self.log_dir, self.run_name), *self.extra_loggers]
        config = self.config if self.config is not None else self._python_config()
        for lg in loggers:
            lg.log_hyperparams(config)
        self.csv_log_dir = loggers[0].log_dir
        return loggers

    def _python_config(self) -> dict[str, Any]:
        """The run's configuration when it was built in Python (the CLI passes its resolved YAML)."""
        def simple(obj: Any) -> dict[str, Any]:
            return {k: v for k, v in vars(obj).items()
                    if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None), list, tuple))}

        inner = self.module.inner
        hp = dict(getattr(inner, "hparams", {}) or {})
        return {"trainer": self.hparams,
                "model": {"class_path": f"{type(inner).__module__}.{type(inner).__qualname__}", "init_args": hp},
                "data": {"class_path": f"{type(self.data).__module__}.{type(self.data).__qualname__}",
                         "init_args": simple(self.data)}}

    # ------------------------------------------------------------------ one round
    def _round(self, r: int, cohort: list[int]) -> dict[str, float]:
        t0 = time.perf_counter()
        module, comm = self.module, self.comm
        self.call_hook("on_round_start", round_idx=r, cohort=cohort)
        mine = [c for c in cohort if self.owner(c) == comm.rank]
        if self._rows.shape[0] < len(mine):
            self._rows = torch.empty(len(mine), module.num_parameters, device=self.device)
        rows = self._rows[: len(mine)]
        module.logged.reset()
        runs = self.executor.train(self, mine, r, rows)
        train_logs = module.logged.results() if self.log_client_metrics else None

        results = []
        for k, (client, run) in enumerate(zip(mine, runs)):
            row = rows[k]
            if self.normalize_update_by_lr:
                row.div_(run.lr)
            result = ClientUpdate(client, r, row, run.samples, run.steps, run.lr)
            self.call_hook("on_client_end", result=result)
            results.append(result)
        # NaN/inf survive clipping, normalization and noise, so one check after the plugins catches
        # a non-finite raw update as well as a non-finite processed one (one pass over all rows).
        finite = torch.isfinite(rows).all(dim=1).tolist() if len(mine) else []
        extra_rows = []
        for k, (result, ok) in enumerate(zip(results, finite)):
            if not ok:
                # The client's update counts as zero, processed like any update: its noise share
                # (distributed) or local noise is drawn again from the same key, so the noise the
                # accountant assumes is all there. The raw update never reaches the global model.
                rows[k].zero_()
                result = ClientUpdate(result.client, r, rows[k], result.num_samples, result.steps, result.lr)
                self.call_hook("on_client_end", result=result)
                if not bool(torch.isfinite(rows[k]).all()):
                    raise NonFiniteUpdateError(f"round {r}: the plugins turned client {result.client}'s zero update "
                                               "into a non-finite one. Fix: check the plugins' settings")
            weight = float(self.data.client_num_samples(result.client)) if self.weighting == "samples" else 1.0
            if weight != 1.0:
                rows[k].mul_(weight)
            scalars = {"weight": weight, "nonfinite": 0.0 if ok else 1.0, **result.scalars}
            extra_rows.append([scalars.get(n, 0.0) for n in self._scalar_names])
        extras = torch.tensor(extra_rows, dtype=torch.float64).reshape(len(mine), len(self._scalar_names)).to(self.device)

        update_sum, extra_sum = self.aggregator(rows, extras, len(cohort), comm)
        scalars = dict(zip(self._scalar_names, extra_sum.tolist()))
        n_bad = int(round(scalars["nonfinite"]))
        if n_bad and self.on_nonfinite == "raise":
            bad = sorted(c for part in comm.allgather_object(
                [c for k, c in enumerate(mine) if extras[k, 1] > 0]) for c in part)
            raise NonFiniteUpdateError(
                f"round {r}: client(s) {bad} produced a non-finite (NaN/inf) update; nothing of this round was "
                "applied. Fix: lower the client learning rate, check the data, or set trainer.on_nonfinite='skip'")
        if self.weighting == "samples":
            denominator = scalars["weight"]
        elif self.sampler.kind == "poisson":
            denominator = self.sampler.expected_cohort
        else:
            denominator = float(len(cohort))
        agg = Aggregate(r, update_sum, scalars, len(cohort), denominator)
        self.call_hook("on_aggregate", aggregate=agg)
        if denominator > 0:
            update = agg.update_sum.div_(denominator)
            if not bool(torch.isfinite(update).all()):
                raise NonFiniteUpdateError(f"round {r}: the aggregated update is not finite; nothing was applied. "
                                           "Fix: check the noise settings and the client learning rate")
            self.call_hook("on_server_update", update=update, aggregate=agg)
        self.last_aggregate = agg

        metrics: dict[str, float] = {"round": r + 1}
        if not (self.private and self.sampler.kind == "poisson"):  # a Poisson cohort's size is not public
            metrics["clients"] = float(len(cohort))
        if n_bad:
            metrics["skipped_clients"] = float(n_bad)
        if self.log_client_metrics:
            metrics.update(merge(comm.allgather_object(train_logs)))
        module.load_global()
        if (r + 1) % self.eval_every == 0 or r + 1 == self.rounds:
            metrics.update(self._evaluate())
        metrics["round_time_s"] = time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self) -> dict[str, float]:
        out: dict[str, float] = {}
        module, data, comm = self.module, self.data, self.comm
        if not module.has_validation_step:
            return out
        if data.has_test_set:
            res = merge([module.evaluate(data.test_batches(), "validation")]) if comm.rank == 0 else None
            out.update(comm.broadcast_object(res, root=0) if comm.size > 1 else res)
        if self.eval_per_client:
            mine = [c for c in range(data.num_clients) if self.owner(c) == comm.rank]
            local = {c: merge([module.evaluate(data.client_eval_batches(c), "validation")]) for c in mine}
            per_client: dict[int, dict[str, float]] = {}
            for part in comm.allgather_object(local):
                per_client.update(part)
            for name in sorted({k for v in per_client.values() for k in v}):
                vals = torch.tensor([v[name] for v in per_client.values() if name in v], dtype=torch.float64)
                out[f"client_{name}_mean"] = float(vals.mean())
                out[f"client_{name}_p10"] = float(torch.quantile(vals, 0.1))
        return out

    def _final_test(self) -> dict[str, float]:
        module, data, comm = self.module, self.data, self.comm
        module.load_global()
        if not (module.has_test_step and data.has_test_set):
            return {}
        res = merge([module.evaluate(data.test_batches(), "test")]) if comm.rank == 0 else None
        return comm.broadcast_object(res, root=0) if comm.size > 1 else res

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_state(self, rounds_done: int) -> dict[str, Any] | None:
        gathered = self.comm.gather_object(self.client_states, root=0)
        if not self.is_global_zero:
            return None
        client_states: dict[int, dict[str, Any]] = {}
        for part in gathered:
            client_states.update(part)
        return {
            "format": ckpt.FORMAT,
            "round": rounds_done,
            "global_params": self.module.global_params.detach().cpu().clone(),
            "num_parameters": self.module.num_parameters,
            "num_clients": self.data.num_clients,
            "seed": self.seed,
            "sampler": (self.sampler.kind, self.sampler.clients_per_round, self.sampler.rate),
            "rng": {"scheme": "keyed by (seed, round, client)", "seed": self.seed},
            "plugins": [{"class": type(p).__name__, "state": p.state_dict()} for p in self.plugins],
            "client_states": client_states,
            "config": self.config if self.config is not None else self._python_config(),
            "history": list(self.history),
            "world_size": self.world_size,
        }

    def save_checkpoint(self, path: str, rounds_done: int | None = None) -> None:
        """Write a checkpoint (rank 0; every rank must call this) and point ``last.ckpt`` at it."""
        state = self._checkpoint_state(self.current_round + 1 if rounds_done is None else rounds_done)
        if state is not None:
            ckpt.save_atomic(state, path)
            last = os.path.join(os.path.dirname(path), "last.ckpt")
            tmp = last + f".tmp-{os.getpid()}"
            if os.path.exists(tmp):
                os.unlink(tmp)
            os.link(path, tmp)
            os.replace(tmp, last)
        self.comm.barrier()

    def _restore(self, state: dict[str, Any]) -> int:
        module, data = self.module, self.data
        sampler = (self.sampler.kind, self.sampler.clients_per_round, self.sampler.rate)
        for key, have in (("num_parameters", module.num_parameters), ("num_clients", data.num_clients), ("seed", self.seed),
                          ("sampler", sampler)):
            if state[key] != have:
                raise ConfigError("resume", state[key], f"the checkpoint's {key} differs from this run's ({have})",
                                  f"resume with the configuration that wrote the checkpoint ({key}={state[key]})")
        saved = state["plugins"]
        names = [type(p).__name__ for p in self.plugins]
        if [s["class"] for s in saved] != names:
            raise ConfigError("resume", [s["class"] for s in saved], f"the checkpoint's plugins differ from {names}",
                              "resume with the plugins that wrote the checkpoint")
        module.global_params.copy_(state["global_params"].to(module.global_params.device))
        module.load_global()
        for p, s in zip(self.plugins, saved):
            p.load_state_dict(s["state"])
        self.client_states = {c: s for c, s in state["client_states"].items() if self.owner(c) == self.rank}
        self.history = list(state.get("history", []))
        require(state["round"] <= self.rounds, "trainer.rounds", self.rounds,
                f"the checkpoint is already at round {state['round']}", f"set rounds >= {state['round']}")
        return int(state["round"])
