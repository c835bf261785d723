"""What DP-SGD takes from Opacus: the per-record gradient module, the layer checks and fixes, and
Opacus's ``DPOptimizer`` with the run's keyed noise. Imported when a DP-SGD run sets up, so that
``import dpfl_lightning`` does not load Opacus."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Iterator

import torch
from opacus import GradSampleModule
from opacus.grad_sample.functorch import prepare_layer
from opacus.layers.dp_rnn import DPGRU, DPLSTM, DPRNN, RNNLinear
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
    """Opacus's ``GradSampleModule`` whose layers are the ones Opacus would hook for the parameters
    trainable *now*, decided at every forward, each layer once, and whose backward capture is a
    tensor hook on the layer's output instead of a full backward hook on the layer.

    Which layers: Opacus's walk (``GradSampleModule.iterate_submodules``) on the parameters trainable
    at the layer's forward: a layer with a trainable parameter of its own, unless a module containing
    it takes its per-record gradients whole (``functorch``: a module with a trainable parameter of its
    own and no grad sampler). Opacus walks once, when it wraps the model, and hooks a layer for both
    directions; here the model is wrapped once per run, so the walk is re-decided at each forward: a
    layer frozen at set-up and unfrozen in a later round (gradual unfreezing) gets per-record
    gradients, and a frozen layer after a trainable one (a LoRA model's frozen head, a frozen
    eval-mode BatchNorm) is skipped in both directions, as plain Opacus skips it. (Opacus hooked only
    the trainable layers but once; hooking every layer for the backward failed on a frozen one:
    ``No activations detected``, or ``This layer has buffers`` for a BatchNorm.)

    Each layer once: Opacus walks the module tree by name, so a layer registered under two names
    (``self.head = self.net[2]``) would be hooked twice, and a layer inside a module taken whole
    would be hooked again where it is registered under another name; both would add its per-record
    gradients twice. (A parameter shared by two different layers, tied weights, is hooked in each,
    which adds its own part: right.)

    The backward: Opacus's full backward hook makes the layer's output a view returned by a custom
    autograd function, which autograd refuses to modify in place, so a model with an in-place
    activation or residual after a trainable layer (``nn.ReLU(inplace=True)``, ``out += identity``:
    torchvision's ResNets) failed at its first step. A hook on the output tensor receives the same
    gradient (the loss's gradient with respect to the layer's output, as computed before any later
    in-place change of that tensor), and leaves the output an ordinary tensor.

    Rows: Opacus takes row ``i`` of every hooked call's input and output gradient for record ``i``.
    Each call's row counts are kept (:meth:`take_rows`) for DP-SGD to hold against the batch's
    records; an Opacus RNN's cells (``RNNLinear``), which run once per time step on that step's
    records (fewer for a packed sequence's later steps), are left out."""

    def __init__(self, m: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(m, **kwargs)
        self._rows: dict[int, set[int]] = {}  # id(layer) -> the row counts of its calls since take_rows
        for p in m.parameters():  # what Opacus sets on trainable parameters only
            if not hasattr(p, "_forward_counter"):
                p.grad_sample = None
                p._forward_counter = 0

    def add_hooks(self, *, loss_reduction: str = "mean", batch_first: bool = True,
                  force_functorch: bool = False) -> None:
        """A forward hook on every layer with parameters (each once), which captures the layer's input
        and hooks its output when the layer is one Opacus's walk would hook now (see the class
        docstring; ``force_functorch`` is not used). Opacus's ``remove_hooks`` removes them."""
        if hasattr(self._module, "autograd_grad_sample_hooks"):
            raise ValueError("Trying to add hooks twice to the same model")
        self.autograd_grad_sample_hooks = self._module.autograd_grad_sample_hooks = []
        layers = list({id(m): m for m in self._module.modules() if has_params(m)}.values())
        whole = [m for m in layers if self._takes_children(m)]
        for layer in layers:
            if type(layer) in (DPRNN, DPLSTM, DPGRU):  # their RNNLinear cells are hooked
                continue
            containers = tuple(w for w in whole if w is not layer and any(sub is layer for sub in w.modules()))
            self.autograd_grad_sample_hooks.append(layer.register_forward_hook(_LayerHook(self, layer, containers)))
        self.enable_hooks()

    def _takes_children(self, module: torch.nn.Module) -> bool:
        """Opacus's rule for a module whose per-record gradients come whole (``functorch``), children
        included, while it has a trainable parameter of its own."""
        return has_params(module) and type(module) not in self.GRAD_SAMPLERS \
            and type(module) not in (DPRNN, DPLSTM, DPGRU)

    def capture(self, layer: torch.nn.Module, inputs: Any, output: Any, containers: tuple[torch.nn.Module, ...]) -> None:
        """After a forward of ``layer``: its input kept and its output hooked, if Opacus's walk would
        hook it now."""
        if not (self.hooks_enabled and layer.training and torch.is_grad_enabled() and has_trainable_params(layer)):
            return
        if any(has_trainable_params(w) for w in containers):
            return  # taken whole by a trainable module around it
        out = _first_tensor(output)  # (the one whose gradient Opacus's full backward hook passes on)
        if out is None or not out.requires_grad:
            return  # no gradient will reach the layer's parameters through this call
        if type(layer) not in self.GRAD_SAMPLERS and not hasattr(layer, "ft_compute_sample_grad"):
            prepare_layer(layer, batch_first=self.batch_first)  # (Opacus does it when it wraps a trainable layer)
        self.capture_activations_hook(layer, inputs, output)
        out.register_hook(partial(self._backprops, layer))

    def _backprops(self, layer: torch.nn.Module, grad: torch.Tensor) -> None:
        """The loss's gradient with respect to one call's output of ``layer``: Opacus's backward capture,
        after the call's rows are counted (of the input Opacus pops now, as it counts them, and of the
        gradient)."""
        if self.hooks_enabled and type(layer) is not RNNLinear:
            activations = getattr(layer, "activations", None)
            counted = (activations[-1][-1] if activations and activations[-1] else None, grad)
            self._rows.setdefault(id(layer), set()).update(t.shape[0] for t in counted
                                                           if isinstance(t, torch.Tensor) and t.dim())
        self.capture_backprops_hook(layer, (), (grad,), loss_reduction=self.loss_reduction,
                                    batch_first=self.batch_first)

    def take_rows(self) -> dict[str, set[int]]:
        """The row counts of every hooked layer's calls whose gradients were captured since the last
        call, by the layer's name (in the model's order), and forgets them."""
        rows, self._rows = self._rows, {}
        return {name or type(m).__name__: rows[id(m)] for name, m in self._module.named_modules() if id(m) in rows}

    def cleanup(self) -> None:
        """Opacus's cleanup, and what its hooks leave on every layer (not only the trainable ones)."""
        super().cleanup()
        self._rows = {}
        for m in self._module.modules():
            for attr in ("activations", "max_batch_len", "ft_compute_sample_grad"):
                if attr in m.__dict__:
                    delattr(m, attr)


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    return None


class _LayerHook:
    """The forward hook :class:`GradSamples` puts on one layer. Opacus's ``functorch`` path re-runs a
    deep copy of a layer taken whole, hooks included: the copy shares this hook (no copy of the
    model behind it), which does nothing for it."""

    def __init__(self, grad_samples: GradSamples, layer: torch.nn.Module, containers: tuple[torch.nn.Module, ...]):
        self.grad_samples, self.layer, self.containers = grad_samples, layer, containers

    def __call__(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if module is self.layer:
            self.grad_samples.capture(module, inputs, output, self.containers)

    def __deepcopy__(self, memo: dict) -> _LayerHook:
        return self


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
    (:mod:`dpfl_lightning.module.optimizer_calls`): at most one step per batch in manual optimization (the
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

    @contextlib.contextmanager
    def gradient_clipping(self) -> Iterator[None]:
        """Around the module's ``configure_gradient_clipping`` override: one that changes the batch
        gradient itself (``torch.nn.utils.clip_grad_norm_`` on ``p.grad``) is refused, as
        ``self.clip_gradients`` at a value is. DP-SGD's step is the sum of the clipped per-record
        gradients plus noise, which replaces ``p.grad``: the change would have no effect. (A change is
        an in-place write to, or a new, ``p.grad`` of a trainable parameter: torch's clipping writes
        even when no norm exceeds the bound, so the refusal comes at the first step.)"""
        before = self._gradient_marks()
        yield
        if self._gradient_marks() != before:
            raise ConfigError("model.configure_gradient_clipping", "changes p.grad", "DP-SGD clips every record's "
                              "gradient at max_grad_norm and its noisy sum replaces p.grad, so clipping the batch "
                              "gradient would have no effect", "remove the clipping from configure_gradient_clipping "
                              "(DPSGD(max_grad_norm=...) is the per-record bound)")

    def _gradient_marks(self) -> list[tuple[int, int] | None]:
        return [None if p.grad is None else (id(p.grad), p.grad._version) for p in self.params]

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
