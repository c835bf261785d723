"""Where a client's optimizers stand at the start of a round: one Lightning run's position.

A client builds fresh optimizers from ``configure_optimizers`` every round (no moment buffer outlives
its round, as in FedAvg). What else an optimizer carries from one epoch to the next under
``lightning.Trainer`` -- ``global_step``, every param group's hyperparameters (the learning rate a
warm-up in ``optimizer_step`` set, a scheduler's), every scheduler's state -- is keyed by the
schedule's position, not by the client: every client of a round that takes ``S`` optimizer steps per
round starts from the same :class:`ScheduleCursor`, the position of one Lightning run whose every
epoch had ``S`` steps, at the start of that round.

The cursor moves from one round to the next in one of three ways:

- the clients of ``S`` steps that trained in the round all ended it in the same state, and that
  state is not what the schedule gives from where they started (the module changed a learning rate,
  stepped its own schedulers, ended an epoch early, stepped several optimizers per batch): the cursor
  takes that :class:`RoundEnd` (not in a DP run, where what a client's training decides stays with the
  client);
- the round left no such state to continue (no client of ``S`` steps trained in it, they ended in
  different states, or their state could not be taken) after the cursor had taken one: it
  :data:`RESTART` s where the schedule alone stands at the next round (``configure_optimizers``'
  settings, ``global_step = (round + 1) * S``, the schedulers stepped as over that many rounds), never
  from a state an earlier round's clients left (a warm-up ``S`` steps old would stay stale for good);
- otherwise the schedule alone from where the cursor stands: ``S`` steps (the step-interval
  schedulers step after each, in automatic optimization and, placing them by their declared interval,
  in manual optimization).

Then, at the round's end, the epoch-interval schedulers and ``ReduceLROnPlateau`` step, as after
one Lightning epoch. In manual optimization lightning.Trainer never steps schedulers: the module
steps them itself, within its round, so the schedule alone there steps each by its declared interval
within the round (a module that does so ends where the schedule does; one that never steps them
ends elsewhere, and that state is taken), and ``ReduceLROnPlateau`` at the round's end only when
nothing was taken.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig

from dpfl_lightning.errors import ConfigError

Groups = list[list[dict[str, Any]]]  # per optimizer, per param group: every setting but "params"
_MISSING = object()
#: what a round left clients of ``S`` steps when there is no state to continue: the next round starts
#: where the schedule alone stands (see the module docstring)
RESTART = "restart"


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    out = dict(group)
    del out["params"]
    return out


def hyperparameters(opts: list[torch.optim.Optimizer]) -> Groups:
    """Every param group's settings (learning rate, momentum, betas, ...), without its parameters."""
    return [[_settings(g) for g in o.param_groups] for o in opts]


def same(a: Any, b: Any) -> bool:
    """Exact equality of settings and scheduler states (tensors element by element)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def ended_as(end: RoundEnd, step: int, opts: list[torch.optim.Optimizer], scheds: list[LRSchedulerConfig]) -> bool:
    """Whether optimizers (and schedulers) at ``step`` are in the state ``end`` (compared in place: a
    client's end of round is copied only where it differs)."""
    if step != end.step or len(opts) != len(end.groups) or len(scheds) != len(end.scheds):
        return False
    for opt, ref in zip(opts, end.groups):
        if len(opt.param_groups) != len(ref):
            return False
        for group, values in zip(opt.param_groups, ref):
            if len(group) != len(values) + 1:
                return False
            for key, value in values.items():
                have = group.get(key, _MISSING)
                if have is not value and (type(have) is not type(value) or not same(have, value)):
                    return False
    return all(same(c.scheduler.state_dict(), state) for c, state in zip(scheds, end.scheds))


@dataclass
class RoundEnd:
    """The state a client's optimizers ended its round in: ``global_step``, the param groups'
    hyperparameters (per optimizer, per group), the schedulers' ``state_dict``."""

    step: int
    groups: Groups
    scheds: list[dict[str, Any]]

    def matches(self, other: RoundEnd) -> bool:
        return self.step == other.step and same(self.groups, other.groups) and same(self.scheds, other.scheds)

    def as_dict(self) -> dict[str, Any]:  # plain types, for checkpoints
        return {"step": self.step, "groups": self.groups, "scheds": self.scheds}


def merge_end(summary: dict[int, RoundEnd | str | None], steps: int, end: RoundEnd | str | None) -> None:
    """Add one client's (or one rank's) end of round to ``summary``: ``None`` while every client of
    ``steps`` steps ended where the schedule does, their common :class:`RoundEnd` while they moved
    alike, else ``"differ"``."""
    if steps not in summary:
        summary[steps] = end
        return
    have = summary[steps]
    if have == "differ" or (have is None and end is None):
        return
    if have is None or end is None or end == "differ" or not have.matches(end):
        summary[steps] = "differ"


def step_scheduler(cfg: LRSchedulerConfig, metric: Any) -> None:
    """What ``LightningModule.lr_scheduler_step`` does by default."""
    if metric is None:
        cfg.scheduler.step()
    else:
        cfg.scheduler.step(metric)


class ScheduleCursor:
    """The optimizers and schedulers of clients that take ``steps`` optimizer steps per round, moved
    round by round without data (see the module docstring). ``step(cfg, metric, epoch, global_step)``
    steps one scheduler as the run does at that position; ``metric(r, monitor)`` is the value round
    ``r`` released; ``taken(r)`` the :class:`RoundEnd` taken for round ``r``, :data:`RESTART`, or
    ``None``; ``alone()`` a fresh cursor of the same clients that never takes (where the schedule alone
    stands: a cursor restarts from it)."""

    def __init__(self, opts: list[torch.optim.Optimizer], scheds: list[LRSchedulerConfig], steps: int,
                 automatic: bool, step: Callable[[LRSchedulerConfig, Any, int, int], None],
                 metric: Callable[[int, str], Any], taken: Callable[[int], RoundEnd | str | None],
                 alone: Callable[[], ScheduleCursor] | None = None) -> None:
        self.opts, self.scheds, self.steps, self.automatic = opts, scheds, steps, automatic
        for opt in opts:
            opt._opt_called = True  # these optimizers never step; torch would warn on the first scheduler step
        self._step, self._metric, self._taken = step, metric, taken
        self._make_alone = alone
        self._alone: ScheduleCursor | None = None
        self.round = 0
        self.start_step = 0  # global_step at the start of ``round``
        self._by_step = [c for c in scheds if c.interval == "step" and not c.reduce_on_plateau]
        self._by_epoch = [c for c in scheds if c.interval == "epoch" and not c.reduce_on_plateau]
        self._plateau = [c for c in scheds if c.reduce_on_plateau]
        self._expected: tuple[int, RoundEnd] | None = None

    # ------------------------------------------------------------------ moving
    def advance(self, round_idx: int) -> None:
        """Bring the cursor to the start of ``round_idx`` (per past round: its end, then the epoch's)."""
        if round_idx < self.round:
            raise RuntimeError(f"schedule cursor at round {self.round} cannot go back to round {round_idx}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            for r in range(self.round, round_idx):
                end = self._taken(r)
                if isinstance(end, str):  # RESTART
                    self._restart(r + 1)
                    continue
                if end is not None:
                    self.load(end.groups, end.scheds)
                    self.start_step = end.step
                else:
                    self.start_step = self._replay(r)
                self._end_epoch(r, taken=end is not None)
                self.round = r + 1

    def _restart(self, round_idx: int) -> None:
        """Take the state the schedule alone has at the start of ``round_idx`` (from a twin cursor that
        never takes, moved along with this one)."""
        if self._make_alone is None:
            raise RuntimeError("a schedule cursor without a schedule-alone twin cannot restart")
        if self._alone is None or self._alone.round > round_idx:
            self._alone = self._make_alone()
        self._alone.advance(round_idx)
        self.load(*self._alone.state())
        self.start_step = self._alone.start_step
        self.round = round_idx

    def _replay(self, r: int) -> int:
        """The round's ``steps`` steps on the schedule alone (step-interval schedulers; in manual
        optimization, where the module steps them itself within its round, the epoch-interval ones
        too); returns the ``global_step`` it ends at."""
        g0 = self.start_step
        for g in range(g0 + 1, g0 + self.steps + 1):
            for cfg in self._by_step:
                if g % cfg.frequency == 0:
                    self._step(cfg, None, r, g)
        if not self.automatic:
            self._epoch_steps(r, g0 + self.steps)
        return g0 + self.steps

    def _epoch_steps(self, r: int, global_step: int) -> None:
        for cfg in self._by_epoch:
            if (r + 1) % cfg.frequency == 0:
                self._step(cfg, None, r, global_step)

    def _end_epoch(self, r: int, taken: bool) -> None:
        """After one Lightning epoch: the epoch-interval schedulers, then ``ReduceLROnPlateau`` on the
        round's released metric (in manual optimization, only where nothing the module did was taken,
        ``ReduceLROnPlateau``: lightning.Trainer never steps schedulers there)."""
        if self.automatic:
            self._epoch_steps(r, self.start_step)
        elif taken:
            return
        for cfg in self._plateau:
            value = self._metric(r, cfg.monitor)
            if value is not None and (r + 1) % cfg.frequency == 0:
                self._step(cfg, float(value), r, self.start_step)

    def expected_end(self) -> RoundEnd:
        """Where the schedule alone ends the current round (before the epoch's scheduler steps of
        automatic optimization): what a client's :class:`RoundEnd` is compared with."""
        if self._expected is None or self._expected[0] != self.round:
            saved = self.state()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                step = self._replay(self.round)
            self._expected = (self.round, RoundEnd(step, *self.state()))
            self.load(*saved)
        return self._expected[1]

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[Groups, list[dict[str, Any]]]:
        return hyperparameters(self.opts), [copy.deepcopy(c.scheduler.state_dict()) for c in self.scheds]

    def fits(self, groups: Groups, n_scheds: int) -> bool:
        """Whether optimizers with these param groups (and schedulers) have the cursor's structure."""
        return n_scheds == len(self.scheds) and len(groups) == len(self.opts) and all(
            len(a) == len(b.param_groups) for a, b in zip(groups, self.opts))

    def load(self, groups: Groups, scheds: list[dict[str, Any]]) -> None:
        for opt, ref in zip(self.opts, groups):
            for group, values in zip(opt.param_groups, ref):
                group.update(values)
        for cfg, state in zip(self.scheds, scheds):
            cfg.scheduler.load_state_dict(copy.deepcopy(state))

    def copy_into(self, opts: list[torch.optim.Optimizer], scheds: list[LRSchedulerConfig]) -> bool:
        """Give fresh client optimizers and schedulers the cursor's settings and states; ``False`` (and
        nothing copied) when configure_optimizers returned another structure and there are no
        schedulers (with schedulers that is refused)."""
        if not self.fits(hyperparameters(opts), len(scheds)):
            if not scheds and not self.scheds:
                return False
            raise ConfigError("model.configure_optimizers", f"{len(opts)} optimizers, {len(scheds)} schedulers",
                              "returned a different structure on another call", "return the same optimizers and "
                              "schedulers (and param groups) every time it is called")
        for opt, ref in zip(opts, self.opts):
            for group, ref_group in zip(opt.param_groups, ref.param_groups):
                for key, value in ref_group.items():
                    if key != "params":
                        group[key] = value
        for cfg, ref in zip(scheds, self.scheds):
            cfg.scheduler.load_state_dict(copy.deepcopy(ref.scheduler.state_dict()))
        return True
