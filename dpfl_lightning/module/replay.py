"""Schedule replay: every client builds fresh optimizers from ``configure_optimizers``, placed where
one Lightning run's schedule would stand at the client's round (a cursor per number of optimizer
steps per round, see :mod:`dpfl_lightning.module.schedule`); where the clients of ``S`` steps of a round all
ended in the same state that the schedule alone does not give, the next round's clients of ``S``
steps continue from it; where a round leaves them nothing to continue (none of them trained, they
ended differently) they restart where the schedule alone stands."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.module.optimizers import parse_optimizers, step_scheduler_as_lightning
from dpfl_lightning.module.schedule import RESTART, RoundEnd, ScheduleCursor, ended_as, hyperparameters, merge_end

#: a rule on the optimizers ``configure_optimizers`` returns, checked at set-up (it raises to refuse)
OptimizerRule = Callable[[list[torch.optim.Optimizer]], None]


class ScheduleReplay:
    """The optimizers and schedulers of the clients of ``fm`` (a
    :class:`~dpfl_lightning.module.FederatedLightningModule`) across rounds, and the round ends taken."""

    def __init__(self, fm: Any) -> None:
        self.fm = fm
        self.optimizer_rules: list[OptimizerRule] = []
        self.reset()

    def reset(self) -> None:
        """A new run: no cursors, no round ends, no released rows."""
        self.cursors: dict[int, ScheduleCursor] = {}
        self.seen_schedulers: bool | None = None
        self.round_metrics: dict[int, dict[str, float]] = {}  # released rows by round (ReduceLROnPlateau)
        self.round_ends: dict[tuple[int, int], RoundEnd] = {}  # taken, by (steps per round, round)
        self.client_ends: dict[int, RoundEnd | str | None] = {}
        self.notes: set[str] = set()  # what the run says differs from lightning.Trainer (once each)
        self.carried: set[int] = set()  # the steps per round with a round end taken
        self.restarts: set[tuple[int, int]] = set()  # (steps per round, round) after which the schedule alone
        self.off_schedule: set[int] = set()  # the steps per round whose cursor continues a round end taken
        self.last_seen: dict[int, int] = {}  # the last round in which clients of each step count trained
        self.optimizer_rules = []
        self.steps_private = False  # the reference client's steps per round follow the data (set up by the run)
        self.private = False  # a DP run (set up by the run)
        self.reference_shape = (0, 0)  # the reference client's (estimated_stepping_batches, num_training_batches)

    # ------------------------------------------------------------------ where a client starts
    def set_client_shape(self, round_idx: int, steps: int, batches: int) -> None:
        """What the module's trainer says at the start of a client's round: ``current_epoch`` is the
        round, ``global_step`` where the schedule of ``steps`` steps per round stands (``round * steps``
        unless the module's own steps moved it; see :mod:`dpfl_lightning.module.schedule`)."""
        shim = self.fm.trainer_shim
        shim.current_epoch = round_idx
        shim.global_step = self.start_step(steps, round_idx)
        shim.set_shape(self.fm.loop.rounds * steps, batches)

    def start_step(self, steps: int, round_idx: int) -> int:
        """``global_step`` at the start of ``round_idx`` for clients of ``steps`` steps per round: that of
        the last round end taken before it, plus ``steps`` per round since; ``round_idx * steps`` when
        none was taken, or a restart came after it."""
        cur = self.cursors.get(steps)
        if cur is not None and cur.round <= round_idx:
            return self.cursor(steps, round_idx).start_step
        last = max((r for s, r in self.round_ends if s == steps and r < round_idx), default=-1)
        if last < 0 or any(s == steps and last < r < round_idx for s, r in self.restarts):
            return round_idx * steps
        return self.round_ends[(steps, last)].step + (round_idx - 1 - last) * steps

    def written_step(self, rounds_done: int) -> int:
        """The ``global_step`` the run writes after ``rounds_done`` rounds (its checkpoints, a Lightning
        checkpoint of the global model, callbacks' ``trainer.global_step``): the reference client's
        (:meth:`start_step`); where :attr:`steps_private` (a DP run whose steps per round follow the
        clients' record counts: ``local_epochs``, or gradient accumulation) ``rounds_done``, one step of
        the global model per round, a function of the settings. The reference client's would be the
        largest client's steps per round times the rounds: one client's data. Nothing reads it back on
        resume: the schedule's positions are recomputed from the clients' data."""
        if self.steps_private:
            return rounds_done
        return self.start_step(self.fm.loop.steps_reference, rounds_done)

    def outside_client(self, rounds_done: int) -> None:
        """What ``self.trainer`` shows outside a client (evaluation after ``rounds_done`` rounds) in a DP
        run: the reference client's shape and the step :meth:`written_step` writes, never the last trained client's
        (its ``global_step`` and batches follow its record count)."""
        if not self.private:
            return
        shim = self.fm.trainer_shim
        # (a DP run takes no round end: the schedule alone, without moving a cursor before the round's row)
        shim.global_step = rounds_done if self.steps_private else rounds_done * self.fm.loop.steps_reference
        shim.set_shape(*self.reference_shape)

    def configure(self, steps: int) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
        """``configure_optimizers`` with ``estimated_stepping_batches`` of clients of ``steps`` steps."""
        fm = self.fm
        shim = fm.trainer_shim
        saved = shim.shape()
        shim.set_shape(fm.loop.rounds * steps, saved[1])
        try:
            opts, scheds = parse_optimizers(fm.inner.configure_optimizers())
        finally:
            shim.set_shape(*saved)
        if fm.automatic_optimization and len(opts) != 1:
            raise ConfigError("model.configure_optimizers", f"{len(opts)} optimizers",
                              "automatic optimization trains with exactly one optimizer",
                              "return one optimizer or set self.automatic_optimization = False")
        return opts, scheds

    def check_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
        """Call ``configure_optimizers`` once, as the reference client would (refuses what cannot run,
        and what the rules of :attr:`optimizer_rules` refuse)."""
        opts, scheds = self.configure(self.fm.loop.steps_reference)
        self.seen_schedulers = bool(scheds)
        for rule in self.optimizer_rules:
            rule(opts)
        return opts, scheds

    def cursor(self, steps: int, round_idx: int) -> ScheduleCursor:
        """The optimizers and schedulers of a client with ``steps`` optimizer steps per round, at the start
        of ``round_idx`` (see :mod:`dpfl_lightning.module.schedule`)."""
        cur = self.cursors.get(steps)
        if cur is None or cur.round > round_idx:
            cur = self.cursors[steps] = self._new_cursor(steps, lambda r: self._outcome(steps, r))
        cur.advance(round_idx)
        return cur

    def _new_cursor(self, steps: int, taken: Callable[[int], RoundEnd | str | None]) -> ScheduleCursor:
        opts, scheds = self.configure(steps)
        return ScheduleCursor(opts, scheds, steps, self.fm.automatic_optimization, self._cursor_step,
                              lambda r, monitor: self.round_metrics.get(r, {}).get(monitor), taken,
                              alone=lambda: self._new_cursor(steps, lambda r: None))

    def _outcome(self, steps: int, round_idx: int) -> RoundEnd | str | None:
        """What round ``round_idx`` left clients of ``steps`` steps: a round end taken, a restart, or
        nothing (the schedule goes on from where they started)."""
        end = self.round_ends.get((steps, round_idx))
        if end is None and (steps, round_idx) in self.restarts:
            return RESTART
        return end

    def _cursor_step(self, cfg: LRSchedulerConfig, metric: Any, epoch: int, global_step: int) -> None:
        """A scheduler step of a cursor, with ``current_epoch`` and ``global_step`` showing its position
        (lightning.Trainer never steps schedulers in manual optimization, nor calls lr_scheduler_step
        there: a cursor places them by their declared interval with their own ``step``)."""
        fm = self.fm
        shim = fm.trainer_shim
        saved = shim.current_epoch, shim.global_step
        shim.current_epoch, shim.global_step = epoch, global_step
        try:
            custom = fm.automatic_optimization and fm.client_loop.overridden["lr_scheduler_step"]
            step_scheduler_as_lightning(fm.inner, cfg, metric, custom)
        finally:
            shim.current_epoch, shim.global_step = saved

    def make_optimizers(self, steps: int = 0, round_idx: int = 0) -> tuple[list[torch.optim.Optimizer],
                                                                          list[LRSchedulerConfig], RoundEnd]:
        """Fresh local optimizers from ``configure_optimizers``, with the settings and scheduler states of
        the cursor of ``steps`` steps per round at the start of ``round_idx``; and the state the schedule
        alone would end the round in (what the client's own end is compared with)."""
        opts, scheds = self.configure(steps)
        if scheds:
            self.seen_schedulers = True
        if scheds or steps in self.carried:
            cur = self.cursor(steps, round_idx)
            if cur.copy_into(opts, scheds):
                return opts, scheds, cur.expected_end()
            self.notes.add("structure")
        return opts, scheds, RoundEnd(self.start_step(steps, round_idx) + steps, hyperparameters(opts), [])

    # ------------------------------------------------------------------ what clients carry across rounds
    def record_end(self, steps: int, opts: list[torch.optim.Optimizer], scheds: list[LRSchedulerConfig],
                   expected: RoundEnd) -> None:
        """A client's end of round, summed up for the round (:func:`~dpfl_lightning.module.schedule.merge_end`):
        only where it differs from the schedule's does its state count."""
        step = self.fm.trainer_shim.global_step
        if ended_as(expected, step, opts, scheds):
            merge_end(self.client_ends, steps, None)
        else:
            merge_end(self.client_ends, steps, RoundEnd(step, hyperparameters(opts),
                                                        [copy.deepcopy(c.scheduler.state_dict()) for c in scheds]))

    def round_ends_of_clients(self) -> dict[int, RoundEnd | str | None]:
        """What this rank's clients of each step count did with their optimizers' state this round (see
        :func:`~dpfl_lightning.module.schedule.merge_end`); cleared for the next round."""
        out, self.client_ends = self.client_ends, {}
        return out

    def take_round_end(self, steps: int, round_idx: int, end: RoundEnd) -> bool:
        """Continue clients of ``steps`` steps per round from ``end`` after ``round_idx``; ``False`` when
        its optimizers do not have the structure of the cursor's (nothing is taken)."""
        if not self.cursor(steps, round_idx).fits(end.groups, len(end.scheds)):
            return False
        self.round_ends[(steps, round_idx)] = end
        self.carried.add(steps)
        self.off_schedule.add(steps)
        return True

    def settle_round(self, round_idx: int, ends: dict[int, RoundEnd | str | None]) -> list[str]:
        """After round ``round_idx`` of a run that is not DP, given what its clients of each step count
        did (:meth:`round_ends_of_clients`, combined over ranks): take each common round end; restart,
        where the schedule alone stands, the step counts whose cursor continues a round end taken and
        that the round leaves nothing to continue. Returns what differs from lightning.Trainer (the
        keys of ``lightning_compat``'s notes): ``differ``, ``structure``, and ``missing`` when a step
        count that took no part in the previous round ended off the schedule, or a continued one took no
        part in this round (its next clients start where the schedule alone stands)."""
        said = []
        for steps, end in sorted(ends.items()):
            if isinstance(end, RoundEnd):
                if not self.take_round_end(steps, round_idx, end):
                    said.append("structure")
                    self._restart(steps, round_idx)
                elif round_idx > 0 and self.last_seen.get(steps) != round_idx - 1:
                    said.append("missing")
            elif end == "differ":
                said.append("differ")
                self._restart(steps, round_idx)
            self.last_seen[steps] = round_idx
        for steps in sorted(self.off_schedule - set(ends)):
            said.append("missing")
            self._restart(steps, round_idx)
        return said

    def _restart(self, steps: int, round_idx: int) -> None:
        if steps in self.off_schedule:
            self.restarts.add((steps, round_idx))
            self.off_schedule.discard(steps)

    def schedule_state(self) -> list[dict[str, Any]]:
        """The round ends taken so far, the restarts and the last round each step count trained in, in
        plain types (for the run's checkpoint)."""
        out = [dict(end.as_dict(), steps=s, round=r) for (s, r), end in sorted(self.round_ends.items())]
        out += [{"steps": s, "round": r, "restart": True} for s, r in sorted(self.restarts)]
        return out + [{"steps": s, "round": r, "seen": True} for s, r in sorted(self.last_seen.items())]

    def load_schedule_state(self, state: list[dict[str, Any]]) -> None:
        ends = [d for d in state if not d.get("restart") and not d.get("seen")]
        self.round_ends = {(d["steps"], d["round"]): RoundEnd(d["step"], d["groups"], d["scheds"]) for d in ends}
        self.restarts = {(d["steps"], d["round"]) for d in state if d.get("restart")}
        self.last_seen = {d["steps"]: d["round"] for d in state if d.get("seen")}
        self.carried = {s for s, _ in self.round_ends}
        self.off_schedule = {s for s in self.carried if max(r for t, r in self.round_ends if t == s)
                             > max((r for t, r in self.restarts if t == s), default=-1)}
        self.cursors = {}
