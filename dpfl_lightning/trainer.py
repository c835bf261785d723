"""FederatedTrainer: the settings, ``fit`` and the round loop; the pieces of a fit live in
:mod:`dpfl_lightning.run` and none of them sees the trainer.

One round: the plan (the cohort, the same on every rank; plugins may edit it); every client of this
rank trained by the executor and finished by the client phase (finite check, ``on_client_end``,
folded into the rank's sum); one exact all-reduce and the server phase (``on_aggregate``, the mean
update, ``on_server_update``, the server optimizer's step); evaluation, ``on_round_end``, the row
through the release filter to the loggers and callbacks; checkpoints. Everything random is keyed by
(seed, round, client, purpose) and the all-reduce is exact, so 1, 2 or 4 ranks give bit-identical
models for the same seed and threads per rank.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.federated.aggregation import PayloadAggregator
from dpfl_lightning.algorithms import Algorithm
from dpfl_lightning.comm import Communicator, make_communicator
from dpfl_lightning.plugins.contexts import ServerContext
from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import require
from dpfl_lightning.executor import Executor, make_executor
from dpfl_lightning.lightning.trainer_options import refuse_unknown_arguments
from dpfl_lightning.lightning.semantics import LightningRun
from dpfl_lightning.tracking.loggers import RoundProgress
from dpfl_lightning.module import FederatedLightningModule
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.run.preemption import Preempted, SignalWatch, finalize_mpi_at_exit, report_fit_failure
from dpfl_lightning.run.reproducibility import python_config, warn_if_unseeded
from dpfl_lightning.run.checkpointing import (RunCheckpoints, checkpoint_to_resume, open_version, planned_checkpoint_dir,
                                            write_lightning_checkpoint)
from dpfl_lightning.run.client_phase import ClientPhase
from dpfl_lightning.run.client_states import ClientStates
from dpfl_lightning.run.round_evaluation import RoundEvaluation
from dpfl_lightning.run.hooks import HookTable
from dpfl_lightning.run.memory import frozen_heap
from dpfl_lightning.run.log_setup import open_loggers, print_run_summary, round_progress
from dpfl_lightning.run.round_row import RoundRow
from dpfl_lightning.run.server_phase import ServerPhase
from dpfl_lightning.run.setup import RunSetup, build_run
from dpfl_lightning.run.stages import fit_inputs, run_stage
from dpfl_lightning.run.status import RunStatus
from dpfl_lightning.run.settings import TrainerSettings, trainer_arguments


class FederatedTrainer:
    """Run federated training of a :class:`FederatedLightningModule` on a :class:`FederatedDataModule`.

    Args:
        rounds: communication rounds ``T``.
        clients_per_round: cohort size ``m`` (``None``: full participation).
        sampling: ``uniform`` (``m`` without replacement; default with ``clients_per_round``),
            ``poisson`` (rate ``sampling_rate``, default ``m / M``) or ``full`` (default without it).
        sampling_rate: Poisson rate ``q``.
        local_epochs / local_steps: local work per client per round (one of them; default 1 epoch).
        records_per_client: public records per client ``N`` (epochs of ``ceil(N / B)`` batches, DP-SGD's rate ``B/N``).
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
        log_dir / run_name: every fit writes a new ``<log_dir>/<run_name>/version_N`` (its CSV log and
            checkpoints); a resumed fit continues the version of its checkpoint.
        loggers: extra Lightning loggers, e.g. :class:`~dpfl_lightning.tracking.loggers.WandbLogger`.
        enable_progress_bar / enable_summary: the console progress bar and end-of-run table.
        checkpoint_every: write a checkpoint every this many rounds (and after the last); ``None``: never.
        checkpoint_dir: default: the fit's ``<log_dir>/<run_name>/version_N/checkpoints``.
        executor: ``auto`` (``vmap`` where it gives ``sequential``'s bits, else ``sequential``; the summary
            says which and why: :mod:`~dpfl_lightning.executor.auto`), ``sequential`` (any module) or ``vmap``.
        log_client_metrics: release statistics computed from client data without noise (the
            training loss the module logs, per-client evaluation, skipped clients, clipping
            statistics). ``None`` (default): only in runs without DP; ``True`` in a DP run is an
            explicit, unaccounted release, listed in the run's privacy statement.
        gradient_clip_val / gradient_clip_algorithm: clip each client's local gradient at every local optimizer step
            (``norm`` or ``value``), through the module's ``configure_gradient_clipping`` as ``lightning.Trainer``
            does. Not DP clipping; refused with ``DPSGD`` and with manual optimization.
        accumulate_grad_batches: step the local optimizer every this many batches (and at the end of
            each local epoch); refused with ``DPSGD`` and with manual optimization.
        precision: ``32`` (default), ``bf16-mixed`` (CPU and CUDA) or ``16-mixed`` (CUDA only):
            autocast around the module's steps; parameters and the global model stay fp32.
        callbacks: Lightning callbacks, run at the round level (``ModelCheckpoint`` on a round
            metric, ``EarlyStopping``, ``LearningRateMonitor``); they see only released metrics.
            Callbacks that need lightning.Trainer's per-step loop are refused with the reason.
        final_checkpoint: after ``fit``, write the global model to ``<checkpoint_dir>/final.ckpt`` as a
            Lightning checkpoint (``MyModule.load_from_checkpoint`` loads it).
        test_after_fit: after the last round, also run the module's ``test_step`` on the test set and add its
            metrics (``test_*``) to the last row. ``lightning.Trainer.fit`` never tests, so the default is ``False``.

    What Lightning's notions (epochs, global steps, LR schedulers, hooks) mean in a federated run is
    written down in :mod:`dpfl_lightning.lightning.semantics`.
    """

    @refuse_unknown_arguments  # lightning.Trainer's max_epochs, devices, ...: their counterpart, not a bare TypeError
    def __init__(
        self,
        rounds: int = 10,
        clients_per_round: int | None = None,
        sampling: str | None = None,
        sampling_rate: float | None = None,
        local_epochs: int | None = None,
        local_steps: int | None = None,
        records_per_client: int | None = None,
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
        executor: str = "auto",
        log_client_metrics: bool | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
        accumulate_grad_batches: int = 1,
        precision: str | int = "32",
        callbacks: list[Callback] | None = None,
        final_checkpoint: bool = False,
        test_after_fit: bool = False,
    ) -> None:
        args, self.hparams = trainer_arguments(locals())
        self.settings = TrainerSettings.build(args, algorithm)
        self.algorithm = algorithm
        self.extra_loggers = list(loggers or [])
        self.callbacks: list[Callback] = list(callbacks or [])
        preset = list(algorithm.plugins()) if algorithm is not None else []
        self.plugins: list[FederatedCallback] = sorted(preset + list(plugins or []), key=lambda p: p.order)
        self.executor: Executor = make_executor(self.settings.executor, self.settings.batch_size)
        self.config: dict[str, Any] | None = None  # the resolved run configuration, set by the CLI
        self.comm: Communicator | None = None
        self.status = RunStatus()
        self.round_times: list[float] = []  # wall-clock seconds of each round (never logged in a DP run)
        self.run: RunSetup | None = None
        self.module: FederatedLightningModule | None = None
        self.data: FederatedDataModule | None = None
        self._states: ClientStates | None = None

    def __getattr__(self, name: str) -> Any:
        """Every setting reads as ``trainer.<name>`` (``trainer.rounds``); settings are frozen."""
        settings = self.__dict__.get("settings")
        if settings is not None and name in TrainerSettings.names():
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "executor" and name in TrainerSettings.names():  # (trainer.executor is the executor object)
            raise AttributeError(f"trainer.{name}: the settings are frozen once the trainer is built; "
                                 f"build a new FederatedTrainer({name}=...)")
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ public helpers
    def owner(self, client: int) -> int:
        """The rank that keeps ``client``'s per-client state (see :mod:`dpfl_lightning.federated.placement`)."""
        return self._states.owner(client)

    def my_clients(self, plan: RoundPlan) -> list[int]:
        """The clients of ``plan`` this rank trains."""
        return self._states.my_clients(plan, self.data.client_num_samples)

    world_size = property(lambda self: self.comm.size if self.comm is not None else 1)
    rank = property(lambda self: self.comm.rank if self.comm is not None else 0)
    is_global_zero = property(lambda self: self.rank == 0)
    private = property(lambda self: self.run is not None and self.run.private)
    sampler = property(lambda self: self.run.sampler)
    ledger = property(lambda self: self.run.ledger if self.run is not None else None,
                      doc="The privacy ledger of a DP run (``None`` without DP mechanisms).")
    history = property(lambda self: self.status.history)
    should_stop = property(lambda self: self.status.should_stop)
    stop_reason = property(lambda self: self.status.stop_reason)
    current_round = property(lambda self: self.status.current_round)
    client_states = property(lambda self: self._states.by_client if self._states is not None else {},
                             doc="This rank's per-client states by client id (control variates).")
    final_metrics = property(lambda self: dict(self.history[-1]) if self.history else {})
    checkpoint_dir = property(lambda self: self.status.checkpoint_dir or planned_checkpoint_dir(self.settings),
                              doc="Where the fit's checkpoints go (``checkpoint_dir`` or ``version_N/checkpoints``).")
    csv_log_dir = property(lambda self: self.status.written_csv_log_dir(), doc="Rank 0's ``version_N`` directory.")

    def client_state(self, client: int) -> dict[str, Any]:
        """Per-client state (e.g. control variates), kept by the owning rank, checkpointed by id."""
        return self._states.of(client)

    def stop(self, reason: str) -> None:
        """Stop before the next round (every rank decides alike: the reason is a public function)."""
        self.status.stop(reason)

    def call_hook(self, name: str, **kwargs: Any) -> None:
        self._hooks.call(name, **kwargs)

    def epsilon(self, delta: float | None = None) -> float:
        """The run's main epsilon (the one logged as ``epsilon``) after the rounds trained so far, at
        ``delta`` (default: the ledger's), like Opacus's ``get_epsilon``; ``inf`` for a run without a
        DP mechanism."""
        require(self.run is not None, "trainer.epsilon", delta, "no fit has run yet", "call fit() first")
        return self.run.ledger.epsilon_at(delta) if self.run.ledger is not None else math.inf

    # ------------------------------------------------------------------ fit
    def fit(self, module: Any, data: FederatedDataModule, ckpt_path: str | None = None) -> FederatedLightningModule:
        """Train for ``rounds`` rounds (continuing from ``ckpt_path`` if given; ``"last"``: the run's
        newest checkpoint, if there is one); returns the module, whose wrapped LightningModule then
        holds the final global model. On ``SIGTERM``, ``SIGUSR1`` or Ctrl-C the run stops after the
        round with a checkpoint and raises :class:`~dpfl_lightning.run.preemption.Preempted`."""
        module = fit_inputs(module, data)
        if self.comm is None:
            self.comm = make_communicator(self.settings.communicator, "cuda" if self.settings.wants_cuda() else "cpu")
        ckpt_path = checkpoint_to_resume(ckpt_path, self.settings, self.comm)
        state = ckpt.load(ckpt_path) if ckpt_path else None
        if state is None and self.is_global_zero:
            warn_if_unseeded(self.seed)  # the user built the model: its weights are not ours to reset
        lightning_run = LightningRun(self.settings, module, data, self.callbacks, self.save_lightning_checkpoint)
        try:  # teardown, also after a failed set-up or round: the user's module is left clean
            with SignalWatch(announce=self.is_global_zero) as signals:
                self._fit(module, data, ckpt_path, state, lightning_run, signals)
        except BaseException as exc:
            report_fit_failure(exc, self.comm, self.checkpoint_dir)
            lightning_run.teardown(exc)
            if isinstance(exc, Preempted):
                finalize_mpi_at_exit()
            raise
        lightning_run.teardown(None)
        return module

    def _build(self, module: FederatedLightningModule, data: FederatedDataModule, lightning_run: LightningRun) -> None:
        """The pieces of one fit, each given what it needs and none of them the trainer."""
        s, comm = self.settings, self.comm
        self.run = run = build_run(s, comm, module, data, self.plugins, self.algorithm)
        self.module, self.data, self.plugins = module, data, run.plugins
        lightning_run.attach(comm, run.releases, self.status)
        lightning_run.check()
        self._hooks = hooks = HookTable(self.plugins)
        self._states = ClientStates(comm, hooks.keeps_client_state)
        self.executor.setup(module, data, hooks.changing_local_steps())
        self.aggregator = PayloadAggregator(run.layout, run.device, s.exact_aggregation)
        self._clients = ClientPhase(hooks, self.aggregator, self._states, module, data, run.random, run.private,
                                    s.normalize_update_by_lr, s.weighting)
        self._server = ServerPhase(hooks, self.aggregator, comm, run.denominator, run.private,
                                   self.is_global_zero and s.enable_summary)
        self._evaluation = RoundEvaluation(module, data, comm, hooks, s.eval_per_client, self._states.owner)
        self._row = RoundRow(run.releases, run.sampler.cohort_size_is_public)
        self._checkpoints = RunCheckpoints(s, comm, module, data, self.plugins, run.sampler, lightning_run,
                                           self._states, self.status, self._run_config)

    def _fit(self, module: FederatedLightningModule, data: FederatedDataModule, ckpt_path: str | None,
             state: dict[str, Any] | None, lightning_run: LightningRun, signals: SignalWatch) -> None:
        self._build(module, data, lightning_run)
        run = self.run
        start = self._checkpoints.restore(state, run) if state is not None else 0
        open_version(self.settings, self.comm, self.status, ckpt_path, state)  # the run's version_N (every rank)
        loggers = open_loggers(self.settings, self.extra_loggers, run, self.status, self._run_config(),
                               start if state is not None else None, self.executor) if self.is_global_zero else []
        progress = round_progress(self.settings, run, start, self.is_global_zero, signals)  # (epsilon notes)
        self.call_hook("on_fit_start", ctx=run.ctx)
        run.print_privacy_statement(self.is_global_zero and self.enable_summary)
        try:
            with frozen_heap():  # what is set up by now lives for the whole run: the GC need not walk it
                lightning_run.fit_start(loggers, start)
                self._rounds(start, loggers, progress, lightning_run, signals)
                lightning_run.train_end()
        finally:
            progress.close()
            module.load_global()  # on failure too: the module shows the global model, not a client's
            self.call_hook("on_fit_end", ctx=run.ctx)
        for lg in loggers:
            lg.finalize("success")
        if self.final_checkpoint:
            self.save_lightning_checkpoint(os.path.join(self.checkpoint_dir, "final.ckpt"))
        if self.enable_summary and self.is_global_zero:
            print_run_summary(self.settings, run, self.status, data.num_clients, self.world_size, self.executor)

    # ------------------------------------------------------------------ validate, test, predict
    def validate(self, model: Any = None, dataloaders: Any = None, ckpt_path: str | None = None, verbose: bool = True,
                 datamodule: Any = None) -> list[dict[str, float]]:
        """``lightning.Trainer.validate``: one dict of metrics per dataloader (see :mod:`dpfl_lightning.run.stages`)."""
        return self._stage("validate", model, dataloaders, datamodule, ckpt_path, verbose=verbose)

    def test(self, model: Any = None, dataloaders: Any = None, ckpt_path: str | None = None, verbose: bool = True,
             datamodule: Any = None) -> list[dict[str, float]]:
        """``lightning.Trainer.test``: as :meth:`validate`, with the module's ``test_step`` on the test set."""
        return self._stage("test", model, dataloaders, datamodule, ckpt_path, verbose=verbose)

    def predict(self, model: Any = None, dataloaders: Any = None, datamodule: Any = None,
                return_predictions: bool | None = None, ckpt_path: str | None = None) -> Any:
        """``lightning.Trainer.predict``: the list of the module's ``predict_step`` outputs (see :meth:`validate`)."""
        return self._stage("predict", model, dataloaders, datamodule, ckpt_path, return_predictions=return_predictions)

    def _stage(self, stage: str, model: Any, dataloaders: Any, datamodule: Any, ckpt_path: Any, **kw: Any) -> Any:
        return run_stage(stage, model, dataloaders, datamodule, ckpt_path, settings=self.settings, rank=self.rank,
                         fitted=self.module, data=self.data, checkpoints=self.checkpoint_dir, callbacks=self.callbacks,
                         run=self.run, **kw)

    # ------------------------------------------------------------------ the round loop
    def _rounds(self, start: int, loggers: list[Any], progress: RoundProgress, lightning_run: LightningRun,
                signals: SignalWatch) -> None:
        status = self.status
        for r in range(start, self.rounds):
            if status.should_stop:  # a callback stopped the run after the previous round
                break
            plan, server = self.run.plan_round(r, self.module, self._states.of, self.status.stop, self.my_clients)
            self.call_hook("before_round", plan=plan, server=server)
            if status.should_stop:
                break
            plan.validate()
            status.current_round = r
            lightning_run.round_start(r)
            metrics = self._round(plan, server)
            row = lightning_run.round_end(r, metrics, self._row.kinds)  # released row; callbacks may stop the run
            if self.test_after_fit and (r + 1 == self.rounds or status.should_stop):
                row.update(self._row.released(self._evaluation.test(), "evaluation"))
            status.history.append(row)
            for lg in loggers:
                lg.log_metrics(row, step=r + 1)
                lg.save()
            progress.update(row)
            saved = self.settings.is_checkpoint_round(r, status.should_stop)
            if saved:
                self._checkpoints.save(self._checkpoints.round_path(r + 1), r + 1)
            if r + 1 < self.rounds and not status.should_stop:
                signum = signals.agreed(self.comm, self.run.device)  # the ranks agree (one may have it)
                if signum:
                    self._checkpoints.preempt(signum, r + 1, loggers, saved)

    def _round(self, plan: RoundPlan, server: ServerContext) -> dict[str, float]:
        """One round on this rank: train and finish its clients, reduce, step, evaluate, report."""
        t0 = time.perf_counter()
        run, module = self.run, self.module
        server.my_clients = mine = self.my_clients(plan)
        self.aggregator.start(len(plan.cohort), self._hooks.value_bounds(run.layout.names, run.max_client_samples,
                                                                          self.weighting))
        module.logged.reset()
        failed = [t.client for t in self.executor.train(self._clients.work(plan, mine)) if not self._clients.finish(t)]
        train_logs = module.logged.results() if run.gathers_client_logs else None
        agg = self._server.aggregate(plan, server, failed)
        if agg.denominator > 0:
            self._server.mean_update(server)
            self._server.step(module.global_params, server)  # the global model moves here, and only here
        self._states.end_round(mine)
        metrics = self._row.training(plan, agg, train_logs, self.comm)
        module.load_global()
        if self.settings.is_evaluation_round(plan.round_idx):
            metrics.update(self._evaluation.validate(self._row.kinds))
        self._row.plugins_round_end(self._hooks, server, metrics)
        self.round_times.append(time.perf_counter() - t0)
        metrics.update(self._row.kinds.tag({"round_time_s": self.round_times[-1]}, "unaccounted"))
        return metrics

    # ------------------------------------------------------------------ logs and checkpoints
    def _run_config(self) -> dict[str, Any]:
        """The run's configuration: the CLI's resolved YAML, or what was built in Python."""
        return self.config if self.config is not None else python_config(self.hparams, self.module.inner, self.data)

    def save_checkpoint(self, path: str, rounds_done: int | None = None) -> None:
        """Write a checkpoint (rank 0; every rank must call this) and point ``last.ckpt`` at it."""
        self._checkpoints.save(path, self.current_round + 1 if rounds_done is None else rounds_done)

    def save_lightning_checkpoint(self, path: str, epoch: int | None = None, global_step: int | None = None) -> str:
        """The global model as a Lightning checkpoint ``MyModule.load_from_checkpoint(path)`` loads (rank 0 writes;
        every rank calls this); ``epoch``: default the rounds done, ``global_step``: the reference client's steps."""
        return write_lightning_checkpoint(self.module, self.data, self.comm, path, self.history, epoch, global_step)
