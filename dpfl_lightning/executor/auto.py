"""AutoExecutor (``executor="auto"``): the vmap executor where it runs the module and its plugins
with the sequential executor's result, bit for bit; the sequential executor otherwise.

Three checks, at set-up, choose vmap:

1. ``training_step`` runs straight through (:func:`step_branches`): no ``if``, loop condition,
   ``try``, conditional expression or ``match`` in it or in the methods of the module it calls, and
   it never reads ``should_stop``. A step that can take another path later in training (return
   ``None`` to skip a batch, stop a client, write a buffer in a branch the trial did not take) would
   make the vmap executor refuse mid-run; such a module trains sequentially from the start.
2. :meth:`VmapExecutor.refusal` runs the vmap executor's set-up (every refusal it would raise, and a
   trial step on synthetic records).
3. One vectorised gradient must equal, bit for bit, the same gradient taken client by client, at the
   run's batch size, on synthetic data (some kernels differ in the last bits when batched).

The choice depends on the module's code, the plugins, the batch size and the data's shapes, never on
a client's records (the summary prints it in a DP run).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Iterator

from dpfl_lightning.executor.interface import Executor, RoundWork, TrainedClient
from dpfl_lightning.executor.sequential import SequentialExecutor
from dpfl_lightning.executor.vmap import VmapExecutor


_BRANCHES = {ast.If: "if", ast.While: "while", ast.Try: "try", ast.IfExp: "a conditional expression",
             ast.Match: "match"}
_LIBRARIES = ("torch", "lightning", "pytorch_lightning", "torchmetrics")


def _user_method(cls: type, name: str) -> Any:
    """``cls``'s method ``name`` when the user's code defines it (not torch's or Lightning's), else ``None``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            fn = vars(klass)[name]
            module = getattr(klass, "__module__", "") or ""
            return None if module.split(".")[0] in _LIBRARIES or not inspect.isfunction(fn) else fn
    return None


def step_branches(inner: Any) -> str | None:
    """Why ``inner``'s ``training_step`` may take another path at a later step (see the module
    docstring), or ``None`` when it runs straight through: it and the methods of ``inner`` it calls
    as ``self.name(...)`` (``forward`` aside: control flow on tensors there is refused by the trial)."""
    todo, seen = ["training_step"], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        fn = _user_method(type(inner), name)
        if fn is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            return f"the source of {name} cannot be read to check that it runs straight through"
        for node in ast.walk(tree):
            kind = next((k for t, k in _BRANCHES.items() if isinstance(node, t)), None)
            if kind is not None:
                return f"{name} has {kind} (line {fn.__code__.co_firstlineno + node.lineno - 1}), so a later step may take another path"
            if isinstance(node, ast.Attribute) and node.attr == "should_stop":
                return f"{name} reads should_stop"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "self" and node.func.attr not in seen | {"forward"}):
                todo.append(node.func.attr)
    return None


class AutoExecutor(Executor):
    """Chooses at set-up (see the module docstring); :attr:`choice` says which and why."""

    name = "auto"

    def __init__(self, batch_size: int | None = None) -> None:
        self.batch_size = batch_size
        self.chosen: Executor | None = None
        self.choice = "auto (not set up)"

    def setup(self, module, data, changes_local_steps: list[str]) -> None:
        reason = step_branches(module.inner)
        if reason is None and self.batch_size is None:
            reason = "batch_size=None (whole-client batches) cannot be checked for equal bits ahead"
        elif reason is None:
            vmap = VmapExecutor()
            reason = vmap.refusal(module, data, changes_local_steps, exact_batch=self.batch_size)
        if reason is None:
            self.chosen, self.choice = vmap, "vmap"
        else:
            self.chosen, self.choice = SequentialExecutor(), f"sequential (vmap cannot run: {reason})"
            self.chosen.setup(module, data, changes_local_steps)

    def train(self, work: RoundWork) -> Iterator[TrainedClient]:
        return self.chosen.train(work)

