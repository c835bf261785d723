"""DP-SGD inside clients (Opacus): per-record gradients, clipping, noise scale, accounting, models
Opacus cannot handle (layers run on rows that are not the batch's records), empty Poisson batches."""

import math

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import rdp as dp_rdp
from torch import nn

from dpfl_lightning import ConfigError
from dpfl_lightning.algorithms import PFL
from dpfl_lightning.plugins import DPSGD
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.federated.releases import MetricRelease
from dpfl_lightning.plugins import PrivacyLedger
from helpers import (AliasedInsideAWholeLayer, AliasedLayer, ExpandedPositions, PositionalEmbedding, TiedAndAliased,
                     TiedWeights, TinyClassifier, quiet_trainer, tiny_data)


def keeping_batches(model_class):
    class BatchKeeper(model_class):
        def training_step(self, batch, batch_idx):
            self.last_batch = batch
            return super().training_step(batch, batch_idx)

    return BatchKeeper


BatchKeeper = keeping_batches(TinyClassifier)


class GradSampleSpy(FederatedCallback):
    """Reads Opacus's per-record gradients at every local step (before clipping)."""

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, *, client, optimizer):
        model = client.model
        self.seen.append(([p.grad_sample.detach().clone() for p in model.parameters()],
                          [t.clone() for t in model.last_batch], [p.detach().clone() for p in model.parameters()]))


# shared parameters: a layer under two names is hooked once; a weight in two layers gets both parts;
# a position embedding on position ids expanded to the batch (GPT-2's wpe, as DP-SGD needs it)
@pytest.mark.parametrize("model", [TinyClassifier, AliasedLayer, TiedWeights, TiedAndAliased, AliasedInsideAWholeLayer,
                                   ExpandedPositions])
def test_per_record_gradients_equal_a_per_example_loop(log_dir, model):
    spy = GradSampleSpy()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=5, local_steps=2,
                            plugins=[DPSGD(noise_multiplier=0.5, max_grad_norm=1.0), spy])
    trainer.fit(keeping_batches(model)(), tiny_data(num_clients=4, samples=20))
    assert len(spy.seen) == 4
    ref = model()
    for grad_samples, (x, y), params in spy.seen:
        assert grad_samples[0].shape[0] == x.shape[0]
        with torch.no_grad():
            for p, v in zip(ref.parameters(), params):
                p.copy_(v)
        for i in range(x.shape[0]):
            ref.zero_grad()
            F.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]).backward()
            for p, gs in zip(ref.parameters(), grad_samples):
                assert torch.allclose(p.grad, gs[i], atol=1e-6)


def test_clipping_bounds_every_record_and_the_update_is_the_clipped_mean(log_dir):
    spy = GradSampleSpy()
    C, B = 0.05, 5
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=B, local_steps=1,
                            plugins=[DPSGD(noise_multiplier=0.0, max_grad_norm=C, allow_infinite_epsilon=True), spy])
    model = BatchKeeper(lr=1.0)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    trainer.fit(model, tiny_data(num_clients=2, samples=20))
    (grad_samples, (x, _), _), = spy.seen
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in grad_samples], dim=1).double()
    norms = flat.norm(dim=1)
    assert (norms > C).all()  # every record would exceed the bound unclipped
    clipped = flat * (C / (norms + 1e-6)).clamp(max=1.0)[:, None]  # Opacus's clipping rule
    assert (clipped.norm(dim=1) <= C).all()
    step = before.double() - trainer.module.global_params.double()  # SGD lr 1, noise 0
    expected = clipped.sum(0) / B  # divided by the expected batch size (here n * rate = B)
    assert torch.allclose(step, expected, atol=1e-6)
    assert step.norm() <= C * x.shape[0] / B + 1e-6


class ZeroGrad(TinyClassifier):
    def training_step(self, batch, batch_idx):
        x, _ = batch
        return 0.0 * self(x).sum()  # every per-record gradient is 0: the update is the noise


def test_noise_on_the_summed_gradient_has_std_z_times_C(log_dir):
    z, C, B, steps = 0.8, 2.0, 4, 3
    model = ZeroGrad(in_features=200, lr=1.0)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()]).double()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=4, batch_size=B, local_steps=steps,
                            plugins=[DPSGD(noise_multiplier=z, max_grad_norm=C)])
    fm = trainer.fit(model, tiny_data(num_clients=4, samples=20, dim=200))
    # each client: sum of `steps` noise draws N(0, (zC)^2) / B; FedAvg averages the 4 clients
    moved = (fm.global_params.double() - before) * B * math.sqrt(4) / math.sqrt(steps)
    assert moved.numel() > 3000
    assert moved.std().item() == pytest.approx(z * C, rel=0.05)  # 13.5k draws: rel. s.e. 0.6%


def test_ledger_epsilon_per_client_equals_dp_accounting(log_dir):
    z, B = 1.1, 4
    ledger = PrivacyLedger(delta=1e-4)
    trainer = quiet_trainer(log_dir, rounds=4, clients_per_round=3, batch_size=B, local_epochs=1,
                            plugins=[DPSGD(noise_multiplier=z), ledger])
    data = tiny_data(num_clients=6, samples=18)
    trainer.fit(TinyClassifier(), data)
    n = 18
    rate, steps = B / n, math.ceil(n / B)
    participations = [0] * 6
    for r in range(4):
        for c in trainer.sampler.sample(trainer.run.random, r):
            participations[c] += 1
    assert len(set(participations)) > 1  # clients took part a different number of times
    for c in range(6):
        acc = dp_rdp.RdpAccountant()
        if participations[c]:
            acc.compose(dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z)), steps * participations[c]))
        assert ledger.client_epsilon(c) == acc.get_epsilon(1e-4)
    assert trainer.history[-1]["epsilon"] == max(ledger.client_epsilon(c) for c in range(6))


def test_target_epsilon_for_every_client(log_dir):
    dpsgd = DPSGD(target_epsilon=2.0, delta=1e-4)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=3, batch_size=4, plugins=[dpsgd])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=6, samples=18))
    assert 2.0 * 0.99 <= trainer.history[-1]["epsilon"] <= 2.0


def test_an_unreachable_target_warns_with_the_target_and_the_calibrated_std(log_dir):
    """As GaussianNoise's (tests/test_noise.py): a legal, private run that learns nothing says so."""
    dpsgd = DPSGD(target_epsilon=1e-6, delta=1e-4, max_grad_norm=0.5)
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, batch_size=4, plugins=[dpsgd])
    with pytest.warns(RuntimeWarning, match=r"^DPSGD: target_epsilon=1e-06 \(delta=0\.0001\) calibrates") as got:
        trainer.fit(TinyClassifier(), tiny_data(num_clients=6, samples=18))
    (message,) = [str(w.message) for w in got if "calibrates" in str(w.message)]
    assert dpsgd.noise_multiplier >= 100
    assert f"the noise std is {dpsgd.noise_multiplier:.4g}x the clip norm" in message


def test_a_reachable_target_or_usual_multiplier_does_not_warn(log_dir, recwarn):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, batch_size=4, plugins=[DPSGD(noise_multiplier=1.0)])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=6, samples=18))
    assert not [w for w in recwarn if "clip norm" in str(w.message)]


class WithBatchNorm(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))


def test_batchnorm_is_refused_with_the_layer_named(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0)])
    with pytest.raises(ConfigError, match=r"BatchNorm.*fix_model=True"):
        trainer.fit(WithBatchNorm(), tiny_data())


def test_fix_model_replaces_batchnorm_and_trains(log_dir):
    dpsgd = DPSGD(noise_multiplier=0.5, fix_model=True)
    # GroupNorm(16, 16) needs two records per batch: batches of ~8 of 12 records
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, batch_size=8, plugins=[dpsgd])
    fm = trainer.fit(WithBatchNorm(), tiny_data())
    assert any("BatchNorm1d -> GroupNorm" in r for r in dpsgd.replaced)
    assert not any(isinstance(m, nn.BatchNorm1d) for m in fm.inner.modules())
    assert torch.isfinite(fm.global_params).all() and math.isfinite(trainer.history[-1]["my_val_loss"])


def _local_model_class():
    class HoldsALambda(WithBatchNorm):  # defined in a function and holding a lambda: torch.save cannot copy it
        def __init__(self):
            super().__init__()
            self.make_optimizer = lambda params: torch.optim.SGD(params, lr=0.1)

    return HoldsALambda


def test_fix_model_fixes_a_model_that_cannot_be_copied(log_dir):
    dpsgd = DPSGD(noise_multiplier=0.5, fix_model=True)
    model = _local_model_class()()
    quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=8, plugins=[dpsgd]).fit(model, tiny_data())
    assert dpsgd.replaced == ["net.1: BatchNorm1d -> GroupNorm"]
    assert isinstance(model.net[1], nn.GroupNorm)


def test_fix_model_leaves_the_model_as_it_was_when_layers_remain(log_dir, monkeypatch):
    from opacus.validators import ModuleValidator

    # a fixer whose replacement Opacus still refuses: nothing of the model may change
    monkeypatch.setitem(ModuleValidator.FIXERS, nn.BatchNorm1d, lambda m, **kw: nn.BatchNorm1d(m.num_features))
    model = _local_model_class()()
    layers = dict(model.named_modules())
    with pytest.raises(ConfigError, match="DPSGD.fix_model=True: layers remain that Opacus cannot handle"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=8,
                      plugins=[DPSGD(noise_multiplier=0.5, fix_model=True)]).fit(model, tiny_data())
    assert dict(model.named_modules()) == layers


class ActivationWatcher(FederatedCallback):
    """After evaluation (on_round_end), Opacus must hold no activations: evaluation ran under no_grad."""

    order = 999

    def setup(self, *, ctx):
        self.model = ctx.model

    def released_metrics(self, *, ctx):
        return [MetricRelease("held_activations", "public", "ActivationWatcher", "a count of the model's buffers")]

    def on_round_end(self, *, server, metrics):
        held = [len(getattr(m, "activations", []) or []) for m in self.model.modules()]
        metrics["held_activations"] = float(sum(held))


def test_evaluation_builds_no_activations(log_dir):
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0), ActivationWatcher()])
    trainer.fit(TinyClassifier(), tiny_data())
    assert [h["held_activations"] for h in trainer.history] == [0.0, 0.0]


def test_empty_poisson_batches_are_noise_only_steps(log_dir):
    # batch 1 of 12 records: each step is empty with probability (11/12)^12 ~ 0.35
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, batch_size=1, local_steps=6,
                            plugins=[DPSGD(noise_multiplier=1.0)], log_client_metrics=True)
    fm = trainer.fit(TinyClassifier(), tiny_data(num_clients=4, samples=12))
    assert torch.isfinite(fm.global_params).all()
    assert math.isfinite(trainer.history[-1]["my_train_loss"])  # empty batches' NaN losses carry no weight


def test_pfl_preset_checks_e_times_r(log_dir):
    trainer = quiet_trainer(log_dir, rounds=3, local_epochs=2, algorithm=PFL(noise_multiplier=1.0, total_epochs=4))
    with pytest.raises(ConfigError, match="total_epochs"):
        trainer.fit(TinyClassifier(), tiny_data(num_clients=4))
    ok = quiet_trainer(log_dir, rounds=2, local_epochs=2, algorithm=PFL(noise_multiplier=1.0, total_epochs=4))
    ok.fit(TinyClassifier(), tiny_data(num_clients=4))
    assert [type(p).__name__ for p in ok.plugins] == ["DPSGD", "ServerOptimizer", "PrivacyLedger"]


def test_dpsgd_refuses_a_trainable_layer_run_in_eval_mode(log_dir):
    model = TinyClassifier()
    model.net[0].eval()  # kept as the user set it, as lightning.Trainer keeps it
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0)])
    with pytest.raises(ConfigError, match=r"net\.0.*eval mode"):
        trainer.fit(model, tiny_data())
    frozen = TinyClassifier()
    frozen.net[0].eval()
    frozen.net[0].requires_grad_(False)  # a frozen layer in eval mode is fine
    quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0)]).fit(frozen, tiny_data())

    class Unfreezes(TinyClassifier):  # a backbone given in eval mode, switched to train mode by a hook
        def on_train_start(self):
            self.net.train()

    late = Unfreezes()
    late.eval()  # the whole module, as from_pretrained-style loaders return it
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0)])
    t.fit(late, tiny_data())
    assert math.isfinite(t.history[-1]["epsilon"])


class SelfAttention(TinyClassifier):
    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        if layout == "in_encoder":
            self.attn = nn.TransformerEncoderLayer(10, 2, 16, dropout=0.0, batch_first=True)
        else:
            self.attn = nn.MultiheadAttention(10, 2, batch_first=layout == "batch_first")

    def forward(self, x):
        seq = x.view(x.shape[0], 2, 5).repeat(1, 1, 2)  # (batch, 2 tokens, 10)
        causal = nn.Transformer.generate_square_subsequent_mask(2)
        if self.layout == "in_encoder":
            seq = self.attn(seq, src_mask=causal, is_causal=True)
        elif self.layout == "batch_first":
            seq = self.attn(seq, seq, seq, attn_mask=causal)[0]
        else:
            t = seq.transpose(0, 1)
            seq = self.attn(t, t, t, attn_mask=causal)[0].transpose(0, 1)
        return self.net(seq.mean(1))


@pytest.mark.parametrize("layout", ["batch_first", "sequence_first", "in_encoder"])
def test_fix_model_refuses_attention_that_opacus_would_replace_by_another_computation(log_dir, layout):
    model = SelfAttention(layout)
    layers = dict(model.named_modules())
    with pytest.raises(ConfigError, match=r"DPSGD.fix_model=\['attn.*'\]: .*MultiheadAttention.*is_causal") as err:
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=6,
                      plugins=[DPSGD(noise_multiplier=0.5, fix_model=True)]).fit(model, tiny_data())
    assert dict(model.named_modules()) == layers and "\n" not in str(err.value)
    model.attn.requires_grad_(False)  # the fix it names: a frozen attention layer needs no per-record gradients
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=6,
                            plugins=[DPSGD(noise_multiplier=0.5, fix_model=True)])
    trainer.fit(model, tiny_data())
    assert math.isfinite(trainer.history[-1]["my_val_loss"])


class ClipsOnlyWhenAsked(TinyClassifier):
    def __init__(self, clip=None):
        super().__init__()
        self.clip, self.calls = clip, 0

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.calls += 1
        self.clip_gradients(optimizer, gradient_clip_val=self.clip or gradient_clip_val)


def test_configure_gradient_clipping_runs_under_dpsgd_unless_it_clips(log_dir):
    model = ClipsOnlyWhenAsked()
    quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0)]).fit(model, tiny_data())
    assert model.calls == 2 * 3  # called at every step, as lightning.Trainer calls it, with nothing to clip
    with pytest.raises(ConfigError, match="DP-SGD clips every record's gradient"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0)]).fit(
            ClipsOnlyWhenAsked(clip=0.5), tiny_data())


class UnfreezesInRound(TinyClassifier):
    """A first layer frozen in __init__ and unfrozen from round ``r`` on (gradual unfreezing), in
    ``on_train_epoch_start`` or in ``configure_optimizers`` (which runs for every client)."""

    def __init__(self, r=1, where="on_train_epoch_start"):
        super().__init__()
        self.r, self.where = r, where
        self.net[0].requires_grad_(False)
        self.first_layer_by_round = []

    def _unfreeze(self):
        if self.current_epoch >= self.r:
            self.net[0].requires_grad_(True)

    def on_train_epoch_start(self):
        if self.where == "on_train_epoch_start":
            self._unfreeze()

    def configure_optimizers(self):
        if self.where == "configure_optimizers":
            self._unfreeze()
        return super().configure_optimizers()

    def on_validation_start(self):
        self.first_layer_by_round.append(self.net[0].weight.detach().clone())


class PerRecordGradientsSeen(FederatedCallback):
    def __init__(self):
        self.first_layer = []

    def on_before_optimizer_step(self, *, client, optimizer):
        gs = client.model.net[0].weight.grad_sample
        self.first_layer.append(None if gs is None else gs.shape[0])


@pytest.mark.parametrize("where", ["on_train_epoch_start", "configure_optimizers"])
def test_a_layer_frozen_in_init_and_unfrozen_in_a_later_round_trains_under_dpsgd(log_dir, where):
    model, seen = UnfreezesInRound(where=where), PerRecordGradientsSeen()
    start = model.net[0].weight.detach().clone()
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2, local_steps=2, batch_size=4,
                            plugins=[DPSGD(noise_multiplier=0.5, sampling="fixed"), seen])
    trainer.fit(model, tiny_data())
    first = model.first_layer_by_round
    assert torch.equal(first[0], start)  # frozen in round 0
    # unfrozen during round 1: trained by its clients, but frozen when the round started, so not part
    # of that round's update (dpfl_lightning.federated.frozen); it joins from round 2, the first to start with it trainable
    assert torch.equal(first[1], first[0]) and not torch.equal(first[2], first[1])
    assert seen.first_layer == [None] * 4 + [4] * 8  # per-record gradients once unfrozen (round 1 on)


class UnfreezesAttention(UnfreezesInRound):
    def __init__(self):
        super().__init__()
        self.net[0].requires_grad_(True)
        self.attn = nn.MultiheadAttention(10, 2).requires_grad_(False)  # frozen: not checked at set-up

    def forward(self, x):
        t = x.unsqueeze(0)
        return self.net(self.attn(t, t, t)[0][0])

    def _unfreeze(self):
        if self.current_epoch >= self.r:
            self.attn.requires_grad_(True)


def test_a_layer_opacus_cannot_handle_unfrozen_later_is_refused_before_its_step(log_dir):
    model = UnfreezesAttention()
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2, plugins=[DPSGD(noise_multiplier=0.5)])
    with pytest.raises(ConfigError, match="model='attn': a layer unfrozen during training is one Opacus cannot "
                                          "compute per-record gradients for.*MultiheadAttention"):
        trainer.fit(model, tiny_data())
    assert len(trainer.history) == 1


# ---------------------------------------------------------------------------------------- rows that are not records
class StepCounter(FederatedCallback):
    """Counts the local steps that got past DPSGD's checks (it runs after DPSGD)."""

    def __init__(self):
        self.steps = 0

    def on_before_optimizer_step(self, *, client, optimizer):
        self.steps += 1


SHARED_ROW = r"fewer rows than the batch has records .*position ids of shape \(1, T\).*max_grad_norm"
EXPAND_FIX = r"Fix: .*position_ids=torch\.arange\(T\)\.expand\(B, T\)"


@pytest.mark.parametrize("positions", ["shared", "mixed"])
def test_a_layer_run_on_a_row_the_batch_shares_is_refused_at_the_first_step_with_the_fix(log_dir, positions):
    """``shared``: GPT-2's position embedding on ids of shape (1, T), which crashed at the first step in
    Opacus's clipping (``stack expects each tensor to be equal size``); ``mixed``: the layer also runs on
    the batch, which trained without error on per-record gradients that gave the first record the whole
    batch's gradient of the shared row."""
    counter = StepCounter()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=5,
                            plugins=[DPSGD(noise_multiplier=0.5), counter])
    with pytest.raises(ConfigError, match=rf"^DPSGD=\['pos'\]: .*{SHARED_ROW}.*{EXPAND_FIX}") as err:
        trainer.fit(PositionalEmbedding(positions), tiny_data(num_clients=4, samples=20))
    assert counter.steps == 0  # refused before the first step changed anything
    assert "\n" not in str(err.value) and "stack expects" in str(err.value)


def test_a_layer_run_on_records_flattened_into_rows_is_refused(log_dir):
    with pytest.raises(ConfigError, match=r"^DPSGD=\['head'\]: .*more rows than the batch has records.*Fix: keep one "
                                          r"row per record on the first dimension"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=5, plugins=[DPSGD(noise_multiplier=0.5)]).fit(
            PositionalEmbedding("flattened"), tiny_data(num_clients=4, samples=20))


def test_expanded_position_ids_train_under_dpsgd(log_dir):
    counter = StepCounter()
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, batch_size=5, local_steps=3,
                            plugins=[DPSGD(noise_multiplier=0.5), counter])
    model = ExpandedPositions()
    before = model.pos.weight.detach().clone()
    trainer.fit(model, tiny_data(num_clients=4, samples=20))
    assert counter.steps == 2 * 2 * 3
    assert not torch.equal(model.pos.weight, before) and math.isfinite(trainer.history[-1]["my_val_loss"])


class PackedLSTM(TinyClassifier):
    """Token embeddings, an LSTM on packed sequences of 1 to 5 steps, a head on the last hidden state."""

    def __init__(self):
        super().__init__()
        del self.net
        torch.manual_seed(0)
        self.tok, self.lstm, self.head = nn.Embedding(10, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 10)

    def forward(self, x):
        tokens = (x[:, :5].abs() * 3).long().clamp(max=9)
        lengths = 1 + (x[:, 5].abs() * 3).long().clamp(max=4)
        packed = nn.utils.rnn.pack_padded_sequence(self.tok(tokens), lengths, batch_first=True, enforce_sorted=False)
        return self.head(self.lstm(packed)[1][0][-1])


def test_opacus_lstm_cells_on_fewer_records_at_later_time_steps_train(log_dir):
    """Opacus's DPLSTM runs its cells once per time step, on the records still running (fewer at the
    later steps of a packed batch): rows that are records, which DPSGD's row check leaves to Opacus."""
    counter = StepCounter()
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, batch_size=6,
                            plugins=[DPSGD(noise_multiplier=0.5, fix_model=True), counter])
    with pytest.warns(UserWarning, match="lstm: LSTM -> DPLSTM"):
        trainer.fit(PackedLSTM(), tiny_data(num_clients=4, samples=20))
    assert counter.steps == 2 * 2 * 4 and math.isfinite(trainer.history[-1]["my_val_loss"])
