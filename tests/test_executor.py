"""Executors: the vectorised executor matches the sequential one, honours the round plan (client
learning-rate decay), and refuses at set-up what it cannot run."""

import pytest
import torch
import torch.nn.functional as F

from dpfl_lightning import ConfigError
from dpfl_lightning.algorithms import PFL, SCAFFOLD
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from helpers import AliasedLayer, TiedAndAliased, TiedWeights, TinyClassifier, quiet_trainer, tiny_data


class Frozen(TinyClassifier):
    def __init__(self):
        super().__init__()
        for p in self.net[0].parameters():
            p.requires_grad_(False)


class ClipsGradients(TinyClassifier):
    def on_before_optimizer_step(self, optimizer):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)


class MovesBatches(TinyClassifier):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x * 2, y


@pytest.mark.parametrize("model,match", [(Frozen, "frozen"), (ClipsGradients, "on_before_optimizer_step"),
                                         (MovesBatches, "on_after_batch_transfer")])
def test_vmap_refuses_what_it_would_not_run(log_dir, model, match):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor="vmap")
    with pytest.raises(ConfigError, match=match):
        trainer.fit(model(), tiny_data())


class LogsADict(TinyClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log_dict({"ld_loss": loss})
        return loss


class LogsWithOptions(TinyClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("hidden_loss", loss, logger=False)  # not for the logs
        self.log("max_loss", loss, reduce_fx="max")
        self.log("weighted_loss", loss, batch_size=1 + batch_idx)  # the user's own weights
        self.log_dict({"hidden_dict": loss}, logger=False)
        self.log_dict({"max_dict": loss}, reduce_fx="max")
        return loss


def test_vmap_passes_self_log_options_through_like_sequential(log_dir):
    out = {}
    for ex in ("sequential", "vmap"):
        t = quiet_trainer(log_dir, rounds=2, clients_per_round=4, executor=ex, batch_size=4)
        t.fit(LogsWithOptions(), tiny_data())
        out[ex] = t.history[-1]
    for hidden in ("hidden_loss", "hidden_dict"):
        assert hidden not in out["vmap"] and hidden not in out["sequential"]
    for key in ("max_loss", "weighted_loss", "max_dict"):
        assert out["vmap"][key] == pytest.approx(out["sequential"][key], rel=1e-5), key


def test_vmap_log_dict_matches_sequential(log_dir):
    out = {}
    for ex in ("sequential", "vmap"):
        t = quiet_trainer(log_dir, rounds=2, clients_per_round=4, executor=ex)
        t.fit(LogsADict(), tiny_data())
        out[ex] = t.history[-1]["ld_loss"]
    assert out["vmap"] == pytest.approx(out["sequential"], rel=1e-5)


class ReadsTheTrainer(TinyClassifier):
    """Records what its training_step reads from the trainer, once per (vectorised) step."""

    def __init__(self):
        super().__init__()
        self.seen, self.recording = [], False

    def on_train_start(self):
        self.recording = True  # not vmap's set-up trial

    def training_step(self, batch, batch_idx):
        if self.recording:
            self.seen.append((self.current_epoch, self.global_step, batch_idx, self.trainer.is_last_batch,
                              self.trainer.training))
        return super().training_step(batch, batch_idx)


def test_training_step_reads_the_same_trainer_state_under_vmap(log_dir):
    seen = {}
    for ex in ("sequential", "vmap"):
        module = ReadsTheTrainer()
        quiet_trainer(log_dir, rounds=3, clients_per_round=2, local_epochs=2, executor=ex).fit(module, tiny_data())
        seen[ex] = module.seen
    steps = len(seen["vmap"]) // 3  # vmap records each step once for the whole cohort of a round
    sequential_first_clients = [seen["sequential"][r * 2 * steps + i] for r in range(3) for i in range(steps)]
    assert seen["vmap"] == sequential_first_clients
    assert {g for _, g, *_ in seen["vmap"]} == set(range(3 * steps))  # global_step advances every step
    assert sum(last for *_, last, _ in seen["vmap"]) == 3
    assert all(training for *_, training in seen["vmap"])


@pytest.mark.parametrize("algorithm,name", [(PFL(noise_multiplier=1.0), "DPSGD"), (SCAFFOLD(), "SCAFFOLD")])
def test_plugins_that_change_local_steps_refuse_the_vmap_executor_once_each(log_dir, algorithm, name):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor="vmap", algorithm=algorithm)
    with pytest.raises(ConfigError, match=rf"trainer.executor='vmap': plugins \['{name}'\] change gradients"):
        trainer.fit(TinyClassifier(), tiny_data())


def test_vmap_follows_the_client_lr_decay_like_sequential(log_dir):
    out = {}
    for ex in ("sequential", "vmap"):
        for decay in (1.0, 0.3):
            t = quiet_trainer(log_dir, rounds=3, clients_per_round=4, executor=ex, client_lr_decay=decay,
                              plugins=[UpdateClipping(5.0), GaussianNoise(noise_multiplier=0.01)])
            out[ex, decay] = t.fit(TinyClassifier(lr=0.3), tiny_data()).global_params.clone()
    assert not torch.allclose(out["vmap", 1.0], out["vmap", 0.3], atol=1e-4)  # the decay matters
    assert torch.allclose(out["vmap", 0.3], out["sequential", 0.3], atol=1e-5)
    assert torch.allclose(out["vmap", 1.0], out["sequential", 1.0], atol=1e-5)


def test_vmap_matches_sequential_with_dp_plugins_and_a_coin(log_dir):
    from plugin_sketches import Coin

    out = {}
    for ex in ("sequential", "vmap"):
        t = quiet_trainer(log_dir, rounds=3, clients_per_round=5, executor=ex,
                          plugins=[Coin(0.5), UpdateClipping(0.5), GaussianNoise(noise_multiplier=0.5, placement="local")])
        out[ex] = t.fit(TinyClassifier(), tiny_data()).global_params
    assert torch.allclose(out["vmap"], out["sequential"], atol=1e-5)


class WithDropout(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(16, 10))


class UpdatesAMetric(TinyClassifier):
    def __init__(self):
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.train_acc = MulticlassAccuracy(10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc)
        return F.cross_entropy(logits, y)


@pytest.mark.parametrize("model,match", [(WithDropout, "random"), (UpdatesAMetric, "cannot be vectorised")])
def test_vmap_refuses_at_setup_what_fails_inside_vmap(log_dir, model, match):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor="vmap")
    with pytest.raises(ConfigError, match=match):
        trainer.fit(model(), tiny_data())
    quiet_trainer(log_dir, rounds=1, clients_per_round=2).fit(model(), tiny_data())  # the sequential executor runs it


class WithOptimizer(TinyClassifier):
    def __init__(self, make):
        super().__init__(lr=0.1)
        self.make = make

    def configure_optimizers(self):
        return self.make(self)


@pytest.mark.parametrize("make", [
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1),  # the direct p -= lr g path
    lambda m: torch.optim.SGD([{"params": m.net[0].parameters(), "lr": 0.05},
                               {"params": m.net[2].parameters()}], lr=0.1),  # groups with their own lr
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),  # the optimizer's own step
    lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
], ids=["sgd", "sgd-groups", "momentum", "adam"])
def test_vmap_runs_the_modules_optimizer_like_sequential(log_dir, make):
    out = {}
    for ex in ("sequential", "vmap"):
        t = quiet_trainer(log_dir, rounds=2, clients_per_round=4, executor=ex)
        out[ex] = t.fit(WithOptimizer(make), tiny_data()).global_params.clone()
    assert torch.allclose(out["vmap"], out["sequential"], atol=1e-5)


def test_vmap_trains_every_client_on_the_sequential_executors_batches():
    # 2 local epochs of batch 4: two shuffles per client from its keyed DATA stream, all clients'
    # drawn together by vmap and client after client by client_batches: the same records in order
    from types import SimpleNamespace

    from dpfl_lightning import rng
    from dpfl_lightning.executor.vmap import VmapExecutor
    from dpfl_lightning.federated.plan import RoundPlan

    data = tiny_data()
    data.setup()
    random = rng.RandomSource(7)
    plan = RoundPlan(round_idx=3, cohort=[0, 1, 2], batch_size=4, local_epochs=2)
    clients = [0, 1, 2]
    n = data.client_num_samples(0)
    orders, bs, steps = VmapExecutor()._orders(SimpleNamespace(plan=plan, data=data, random=random), clients, n)
    x = data.in_memory_tensors[0]
    for j, c in enumerate(clients):
        batches = list(data.client_batches(c, 4, epochs=2, stream=random.stream(3, c, rng.DATA)))
        assert len(batches) == steps
        seq = torch.cat([b[0] for _, _, b in batches])
        vm = x[orders[j, : len(seq)]]
        assert torch.equal(seq, vm)


@pytest.mark.parametrize("model", [TiedWeights, AliasedLayer, TiedAndAliased])
def test_vmap_trains_shared_parameters_like_sequential_and_leaves_the_module_whole(log_dir, model):
    out = {}
    for ex in ("sequential", "vmap"):
        m = model()
        places = [(sub, attr, p) for sub in m.modules() for attr, p in sub._parameters.items()]
        # two rounds, then the evaluation, which runs the module itself
        out[ex] = quiet_trainer(log_dir, rounds=2, clients_per_round=4, executor=ex).fit(m, tiny_data()).global_params.clone()
        assert all(sub._parameters[attr] is p for sub, attr, p in places)  # its own parameters, still shared
    # a tied weight's gradient has both layers' parts
    assert torch.allclose(out["vmap"], out["sequential"], atol=1e-6)


def test_vmap_refuses_and_repairs_a_module_left_holding_tensors_from_the_vectorised_step(log_dir, monkeypatch):
    from dpfl_lightning.executor.vmap import VmapExecutor

    loss = VmapExecutor._loss

    def leaves_a_tensor(self, params, batch):
        out = loss(self, params, batch)
        self._step.inner.net[0]._parameters["weight"] = params["inner.net.0.weight"] * 1.0
        return out

    monkeypatch.setattr(VmapExecutor, "_loss", leaves_a_tensor)
    m = TinyClassifier()
    weight = m.net[0].weight
    with pytest.raises(ConfigError, match=r"other tensors than its parameters \['weight'\]"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor="vmap").fit(m, tiny_data())
    assert m.net[0].weight is weight
    monkeypatch.undo()
    quiet_trainer(log_dir, rounds=1, clients_per_round=2).fit(m, tiny_data())  # the module still trains


def test_vmap_refuses_a_training_step_that_stops_local_training(log_dir):
    class StopsEarly(TinyClassifier):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                self.trainer.should_stop = True
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor="vmap", batch_size=4)
    with pytest.raises(ConfigError, match="should_stop.*sequential"):
        trainer.fit(StopsEarly(), tiny_data())
    quiet_trainer(log_dir, rounds=1, clients_per_round=2, batch_size=4).fit(StopsEarly(), tiny_data())  # sequential: fine


def test_the_run_freezes_its_set_up_objects_for_the_gc_and_unfreezes_them_after(log_dir):
    import gc

    from dpfl_lightning.plugins.callback import FederatedCallback

    seen = []

    class Frozen(FederatedCallback):
        def before_round(self, *, plan, server):
            seen.append(gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    quiet_trainer(log_dir, rounds=2, clients_per_round=2, plugins=[Frozen()]).fit(TinyClassifier(), tiny_data())
    assert min(seen) > 10_000 and gc.get_freeze_count() == 0
    gc.freeze()  # a process that froze its own objects keeps them frozen
    try:
        before = gc.get_freeze_count()
        quiet_trainer(log_dir, rounds=1, clients_per_round=2).fit(TinyClassifier(), tiny_data())
        assert gc.get_freeze_count() >= 0.9 * before  # not unfrozen (a few of its objects may go)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("chunk_size, stage_rows, in_place", [(None, 64, 2), (2, 64, 6), (2, 3, 4), (4, 3, 2)])
def test_vmap_trains_in_the_trainers_rows_when_free_and_copies_otherwise(log_dir, monkeypatch, chunk_size, stage_rows,
                                                                          in_place):
    # A chunk that fits in the trainer's free staged rows trains in place there; one that does not
    # (a stage of 3 rows: the second chunk of 2, or a chunk of 4) writes each update as the
    # sequential executor does. Every client's update, before and after the plugins, and the model
    # are the bits of the copying path, and the run ends where the sequential executor ends.
    from dpfl_lightning.federated import aggregation
    from dpfl_lightning.federated.aggregation import PayloadAggregator
    from dpfl_lightning.executor.vmap import VmapExecutor
    from helpers import Recorder

    def run(executor):
        raw, done = Recorder(order=-10**6), Recorder(order=10**6)
        t = quiet_trainer(log_dir, rounds=2, clients_per_round=5, executor=executor,
                          plugins=[UpdateClipping(0.5), GaussianNoise(noise_multiplier=0.5, placement="local"), raw, done])
        if executor == "vmap":
            t.executor = VmapExecutor(chunk_size=chunk_size)
        params = t.fit(TinyClassifier(), tiny_data()).global_params.clone()
        return params, (raw.clients, raw.updates), (done.clients, done.updates)

    reference = run("sequential")[0]
    row_bytes = 4 * (reference.numel() + 64)  # the update and the few values of the other segments
    monkeypatch.setattr(aggregation, "STAGE_BYTES", stage_rows * row_bytes)
    blocks = []
    update_rows = PayloadAggregator.update_rows

    def counted(self, n):
        block = update_rows(self, n)
        blocks.append(block is not None)
        return block

    monkeypatch.setattr(PayloadAggregator, "update_rows", counted)
    params, raw, done = run("vmap")
    assert sum(blocks) == in_place  # chunks trained in place over the 2 rounds
    monkeypatch.setattr(PayloadAggregator, "update_rows", lambda self, n: None)
    copied = run("vmap")
    assert torch.equal(params, copied[0])
    for ours, theirs in ((raw, copied[1]), (done, copied[2])):  # (clients, updates) in finishing order
        assert ours[0] == theirs[0] and all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))
    assert torch.allclose(params, reference, atol=1e-6)


class ScalesByABuffer(TinyClassifier):  # a constant buffer (a normalization, a positional encoding)
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 10))

    def forward(self, x):
        return self.net(x * self.scale)


class CountsSteps(ScalesByABuffer):  # writes its buffer, from the step ``first`` on
    first = 0

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        if batch_idx >= self.first:
            self.steps += 1
        return super().training_step(batch, batch_idx)


class CountsFromTheSecondStep(CountsSteps):
    first = 1


class ReplacesItsBuffer(ScalesByABuffer):  # from the step ``first`` on, with a constant or with the batch's mean
    first, from_batch = 0, False

    def training_step(self, batch, batch_idx):
        if batch_idx >= self.first:
            self.scale = batch[0].mean(0) if self.from_batch else self.scale * 0.9
        return super().training_step(batch, batch_idx)


class ReplacesFromTheSecondStep(ReplacesItsBuffer):
    first = 1


class StoresTheBatchMean(ReplacesItsBuffer):
    from_batch = True


class StoresTheBatchMeanFromTheSecondStep(ReplacesItsBuffer):
    first, from_batch = 1, True


def test_vmap_runs_a_module_with_constant_buffers_like_sequential(log_dir):
    out = {}
    for ex in ("sequential", "vmap"):
        out[ex] = quiet_trainer(log_dir, rounds=2, clients_per_round=4, executor=ex).fit(
            ScalesByABuffer(), tiny_data()).global_params.clone()
    assert torch.allclose(out["vmap"], out["sequential"], atol=1e-6)
    # the buffer matters: without it the model trains elsewhere
    plain = quiet_trainer(log_dir, rounds=2, clients_per_round=4, executor="vmap").fit(TinyClassifier(), tiny_data())
    assert not torch.allclose(plain.global_params, out["vmap"], atol=1e-3)


@pytest.mark.parametrize("model", [CountsSteps, CountsFromTheSecondStep, ReplacesItsBuffer, ReplacesFromTheSecondStep,
                                   StoresTheBatchMean, StoresTheBatchMeanFromTheSecondStep])
def test_vmap_refuses_a_training_step_that_changes_a_buffer_and_leaves_the_module_whole(log_dir, model):
    # at set-up when the first step changes it; else at the step that does (batch size 4 of 12: 3 steps)
    m = model()
    buffers = dict(m.named_buffers())
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor="vmap")
    says = r"changes a buffer or another tensor of the module in place" if issubclass(model, CountsSteps) else \
        rf"training_step changes the buffers \['{model.__name__}.scale'\]"
    with pytest.raises(ConfigError, match=says):
        trainer.fit(m, tiny_data())
    assert trainer.round_times == []  # no round finished
    assert all(b is buffers[name] for name, b in m.named_buffers())  # its own buffers, nothing from inside vmap
    quiet_trainer(log_dir, rounds=1, clients_per_round=2).fit(m, tiny_data())  # the sequential executor runs it


class SkipsOddBatches(TinyClassifier):  # returning None skips a step (sequential runs it, see test_lightning_compat)
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


def test_vmap_refuses_a_training_step_that_skips_a_step_naming_the_batch(log_dir):
    with pytest.raises(ConfigError, match="training_step returned None at batch 1, which skips the step"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor="vmap").fit(SkipsOddBatches(), tiny_data())
