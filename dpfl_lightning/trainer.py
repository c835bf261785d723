"""FederatedTrainer: the round loop.

One round ``t``:

1. the cohort ``S_t`` is sampled (same on every rank) and the round plan made; plugins may edit
   the plan (``before_round``);
2. each rank trains the clients of ``S_t`` it owns (client ``c`` lives on rank ``c mod P``) through
   the executor; as each client finishes, the plugins bound and noise its payload
   (``on_client_end``) and non-finite updates are caught;
3. one exact all-reduce sums every segment of every payload over all ranks;
4. ``on_aggregate`` (central noise), the mean update, ``on_server_update`` (step sizes, the server
   optimizer);
5. evaluation, ``on_round_end`` (the privacy ledger), logging through the release list,
   checkpoints.

Everything random is keyed by (seed, round, client, purpose), and the all-reduce is exact, so
``mpiexec -n 1``, ``-n 2`` and ``-n 4`` give bit-identical models for the same seed and threads
per rank.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from dpfl_lightning import checkpoint as ckpt
from dpfl_lightning import frozen, placement
from dpfl_lightning.aggregation import PayloadAggregator
from dpfl_lightning.algorithms import Algorithm
from dpfl_lightning.comm import Communicator, make_communicator
from dpfl_lightning.contexts import ClientContext, ServerContext
from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import ConfigError, NonFiniteUpdateError, drain_output, report_failure, require
from dpfl_lightning.export import save_lightning_checkpoint
from dpfl_lightning.executor import EXECUTORS, Executor, RoundWork
from dpfl_lightning.logged_metrics import merge
from dpfl_lightning.loggers import (RoundProgress, log_privacy_settings, make_loggers, print_summary,
                                    privacy_settings, summary_rows)
from dpfl_lightning.lightning_compat import LightningRun
from dpfl_lightning.module import FederatedLightningModule, is_lightning_module
from dpfl_lightning.payload import Aggregate
from dpfl_lightning.plan import RoundPlan
from dpfl_lightning.plugins.base import FederatedCallback
from dpfl_lightning.preemption import Preempted, SignalWatch, finalize_mpi_at_exit, interrupt_hint, resume_hint
from dpfl_lightning.reproducibility import python_config, warn_if_unseeded
from dpfl_lightning.run_setup import RunSetup, build_run, collect_mechanisms
from dpfl_lightning.settings import check_trainer_settings

HOOKS = ("before_round", "on_client_start", "on_before_optimizer_step", "wrap_optimizer", "on_client_end",
         "on_aggregate", "on_server_update", "on_round_end", "on_fit_start", "on_fit_end", "evaluation_params")


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
        seed: keys all randomness: (seed, round, client, purpose).
        secure: draw the noise and the sampling (cohorts, DP-SGD batches, coins) from a CSPRNG keyed
            by a secret that is never logged or checkpointed, with a floating-point mitigation; runs
            are then not reproducible. Without it (a simulation) everything is a function of the
            seed, and the guarantee holds only towards someone who does not know it.
        accelerator: ``auto``, ``cpu`` or ``cuda`` (rank ``r`` uses ``cuda:(local_rank % n_gpus)``).
        communicator: ``auto``, ``local``, ``mpi``, ``nccl`` or ``gloo``.
        num_threads: torch threads per rank (default: cores / ranks on this node).
        exact_aggregation: order-independent sum (bit-identical for any number of ranks);
            ``False`` uses a float64 all-reduce.
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
        log_client_metrics: release statistics computed from client data without noise (the
            training loss the module logs, per-client evaluation, skipped clients, clipping
            statistics). ``None`` (default): only in runs without DP; ``True`` in a DP run is an
            explicit, unaccounted release, listed in the run's privacy statement.
        gradient_clip_val / gradient_clip_algorithm: clip each client's local gradient at every local
            optimizer step (``norm`` or ``value``), through the module's ``configure_gradient_clipping``
            as ``lightning.Trainer`` does. Not DP clipping; refused with ``DPSGD`` and with manual
            optimization.
        accumulate_grad_batches: step the local optimizer every this many batches (and at the end of
            each local epoch); refused with ``DPSGD`` and with manual optimization.
        precision: ``32`` (default), ``bf16-mixed`` (CPU and CUDA) or ``16-mixed`` (CUDA only):
            autocast around the module's steps; parameters and the global model stay fp32.
        callbacks: Lightning callbacks, run at the round level (``ModelCheckpoint`` on a round
            metric, ``EarlyStopping``, ``LearningRateMonitor``); they see only released metrics.
            Callbacks that need lightning.Trainer's per-step loop are refused with the reason.
        final_checkpoint: after ``fit``, write the global model to ``<checkpoint_dir>/final.ckpt`` as a
            Lightning checkpoint (``MyModule.load_from_checkpoint`` loads it).
        test_after_fit: after the last round, also run the module's ``test_step`` on the test set and
            add its metrics (``test_*``) to the last row. ``lightning.Trainer.fit`` never tests, so
            the default is ``False``.

    What Lightning's notions (epochs, global steps, LR schedulers, hooks) mean in a federated run is
    written down in :mod:`dpfl_lightning.lightning_compat`.
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
        secure: bool = False,
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
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        accumulate_grad_batches: int = 1,
        precision: str | int = "32",
        callbacks: list[Callback] | None = None,
        final_checkpoint: bool = False,
        test_after_fit: bool = False,
    ) -> None:
        args = {k: v for k, v in locals().items() if k not in ("self", "plugins", "loggers", "algorithm", "callbacks")}
        self.hparams = dict(args, plugins=[repr(p) for p in plugins or []],
                            algorithm=repr(algorithm) if algorithm is not None else None,
                            callbacks=[type(c).__name__ for c in callbacks or []])
        s = check_trainer_settings(args)
        require(executor in EXECUTORS, "trainer.executor", executor, "unknown executor", f"use one of {', '.join(EXECUTORS)}")
        for name, value in s.items():
            setattr(self, name, value)
        self.seed = int(seed)
        self.client_lr_decay = float(client_lr_decay)
        self.algorithm = algorithm
        self.normalize_update_by_lr = bool(normalize_update_by_lr or getattr(algorithm, "normalize_update_by_lr", False))
        self.communicator_kind = communicator
        self.run_name = run_name or (getattr(algorithm, "name", None) or "dpfl")
        self.extra_loggers = list(loggers or [])
        self.callbacks: list[Callback] = list(callbacks or [])
        self.checkpoint_dir = checkpoint_dir or os.path.join(log_dir, self.run_name, "checkpoints")
        preset = list(algorithm.plugins()) if algorithm is not None else []
        self.plugins: list[FederatedCallback] = sorted(preset + list(plugins or []), key=lambda p: p.order)
        self.executor: Executor = EXECUTORS[executor]()
        self.config: dict[str, Any] | None = None  # the resolved run configuration, set by the CLI
        self.comm: Communicator | None = None
        self.history: list[dict[str, float]] = []
        self.round_times: list[float] = []  # wall-clock seconds of each round (never logged in a DP run)
        self.client_states: dict[int, dict[str, Any]] = {}
        self._warned_secure_states = False
        self.current_round = 0
        self.should_stop = False
        self.stop_reason: str | None = None
        self.run: RunSetup | None = None

    # ------------------------------------------------------------------ public helpers
    def owner(self, client: int) -> int:
        """The rank that keeps ``client``'s per-client state (see :mod:`dpfl_lightning.placement`)."""
        return placement.owner(client, self.world_size)

    def my_clients(self, plan: RoundPlan) -> list[int]:
        """The clients of ``plan`` this rank trains: by id where per-client state lives, else a
        placement that balances the ranks' local steps (see :mod:`dpfl_lightning.placement`)."""
        size, rank = self.world_size, self.rank
        if size == 1:
            return list(plan.cohort)
        if self._keeps_state:
            return [c for c in plan.cohort if self.owner(c) == rank]
        work = [plan.steps_for(self.data.client_num_samples(c)) for c in plan.cohort]
        return placement.balanced(list(plan.cohort), work, size)[rank]

    @property
    def world_size(self) -> int:
        return self.comm.size if self.comm is not None else 1

    @property
    def rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def private(self) -> bool:
        return self.run is not None and self.run.private

    @property
    def sampler(self):
        return self.run.sampler

    @property
    def ledger(self):
        """The privacy ledger of a DP run (``None`` without DP mechanisms)."""
        return self.run.ledger if self.run is not None else None

    def client_state(self, client: int) -> dict[str, Any]:
        """Per-client state (e.g. control variates), kept by the owning rank, checkpointed by id."""
        return self.client_states.setdefault(client, {})

    def stop(self, reason: str) -> None:
        """Stop before the next round (every rank decides alike: the reason is a public function)."""
        self.should_stop = True
        self.stop_reason = reason

    def call_hook(self, name: str, **kwargs: Any) -> None:
        for p in self._hooks[name]:
            getattr(p, name)(**kwargs)

    # ------------------------------------------------------------------ fit
    def epsilon(self, delta: float | None = None) -> float:
        """The run's main epsilon (the one logged as ``epsilon``) after the rounds trained so far, at
        ``delta`` (default: the ledger's), like Opacus's ``get_epsilon``; ``inf`` for a run without a
        DP mechanism."""
        require(self.run is not None, "trainer.epsilon", delta, "no fit has run yet", "call fit() first")
        return self.run.ledger.epsilon_at(delta) if self.run.ledger is not None else math.inf

    def fit(self, module: Any, data: FederatedDataModule, ckpt_path: str | None = None) -> FederatedLightningModule:
        """Train for ``rounds`` rounds (continuing from ``ckpt_path`` if given; ``"last"``: the run's
        newest checkpoint, if there is one); returns the module, whose wrapped LightningModule then
        holds the final global model. On ``SIGTERM``, ``SIGUSR1`` or Ctrl-C the run stops after the
        round with a checkpoint and raises :class:`~dpfl_lightning.preemption.Preempted`."""
        if not isinstance(module, FederatedLightningModule):
            if not is_lightning_module(module):
                raise ConfigError("module", type(module).__name__, "is not a LightningModule",
                                  "wrap it: FederatedLightningModule(model, loss_fn=...)")
            module = FederatedLightningModule(module)
        require(isinstance(data, FederatedDataModule), "data", type(data).__name__, "is not a FederatedDataModule",
                "wrap it: FederatedDataModule.from_datamodule(dm, num_clients=...)")
        if self.comm is None:
            self.comm = make_communicator(self.communicator_kind, "cuda" if self._wants_cuda() else "cpu")
        ckpt_path = self._checkpoint_to_resume(ckpt_path)
        state = ckpt.load(ckpt_path) if ckpt_path else None
        if state is None and self.is_global_zero:
            warn_if_unseeded(self.seed)  # the user built the model: its weights are not ours to reset
        self._lightning_run = lightning_run = LightningRun(self, module, data)
        try:  # teardown, also after a failed set-up or round: the user's module is left clean
            with SignalWatch(announce=self.is_global_zero) as self._signals:
                self._fit(module, data, state, lightning_run)
        except BaseException as exc:
            if self.world_size > 1 and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
                report_failure(exc, self.rank, self.world_size)  # out before any rank aborts the job
            if isinstance(exc, KeyboardInterrupt) and self.is_global_zero:
                for line in interrupt_hint(os.path.join(self.checkpoint_dir, "last.ckpt"), self.world_size):
                    print(line, file=sys.stderr, flush=True)
            lightning_run.teardown(exc)
            if isinstance(exc, Preempted):
                finalize_mpi_at_exit()
            raise
        lightning_run.teardown(None)
        return module

    def _fit(self, module: FederatedLightningModule, data: FederatedDataModule, state: dict[str, Any] | None,
             lightning_run: LightningRun) -> FederatedLightningModule:
        self.run = run = build_run(self, module, data)
        self.module, self.data = module, data
        lightning_run.check()
        self._hooks = {h: [p for p in self.plugins if getattr(type(p), h) is not getattr(FederatedCallback, h)]
                       for h in HOOKS}
        self._bounders = [p for p in self.plugins if type(p).value_bound is not FederatedCallback.value_bound]
        self._keeps_state = any(p.keeps_client_state for p in self.plugins)  # clients train where it lives
        self.executor.setup(module, data, list(dict.fromkeys(
            type(p).__name__ for p in self._hooks["on_before_optimizer_step"] + self._hooks["wrap_optimizer"])))
        self.aggregator = PayloadAggregator(run.layout, run.device, self.exact_aggregation)
        self._kinds: dict[str, str] = {}  # the release kind of every metric key
        self._noted = False
        start = self._restore(state) if state is not None else 0
        if state is not None and run.ledger is not None:  # restored plugins (calibrated noise) are in force now
            collect_mechanisms(self.plugins, run.ctx)
            run.ledger.setup(ctx=run.ctx)
        loggers = self._make_loggers(start if state is not None else None)
        progress = RoundProgress(self.rounds, start, self.enable_progress_bar and self.is_global_zero)
        self.call_hook("on_fit_start", ctx=run.ctx)
        run.print_privacy_statement(self)
        t_fit = time.perf_counter()
        # Everything set up so far (torch, Lightning, the data, the module: ~4e5 objects) lives for the
        # whole run; frozen, Python's cyclic GC no longer walks it, where a full collection paused a
        # rank for ~0.2 s (every ~100 vmap rounds on W1; under MPI every rank's pause stalls the round)
        freeze = gc.isenabled() and gc.get_freeze_count() == 0  # leave a user's own GC settings alone
        if freeze:  # (without a collection first: one costs ~0.2 s; what is garbage now waits for the end)
            gc.freeze()
        try:
            lightning_run.fit_start(loggers, start)
            for r in range(start, self.rounds):
                if self.should_stop:  # a callback stopped the run after the previous round
                    break
                plan, server = self._plan(r)
                self.call_hook("before_round", plan=plan, server=server)
                if self.should_stop:
                    break
                plan.validate()
                self.current_round = r
                lightning_run.round_start(r)
                metrics = self._round(plan, server)
                row = lightning_run.round_end(r, metrics, self._kinds)  # released row; callbacks may stop the run
                if self.test_after_fit and (r + 1 == self.rounds or self.should_stop):
                    row.update(run.releases.filter(self._tagged(self._final_test(), "evaluation"), self._kinds))
                self.history.append(row)
                for lg in loggers:
                    lg.log_metrics(row, step=r + 1)
                    lg.save()
                progress.update(row)
                saved = bool(self.checkpoint_every) and ((r + 1) % self.checkpoint_every == 0 or r + 1 == self.rounds
                                                         or self.should_stop)  # an early stop keeps its last round
                if saved:
                    self.save_checkpoint(os.path.join(self.checkpoint_dir, f"round-{r + 1:06d}.ckpt"), r + 1)
                if r + 1 < self.rounds and not self.should_stop:
                    signum = self._signals.agreed(self.comm, run.device)  # the ranks agree (one may have it)
                    if signum:
                        self._preempt(signum, r + 1, loggers, saved)
            lightning_run.train_end()
        finally:
            if freeze:
                gc.unfreeze()
            progress.close()
            module.load_global()  # on failure too: the module shows the global model, not a client's
            self.call_hook("on_fit_end", ctx=run.ctx)
        for lg in loggers:
            lg.finalize("success")
        if self.final_checkpoint:
            self.save_lightning_checkpoint(os.path.join(self.checkpoint_dir, "final.ckpt"))
        self.final_metrics = dict(self.history[-1]) if self.history else {}
        if self.enable_summary and self.is_global_zero:
            print_summary(f"{self.run_name}: done", self._summary(time.perf_counter() - t_fit, start))
            run.print_release_notes()
        return module

    def _wants_cuda(self) -> bool:
        if self.accelerator in ("cuda", "gpu"):
            if not torch.cuda.is_available():
                raise ConfigError("trainer.accelerator", self.accelerator, "CUDA is not available on this machine",
                                  "use accelerator=auto or cpu")
            return True
        return self.accelerator == "auto" and torch.cuda.is_available()

    def _plan(self, r: int) -> tuple[RoundPlan, ServerContext]:
        run = self.run
        plan = run.default_plan(r)
        plan.trainable = frozen.trainable_mask(self.module.parameter_list, self.module.parameter_slices,
                                               self.module.num_parameters, run.device)
        server = ServerContext(r, plan, run.random, self.data.num_clients, self.module.global_params,
                               client_state=self.client_state, stop=self.stop,
                               next_plan=lambda: run.default_plan(r + 1) if r + 1 < self.rounds else None)
        return plan, server

    # ------------------------------------------------------------------ one round
    def _round(self, plan: RoundPlan, server: ServerContext) -> dict[str, float]:
        t0 = time.perf_counter()
        run, module, comm = self.run, self.module, self.comm
        mine = self.my_clients(plan)
        server.my_clients = mine
        run.current_plan = plan
        self.aggregator.start(len(plan.cohort), self._value_bounds())
        module.logged.reset()
        work = RoundWork(module, self.data, plan, mine, run.random, lambda k: self.aggregator.update_out,
                         self._open_client, self._step_hook, self._optimizer_wrapper, self.aggregator.update_rows)
        bad = [ctx.client for _, ctx, client_run in self.executor.train(work) if not self._finish_client(ctx, client_run)]
        train_logs = module.logged.results() if run.gathers_client_logs else None

        sums = self.aggregator.reduce(comm)
        if not self._noted and self.is_global_zero and self.enable_summary:
            for note in self.aggregator.notes():
                print(f"note: {note}", flush=True)
        self._noted = True
        if "nonfinite" in sums and sums["nonfinite"].item() > 0:
            raise NonFiniteUpdateError(
                f"round {plan.round_idx + 1}: {self._who_failed(bad, int(round(sums['nonfinite'].item())))} produced a "
                "non-finite (NaN/inf) update; nothing of this round was applied. Fix: lower the client learning rate, "
                "check the data, or set trainer.on_nonfinite='skip'")
        skipped = int(round(sums["skipped"].item())) if "skipped" in sums else 0
        server.aggregate = agg = Aggregate(plan.round_idx, sums, len(plan.cohort), run.denominator(plan, sums), skipped)
        self.call_hook("on_aggregate", server=server)
        if agg.denominator > 0:
            # into a buffer of its own: the aggregate keeps the (noised) sums the plugins' round-end
            # statistics read (GaussianNoise's snr), and the server plugins scale the mean in place
            server.update = update = torch.div(agg.update_sum, agg.denominator, out=self._mean_buffer(agg.update_sum))
            if not math.isfinite(float(update.sum())):  # one pass, no temporary: NaN/inf anywhere shows here
                raise NonFiniteUpdateError(f"round {plan.round_idx + 1}: the aggregated update is not finite; nothing "
                                           "was applied. Fix: check the noise settings and the client learning rate")
            self.call_hook("on_server_update", server=server)
        for c in mine:  # every client's context opens a state: an empty one is not kept (it would cost
            if not self.client_states.get(c, True):  # ~130 B for every client ever sampled: 130 MB for 10^6)
                del self.client_states[c]
        if not self._keeps_state:
            self._refuse_undeclared_state(mine)

        metrics = self._tagged({"round": plan.round_idx + 1}, "public")
        self._kinds["clients"] = "public" if run.sampler.cohort_size_is_public else "unaccounted"
        metrics["clients"] = float(len(plan.cohort))
        if "skipped" in sums:
            metrics.update(self._tagged({"skipped_clients": float(skipped)}, "unaccounted"))
        if train_logs is not None:
            metrics.update(self._tagged(merge(comm.allgather_object(train_logs)), "unaccounted"))
        module.load_global()
        if (plan.round_idx + 1) % self.eval_every == 0 or plan.round_idx + 1 == self.rounds:
            self._load_evaluation_params()
            metrics.update(self._evaluate())
            module.load_global()
        for p in self._hooks["on_round_end"]:
            added: dict[str, float] = {}
            p.on_round_end(server=server, metrics=added)
            for key in added:
                self._kinds[key] = run.releases.kind(key, type(p).__name__)
            metrics.update(added)
        self.round_times.append(time.perf_counter() - t0)
        metrics.update(self._tagged({"round_time_s": self.round_times[-1]}, "unaccounted"))
        return metrics

    def _who_failed(self, bad: list[int], count: int) -> str:
        """The clients of an error message (every rank calls this): by id without DP; in a DP run only
        how many, since which clients took part (and failed) is what the guarantee hides."""
        if self.private:
            return f"{count} client{'' if count == 1 else 's'}"
        return f"client(s) {sorted(c for part in self.comm.allgather_object(bad) for c in part)}"

    def _mean_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The mean update's buffer, allocated once per run."""
        buf = getattr(self, "_mean", None)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            self._mean = buf = torch.empty_like(like)
        return buf

    def _refuse_undeclared_state(self, clients: list[int]) -> None:
        """Per-client state written (in a client's hooks or by the server) while no plugin declares
        ``keeps_client_state``: the client may train on another rank next round, without it."""
        written = next((self.client_states[c] for c in clients if self.client_states.get(c)), None)
        if written:
            raise ConfigError("plugins", sorted(map(str, written)), "a plugin wrote client.state (per-client state "
                              "kept across rounds) but none declares keeps_client_state = True, so the client could "
                              "train on another rank next round, without its state",
                              "set keeps_client_state = True on the plugin class that keeps it")

    def _open_client(self, client: int) -> ClientContext:
        run = self.run
        ctx = ClientContext(client, run.current_plan.round_idx, run.current_plan, run.random, self.client_state(client),
                            self.module.inner, num_samples=self.data.client_num_samples(client))
        self.call_hook("on_client_start", client=ctx)
        return ctx

    def _step_hook(self, ctx: ClientContext):
        plugins = self._hooks["on_before_optimizer_step"]
        if not plugins:
            return None

        def hook(optimizer: torch.optim.Optimizer) -> None:
            for p in plugins:
                p.on_before_optimizer_step(client=ctx, optimizer=optimizer)

        return hook

    def _optimizer_wrapper(self, ctx: ClientContext):
        plugins = self._hooks["wrap_optimizer"]
        if not plugins:
            return None

        def wrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            for p in plugins:
                optimizer = p.wrap_optimizer(client=ctx, optimizer=optimizer)
            return optimizer

        return wrap

    def _value_bounds(self) -> dict[str, float | None]:
        """Every payload segment's declared bound for this round (see ``value_bound``)."""
        bounds: dict[str, float | None] = {"nonfinite": 1.0, "skipped": 1.0, "weight": self.run.max_client_samples}
        for seg in self.run.layout.names:
            for p in self._bounders:
                bounds[seg] = p.value_bound(segment=seg, bound=bounds.get(seg))
        if self.weighting == "samples" and bounds.get("update") is not None:
            bounds["update"] *= self.run.max_client_samples  # the update is multiplied by the client's weight
        return bounds

    def _finish_client(self, ctx: ClientContext, client_run) -> bool:
        """Run the plugins on one trained client's payload and add it to the rank's sum; ``False``
        if its update was not finite."""
        row = self.aggregator.row
        ctx.payload = self.aggregator.client_views()
        ctx.steps, ctx.lr = client_run.steps, client_run.lr
        if self.normalize_update_by_lr:
            ctx.payload["update"].div_(client_run.lr)
        self.call_hook("on_client_end", client=ctx)
        # NaN/inf survive clipping, normalization and noise, so one check after the plugins catches
        # a non-finite raw update as well as a non-finite processed one; a segment whose norm a
        # bounding plugin found finite is not checked again (noise adds finite values).
        ok = all(bool(torch.isfinite(ctx.payload[name]).all()) for name in self.aggregator.checked
                 if name not in ctx.checked_finite)
        if not ok:
            # The client's update counts as zero, processed like any update: its local noise or noise
            # share is drawn again from the same key, so the noise the accountant assumes is all there.
            # The raw update never reaches the global model.
            row.zero_()
            ctx.replay = True
            ctx.checked_finite.clear()
            self.call_hook("on_client_end", client=ctx)
            if not bool(torch.isfinite(row).all()):
                who = "a client" if self.private else f"client {ctx.client}"  # in a DP run: what, not who
                raise NonFiniteUpdateError(f"round {ctx.round_idx + 1}: the plugins turned {who}'s zero update into a "
                                           "non-finite one. Fix: check the plugins' settings")
            flag = "nonfinite" if "nonfinite" in ctx.payload else "skipped"
            if flag in ctx.payload:
                ctx.payload[flag].fill_(1.0)
        if self.weighting == "samples":
            weight = float(ctx.num_samples)
            ctx.payload["update"].mul_(weight)
            ctx.payload["weight"].fill_(weight)
        self.aggregator.fold()
        return ok

    def _tagged(self, metrics: dict[str, float], kind: str) -> dict[str, float]:
        for key in metrics:
            self._kinds[key] = kind
        return metrics

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self) -> dict[str, float]:
        out: dict[str, float] = {}
        module, data, comm = self.module, self.data, self.comm
        if not module.has_validation_step:
            return out
        if data.has_val_set:  # the DataModule's val_dataloader, else the test set
            res = merge([module.evaluate(data.val_batches(), "validation")]) if comm.rank == 0 else None
            out.update(self._tagged(comm.broadcast_object(res, root=0) if comm.size > 1 else res, "evaluation"))
        if self.eval_per_client:
            mine = [c for c in range(data.num_clients) if self.owner(c) == comm.rank]
            local = {c: merge([module.evaluate(data.client_eval_batches(c), "validation")]) for c in mine}
            per_client: dict[int, dict[str, float]] = {}
            for part in comm.allgather_object(local):
                per_client.update(part)
            for name in sorted({k for v in per_client.values() for k in v}):
                vals = torch.tensor([v[name] for v in per_client.values() if name in v], dtype=torch.float64)
                out.update(self._tagged({f"client_{name}_mean": float(vals.mean()),
                                         f"client_{name}_p10": float(torch.quantile(vals, 0.1))}, "unaccounted"))
        return out

    def _final_test(self) -> dict[str, float]:
        module, data, comm = self.module, self.data, self.comm
        module.load_global()
        if not (module.has_test_step and data.has_test_set):
            return {}
        self._load_evaluation_params()
        res = merge([module.evaluate(data.test_batches(), "test")]) if comm.rank == 0 else None
        module.load_global()
        return comm.broadcast_object(res, root=0) if comm.size > 1 else res

    def _load_evaluation_params(self) -> None:
        """Let plugins choose the parameters evaluation sees (e.g. the average of the last iterates);
        training continues from the global model."""
        params = self.module.global_params
        for p in self._hooks["evaluation_params"]:
            params = p.evaluation_params(params=params)
        if params is not self.module.global_params:
            self.module.working.copy_(params)

    # ------------------------------------------------------------------ logging
    def _make_loggers(self, resume_round: int | None = None) -> list[Any]:
        if not self.is_global_zero:
            return []
        config = self.config if self.config is not None else self._python_config()
        loggers = make_loggers(self.log_dir, self.run_name, self.extra_loggers, resume_round=resume_round,
                               config=config)
        if self.private:
            log_privacy_settings(loggers, privacy_settings(self.run.ctx.mechanisms, self.ledger, self.run.privacy_lines()))
        self.csv_log_dir = loggers[0].log_dir
        return loggers

    def _python_config(self) -> dict[str, Any]:
        """The run's configuration when it was built in Python (the CLI passes its resolved YAML)."""
        return python_config(self.hparams, self.module.inner, self.data)

    def _summary(self, seconds: float, start: int) -> dict[str, Any]:
        rows = summary_rows(self.history, extra={"num_clients": self.data.num_clients, "ranks": self.world_size})
        if self.stop_reason:
            rows["stopped"] = self.stop_reason
        return rows

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_state(self, rounds_done: int) -> dict[str, Any] | None:
        # Only clients with state: an empty entry would still say that the client took part once.
        kept = {c: s for c, s in self.client_states.items() if s}
        gathered = self.comm.gather_object(kept, root=0)
        if not self.is_global_zero:
            return None
        client_states: dict[int, dict[str, Any]] = {}
        for part in gathered:
            client_states.update(part)
        if self.secure and client_states and not self._warned_secure_states:
            self._warned_secure_states = True
            warnings.warn("secure mode: the checkpoints hold per-client state (e.g. SCAFFOLD's c_i) of the clients "
                          "that took part, so successive checkpoints reveal the cohorts that the guarantee keeps "
                          "secret: keep checkpoints as private as the clients' data", stacklevel=2)
        return {
            **self._lightning_run.lightning_fields(rounds_done),  # Lightning's load_from_checkpoint reads these
            "format": ckpt.FORMAT,
            "round": rounds_done,
            "global_params": self.module.global_params.detach().cpu().clone(),
            "num_parameters": self.module.num_parameters,
            "num_clients": self.data.num_clients,
            "seed": self.seed,
            "secure": self.secure,
            "sampler": (self.sampler.kind, self.sampler.clients_per_round, self.sampler.rate),
            "plugins": ckpt.plugin_states(self.plugins),
            "callbacks": self._lightning_run.callback_states(),
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

    def _preempt(self, signum: int, rounds_done: int, loggers: list[Any], saved: bool) -> None:
        """Stop on a signal after ``rounds_done`` rounds: a checkpoint (unless this round wrote one),
        the resume command on rank 0, out before any rank exits; then :class:`Preempted`."""
        if not saved:
            self.save_checkpoint(os.path.join(self.checkpoint_dir, f"round-{rounds_done:06d}.ckpt"), rounds_done)
        last = os.path.join(self.checkpoint_dir, "last.ckpt")
        for lg in loggers:
            lg.finalize("preempted")
        if self.is_global_zero:
            for line in resume_hint(last, rounds_done, signum, self.world_size):
                print(line, file=sys.stderr, flush=True)
            drain_output()
        self.comm.barrier()
        raise Preempted(signum, last, rounds_done)

    def _checkpoint_to_resume(self, ckpt_path: str | None) -> str | None:
        """``"last"``: the run's ``last.ckpt`` if it exists (a first start has none), as in Lightning."""
        if ckpt_path != "last":
            return ckpt_path
        last = os.path.join(self.checkpoint_dir, "last.ckpt")
        if os.path.isfile(last):
            return last
        if self.enable_summary and self.is_global_zero:
            print(f"resume: no checkpoint at {last} yet; starting from round 0", file=sys.stderr, flush=True)
        return None

    def save_lightning_checkpoint(self, path: str, epoch: int | None = None, global_step: int | None = None) -> str:
        """Write the global model as a Lightning checkpoint that ``MyModule.load_from_checkpoint(path)``
        loads (rank 0 writes; every rank must call this). ``epoch`` defaults to the rounds done and
        ``global_step`` to the reference client's steps by then (see :mod:`dpfl_lightning.export`)."""
        module = getattr(self, "module", None)
        require(module is not None, "save_lightning_checkpoint", path, "there is no trained model yet",
                "call it after fit (or set final_checkpoint=True)")
        done = int(self.history[-1].get("round", len(self.history))) if self.history else 0
        epoch = done if epoch is None else epoch
        if global_step is None:
            global_step = module.start_step(module.loop.steps_reference, done)
        module.load_global()
        if self.is_global_zero:
            datamodule = getattr(self.data, "datamodule", None)
            save_lightning_checkpoint(module.inner, path, epoch, global_step,
                                      datamodule if hasattr(datamodule, "CHECKPOINT_HYPER_PARAMS_KEY") else None)
        if self.comm is not None and self.comm.size > 1:
            self.comm.barrier()
        return path

    def _restore(self, state: dict[str, Any]) -> int:
        module, data = self.module, self.data
        sampler = (self.sampler.kind, self.sampler.clients_per_round, self.sampler.rate)
        for key, have in (("num_parameters", module.num_parameters), ("num_clients", data.num_clients), ("seed", self.seed),
                          ("sampler", sampler), ("secure", self.secure)):
            if state.get(key) != have:
                raise ConfigError("resume", state.get(key), f"the checkpoint's {key} differs from this run's ({have})",
                                  f"resume with the configuration that wrote the checkpoint ({key}={state.get(key)})")
        require(state["round"] <= self.rounds, "trainer.rounds", self.rounds,
                f"the checkpoint is already at round {state['round']}", f"set rounds >= {state['round']}")
        fresh = ckpt.restore_plugins(self.plugins, state["plugins"], state["round"])
        self._lightning_run.saved_callback_states = state.get("callbacks", {})
        self.resume_changes = ckpt.config_changes(state.get("config") or {},
                                                  self.config if self.config is not None else self._python_config())
        if self.is_global_zero and self.enable_summary:
            if fresh:
                print(f"resume: plugins not in the checkpoint start from their initial state: {', '.join(fresh)}",
                      flush=True)
            for line in self.resume_changes:
                print(f"resume: changed since the checkpoint: {line}", flush=True)
        module.global_params.copy_(state["global_params"].to(module.global_params.device))
        module.load_global()
        self.client_states = {c: move_data_to_device(s, self.run.device)  # checkpoints load on the CPU
                              for c, s in state["client_states"].items() if self.owner(c) == self.rank}
        if self.client_states and not self._keeps_state:
            warnings.warn("resume: the checkpoint holds per-client state, but no plugin of this run keeps any "
                          "(keeps_client_state); it is dropped", RuntimeWarning, stacklevel=2)
            self.client_states = {}
        self.history = list(state.get("history", []))
        return int(state["round"])
