"""Where a client's optimizers start with clients of different sizes and partial participation (the
rule in dpfl_lightning.module.schedule and the README's "Lightning semantics"): a client of ``S`` optimizer
steps per round starts round ``r`` at ``global_step = r * S``; what the module itself changed (a
warm-up in ``optimizer_step``) continues only from the previous round's clients of ``S`` steps, else
the client starts where the schedule alone stands (``configure_optimizers``' settings, its
schedulers stepped ``r * S`` times), and the run says so. Expected values are computed here, by the
warm-up's formula or by stepping a fresh torch scheduler."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpfl_lightning import FederatedDataModule
from helpers import TinyClassifier, quiet_trainer, torch_lrs

BASE, W, ROUNDS = 0.1, 20, 8
SIZES = (16, 20, 24, 28)  # batch 4: 4, 5, 6 and 7 optimizer steps per round
MISSING = "took no part in the previous round"


def _unequal_data(sizes=SIZES):
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    x, y = torch.randn(n, 10, generator=g), torch.randint(0, 10, (n,), generator=g)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    indices = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    return FederatedDataModule.from_tensors(x, y, x[:8], y[:8], client_indices=indices)


class Seen(TinyClassifier):
    """Records (round, steps this round, global_step, lr) at every local optimizer step."""

    def __init__(self):
        super().__init__(lr=BASE)
        self.seen: list[tuple[int, int, int, float]] = []

    def on_before_optimizer_step(self, optimizer):
        self.seen.append((self.current_epoch, self.trainer.num_training_batches, self.global_step,
                          optimizer.param_groups[0]["lr"]))


class WarmUp(Seen):
    """Lightning's documented warm-up recipe: the learning rate set in optimizer_step after each step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        gs = self.trainer.global_step
        for pg in optimizer.param_groups:
            pg["lr"] = min(1.0, (gs + 1) / W) * self.lr


class Scheduled(Seen):
    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = self.make(opt, self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _warm(g):
    """The warm-up's lr at step ``g`` of one lightning.Trainer run (set after step ``g - 1``)."""
    return BASE if g == 0 else min(1.0, g / W) * BASE


def _fit(model, log_dir, **kw):
    kw.setdefault("rounds", ROUNDS)
    kw.setdefault("clients_per_round", 2)
    trainer = quiet_trainer(log_dir, local_epochs=1, seed=0, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trainer.fit(model, _unequal_data())
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out, said


def _participation(seen):
    by_round: dict[int, set[int]] = {}
    for r, s, _, _ in seen:
        by_round.setdefault(r, set()).add(s)
    return by_round


def test_a_warm_up_continues_only_from_the_previous_rounds_clients_of_the_same_step_count(log_dir):
    model = WarmUp()
    _, said = _fit(model, log_dir)
    took = _participation(model.seen)
    assert all(len(took[r]) == 2 for r in range(ROUNDS))  # (every client's size is its own)
    restarts = 0
    for r, s, g, lr in model.seen:
        assert r * s <= g < (r + 1) * s, (r, s, g)  # global_step = round * S at the client's start
        if g == r * s and r > 0 and s not in took[r - 1]:  # nothing to continue: the schedule alone
            restarts += 1
            assert lr == BASE, (r, s, g)
        else:
            assert lr == pytest.approx(_warm(g), rel=1e-12), (r, s, g)
    # the case that was stale: a step count that trained in some earlier round, not in the last one
    stale = [(r, s) for r in range(2, ROUNDS) for s in took[r]
             if s not in took[r - 1] and any(s in took[q] for q in range(r - 1))]
    assert stale and restarts > len(stale) - 1
    assert len(said) == 1 and MISSING in said[0] and "global_step = round * S" in said[0]


def test_full_participation_continues_each_step_counts_warm_up_silently(log_dir):
    model = WarmUp()
    _, said = _fit(model, log_dir, rounds=4, clients_per_round=None)
    assert len(model.seen) == 4 * sum(n // 4 for n in SIZES)
    for r, s, g, lr in model.seen:  # one lightning.Trainer run of S steps per epoch, per step count
        assert r * s <= g < (r + 1) * s
        assert lr == pytest.approx(_warm(g), rel=1e-12), (r, s, g)
    assert said == []


@pytest.mark.parametrize("name", ["lambda_warm_up", "one_cycle"])
def test_step_schedulers_stand_at_global_step_whoever_trained_before(log_dir, name):
    lr_scheduler = torch.optim.lr_scheduler
    make = {"lambda_warm_up": lambda opt, total: lr_scheduler.LambdaLR(opt, lambda g: min(1.0, (g + 1) / W)),
            "one_cycle": lambda opt, total: lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=total)}[name]
    model = Scheduled(make)
    _, said = _fit(model, log_dir)
    refs = {s: torch_lrs(lambda opt, s=s: make(opt, ROUNDS * s), ROUNDS * s, BASE) for s in {n // 4 for n in SIZES}}
    for r, s, g, lr in model.seen:
        assert r * s <= g < (r + 1) * s
        assert lr == pytest.approx(refs[s][g], rel=1e-12), (r, s, g)
    assert said == []


def test_a_resumed_run_restarts_and_continues_as_the_uninterrupted_one(log_dir, tmp_path):
    ref = WarmUp()
    whole, _ = _fit(ref, log_dir)
    _fit(WarmUp(), log_dir, rounds=3, checkpoint_every=3, checkpoint_dir=str(tmp_path))
    model = WarmUp()
    trainer = quiet_trainer(log_dir, rounds=ROUNDS, clients_per_round=2, local_epochs=1, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        resumed = trainer.fit(model, _unequal_data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert model.seen == [row for row in ref.seen if row[0] >= 3]
    assert torch.equal(resumed.global_params, whole.global_params)
