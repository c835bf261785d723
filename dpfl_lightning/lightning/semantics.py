"""Lightning semantics of a federated run: what an ordinary LightningModule sees, and what its
Lightning notions mean when :class:`~dpfl_lightning.FederatedTrainer` drives it as many clients.

A module runs unchanged, or is refused at set-up with one line naming the setting and the fix
(:class:`~dpfl_lightning.errors.ConfigError`); nothing below silently behaves otherwise.

**Epochs, steps and rounds.** One round is one epoch of the federated run.

- ``self.current_epoch`` is the round (0-based), in every client and in evaluation;
  ``self.trainer.max_epochs`` is ``rounds``.
- A client's local work in a round (``local_epochs`` passes over its data, or ``local_steps``
  batches) is its part of that epoch: ``on_train_epoch_start`` / ``on_train_epoch_end`` run once per
  client per round, around all of its local epochs, so state a module keeps for an epoch (the LSTM
  demo's hidden state, outputs collected for an epoch-end metric) never passes from one client to
  the next. A client's ``on_train_epoch_end`` therefore runs when its local training ends, before the
  round's evaluation of the aggregated model (lightning.Trainer validates before
  ``on_train_epoch_end``; the one difference in the order of hooks, which a run with a
  ``validation_step`` says once, as a warning, at set-up).
  ``self.trainer.num_training_batches`` is the client's batches this round.
- ``S``, a client's optimizer steps per round: ``ceil(batches per local epoch / accumulate_grad_batches)``
  per local epoch (Lightning also steps on the last batch of an epoch), i.e. its batches per round
  without accumulation; in manual optimization ``S`` is its batches per round.
- ``self.global_step`` counts the client's optimizer steps as if it had taken part in every round:
  it grows by one per local optimizer step (manual optimization: per ``optimizer.step()``, of any
  optimizer) and starts a round where the previous round's clients ended it (see below): ``round *
  S`` unless the module steps several optimizers per batch or ends an epoch early
  (``on_train_batch_start`` returning ``-1``).
- ``self.trainer.estimated_stepping_batches`` is ``rounds * S``: the steps one client takes over the
  run (so ``OneCycleLR(total_steps=self.trainer.estimated_stepping_batches)`` ends with the run).
  Under ``local_epochs``, clients of different sizes have different ``S``, unless
  ``trainer.records_per_client=N`` is set: a local epoch is then ``ceil(N / batch_size)`` batches
  for every client, whatever it holds. A DP run never shows a value that follows the clients' sizes:
  where ``S`` does (``local_epochs`` or gradient accumulation without ``N``), reading
  ``estimated_stepping_batches`` or ``num_training_batches`` is refused with the setting that fixes
  it, and outside a client (evaluation) ``global_step`` is the step the run writes
  (:mod:`dpfl_lightning.federated.public_sizes`).

**What a client's optimizers carry across rounds** (:mod:`dpfl_lightning.module.schedule`).
``configure_optimizers`` runs for every client in every round: fresh optimizers, so moment buffers
(momentum, Adam's averages) restart every round, as in FedAvg; a module whose optimizer keeps such
state trains differently from one lightning.Trainer run. Everything else an optimizer carries from
one epoch to the next is keyed by the schedule's position, the same for every client of a round: a
client of ``S`` steps per round starts round ``r`` with the ``global_step``, param-group settings
(learning rate, momentum, ...) and scheduler states of one Lightning run whose every epoch had ``S``
steps, at the start of epoch ``r``. Not per client: a client sitting out rounds would come back with
a stale learning rate while ``global_step`` moved on, and a million clients would each keep a copy.
The position moves over a round in one of two ways:

- the round's clients of ``S`` steps all ended it in the same state, and that state is not what the
  schedule alone gives: the module changed it (Lightning's warm-up that sets ``pg["lr"]`` in
  ``optimizer_step``, schedulers it steps itself in manual optimization, several optimizer steps per
  batch, an epoch ended early); the next round's clients continue from it. The ranks agree on it
  (one all-gather of this summary per round); resumed runs continue it (it is in the checkpoint).
- otherwise, the schedule alone (below): on from where the round's clients started, when they ended
  where it does; else (no client of ``S`` steps trained in the round, they ended in different states,
  or in another structure) from the start of round ``r + 1`` of the schedule alone --
  ``configure_optimizers``' settings, ``global_step = (r + 1) * S``, the schedulers placed as below --
  never from a state an older round's clients left. Where that is not what lightning.Trainer would
  have, the run says so once with a ``RuntimeWarning``: clients of a round that ended in different
  states (a learning rate set from the data), clients of ``S`` steps that took no part in the
  previous round while the module moves their state (partial participation, clients of different
  sizes), ``configure_optimizers`` returning another structure. A DP run never says what its
  clients' training did (whether a client ended off the schedule depends on its data): it says at
  set-up, from the module's code (it overrides ``optimizer_step``, ``lr_scheduler_step`` or
  ``on_train_batch_start``, or optimizes manually), that what a client's training decides stays
  with the client.

The schedule alone places the schedulers exactly where that Lightning run would have them (the
scheduler objects are stepped on a copy, with no data):

- ``interval="epoch"`` (``frequency=f``): stepped ``floor(r / f)`` times -- once per round, for every
  client alike; it never steps inside a client.
- ``interval="step"`` (``frequency=f``): stepped ``floor(r * S / f)`` times, then after each local
  optimizer step whose ``global_step`` is a multiple of ``f``.
- ``ReduceLROnPlateau`` (its ``monitor`` is required): the server steps it once per round with the
  monitored value of the round's *released* row (the metrics the run logs), after the epoch-interval
  schedulers; round ``r``'s value sets round ``r+1``'s learning rate. A round whose row lacks the
  metric because nothing was evaluated (``eval_every``) does not step it; a metric missing from a
  round that evaluated -- e.g. a training loss a DP run withholds -- stops the run with the reason
  (``strict=False``: a warning, and the step is skipped).
- The module's ``lr_scheduler_step`` override is used for every step of automatic optimization,
  with ``self.current_epoch`` and ``self.global_step`` set to the position being stepped (never in
  manual optimization, as under Lightning).
- ``client_lr_decay`` multiplies the learning rate of every local step (scheduled lr x decay**round);
  ``param_groups`` show the scheduled lr.
- In manual optimization the module steps its schedulers itself; the next round continues from
  those steps when the round's clients agree on them (above). Otherwise each client starts where the
  scheduler's declared ``interval`` places it (as above, with ``S`` = batches per round).

Every rank computes these positions from the round, the released rows and the clients' agreed
ends, so results do not depend on the number of ranks, and a resumed run continues the same
sequence.

**The Trainer API inside the module.** ``self.trainer`` is a stand-in for ``lightning.Trainer``:
``current_epoch``, ``global_step``, ``estimated_stepping_batches``, ``max_epochs``,
``num_training_batches``, ``accumulate_grad_batches``, ``gradient_clip_val`` /
``gradient_clip_algorithm``, ``precision``, ``optimizers`` (the client's, DP-SGD-wrapped where DP-SGD
runs), ``lr_scheduler_configs``, ``model`` / ``lightning_module`` (the module), ``datamodule`` (the
LightningDataModule, if the data came from one), ``callback_metrics`` / ``logged_metrics`` (the
previous round's released row), ``is_last_batch``, ``training`` / ``validating`` / ``testing``,
``global_rank`` / ``world_size`` / ``is_global_zero``, ``log_dir``, ``strategy`` and
``precision_plugin`` (what Lightning's own methods call). Through them ``self.optimizers()``
(``LightningOptimizer`` objects, in automatic and manual optimization), ``self.lr_schedulers()``,
``self.manual_backward``, ``self.clip_gradients``, ``self.toggle_optimizer`` /
``self.untoggle_optimizer`` / ``toggled_optimizer`` and ``self.print`` behave as under Lightning.
Setting ``self.trainer.should_stop = True`` inside a client ends that client's local training (to
stop the run on a metric, use ``EarlyStopping``). ``self.logger`` is ``None``: what the module
reports goes through ``self.log``, and so through the run's release list (a logger inside a client
would write un-noised client statistics past it). Anything else raises an ``AttributeError`` naming it.

**Hooks.** Per run, in Lightning's order: ``setup("fit")`` and ``configure_model()`` before the
parameters are laid out (layers they create are trained and federated), ``configure_optimizers``
(checked once), ``on_fit_start``, ``on_train_start``; after the last round ``on_train_end``,
``on_fit_end``; ``teardown("fit")`` always (the DataModule's too), also when set-up or training
fails. Per client:
``on_train_epoch_start``, the per-batch hooks (see :mod:`dpfl_lightning.module`),
``on_train_epoch_end``. Server evaluation: ``on_validation_model_zero_grad``,
``on_validation_model_eval``, ``on_validation_start``, ``on_validation_epoch_start``,
``validation_step`` and its batch hooks, ``on_validation_epoch_end``, ``on_validation_end``,
``on_validation_model_train``. ``fit`` runs no ``test_step``, as ``lightning.Trainer.fit``;
``FederatedTrainer(test_after_fit=True)`` tests the final model on the test set (the ``test`` hooks
as above) and adds its metrics to the last row. ``tests/test_lightning_oracle.py`` checks all of
this against ``lightning.Trainer`` with one client holding all the data: weights, learning rates and
``global_step`` at every step, and the order of hooks.
After ``fit`` (and after a failed one) the module is an ordinary LightningModule again: its own
parameter storage holding the final global model, no trainer attached, Lightning's ``self.log``;
``lightning.Trainer`` can fit and test it.

**Trainer settings.**

- ``gradient_clip_val`` / ``gradient_clip_algorithm``: clipping of each client's local gradient at
  every local optimizer step, after ``on_before_optimizer_step``, through the module's
  ``configure_gradient_clipping`` (default: ``self.clip_gradients``). It is not DP clipping (that is
  ``UpdateClipping`` on updates, or ``DPSGD`` per record), and it is refused with ``DPSGD``, which
  clips every record's gradient and ignores the batch gradient (a ``configure_gradient_clipping``
  override runs under ``DPSGD``, and is refused at the step where it clips at a value). Refused with
  manual optimization, as Lightning does (call ``self.clip_gradients`` in ``training_step``).
- ``accumulate_grad_batches=k``: the optimizer steps every ``k`` batches and at the end of each local
  epoch (loss divided by ``k``), as Lightning does. Refused with manual optimization and with
  ``DPSGD`` (its accountant counts one noisy step per sampled batch: use a larger batch size).
- ``precision``: ``32`` (default); ``bf16-mixed`` (CPU and CUDA) and ``16-mixed`` (CUDA only, with a
  gradient scaler per rank, so its loss scale depends on which clients a rank trained) run
  ``training_step``, ``validation_step`` and ``test_step`` under autocast; parameters, updates and
  the global model stay fp32. ``16-mixed`` is refused on CPU, and with ``DPSGD`` (the scaled per-record
  gradients would be clipped at a scaled bound); ``*-true`` and ``64`` precisions are refused.
- ``callbacks``: Lightning callbacks run at the round level (see :mod:`dpfl_lightning.lightning.callbacks`):
  ``ModelCheckpoint`` on a round metric, ``EarlyStopping``, ``LearningRateMonitor`` (the scheduled lr
  at the start of each round, before ``client_lr_decay``), or a one-line refusal naming the callback.
  They see only the metrics the run releases. The module's ``configure_callbacks`` are added.
- Other ``lightning.Trainer`` arguments have federated counterparts: ``max_epochs`` -> ``rounds``,
  ``devices`` / ``strategy`` -> ``mpiexec`` ranks, ``check_val_every_n_epoch`` -> ``eval_every``,
  ``logger`` -> ``loggers``, ``enable_checkpointing`` -> ``checkpoint_every``.

**The optimizer's own calls.** ``optimizer.step(closure)`` of torch's optimizers (all but L-BFGS,
with no step pre-hooks) is the closure and then ``optimizer.step()``, without any step pre-hook the
closure registered (``step(closure)`` runs its pre-hooks before the closure); for plain
``torch.optim.SGD`` on CPU (no momentum, weight decay, ``maximize``, ``foreach``, ``fused``,
``differentiable``; no step hooks) that step is ``p -= lr * grad`` computed by the loop, and torch's
own ``zero_grad`` is ``grad = None`` (see :mod:`dpfl_lightning.module.optimizer_calls`): the same
parameters, bit for bit, and an LR scheduler still sees the step; what differs is that a torch
profile has no ``Optimizer.step#SGD.step`` / ``Optimizer.zero_grad#SGD.zero_grad`` ranges.

**DataModules** (:meth:`FederatedDataModule.from_datamodule`): the train set is split over clients;
validation runs on ``val_dataloader`` (its batch size, ``collate_fn`` and sampler) when the
DataModule has one, else on the test set; the final test on ``test_dataloader`` (else the validation
set). The train loader's ``collate_fn`` builds the clients' batches; dict batches work; its
``batch_size`` and sampler are replaced by the trainer's ``batch_size`` and each client's own
shuffling (DP-SGD: its accounted sampling), with a warning when they differ. An ``IterableDataset``
training set is refused (it cannot be split by index; Lightning's ``BoringDataModuleNoLen`` too). The DataModule's batch-transfer hooks take
precedence over the module's, as in Lightning.

**Differential privacy.** Callbacks, ``ReduceLROnPlateau`` and ``self.trainer.callback_metrics``
read only the released row; what the module reads of the run's length follows the public
``records_per_client``, never a client's size (above). ``DPSGD`` works with manual optimization
(``self.optimizers()`` returns the DP-SGD optimizer; stepping it twice on one batch is refused) and
with batches for which
``training_step`` returns ``None``: the step is still taken, with no gradient and the full noise, so
every sampled batch is one noisy step as its accountant assumes (the decision to skip must not
depend on the batch's records). ``DPSGD(fix_model=True)`` replaces the unsupported layers in the
module you passed, in place, and says so with a warning; it refuses to replace
``nn.MultiheadAttention`` (Opacus's replacement fails on the causal-mask hint of torch's Transformer
layers and computes other outputs or per-record gradients depending on the layout): freeze such
layers or use update-level DP. A layer frozen in ``__init__`` and unfrozen in a later round (in
``on_train_epoch_start`` or ``configure_optimizers``, keyed on ``self.current_epoch``: gradual
unfreezing) gets per-record gradients from then on; a layer Opacus cannot handle is refused at its
first forward once unfrozen.

**BatchNorm.** A BatchNorm with running statistics in eval mode (a pretrained one, frozen) runs, its
statistics fixed, as under Lightning, which keeps each submodule's mode; one in train mode would
compute them from each client's data without federating them: refused at set-up, or at the first
forward after a hook switched it to train mode.

**Executors.** The ``vmap`` executor runs none of the above beyond ``training_step`` and refuses a
module or setting that needs them (schedulers, epoch hooks, gradient clipping, accumulation, mixed
precision). Inside ``training_step`` it sets ``current_epoch``, ``global_step``, ``batch_idx`` and
``trainer.is_last_batch`` as the sequential executor does (every client of a chunk is at the same
step); ``self.optimizers()`` is empty there (a module that needs it uses manual optimization, which
vmap refuses).

**Export.** ``FederatedTrainer.save_lightning_checkpoint(path)`` (and ``final_checkpoint=True``, which
writes ``<checkpoint_dir>/final.ckpt`` after ``fit``) writes the global model as a Lightning checkpoint
that ``MyModule.load_from_checkpoint(path)`` loads (see :mod:`dpfl_lightning.run.lightning_export`). The run's own
checkpoints (``round-*.ckpt``, ``last.ckpt``) load the same way; a DP run's with
``weights_only=False`` (the privacy ledger's records are Python objects).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

from lightning.pytorch.utilities.warnings import PossibleUserWarning

from dpfl_lightning.lightning.callbacks import RoundTrainer, check_callbacks
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.module import FederatedLightningModule, LoopSettings, is_overridden, optimizer_steps_per_round
from dpfl_lightning.module.schedule import ScheduleCursor, merge_end
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.federated.public_sizes import public_records
from dpfl_lightning.federated.releases import learning_rate_kind

if TYPE_CHECKING:
    from dpfl_lightning.comm import Communicator
    from dpfl_lightning.data.module import FederatedDataModule
    from dpfl_lightning.federated.releases import ReleaseList
    from dpfl_lightning.run.status import RunStatus
    from dpfl_lightning.run.settings import TrainerSettings


def mixed16_needs_cuda(settings: TrainerSettings) -> None:
    """``16-mixed`` is refused on CPU (float16 autocast with a loss scaler is a CUDA feature)."""
    if not settings.wants_cuda():
        raise ConfigError("trainer.precision", "16-mixed", "float16 autocast with loss scaling needs CUDA, and this "
                          "run trains on CPU", "use precision='bf16-mixed' (CPU and CUDA) or '32'")


_SCHEDULE_KEY = "dpfl_lightning.module.schedule"

# what the run says, once, where a client's optimizers cannot continue as one lightning.Trainer run's would
_DIFFERS = {
    "private": "the module {hooks}, where it can change its optimizers' state in local training (global_step, a "
               "learning rate, a scheduler's state: a warm-up in optimizer_step, an epoch ended early, several "
               "optimizers or schedulers stepped by the module); in a DP run what a client's training decides stays "
               "with the client, so every client starts each round where the schedule places it (said at set-up from "
               "the module's code: what the clients' training did is never said)",
    "differ": "the clients of a round ended their local training in different optimizer states (global_step, learning "
              "rates or scheduler states depend on their data or size), so the next round's clients start where the "
              "schedule places them",
    "missing": "the module changes its optimizers' state in local training, and clients of S optimizer steps per "
               "round that took no part in the previous round (partial participation with clients of different sizes) "
               "start where the schedule alone places them (configure_optimizers' settings, its schedulers stepped to "
               "global_step = round * S), not where one lightning.Trainer run of S steps per epoch would have them",
    "structure": "configure_optimizers returned other optimizers or param groups than the state carried from the "
                 "previous round, so the fresh optimizers keep configure_optimizers' settings",
    "epoch_end": "the module's on_train_epoch_end runs when each client's local training of the round ends, before "
                 "the round's validation of the aggregated model (lightning.Trainer validates first), so validation "
                 "metrics it reads (self.trainer.callback_metrics) are the previous round's",
}


#: hooks in which a module usually changes its optimizers' state during local training
_STATE_HOOKS = ("optimizer_step", "lr_scheduler_step", "on_train_batch_start")


def optimizer_state_hooks(inner: Any) -> list[str]:
    """What in ``inner``'s code can move its optimizers off the schedule in local training: the
    overridden hooks of :data:`_STATE_HOOKS`, and manual optimization (``training_step`` steps the
    optimizers itself). A DP run says it at set-up from these, never from what clients did."""
    hooks = [hook for hook in _STATE_HOOKS if is_overridden(inner, hook)]
    found = [f"overrides {', '.join(hooks)}"] if hooks else []
    if not bool(getattr(inner, "automatic_optimization", True)):
        found.append("steps its optimizers in training_step (manual optimization)")
    return found


class LightningRun:
    """The Lightning side of one ``FederatedTrainer.fit``: run-level hooks, callbacks, the schedule's
    reference and the checks of what cannot run. The trainer calls it at fixed points of ``fit``;
    ``save_checkpoint(path, epoch, global_step)`` writes the global model as a Lightning checkpoint
    (for ``ModelCheckpoint``). :meth:`attach` gives it the run's communicator, release list and status
    once the run is built."""

    def __init__(self, settings: TrainerSettings, module: FederatedLightningModule, data: FederatedDataModule,
                 callbacks: list[Any], save_checkpoint: Callable[[str, int, int], Any]) -> None:
        self.settings, self.module, self.data = settings, module, data
        self._save_checkpoint = save_checkpoint
        self.comm: Communicator | None = None
        self.releases: ReleaseList | None = None
        self.status: RunStatus | None = None
        self.rounds_done = 0
        self.round_idx = 0
        self.adapter: RoundTrainer | None = None
        self.steps_public = True  # every client takes the same optimizer steps per round, set by the settings
        self._plateau_warned: set[str] = set()
        self._said: set[str] = set()
        inner = module.inner
        callbacks = list(callbacks)
        if is_overridden(inner, "configure_callbacks"):
            extra = inner.configure_callbacks()
            extra = [extra] if extra is not None and not isinstance(extra, (list, tuple)) else list(extra or [])
            callbacks += extra
        check_callbacks(callbacks)
        self.callbacks = callbacks
        self.saved_callback_states: dict[str, Any] = {}  # from a checkpoint, loaded after their setup
        if settings.precision == "16-mixed":
            mixed16_needs_cuda(settings)
        manual = not bool(getattr(inner, "automatic_optimization", True))
        if manual:
            require(not settings.gradient_clip_val, "trainer.gradient_clip_val", settings.gradient_clip_val,
                    "automatic gradient clipping is not supported with manual optimization (as in Lightning)",
                    "call self.clip_gradients(opt, gradient_clip_val=...) in training_step, or remove the setting")
            require(settings.accumulate_grad_batches == 1, "trainer.accumulate_grad_batches",
                    settings.accumulate_grad_batches, "automatic gradient accumulation is not supported with manual "
                    "optimization (as in Lightning)", "accumulate in training_step, or remove the setting")
        # (what the vmap executor cannot run of these settings it refuses in its own set-up)
        module.configure_loop(LoopSettings(
            rounds=settings.rounds, accumulate_grad_batches=settings.accumulate_grad_batches,
            gradient_clip_val=settings.gradient_clip_val or None, gradient_clip_algorithm=settings.gradient_clip_algorithm,
            precision=settings.precision, eval_every=settings.eval_every, log_dir=settings.log_dir),
            datamodule=getattr(data, "datamodule", None))

    # ------------------------------------------------------------------ set-up
    def attach(self, comm: Communicator, releases: ReleaseList, status: RunStatus) -> None:
        self.comm, self.releases, self.status = comm, releases, status

    @property
    def is_global_zero(self) -> bool:
        return self.comm is None or self.comm.rank == 0

    def check(self) -> None:
        """After the run is built: the reference client's steps, ``configure_optimizers``, data settings."""
        settings, module, data = self.settings, self.module, self.data
        records = public_records(settings, data)
        plan = RoundPlan(0, (), settings.local_steps, settings.local_epochs, settings.batch_size,
                         records_per_client=records)
        k = settings.accumulate_grad_batches if module.automatic_optimization else 1
        sizes = [records] if records is not None else sorted({data.client_num_samples(c) for c in range(data.num_clients)})
        shapes = {(optimizer_steps_per_round(plan.steps_for(n), plan.epoch_batches(n), k), plan.steps_for(n))
                  for n in sizes}
        module.loop.steps_reference, batches = max(shapes)
        # every client takes the same public number of steps per round: set by the settings
        self.steps_public = records is not None or (settings.local_steps is not None and k == 1)
        # a DP run writes a global_step of the settings where the reference client's follows the data, and
        # withholds what the module would read of the clients' sizes (dpfl_lightning.federated.public_sizes)
        private = bool(self.releases is not None and self.releases.private)
        module.schedules.steps_private = private and not self.steps_public
        module.schedules.private = private
        shim = module.trainer_shim  # outside a client (set-up, evaluation, the vmap executor): the reference client
        shim.sizes_withheld = module.schedules.steps_private
        module.schedules.reference_shape = (settings.rounds * module.loop.steps_reference, batches)
        shim.set_shape(*module.schedules.reference_shape)
        module.check_optimizers()  # (and the plugins' rules on the optimizers, e.g. DPSGD's)
        if is_overridden(module.inner, "on_train_epoch_end") and module.has_validation_step and self.is_global_zero:
            self._say("epoch_end")
        hooks = optimizer_state_hooks(module.inner)
        if self.releases is not None and self.releases.private and hooks and self.is_global_zero:
            self._say("private", hooks=" and ".join(hooks))
        self._check_data()

    def _check_data(self) -> None:
        data, settings = self.data, self.settings
        info = getattr(data, "train_loader_info", None) or {}
        bs = info.get("batch_size")
        if bs is not None and settings.batch_size is not None and bs != settings.batch_size and self.is_global_zero:
            warnings.warn(f"data: the DataModule's train_dataloader has batch_size={bs}; clients train with "
                          f"trainer.batch_size={settings.batch_size} (set it to {bs} to keep the DataModule's)",
                          UserWarning, stacklevel=3)
        sampler = info.get("sampler")
        if sampler is not None and self.is_global_zero:
            warnings.warn(f"data: the DataModule's train_dataloader sampler ({sampler}) is not used: each client "
                          "draws its own batches from its own records (shuffled, or as DP-SGD's accountant assumes)",
                          UserWarning, stacklevel=3)

    def reference(self) -> ScheduleCursor:
        """The optimizers and schedulers of the reference (largest) client at the current round: what
        ``LearningRateMonitor`` reports."""
        return self.module.cursor(self.module.loop.steps_reference, self.round_idx)

    @property
    def lr_kind(self) -> str:
        """The release kind of the learning rate the run logs, from the settings
        (:func:`~dpfl_lightning.federated.releases.learning_rate_kind`)."""
        return learning_rate_kind(any(c.interval == "step" for c in self.reference().scheds), self.steps_public)

    # ------------------------------------------------------------------ run-level hooks
    def fit_start(self, loggers: list[Any], start_round: int) -> None:
        inner = self.module.inner
        self.rounds_done = self.round_idx = start_round
        for r, row in enumerate(self.status.history):  # a resumed run: ReduceLROnPlateau's past inputs
            self.module.record_round(int(row.get("round", r + 1)) - 1, row)
        self.module.load_schedule_state(self.saved_callback_states.get(_SCHEDULE_KEY, []))
        if self.callbacks:
            self.adapter = RoundTrainer(self, self.callbacks, loggers)
            self.adapter.current_epoch = start_round
            self.adapter.call("setup", "fit")
            for cb in self.callbacks:  # as lightning.Trainer restores them: after setup, before on_fit_start
                if cb.state_key in self.saved_callback_states:
                    cb.load_state_dict(self.saved_callback_states[cb.state_key])
            self.adapter.call("on_fit_start")
        inner.on_fit_start()
        eval_modules = [name for name, m in inner.named_modules() if not m.training]
        if eval_modules and self.is_global_zero:  # lightning.Trainer's own warning, at the same point
            warnings.warn(f"Found {len(eval_modules)} module(s) in eval mode at the start of training. This may lead to "
                          "unexpected behavior during training. If this is intentional, you can ignore this warning.",
                          PossibleUserWarning, stacklevel=2)
        if self.adapter is not None:
            self.adapter.call("on_train_start")
        inner.on_train_start()

    def round_start(self, round_idx: int) -> None:
        self.round_idx = round_idx
        self.module.set_round(round_idx)
        if self.adapter is not None:
            self.adapter.set_round(round_idx, None, False)
            self.adapter.call("on_train_epoch_start")

    def round_end(self, round_idx: int, metrics: dict[str, float], kinds: dict[str, str]) -> dict[str, float]:
        """The round's released row: callbacks' logs merged in, then filtered; callbacks and the
        schedules see only it."""
        module, releases = self.module, self.releases
        evaluated = self.settings.is_evaluation_round(round_idx)
        self._merge_logs(metrics, kinds)
        row = releases.filter(metrics, kinds)
        self.rounds_done = round_idx + 1
        self._take_round_ends(round_idx)
        module.record_round(round_idx, row)
        self._check_plateau(round_idx, row, evaluated)
        if self.adapter is not None:
            self.adapter.set_round(round_idx, row, evaluated)
            if evaluated:
                for hook in ("on_validation_start", "on_validation_epoch_start", "on_validation_epoch_end",
                             "on_validation_end"):
                    self.adapter.call(hook)
            self.adapter.call("on_train_epoch_end")
            late: dict[str, float] = {}
            self._merge_logs(late, kinds)
            row.update(releases.filter(late, kinds))
        return row

    def _take_round_ends(self, round_idx: int) -> None:
        """Where the round's clients all ended their local training in the same optimizer state that
        the schedule alone does not give, the next round's clients continue from it (one Lightning
        run's position; see :mod:`dpfl_lightning.module.schedule`); not in a DP run, which says nothing here:
        whether a client ended off the schedule depends on its data (:meth:`check` said at set-up, from
        the module's code, that clients start on the schedule). Otherwise the run says, once, what
        differs from lightning.Trainer."""
        module = self.module
        ends = module.round_ends_of_clients()
        if self.releases.private:
            return
        comm = self.comm
        if comm is not None and comm.size > 1:
            parts, ends = comm.allgather_object(ends), {}
            for part in parts:
                for steps, end in part.items():
                    merge_end(ends, steps, end)
        for kind in module.schedules.settle_round(round_idx, ends):
            self._say(kind)
        for kind in sorted(module.notes):
            self._say(kind)

    def _say(self, kind: str, **detail: str) -> None:
        if kind in self._said:
            return
        self._said.add(kind)
        warnings.warn(f"lightning.Trainer would differ: {_DIFFERS[kind].format(**detail)}", RuntimeWarning,
                      stacklevel=3)

    def _merge_logs(self, metrics: dict[str, float], kinds: dict[str, str]) -> None:
        if self.adapter is None:
            return
        captured = self.adapter.capture.pop()
        lr_keys = [k for k in captured if k.startswith(("lr-", "momentum-"))]
        lr_kind = self.lr_kind if lr_keys else "public"
        for key, value in captured.items():
            kinds[key] = lr_kind if key in lr_keys else "unaccounted"
            metrics[key] = value

    def _check_plateau(self, round_idx: int, row: dict[str, float], evaluated: bool) -> None:
        scheds = self.reference().scheds if self.module.has_schedulers else []
        for cfg in scheds:
            if not cfg.reduce_on_plateau or cfg.monitor in row or not evaluated:
                continue
            releases = self.releases
            why = f"the round released {sorted(row)}"
            if releases.private and not releases.opt_in:
                why += " (this DP run withholds what training_step logs: un-noised statistics of client data)"
            if cfg.strict:
                raise ConfigError("model.configure_optimizers", f"monitor={cfg.monitor!r}", "ReduceLROnPlateau monitors "
                                  f"a metric the round did not release: {why}", "monitor a released metric (an "
                                  "evaluation metric such as val_loss), set log_client_metrics=True, or strict=False")
            if cfg.monitor not in self._plateau_warned:
                self._plateau_warned.add(cfg.monitor)
                warnings.warn(f"ReduceLROnPlateau(monitor={cfg.monitor!r}) skipped round {round_idx + 1}: {why}",
                              RuntimeWarning, stacklevel=2)

    def callback_states(self) -> dict[str, Any]:
        """Every Lightning callback's ``state_dict`` by ``state_key``, for the run's checkpoint
        (``ModelCheckpoint``'s best models, ``EarlyStopping``'s patience count)."""
        states = {cb.state_key: cb.state_dict() for cb in self.callbacks}
        # and where the clients' optimizers stand (dpfl_lightning.module.schedule), under a key no callback has
        states[_SCHEDULE_KEY] = self.module.schedule_state()
        return states

    def train_end(self) -> None:
        inner = self.module.inner
        if self.adapter is not None:
            self.adapter.call("on_train_end")
        inner.on_train_end()
        if self.adapter is not None:
            self.adapter.call("on_fit_end")
        inner.on_fit_end()

    def teardown(self, error: BaseException | None) -> None:
        """Always, also after a failure, in ``lightning.Trainer``'s order: callbacks' ``on_exception``,
        the DataModule's ``teardown("fit")``, callbacks' ``teardown``, the module's ``teardown("fit")``;
        then the module is detached from the run."""
        module = self.module
        try:
            if error is not None and self.adapter is not None:
                for cb in self.callbacks:
                    cb.on_exception(self.adapter, module.inner, error)
            if module.datamodule is not None:
                module.datamodule.teardown("fit")
            if self.adapter is not None:
                self.adapter.call("teardown", "fit")
            if module.attached:
                module.inner.teardown("fit")
        finally:
            module.teardown()

    # ------------------------------------------------------------------ export
    def lightning_fields(self, rounds_done: int) -> dict[str, Any]:
        """What a Lightning checkpoint of the global model holds (``state_dict``, hyperparameters,
        ``epoch``, ``global_step``, Lightning's version), for the run's own checkpoints: with them
        ``MyModule.load_from_checkpoint("last.ckpt")`` loads the global model of that round too."""
        from dpfl_lightning.run.lightning_export import lightning_checkpoint

        module = self.module
        module.load_global()
        datamodule = getattr(self.data, "datamodule", None)
        return lightning_checkpoint(module.inner, rounds_done, module.schedules.written_step(rounds_done),
                                    datamodule if hasattr(datamodule, "CHECKPOINT_HYPER_PARAMS_KEY") else None)

    def save_lightning_checkpoint(self, path: str, epoch: int, global_step: int) -> None:
        """The global model as a Lightning checkpoint (rank 0 writes; every rank calls this)."""
        self._save_checkpoint(path, epoch, global_step)
