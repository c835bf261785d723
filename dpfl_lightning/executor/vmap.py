"""VmapExecutor: a rank's clients trained together with ``torch.func.vmap`` over stacked parameters."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torchmetrics import Metric

from dpfl_lightning.module import optimizer_calls
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.executor.interface import Executor, RoundWork, TrainedClient
from dpfl_lightning.module import ClientRun, is_overridden, parse_optimizers, step_loss
from dpfl_lightning.federated.plan import batch_shape


# Optimizers whose update is elementwise: running one on parameters stacked over clients is the
# same as running one per client.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.RMSprop)


class _TrainingStep(nn.Module):
    """Calls the wrapped module's ``training_step`` as ``forward``, so ``torch.func.functional_call``
    can substitute each client's parameters; what ``self.log`` records comes back as outputs."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.batch_idx = 0
        self.log_options: dict[str, tuple[tuple, dict]] = {}  # each name's other self.log arguments

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logged: dict[str, torch.Tensor] = {}

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            logged[name] = torch.as_tensor(value).detach().reshape(())
            self.log_options[name] = (args, kwargs)  # prog_bar, logger, reduce_fx, batch_size ... as given

        def log_dict(dictionary: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            for name, value in dictionary.items():
                log(name, value, *args, **kwargs)

        inner = self.inner
        saved = inner.__dict__.get("log"), inner.__dict__.get("log_dict")
        inner.log, inner.log_dict = log, log_dict
        try:
            out = inner.training_step(batch, self.batch_idx)
        finally:
            inner.log, inner.log_dict = saved
        loss = step_loss(out)
        if loss is None:
            raise ConfigError("trainer.executor", "vmap", f"training_step returned None at batch {self.batch_idx}, which "
                              "skips the step; vectorised clients take every step together", "use executor='sequential'")
        return loss, logged


_CAPTURED = "mutate a captured Tensor"  # torch.func's refusal of an in-place write to a tensor from outside


def _refusal(exc: Exception) -> ConfigError:
    """The ConfigError for a training_step that failed inside the vectorised step, with the reason."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    hint = ""
    if "random" in first.lower():
        hint = " (dropout or another random op in training_step)"
    elif _CAPTURED in first:
        hint = " (it changes a buffer or another tensor of the module in place, which the clients of a chunk share)"
    return ConfigError("trainer.executor", "vmap", f"the module's training_step cannot be vectorised{hint}: "
                       f"{type(exc).__name__}: {first[:200]}", "use executor='sequential'")


def _buffer_refusal(names: list[str]) -> ConfigError:
    return ConfigError("trainer.executor", "vmap", f"training_step changes the buffers {names[:3]}, which the clients "
                       "of a vectorised chunk share", "use executor='sequential'")


def _synthetic_batch(data, batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Two clients' batches of ``batch_size`` synthetic records with the data's shapes and types
    (standard normal floats, zero integers: valid class labels and token ids), from a fixed seed, on
    ``device`` (the parameters')."""
    generator = torch.Generator().manual_seed(0)
    return tuple((torch.randn(2, batch_size, *t.shape[1:], generator=generator, dtype=t.dtype)
                  if t.is_floating_point() else torch.zeros(2, batch_size, *t.shape[1:], dtype=t.dtype)).to(device)
                 for t in data.in_memory_tensors)


def _parameter_places(module: nn.Module) -> list[tuple[str, str]] | None:
    """Every place where a module holds a parameter, once, as ``(path, name)`` with ``name`` the
    parameter's name in ``named_parameters()``; ``None`` when each parameter has one place.

    A parameter shared by two modules (tied weights) has two places, both to be substituted; a module
    registered under two names (``self.head = self.net[2]``) is one place reachable by two paths,
    to be substituted once (``functional_call(tie_weights=True)`` substitutes it twice and then
    restores a substituted tensor instead of the parameter, so the module keeps a tensor from
    inside ``vmap``)."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    places, seen = [], set()
    for path, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():  # noqa: SLF001 - the module's own slots
            if p is not None and (id(sub), attr) not in seen:
                seen.add((id(sub), attr))
                places.append((f"{path}.{attr}" if path else attr, name_of[id(p)]))
    one_each = len(places) == len(name_of) and all(path == name for path, name in places)
    return None if one_each else places


class VmapExecutor(Executor):
    """Train a rank's clients together: ``torch.func.vmap`` over parameters stacked per client.

    Each local step is one vectorised ``grad`` of the module's ``training_step`` over the clients of
    a group, and one step of the module's own optimizer class on the stacked parameters (exact for
    elementwise optimizers: SGD, Adam, AdamW, Adagrad, RMSprop). Clients with the same number of
    samples form a group (their batches stack); a group is processed in chunks of ``chunk_size``.

    What it does not run: per-batch hooks other than ``training_step`` (a module overriding one is
    refused), LR schedulers, manual optimization, plugins that change gradients or optimizers
    (DP-SGD), random ops inside ``training_step`` (dropout: vmap would draw from one generator for
    the whole chunk), frozen parameters and a ``training_step`` that changes buffers (constant
    buffers are fine). Those raise a clear error at set-up (a buffer changed at a later step: at that
    step); use the sequential executor for them.

    Results match the sequential executor to float rounding (different kernels), not bitwise; they
    do not depend on the number of ranks as long as the batched kernels compute every client's
    slice independently of the others (true for the CPU and CUDA matmul paths checked in the tests).
    """

    name = "vmap"

    def __init__(self, chunk_size: int | None = None) -> None:
        self.chunk_size = chunk_size

    def setup(self, module, data, changes_local_steps: list[str]) -> None:
        m = module.inner
        if not module.automatic_optimization:
            raise ConfigError("trainer.executor", "vmap", "manual optimization is not vectorisable",
                              "use executor='sequential'")
        if changes_local_steps:
            raise ConfigError("trainer.executor", "vmap", f"plugins {changes_local_steps} change gradients or optimizers "
                              "inside local steps", "use executor='sequential'")
        hooks = module.overridden_step_hooks + module.overridden_transfer_hooks
        loop = module.loop
        wanted = [name for name, on in (
            ("gradient_clip_val", bool(loop.gradient_clip_val)), ("accumulate_grad_batches", loop.accumulate_grad_batches != 1),
            ("precision", loop.precision != "32-true"),
            ("on_train_epoch_start/end", is_overridden(m, "on_train_epoch_start") or is_overridden(m, "on_train_epoch_end")))
            if on]
        if wanted:
            raise ConfigError("trainer.executor", "vmap", f"the vectorised step runs only training_step and an "
                              f"elementwise optimizer, not {', '.join(wanted)}", "use executor='sequential'")
        if hooks:
            raise ConfigError("trainer.executor", "vmap", f"the module overrides {hooks}, which the vectorised "
                              "step does not call", "use executor='sequential'")
        frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
        if frozen:
            raise ConfigError("trainer.executor", "vmap", f"frozen parameters {frozen[:3]} would be trained",
                              "use executor='sequential'")
        if data.in_memory_tensors is None:
            raise ConfigError("trainer.executor", "vmap", "the client data is not in memory",
                              "use executor='sequential' or FederatedDataModule(in_memory=True)")
        opts, scheds = parse_optimizers(m.configure_optimizers())
        if scheds or type(opts[0]) not in ELEMENTWISE_OPTIMIZERS:  # a subclass may not be elementwise
            raise ConfigError("trainer.executor", "vmap",
                              f"needs one elementwise optimizer ({', '.join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)}) "
                              "and no LR scheduler", "use executor='sequential'")
        attached = optimizer_calls.customisations(opts[0])
        if attached:
            raise ConfigError("trainer.executor", "vmap", f"the optimizer has {', '.join(attached)}, which the "
                              "vectorised step (its own optimizer of the same class) does not call",
                              "use executor='sequential'")
        self._opt_class = type(opts[0])
        # plain SGD (no momentum, weight decay or maximize): its step is p -= lr * g, done directly
        # (torch's SGD.step costs ~0.1 ms of bookkeeping per call on the stacked parameters)
        self._plain_sgd = optimizer_calls.plain_sgd(opts[0])
        self._group_of = {}
        for gi, group in enumerate(opts[0].param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = gi
        self._group_hparams = [{k: v for k, v in g.items() if k != "params"} for g in opts[0].param_groups]
        self._step = _TrainingStep(m)
        self._names = [n for n, _ in self._step.named_parameters()]
        self._places = _parameter_places(self._step)
        # buffers (constants such as positional encodings or normalization statistics) are shared by
        # the clients of a chunk: a step that changes one (a counter, running statistics) is refused
        self._buffers = [(sub, name) for sub in m.modules() for name, b in sub._buffers.items() if b is not None]  # noqa: SLF001
        self._params = module.parameter_list
        self._shapes = [p.shape for p in self._params]
        self._slices = module.parameter_slices
        self._fn = torch.func.vmap(torch.func.grad_and_value(self._loss, has_aux=True), randomness="error")
        self._trial(module, data)

    def refusal(self, module, data, changes_local_steps: list[str], exact_batch: int | None = None) -> str | None:
        """Why this executor cannot run ``module`` with these plugins, or ``None``: :meth:`setup`'s own
        refusal (its ``problem``), set up when there is none. With ``exact_batch``, also why its result
        could differ in bits from the sequential executor's: one vectorised gradient of two clients at
        batch size ``exact_batch`` on synthetic data (never a client's: the answer may be printed in a
        DP run) must equal, bit for bit, the same gradient taken one client at a time."""
        try:
            self.setup(module, data, changes_local_steps)
        except ConfigError as exc:
            return exc.problem
        return None if exact_batch is None else self._inexact(module, data, exact_batch)

    def _inexact(self, module, data, batch_size: int) -> str | None:
        """Why one vectorised step is not bit-equal to the unvectorised one (see :meth:`refusal`), or ``None``."""
        batch = _synthetic_batch(data, batch_size, self._params[0].device)
        params = {n: p.detach().unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in zip(self._names, self._params)}
        one = torch.func.grad_and_value(self._loss, has_aux=True)
        try:
            together, _ = self._fn(params, batch)
            apart = [one({n: v[j] for n, v in params.items()}, tuple(t[j] for t in batch))[0] for j in range(2)]
        except Exception as exc:  # noqa: BLE001 - what cannot be checked is not chosen
            return f"its step could not be checked on synthetic data ({type(exc).__name__})"
        finally:
            for m in module.inner.modules():
                if isinstance(m, Metric):
                    m.reset()
        if not all(torch.equal(together[n][j], apart[j][n]) for j in range(2) for n in self._names):
            return (f"its vectorised gradients differ in the last bits from the sequential step's at batch size "
                    f"{batch_size} (other kernels)")
        return None

    def _trial(self, module, data) -> None:
        """One vectorised step of two clients at set-up, on synthetic records of the data's shapes and
        types (never a client's: the refusal is printed in a DP run): what vmap cannot run (dropout and
        other random ops, metric updates, control flow on tensors' values) is refused now, with the
        reason, instead of failing at the first step."""
        held = [(sub, attr, p) for sub in module.inner.modules() for attr, p in sub._parameters.items()]  # noqa: SLF001
        buffers = self._buffer_state()
        batch = _synthetic_batch(data, 2, self._params[0].device)
        params = {n: p.detach().unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in zip(self._names, self._params)}
        try:
            self._fn(params, batch)  # in the modes the user gave the submodules, as training runs
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the vectorised step is a refusal
            raise _refusal(exc) from None
        finally:
            for m in module.inner.modules():  # a metric updated by the trial forgets it
                if isinstance(m, Metric):
                    m.reset()
            changed = [attr for sub, attr, p in held if sub._parameters.get(attr) is not p]  # noqa: SLF001
            for sub, attr, p in held:  # a tensor from inside vmap left in the module: its own parameters back
                sub._parameters[attr] = p  # noqa: SLF001
            written = self._changed_buffers(buffers)  # and its own buffers
        if changed:
            raise ConfigError("trainer.executor", "vmap", f"after a vectorised step the module held other tensors than "
                              f"its parameters {changed[:3]} (an unusual parameter layout)", "use executor='sequential'")
        if written:
            raise _buffer_refusal(written)

    def _buffer_state(self) -> list[tuple[torch.Tensor, int]]:
        return [(sub._buffers[name], sub._buffers[name]._version) for sub, name in self._buffers]  # noqa: SLF001

    def _changed_buffers(self, before: list[tuple[torch.Tensor, int]]) -> list[str]:
        """The buffers written or replaced since ``before``, named; a replaced one (perhaps by a tensor
        from inside vmap) is put back."""
        changed = []
        for (sub, name), (b, version) in zip(self._buffers, before):
            if sub._buffers.get(name) is not b or b._version != version:  # noqa: SLF001
                changed.append(f"{type(sub).__name__}.{name}")
                sub._buffers[name] = b  # noqa: SLF001
        return changed

    def _check_buffers(self, before: list[tuple[torch.Tensor, int]]) -> None:
        """Refuse a step that wrote or replaced a buffer: it would run once for the whole chunk, where
        the sequential executor runs it for each client (from the initial buffers, see ``load_global``)."""
        changed = self._changed_buffers(before)
        if changed:
            raise _buffer_refusal(changed)

    def _loss(self, params: dict[str, torch.Tensor], batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch = tuple(t.unsqueeze(0) if t.dim() == 0 else t for t in batch) if isinstance(batch, tuple) else batch
        if self._places is not None:  # a parameter in several places: each place gets it (its gradient sums them)
            params = {place: params[name] for place, name in self._places}
        # tie_weights=False: every place is given (and functional_call's own search costs a call each step)
        loss, logged = torch.func.functional_call(self._step, params, (batch,), tie_weights=False)
        return loss, logged

    def train(self, work: RoundWork) -> Iterator[TrainedClient]:
        data = work.data
        groups: dict[int, list[int]] = defaultdict(list)  # clients of equal size have stackable batches
        for k, c in enumerate(work.clients):
            groups[data.client_num_samples(c)].append(k)
        for positions in groups.values():
            size = self.chunk_size or len(positions)
            for start in range(0, len(positions), size):
                chunk = positions[start : start + size]
                yield from self._train_chunk(work, chunk)

    def _orders(self, work: RoundWork, clients: list[int], n: int) -> tuple[torch.Tensor, int, int]:
        """Every client's record order for the round, ``[clients, passes * n]``: the same permutations,
        drawn from the same keyed streams, as :meth:`FederatedDataModule.client_batches` (so vmap and
        sequential train on the same batches); plus the batch size and the number of steps."""
        plan, data = work.plan, work.data
        bs, per_epoch = batch_shape(n, plan.batch_size)
        steps = plan.steps_for(n)
        passes = math.ceil(steps / per_epoch)
        idx = torch.stack([data.client_indices(c) for c in clients])  # [clients, n]
        if bs >= n:
            return idx.repeat(1, passes), bs, steps
        # A client's shuffles are stable argsorts of its DATA stream's successive 53-bit integers
        # (HashStream.randperm, as client_batches draws them pass after pass): all in one argsort.
        words = work.random.data_words(plan.round_idx, clients, passes * n).reshape(len(clients), passes, n)
        perms = torch.from_numpy(np.argsort(words, axis=2, kind="stable").astype(np.int64, copy=False)).to(idx.device)
        rows = torch.gather(idx.unsqueeze(1).expand(-1, passes, -1), 2, perms)
        return rows.reshape(len(clients), passes * n), bs, steps

    def _apply(self, opt: Any, groups: list[dict], names: list[list[str]], params: list[torch.Tensor],
               grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step of every client of the chunk."""
        if opt is None:  # plain SGD: what SGD.step does, p.add_(g, alpha=-lr), without its bookkeeping
            with torch.no_grad():
                for g, group_names in zip(groups, names):
                    torch._foreach_add_(g["params"], [grads[name] for name in group_names], alpha=-g["lr"])
            return
        for p, name in zip(params, self._names):
            p.grad = grads[name]
        opt.step()

    def _log(self, logged: Any, logs: dict[str, torch.Tensor], size: int) -> None:
        """What ``training_step`` logged at this step, for every client, as ``self.log`` would."""
        for name, values in logs.items():
            args, kwargs = self._step.log_options.get(name, ((), {}))
            if len(args) < 10:  # batch_size is self.log's 11th argument after the value
                kwargs = {"batch_size": size, **kwargs}
            for v in values:
                logged.log(name, v, *args, **kwargs)

    def _train_chunk(self, work: RoundWork, positions: list[int]) -> Iterator[TrainedClient]:
        module, plan, data = work.module, work.plan, work.data
        clients = [work.clients[k] for k in positions]
        n_clients = len(clients)
        contexts = [work.hooks.open(c) for c in clients]
        # every client starts at the global model; trained in place in the trainer's rows when it has
        # them free (each row then already holds its client's update, no copy)
        block = work.rows(n_clients)
        flat = block if block is not None else module.global_params.new_empty(n_clients, module.global_params.numel())
        flat.copy_(module.global_params.expand(n_clients, -1))
        params = [flat[:, o : o + size].view(n_clients, *shape) for (o, size), shape in zip(self._slices, self._shapes)]
        groups = [dict(h, params=[], lr=h["lr"] * plan.lr_factor) for h in self._group_hparams]
        names: list[list[str]] = [[] for _ in groups]
        for p, orig, name in zip(params, self._params, self._names):
            groups[self._group_of[id(orig)]]["params"].append(p)
            names[self._group_of[id(orig)]].append(name)
        names = [n for g, n in zip(groups, names) if g["params"]]
        groups = [g for g in groups if g["params"]]
        opt = None if self._plain_sgd else self._opt_class(groups)
        n = data.client_num_samples(clients[0])
        orders, bs, steps = self._orders(work, clients, n)
        tensors = data.in_memory_tensors
        per_epoch = math.ceil(n / bs)
        shown = plan.epoch_batches(n)  # what batch_idx counts (the public epoch's batches, where one is set)
        logged = module.logged
        module.set_round(plan.round_idx)
        # what training_step may read, as the sequential executor sets it: every client of the chunk
        # is at the same step (current_epoch = round, global_step from round * steps, is_last_batch)
        shim = module.trainer_shim
        module.set_client_shape(plan.round_idx, steps, steps)
        named = dict(zip(self._names, params))
        samples = 0
        shim.training = True
        shim.should_stop = False
        logged.step_level = True
        buffers = self._buffer_state() if self._buffers else None
        try:
            for s in range(steps):
                epoch, b = divmod(s, per_epoch)
                sel = orders[:, epoch * n + b * bs : epoch * n + min((b + 1) * bs, n)]
                batch = tuple(t[sel] for t in tensors)
                self._step.batch_idx = s % shown
                shim.is_last_batch = s + 1 == steps
                try:
                    grads, (_, logs) = self._fn(named, batch)
                except RuntimeError as exc:
                    if _CAPTURED in str(exc):  # a write the set-up's trial step did not make
                        raise _refusal(exc) from None
                    raise
                if buffers is not None:
                    self._check_buffers(buffers)
                if shim.should_stop:  # set inside training_step: it would end one client's training
                    raise ConfigError("trainer.executor", "vmap", "training_step set self.trainer.should_stop, which "
                                      "ends a client's local training; vectorised clients take their steps together",
                                      "use executor='sequential'")
                self._apply(opt, groups, names, params, grads)
                shim.global_step += 1
                size = sel.shape[1]
                self._log(logged, logs, size)
                samples += size
        finally:  # as fit_client: the flags never outlive the chunk, even when training_step raises
            if buffers is not None:
                self._changed_buffers(buffers)  # a step that failed may have replaced one: the module's own back
            shim.is_last_batch = False
            shim.training = False
            logged.step_level = False
        lr = float(groups[0]["lr"])
        flat.sub_(module.global_params)  # every client's update, in one operation
        for j, k in enumerate(positions):  # in row order: the clients of a block take its rows in turn
            yield TrainedClient(k, contexts[j], ClientRun(steps=steps, samples=samples, lr=lr), flat[j])
