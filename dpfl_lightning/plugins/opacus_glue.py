"""What DP-SGD takes from Opacus: the per-record gradient module, the layer checks and fixes, and
Opacus's ``DPOptimizer`` with the run's keyed noise. Imported when a DP-SGD run sets up, so that
``import dpfl_lightning`` does not load Opacus."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from opacus import GradSampleModule
from opacus.layers.dp_rnn import DPGRU, DPLSTM, DPRNN
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from opacus.utils.module_utils import has_trainable_params, trainable_modules
from opacus.validators import ModuleValidator

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError

__all__ = ["GradSamples", "KeyedDPOptimizer", "attention_layers", "has_params", "has_trainable_params",
           "layer_fixes", "put_layer", "trainable_modules", "unsupported_layers"]


def unsupported_layers(model: torch.nn.Module) -> list[str]:
    """Opacus's objections to the model's layers. Its "needs to be in training mode" is left out: the
    modes are the user's until training (a hook may switch them), and a layer that runs in eval mode
    is refused then, by name."""
    errors = (str(e) for e in ModuleValidator.validate(model, strict=False))
    return list(dict.fromkeys(e for e in errors if "training mode" not in e))


def has_params(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


class GradSamples(GradSampleModule):
    """Opacus's ``GradSampleModule`` that hooks each layer once, frozen layers included.

    Opacus walks the module tree by name, so a layer registered under two names (``self.head =
    self.net[2]``) would be hooked twice, and a layer inside a module whose per-record gradients
    Opacus takes whole with ``functorch`` (a module with parameters of its own and no grad sampler:
    children included) would be hooked again where it is registered under another name; both would
    add its per-record gradients twice. (A parameter shared by two different layers, tied weights, is
    hooked in each, which adds its own part: right.)

    Opacus hooks only the layers trainable when it wraps the model; the model is wrapped once per run,
    so a layer frozen then and unfrozen in a later round (gradual unfreezing) would have no per-record
    gradients. Every layer with parameters is hooked here: Opacus's hooks skip a layer while none of
    its parameters needs a gradient, so a frozen layer costs nothing until it is unfrozen."""

    def __init__(self, m: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(m, **kwargs)
        for p in m.parameters():  # what Opacus sets on trainable parameters only
            if not hasattr(p, "_forward_counter"):
                p.grad_sample = None
                p._forward_counter = 0

    def iterate_submodules(self, module: torch.nn.Module) -> Iterable[torch.nn.Module]:
        found = list({id(m): m for m in self._with_params(module)}.values())  # each once, in order
        whole = [m for m in found if self._takes_children(m)]
        inside = {id(sub) for m in whole for sub in m.modules() if sub is not m}
        return [m for m in found if id(m) not in inside]

    def _with_params(self, module: torch.nn.Module) -> Iterable[torch.nn.Module]:
        """Opacus's walk (``GradSampleModule.iterate_submodules``) over layers with parameters, trainable
        or not."""
        if has_params(module):
            yield module
        if self._takes_children(module):
            return
        for child in module.children():
            yield from self._with_params(child)

    def _takes_children(self, module: torch.nn.Module) -> bool:
        """Opacus's rule for a module it does not recurse into (its per-record gradients come whole)."""
        return has_params(module) and type(module) not in self.GRAD_SAMPLERS \
            and type(module) not in (DPRNN, DPLSTM, DPGRU)


def layer_fixes(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """``(name, layer, replacement)`` for every layer of ``model`` that one of Opacus's fixers
    (``ModuleValidator.FIXERS``: BatchNorm -> GroupNorm, LSTM -> DPLSTM, ...) replaces.
    ``ModuleValidator.fix`` makes them on a copy of the whole model made with ``torch.save``, which
    fails for a module holding a lambda or a class defined inside a function: they are made here from
    the model's own layers."""
    out = []
    for name, sub in trainable_modules(model):
        fixer = ModuleValidator.FIXERS.get(type(sub))
        if fixer is not None:
            out.append((name, sub, fixer(sub).to(next(sub.parameters()).device)))
    return out


def attention_layers(model: torch.nn.Module) -> list[str]:
    """The trainable ``nn.MultiheadAttention`` layers. Opacus's fixer would replace them by its
    ``DPMultiheadAttention``, which computes another function for ``batch_first=True`` inputs (its
    output is reshaped across heads), takes per-record gradients over the sequence axis for
    sequence-first inputs (the per-record gradients here are batch-first), and fails an assertion on
    the ``is_causal`` hint that torch's Transformer layers pass with a causal mask."""
    return [name for name, sub in trainable_modules(model) if type(sub) is torch.nn.MultiheadAttention]


def put_layer(model: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


class KeyedDPOptimizer(DPOptimizer):
    """Opacus's ``DPOptimizer`` whose noise comes from one of the run's streams (keyed by
    (seed, round, client), or the CSPRNG in secure mode) instead of a torch generator, whose
    ``manual_seed`` would use only 32 bits.

    A step for which no backward ran (``training_step`` returned ``None``) is still a noisy step: the
    clipped sum is zero and the full noise is added, so every sampled batch is one release, as the
    accountant counts (like an empty Poisson batch).

    Its own rules, which the local loop honours without knowing them
    (:mod:`dpfl_lightning.optimizer_calls`): at most one step per batch in manual optimization (the
    accountant counts one noisy step per sampled batch), and no clipping of the batch gradient
    (every record's gradient is clipped, and the batch gradient is ignored)."""

    def __init__(self, *args: Any, noise_stream: rng.Stream, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noise_stream = noise_stream
        self.steps_this_batch: int | None = None  # counted from the first on_train_batch_start

    def on_train_batch_start(self) -> None:
        """Before every ``training_step`` of manual optimization (the module steps this optimizer)."""
        self.steps_this_batch = 0

    def step(self, closure: Any = None) -> Any:
        if self.steps_this_batch is not None:
            self.steps_this_batch += 1
            if self.steps_this_batch > 1:
                raise ConfigError("DPSGD", "optimizer.step()", "training_step stepped the DP-SGD optimizer more "
                                  "than once on one batch, but the accountant counts one noisy step per sampled "
                                  "batch", "step each optimizer at most once per training_step")
        return super().step(closure)

    def check_gradient_clipping(self, clip_val: float) -> None:
        """Clipping the batch gradient (``self.clip_gradients``, ``configure_gradient_clipping``) is refused."""
        raise ConfigError("gradient clipping", clip_val, "DP-SGD clips every record's gradient at max_grad_norm and "
                          "ignores the batch gradient, so clipping it has no effect",
                          "remove the clipping (DPSGD(max_grad_norm=...) is the bound)")

    @property
    def accumulated_iterations(self) -> int:
        if all(getattr(p, "grad_sample", None) is None for p in self.params):
            return 1  # a step without per-record gradients (see the class docstring)
        return super().accumulated_iterations

    def pre_step(self, closure: Any = None) -> bool:
        params = self.params
        if params and all(getattr(p, "grad_sample", None) is None for p in params):
            for p in params:  # no per-record gradients this step: their clipped sum is zero
                if p.summed_grad is None:
                    p.summed_grad = torch.zeros_like(p)
            if self._check_skip_next_step():
                self._is_last_step_skipped = True
                return False
            self.add_noise()
            self.scale_grad()
            if self.step_hook:
                self.step_hook(self)
            self._is_last_step_skipped = False
            return True
        return super().pre_step(closure)

    def add_noise(self) -> None:
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            grad = p.summed_grad
            if std > 0:
                grad = grad + self.noise_stream.normal(grad.shape, std, grad.device, grad.dtype)
            p.grad = grad.view_as(p)
            _mark_as_processed(p.summed_grad)
