"""How the local loop calls a torch optimizer: around its per-call bookkeeping where that gives the
same parameters, bit for bit, as ``optimizer.step(closure)`` and ``optimizer.zero_grad()``.

A torch optimizer's ``step`` runs through a wrapper (a profiler range, pre- and post-hooks) and,
for SGD, ``_use_grad`` and ``_init_group`` before the arithmetic; ``zero_grad`` opens a profiler
range too. On a small model that is most of a step's Python time: ~23 us for ``SGD.step`` against
~9 us for its arithmetic, ~10 us for ``zero_grad`` against ~1.5 us (one thread, a 14k-parameter
MLP). The shortcuts below are taken only when nothing observable but those profiler ranges
differs: no hooks registered, no method replaced, torch's own classes, and for SGD only the
configuration whose update is ``p -= lr * grad`` on CPU tensors (where torch itself takes the
per-tensor path: on other devices it takes the ``_foreach`` kernels, whose rounding may differ).
Everything else goes through the optimizer's own methods, as under ``lightning.Trainer``.

An optimizer may also declare rules of its own that the loop honours without knowing them (see
:func:`batch_starts`, :func:`check_gradient_clipping` and :func:`gradient_clipping`): DP-SGD's
refusals live with DP-SGD.
"""

from __future__ import annotations

import contextlib
import sys
from itertools import chain
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

_CLOSURE_ONCE: dict[type, bool] = {}
_LR_SCHEDULER_WRAPPERS = ("_wrapped_by_lr_sched", "_with_counter")  # how torch's schedulers wrap opt.step


def _unhooked(method: Any) -> Any:
    """A class's ``step`` without the profiling wrapper ``Optimizer.__init__`` puts around it."""
    return method.__wrapped__ if getattr(method, "hooked", False) else method


_ZERO_GRAD = torch.optim.Optimizer.zero_grad
_OPTIMIZER_FILE = _torch_optimizer.__file__
_SGD_FILE = sys.modules[torch.optim.SGD.__module__].__file__


def _is_torch_sgd_step(method: Any) -> bool:
    """Whether a class's ``step`` is torch's own ``SGD.step`` (its ``_use_grad`` wrapper around the
    function in ``torch/optim/sgd.py``), not a replacement, however early it was patched."""
    fn = _unhooked(method)
    inner = getattr(fn, "__wrapped__", None)
    code, inner_code = getattr(fn, "__code__", None), getattr(inner, "__code__", None)
    return (code is not None and inner_code is not None and code.co_filename == _OPTIMIZER_FILE
            and inner_code.co_filename == _SGD_FILE and inner_code.co_name == "step")


def _scheduler_wrapper_only(optimizer: torch.optim.Optimizer) -> bool:
    """No ``step`` on the instance, or only an LR scheduler's counter around the class's own
    ``step`` (a scheduler wraps whatever ``step`` was there, a user's replacement too)."""
    own = optimizer.__dict__.get("step")
    return own is None or (any(hasattr(own, a) for a in _LR_SCHEDULER_WRAPPERS)
                           and getattr(own, "__wrapped__", None) is type(optimizer).step)


def _global_hooks(kind: str) -> Any:
    return getattr(_torch_optimizer, f"_global_optimizer_{kind}_hooks", None)


def steps_directly(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step(closure)`` is ``closure()`` then ``step()`` with nothing in between,
    so the loop may make the two calls itself: torch's own optimizers (all but L-BFGS, which
    re-evaluates the closure), with no step pre-hooks (they run before the closure) and no ``step``
    replaced on the instance (other than by an LR scheduler's counter around the class's own
    ``step``). Otherwise the closure goes through ``step``, as under Lightning."""
    cls = type(optimizer)
    once = _CLOSURE_ONCE.get(cls)
    if once is None:
        once = _CLOSURE_ONCE[cls] = cls.__module__.startswith("torch.optim.") and not issubclass(cls, torch.optim.LBFGS)
    if not once or getattr(optimizer, "_optimizer_step_pre_hooks", None) or _global_hooks("pre"):
        return False
    return _scheduler_wrapper_only(optimizer)


def customisations(optimizer: torch.optim.Optimizer) -> list[str]:
    """What the user attached to ``optimizer`` beyond its class and settings: step pre-/post-hooks
    (its own or torch's global ones) and methods replaced on the instance (``step``, ``zero_grad``).
    An executor that steps its own optimizer built from the class would skip them."""
    found = []
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or _global_hooks("pre"):
        found.append("step pre-hooks")
    if getattr(optimizer, "_optimizer_step_post_hooks", None) or _global_hooks("post"):
        found.append("step post-hooks")
    found += [f"{name} replaced on the instance" for name in ("step", "zero_grad") if name in optimizer.__dict__]
    return found


def plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """``torch.optim.SGD`` itself whose update is ``p -= lr * grad`` in every group: no momentum,
    weight decay, ``maximize``, ``differentiable``, ``foreach`` or ``fused``, and a number for ``lr``."""
    if type(optimizer) is not torch.optim.SGD or optimizer.defaults.get("differentiable"):
        return False  # (a differentiable default turns gradients on in step, whatever the groups say)
    for g in optimizer.param_groups:
        if (g["momentum"] or g["weight_decay"] or g["maximize"] or g["differentiable"] or g["foreach"]
                or g["fused"] or type(g["lr"]) not in (float, int)):
            return False
    return True


def _on_cpu(optimizer: torch.optim.Optimizer) -> bool:
    return all(p.is_cpu for g in optimizer.param_groups for p in g["params"])


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` after the closure has run (the caller checked :func:`steps_directly`).

    Plain SGD on CPU without step hooks is computed here: for every parameter with a gradient,
    ``p.add_(p.grad, alpha=-lr)`` under ``no_grad``, which is what ``SGD.step`` does for it
    (``_single_tensor_sgd``), in the same order. An LR scheduler's wrapper only records that the
    optimizer stepped; that is recorded here too."""
    own = optimizer.__dict__.get("step")
    if (not plain_sgd(optimizer) or not _is_torch_sgd_step(type(optimizer).step)
            or optimizer._optimizer_step_post_hooks or _global_hooks("post")
            or (own is not None and not hasattr(own, "_wrapped_by_lr_sched"))  # steps_directly checked the rest
            or getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None
            or not _on_cpu(optimizer)):
        _step_without_new_pre_hooks(optimizer)
        return
    if own is not None:
        optimizer._opt_called = True  # what the scheduler's wrapper sets
    with torch.no_grad():
        for g in optimizer.param_groups:
            alpha = -g["lr"]
            for p in g["params"]:
                grad = p.grad
                if grad is not None:
                    p.add_(grad, alpha=alpha)


def _step_without_new_pre_hooks(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without the step pre-hooks, all of which the closure registered (there were
    none before it, see :func:`steps_directly`): ``step(closure)`` runs its pre-hooks before the
    closure, so under Lightning a pre-hook registered inside ``training_step`` first runs at the next
    step. What torch's step wrapper (``Optimizer.profile_hook_step``) runs after its pre-hooks is run
    here: the class's step, the profiler's entry point, the post-hooks (the optimizer's own first)."""
    cls_step = type(optimizer).step
    pre = getattr(optimizer, "_optimizer_step_pre_hooks", None) or _global_hooks("pre")
    if not pre or not getattr(cls_step, "hooked", False):
        optimizer.step()
        return
    if "step" in optimizer.__dict__:  # an LR scheduler's counter (the only instance step steps_directly allows)
        optimizer._opt_called = True
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        _unhooked(cls_step)(optimizer)
        optimizer._optimizer_step_code()
        for hook in chain(optimizer._optimizer_step_post_hooks.values(), (_global_hooks("post") or {}).values()):
            hook(optimizer, (optimizer,), {})


def zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad()``: when that is torch's own (not overridden or replaced), it sets every
    gradient of the optimizer's parameters to ``None``, which is done here without its profiler range."""
    if type(optimizer).zero_grad is not _ZERO_GRAD or "zero_grad" in optimizer.__dict__:
        optimizer.zero_grad()
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            p.grad = None


# ---------------------------------------------------------------------------------------- what an optimizer may ask of the loop
# An optimizer (a plugin's wrapper, such as DP-SGD's) may declare two methods; the local loop calls
# them and knows nothing else of the optimizer's rules:
#   ``on_train_batch_start()``: called before every ``training_step`` of manual optimization, where
#       the module steps its optimizers itself (an optimizer that may step once per batch counts here);
#   ``check_gradient_clipping(clip_val)``: called before the batch gradient is clipped at
#       ``clip_val`` (``self.clip_gradients``, ``gradient_clip_val``); it raises if that is refused;
#   ``gradient_clipping()``: a context manager around the module's ``configure_gradient_clipping``
#       override, which may clip with torch directly; it raises if what the override did is refused.


def batch_starts(optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    """The ``on_train_batch_start`` methods of the optimizers that declare one."""
    return [o.on_train_batch_start for o in optimizers if callable(getattr(o, "on_train_batch_start", None))]


def check_gradient_clipping(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    """Let the optimizer refuse gradient clipping at ``clip_val`` (see above)."""
    check = getattr(optimizer, "check_gradient_clipping", None)
    if check is not None:
        check(clip_val)


def gradient_clipping(optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer's context around a ``configure_gradient_clipping`` override (see above), or none."""
    around = getattr(optimizer, "gradient_clipping", None)
    return around() if around is not None else contextlib.nullcontext()
