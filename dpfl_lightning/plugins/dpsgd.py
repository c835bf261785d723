"""DPSGD: record-level DP inside every client, with Opacus (paper 004 Alg. 1; paper 001's clients).

Each local step clips every record's gradient to L2 norm ``max_grad_norm`` (``C``), sums them, adds
``N(0, (z C)^2 I)`` and divides by the expected batch size (Abadi et al. 2016) -- Opacus's
``DPOptimizer``, created fresh for every client around the module's own optimizer. Per-record
gradients come from one Opacus ``GradSampleModule`` wrapped around the rank's model once; the
module's own ``training_step`` keeps running unchanged (Opacus's hooks sit on the layers).
Only the parameters trainable at a step take part in it, as with plain Opacus: a record's gradient
norm that is clipped is over them, the noise is added to them, and a frozen parameter
(``requires_grad=False``: a LoRA model's base weights and tied head, a frozen BatchNorm) gets no
per-record gradient, no noise and no step. Opacus takes row ``i`` of a hooked layer's input for
record ``i``: a layer run on other rows -- a row that the whole batch shares, as GPT-2's position
embedding on its default position ids of shape ``(1, T)``, or records flattened into rows -- is
refused at the first step it does so, before that step changes anything, with the layer's name and
the fix (position ids expanded to the batch).

Sensitivity and threat model: neighbouring datasets differ in one record of one client
(add/remove for Poisson batches, replace-one for fixed-size batches). The clipped sum of a batch
changes by at most ``C`` (add/remove) or ``2C`` (replace-one). The guarantee is towards the server
(and anyone who sees the client's updates): per client, the composition of every local step of
every round it took part in. Client sampling gives no amplification towards the server, who knows
who took part. Batches are drawn independently every step -- Poisson with rate ``B / N`` or ``B`` of
``N`` records without replacement -- so the accounted sampling is the one that happens. ``N`` is the
run's public number of records per client (``trainer.records_per_client``, as Opacus takes a
dataset's size to be public), never a client's own count ``n``: with it the sampling rate, the
steps per local epoch (``ceil(N / B)``) and the expected batch size that the noisy sum is divided
by are the same for every client, and the epsilon holds for a client of any size (Poisson: each of
its records is in a batch with probability ``B / N``, whatever ``n``; fixed-size: a client of fewer
records is one of ``N`` with empty slots, one of more is sampled at a lower rate). A run without
``N`` is refused: its epsilon would name the smallest client's count
(:mod:`dpfl_lightning.federated.public_sizes`).

Noise and batches are drawn from the run's random source keyed by (seed, round, client, purpose),
so results do not depend on the number of ranks; with ``FederatedTrainer(secure=True)`` both come
from the CSPRNG (noise with the floating-point mitigation of :mod:`dpfl_lightning.rng`).
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import torch

from dpfl_lightning import rng
from dpfl_lightning.data.module import record_sampling_rate
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.public_sizes import dpsgd_error
from dpfl_lightning.plugins.callback import ORDER_LOCAL_TRAINING, FederatedCallback
from dpfl_lightning.plugins.calibrated_noise import CalibratedNoise
from dpfl_lightning.plugins.gaussian_noise import check_noise_multiplier
from dpfl_lightning.privacy.guarantees import guarantees
from dpfl_lightning.privacy.mechanisms import Mechanism, RecordProfile


def _opacus() -> Any:
    """Opacus's side of DP-SGD (:mod:`dpfl_lightning.plugins.opacus_glue`), loaded when a DP-SGD run
    sets up: ``import dpfl_lightning`` does not load Opacus."""
    from dpfl_lightning.plugins import opacus_glue

    return opacus_glue


def _one_optimizer(opts: list[torch.optim.Optimizer]) -> None:
    """What ``configure_optimizers`` may return under DP-SGD: one optimizer."""
    require(len(opts) == 1, "model.configure_optimizers", f"{len(opts)} optimizers", "DPSGD's accountant "
            "counts one noisy step per sampled batch; a second DP optimizer would release every batch twice",
            "train with one optimizer under DPSGD")


class DPSGD(CalibratedNoise, FederatedCallback):
    """Train every client with DP-SGD (Opacus).

    Args:
        noise_multiplier: ``z``; the noise on a batch's clipped sum has std ``z * max_grad_norm``.
        max_grad_norm: the per-record clipping bound ``C``.
        target_epsilon / delta: instead of ``z``: calibrate it before training so that the worst
            client's record-level epsilon after the whole run is at most the target
            (``delta`` defaults to ``1e-6``, a public setting that assumes at most 10^5 records per
            client, or to a power of ten at most ``0.1 / N`` for a larger ``trainer.records_per_client``:
            :func:`~dpfl_lightning.privacy.guarantees.default_delta_for`).
        sampling: ``poisson`` (each record in a batch with probability ``B/N``; Opacus's default)
            or ``fixed`` (``B`` of ``N`` slots without replacement per batch), ``N`` the run's
            ``trainer.records_per_client``.
        fix_model: replace layers Opacus cannot handle (BatchNorm -> GroupNorm, ...) with Opacus's
            fixers (``opacus.validators.ModuleValidator.FIXERS``) instead of failing. The layers are
            replaced in the module you passed (in place: it is the module that trains and holds the
            result), and a warning lists them; if layers remain that Opacus cannot handle, the
            module is left as it was and the run is refused, and if the run fails later (in DPSGD's
            set-up or in any round) the layers it had are put back (the objects you built, as you
            built them; the other layers hold the global model, as after any failed fit).
            In-place operations after a trainable layer (``nn.ReLU(inplace=True)``, a residual
            ``out += identity``) need no fix.
        loss_reduction: how the module's loss reduces over a batch (``mean`` or ``sum``).
        accountant: for calibration (``rdp``, ``pld``, ``prv``).
        allow_infinite_epsilon: accept ``noise_multiplier=0`` (clipping only, no guarantee).
    """

    order = ORDER_LOCAL_TRAINING

    def __init__(self, noise_multiplier: float | None = None, max_grad_norm: float = 1.0,
                 target_epsilon: float | None = None, delta: float | None = None, sampling: str = "poisson",
                 fix_model: bool = False, loss_reduction: str = "mean", accountant: str = "rdp",
                 allow_infinite_epsilon: bool = False, secure_mode: bool | None = None) -> None:
        require((noise_multiplier is None) != (target_epsilon is None), "DPSGD",
                {"noise_multiplier": noise_multiplier, "target_epsilon": target_epsilon},
                "exactly one of noise_multiplier and target_epsilon must be set",
                "pass noise_multiplier=... or target_epsilon=... (with delta)")
        require(secure_mode is None, "DPSGD.secure_mode", secure_mode, "secure randomness is one switch for the whole "
                "run (noise and batch sampling)", "set FederatedTrainer(secure=True) instead")
        check_noise_multiplier("DPSGD", noise_multiplier, allow_infinite_epsilon)
        self.check_target_epsilon("DPSGD", target_epsilon)
        require(math.isfinite(max_grad_norm) and max_grad_norm > 0, "DPSGD.max_grad_norm", max_grad_norm,
                "the clipping bound C must be a finite number > 0", "set max_grad_norm, e.g. 1.0")
        require(delta is None or 0 < delta < 1, "DPSGD.delta", delta, "must be in (0, 1)", "set delta well below 1/n")
        require(sampling in ("poisson", "fixed"), "DPSGD.sampling", sampling, "unknown batch sampling",
                "use 'poisson' or 'fixed'")
        require(loss_reduction in ("mean", "sum"), "DPSGD.loss_reduction", loss_reduction, "unknown reduction",
                "use 'mean' or 'sum'")
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = float(max_grad_norm)
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.sampling = sampling
        self.fix_model = fix_model
        self.loss_reduction = loss_reduction
        self.accountant = accountant
        self.allow_infinite_epsilon = allow_infinite_epsilon
        self.replaced: list[str] = []
        self._fixes: list[tuple[str, torch.nn.Module, torch.nn.Module]] = []  # (name, the user's layer, its replacement)
        self._outer_error: BaseException | None = None
        self._grad_sample_module = None
        self._module = None
        self._coverage_checked = False
        self._trainable: tuple[bool, ...] | None = None
        self._profiles: tuple[RecordProfile, ...] = ()

    # ------------------------------------------------------------------ set-up
    def configure_model(self, *, ctx, model: Any) -> Any:
        """The local loop's settings are checked first (before a layer is replaced), then Opacus's
        objections to the model's layers (``fix_model`` replaces them)."""
        self._check_local_loop(ctx.module)
        self._fixes, self.replaced = [], []
        problems = _opacus().unsupported_layers(model)
        if not problems:
            return model
        if not self.fix_model:
            raise ConfigError("DPSGD", type(model).__name__,
                              f"Opacus cannot compute per-record gradients for this model: {'; '.join(problems)}",
                              "set DPSGD(fix_model=True) to replace those layers (BatchNorm -> GroupNorm), "
                              "or change the model")
        attention = _opacus().attention_layers(model)
        if attention:
            raise ConfigError("DPSGD.fix_model", attention[:3], "Opacus's replacement of nn.MultiheadAttention "
                              "(DPMultiheadAttention) computes another function on batch_first inputs, per-record "
                              "gradients over the sequence axis on sequence-first ones, and fails on the is_causal hint "
                              "of torch's Transformer layers", "freeze the attention layers (requires_grad=False), or "
                              "protect the clients' data with DP-FedAvg (update clipping and noise) instead of DPSGD")
        fixes = _opacus().layer_fixes(model)
        for name, _, new in fixes:
            _opacus().put_layer(model, name, new)
        left = _opacus().unsupported_layers(model)
        if left:  # the model as it was: nothing half-changed
            for name, old, _ in reversed(fixes):
                _opacus().put_layer(model, name, old)
            raise ConfigError("DPSGD.fix_model", True, f"layers remain that Opacus cannot handle: {'; '.join(left)}",
                              "change the model")
        self.replaced = [f"{name}: {type(old).__name__} -> {type(new).__name__}" for name, old, new in fixes]
        self._fixes = fixes
        if ctx.is_global_zero:
            message = (f"DPSGD(fix_model=True) changed {type(model).__name__} in place: {', '.join(self.replaced)} "
                       "(the module you passed now has these layers and is the one trained; if the run fails, "
                       "the layers it had are put back)")
            warnings.warn(message, UserWarning, stacklevel=2)
            if ctx.verbose:
                print(message, flush=True)
        return model

    def _check_local_loop(self, module: Any) -> None:
        """What the local loop may not do under DP-SGD, whose accountant counts one noisy step of clipped
        per-record gradients per sampled batch: clip the batch gradient at ``gradient_clip_val``, accumulate
        batches, scale the loss (``16-mixed``), or train with a second DP optimizer (checked on what
        ``configure_optimizers`` returns, at set-up). A ``configure_gradient_clipping`` override runs,
        with no value to clip at; clipping at a value through ``self.clip_gradients``, an override that
        clips ``p.grad`` with torch directly, and a second step on one batch are refused at the first step
        that does it, before the parameters change (:class:`KeyedDPOptimizer`)."""
        loop = module.loop
        require(not loop.gradient_clip_val, "trainer.gradient_clip_val", loop.gradient_clip_val,
                "DPSGD clips every record's gradient at max_grad_norm and ignores the batch gradient, so local "
                "gradient clipping would have no effect", "remove it (DPSGD(max_grad_norm=...) is the bound)")
        require(loop.accumulate_grad_batches == 1, "trainer.accumulate_grad_batches",
                loop.accumulate_grad_batches, "DPSGD's accountant counts one noisy step per sampled batch; "
                "accumulating k batches would make one step of k batches",
                "use a k times larger batch_size instead")
        require(loop.precision != "16-mixed", "trainer.precision", "16-mixed", "the loss scaler would scale "
                "the per-record gradients that DPSGD clips at max_grad_norm", "use 'bf16-mixed' or '32' with DPSGD")
        module.add_optimizer_rule(_one_optimizer)

    def setup(self, *, ctx) -> None:
        try:
            self._setup(ctx)
        except BaseException:
            self._put_back_layers(ctx)  # a refused set-up leaves the model as it was given
            raise

    def _setup(self, ctx) -> None:
        require(ctx.plan.batch_size is not None, "trainer.batch_size", None, "DP-SGD needs a batch size",
                "set trainer.batch_size (the expected batch size B)")
        if ctx.plan.records_per_client is None:
            raise dpsgd_error()
        self._coverage_checked = False
        self._trainable: tuple[bool, ...] | None = None
        self._profiles = self._client_profiles(ctx)
        if self.target_epsilon is not None:
            if self.delta is None:
                self.delta = ctx.privacy.default_delta("record")
            record = lambda z: guarantees([self._mechanism(z)], ctx.sampler.accounted())[0]  # noqa: E731
            self.noise_multiplier = ctx.privacy.calibrate(record, self.target_epsilon, self.delta, self.accountant)

    def on_fit_start(self, *, ctx) -> None:
        self._outer_error = sys.exc_info()[1]  # (fit called inside an except block: not this run's failure)
        if ctx.is_global_zero:  # (calibrated by now: a target's warning names the target and the std it gave)
            self.warn_if_useless("DPSGD", self.noise_multiplier, self.max_grad_norm, "raise target_epsilon (or "
                                 "delta), use larger batches or fewer local steps, or train fewer rounds")
        self._module = ctx.module  # (its batch_records: the records of the batch each step trains on)
        if ctx.model is not None and self._grad_sample_module is None:
            # Hooks on the layers: the module's own training_step computes per-record gradients. Set
            # here, not in setup, so that a run failing during set-up leaves no hooks on the model.
            self._grad_sample_module = _opacus().GradSamples(ctx.model, strict=False, loss_reduction=self.loss_reduction)
            # Opacus records a layer's activations only in train mode, and the submodules keep the
            # modes the user gives them (hooks such as on_train_start may change them): a trainable
            # layer run in eval mode with gradients on is refused when it runs, with its name.
            # (every layer with parameters: one frozen now may be unfrozen in a later round, and is then
            # checked as set-up checked the trainable ones)
            checked = {id(m) for _, m in _opacus().trainable_modules(ctx.model)}
            self._mode_hooks = [m.register_forward_pre_hook(self._check_layer(name or type(m).__name__, checked))
                                for name, m in ctx.model.named_modules() if _opacus().has_params(m)]

    def _client_profiles(self, ctx) -> tuple[RecordProfile, ...]:
        """One profile for every client, from the public records per client ``N`` (its sampling rate
        ``B / N``, its batch ``min(B, N)``): no client's own count enters the accounting."""
        N, B = ctx.plan.records_per_client, ctx.plan.batch_size
        return (RecordProfile(N, record_sampling_rate(N, B), min(B, N), None),)

    def _mechanism(self, z: float) -> Mechanism:
        return Mechanism.dp_sgd("DP-SGD", z, self._profiles, self.sampling)

    def privacy_mechanisms(self, *, ctx) -> list[Mechanism]:
        return [self._mechanism(self.noise_multiplier)]

    # ------------------------------------------------------------------ per round / client
    def before_round(self, *, plan, server) -> None:
        plan.batch_sampling = self.sampling  # batches drawn the way the accountant assumes

    def on_before_optimizer_step(self, *, client, optimizer) -> None:
        """At the first local step, and again at the first step after the set of trainable parameters
        changed (a layer unfrozen in a later round): every trainable parameter must have per-record
        gradients, from a layer Opacus supports. Opacus computes them per layer; a parameter used
        outside its layers' forward (say, a temperature multiplied in ``training_step``) would silently
        get noise only. At every step, before the check: every hooked call must have run on the
        batch's records (:meth:`_check_rows`)."""
        self._check_rows()
        trainable = tuple(p.requires_grad for p in client.model.parameters())
        if trainable != self._trainable:
            self._trainable, self._coverage_checked = trainable, False
        if self._coverage_checked:
            return
        params = [(n, p) for n, p in client.model.named_parameters() if p.requires_grad]
        if all(p.grad is None and getattr(p, "grad_sample", None) is None for _, p in params):
            return  # no backward this step (training_step returned None): check at the next one
        self._coverage_checked = True
        scale = max((float(p.grad.abs().max()) for _, p in params if p.grad is not None and p.grad.numel()), default=0.0)
        missing = []
        for name, p in params:
            gs = getattr(p, "grad_sample", None)
            # all-zero per-record gradients for a parameter whose gradient is not negligible (rounding
            # residue, e.g. of a normalisation over one element, is not a miss)
            silent = (gs is not None and gs.numel() and not gs.any() and p.grad is not None
                      and float(p.grad.abs().max()) > 1e-5 * scale)
            if gs is None or silent:
                missing.append(name)
        if missing:
            raise ConfigError("DPSGD", missing, "Opacus computes no per-record gradients for these parameters "
                              "(used outside a supported layer's forward), so DP-SGD would train them on noise only",
                              "compute them inside a module Opacus supports, or freeze them (requires_grad=False)")

    def _check_rows(self) -> None:
        """Every call of a layer Opacus hooked must have run on one row per record of the batch: Opacus
        takes row ``i`` of its input and output gradient for record ``i``. A layer run on a row that
        every record shares (GPT-2's position embedding ``wpe`` on position ids of shape ``(1, T)``,
        broadcast over the batch) gets per-record gradients of one row, which fail to stack with the
        others (Opacus's ``stack expects each tensor to be equal size`` at the step); one run both on
        the batch and on a shared row gets the shared row's gradient, which every record's loss
        reaches, added to the first record's, so a record's effect is not bounded by ``C``; a layer
        run on records flattened into rows (tokens) would clip each row as a record. Checked before
        the step changes anything; the message names the layers, not the batch's size (a client's)."""
        if self._grad_sample_module is None or self._module is None:
            return
        rows, n = self._grad_sample_module.take_rows(), self._module.batch_records
        odd = {name: r for name, r in rows.items() if r != {n}}
        if not odd:
            return
        shared = [name for name, r in odd.items() if any(k < n or n == 0 for k in r)]
        flat = [name for name in odd if name not in shared]
        problems, fixes = [], []
        if shared:
            problems.append(f"{shared} ran on fewer rows than the batch has records (such as a row that every "
                            "record shares: position ids of shape (1, T) broadcast over the batch), whose gradient "
                            "Opacus cannot split by record: its per-record gradients fail to stack with the "
                            "others' ('stack expects each tensor to be equal size'), or, for a layer that also "
                            "ran on the batch, are added to the first record's, beyond the bound max_grad_norm")
            fixes.append("call such a layer on one row per record: pass position ids expanded to the batch, "
                         "position_ids=torch.arange(T).expand(B, T), in the model's forward (a Hugging Face "
                         "model: model(input_ids, position_ids=...)), or freeze the layer (requires_grad=False)")
        if flat:
            problems.append(f"{flat} ran on more rows than the batch has records (records flattened into rows, as "
                            "tokens), so Opacus would clip every row as a record and a record's gradient would "
                            "be bounded only by max_grad_norm times its rows")
            fixes.append("keep one row per record on the first dimension (Opacus's layers take (B, T, ...) inputs) "
                         "instead of reshaping to (B * T, ...)")
        raise ConfigError("DPSGD", list(odd), "DP-SGD needs every trainable layer's "
                          "per-record gradients, and Opacus takes row i of a layer's input for record i, but "
                          + "; ".join(problems), "; ".join(fixes))

    def wrap_optimizer(self, *, client, optimizer: torch.optim.Optimizer):
        N = client.plan.records_per_client  # the expected batch size B (min(B, N)), the same for every client
        expected = N * record_sampling_rate(N, client.plan.batch_size)
        stream = client.random.stream(client.round_idx, client.client, rng.RECORD_NOISE)
        return _opacus().KeyedDPOptimizer(optimizer, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
                                expected_batch_size=expected, loss_reduction=self.loss_reduction, noise_stream=stream)

    @staticmethod
    def _check_layer(name: str, checked: set[int]):
        """A forward pre-hook on a layer with parameters: while it is trainable and gradients are on, it
        must run in train mode (Opacus records nothing of a layer in eval mode), and a layer unfrozen
        after set-up must be one Opacus supports (checked at its first such forward)."""
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled() or not _opacus().has_trainable_params(module):
                return
            if not module.training:
                raise ConfigError("model", name, "DP-SGD needs per-record gradients of every trainable layer, and "
                                  "Opacus records none of a layer in eval mode",
                                  "keep the layer in train mode while training, or freeze its parameters "
                                  "(requires_grad=False)")
            if id(module) not in checked:
                problems = _opacus().unsupported_layers(module)
                if problems:
                    raise ConfigError("model", name, "a layer unfrozen during training is one Opacus cannot compute "
                                      f"per-record gradients for: {'; '.join(problems)}",
                                      "keep it frozen, or replace it in the model before training")
                checked.add(id(module))
        return hook

    def on_fit_end(self, *, ctx) -> None:
        for h in getattr(self, "_mode_hooks", []):
            h.remove()
        self._mode_hooks = []
        if self._grad_sample_module is not None:
            self._grad_sample_module.cleanup()  # remove Opacus hooks and attributes from the model
            self._grad_sample_module = None
        self._module = None
        failing = sys.exc_info()[1]  # on_fit_end runs on the way out of a failed round too
        if failing is not None and failing is not self._outer_error:
            self._put_back_layers(ctx)
        self._fixes = []

    def _put_back_layers(self, ctx) -> None:
        """After a failed run: the layers ``fix_model`` replaced are put back (on the model's device)."""
        if not self._fixes or ctx.model is None:
            return
        for name, old, _ in reversed(self._fixes):
            _opacus().put_layer(ctx.model, name, old.to(ctx.device))
        if ctx.is_global_zero:
            warnings.warn(f"DPSGD(fix_model=True): the run failed; {type(ctx.model).__name__} has its own layers "
                          f"back ({', '.join(name for name, _, _ in self._fixes)})", UserWarning, stacklevel=2)
        self._fixes, self.replaced = [], []
