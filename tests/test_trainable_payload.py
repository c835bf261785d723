"""A client with frozen parameters sends and sums the trainable part of its update only: for a
LoRA-like model (a frozen base, a small adapter) the all-reduce of a private run carries the adapter's entries, the
trained model is the one a run that sends zeros for the frozen entries reaches, the noise falls on
the trainable entries only, and a layer unfrozen between rounds joins the payload."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning as L
from dpfl_lightning import ConfigError
from dpfl_lightning.federated.aggregation import PayloadAggregator
from dpfl_lightning.algorithms import DPFedAvg
from dpfl_lightning.comm import LocalCommunicator
from dpfl_lightning.federated.payload import PayloadLayout, Segment
from dpfl_lightning.plugins import SCAFFOLD, GaussianNoise, ScaffNew, ServerOptimizer, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import quiet_trainer, tiny_data


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable rank-``r`` adapter ``B A``."""

    def __init__(self, fan_in: int, fan_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(fan_in, fan_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, fan_in) * 0.1)
        self.b = nn.Parameter(torch.randn(fan_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class LoRANet(L.LightningModule):
    """A frozen base (two linear layers and a head) with adapters on the first two layers."""

    def __init__(self, width: int = 32, frozen: bool = True, lr: float = 0.1):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = LoRALinear(10, width), LoRALinear(width, width)
        self.head = nn.Linear(width, 10)
        self.head.requires_grad_(False)
        self.lr = lr
        if not frozen:  # the same entries trainable, but never moved: the zeros a frozen run would send
            for p in self.base_parameters():
                p.requires_grad_(True)
                p.register_hook(torch.zeros_like)

    def base_parameters(self):
        return [*self.l1.base.parameters(), *self.l2.base.parameters(), *self.head.parameters()]

    def forward(self, x):
        return self.head(torch.relu(self.l2(torch.relu(self.l1(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def adapter_count(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.endswith((".a", ".b")))


class RecordingComm(LocalCommunicator):
    """What every all-reduce receives (its number of entries)."""

    def __init__(self):
        self.sums: list[int] = []

    def allreduce_sum_(self, tensor):
        self.sums.append(tensor.numel())
        return tensor


def _fit(log_dir, model, rounds=3, comm=None, **kw):
    kw.setdefault("clients_per_round", 5)
    trainer = quiet_trainer(log_dir, rounds=rounds, seed=0, **kw)
    if comm is not None:
        trainer.comm = comm
    trainer.fit(model, tiny_data(num_clients=10))
    return trainer


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def test_the_all_reduce_carries_the_adapter_entries_only(log_dir):
    model = LoRANet()
    comm = RecordingComm()
    trainer = _fit(log_dir, model, comm=comm, algorithm=DPFedAvg(clip=0.5, noise_multiplier=0.5))
    d, layout = sum(p.numel() for p in model.parameters()), trainer.run.layout
    extras = layout.size - layout.segment("update").size  # the payload's scalars (the non-finite flag)
    assert layout.segment("update").size == d == 1950
    assert adapter_count(model) == 2 * (10 + 32) + 2 * (32 + 32) == 212
    assert comm.sums == [adapter_count(model) + extras] * 3  # one all-reduce a round, of the adapter and scalars


@pytest.mark.parametrize("plugins", [
    lambda: [],
    lambda: [UpdateClipping(0.3), ServerOptimizer("sgd", lr=1.0, momentum=0.9)],
    lambda: [ServerOptimizer("adam", lr=0.05)],
    lambda: [SCAFFOLD()],
    lambda: [UpdateClipping(0.5), ScaffNew(p=0.5)],
], ids=["fedavg", "clip_momentum", "adam", "scaffold", "scaffnew"])
def test_the_trained_model_is_the_one_sending_zeros_for_frozen_entries_reaches(log_dir, plugins):
    # the reference: the base trainable but never moved (its gradients zeroed), so its update is
    # zero and is sent, clipped, summed and stepped as a full-length vector
    sampling = {"clients_per_round": None} if any(isinstance(p, ScaffNew) for p in plugins()) else {}
    frozen = LoRANet()
    base = _flat(frozen.base_parameters())
    sent_f, sent_r = RecordingComm(), RecordingComm()
    _fit(log_dir, frozen, comm=sent_f, plugins=plugins(), **sampling)
    reference = LoRANet(frozen=False)
    _fit(log_dir, reference, comm=sent_r, plugins=plugins(), **sampling)
    # a run without DP sends the whole update, zeros at frozen entries (a layer the module unfreezes
    # during local training then trains in that round, as under lightning.Trainer: test_lightning_oracle)
    assert sent_f.sums == sent_r.sums
    assert torch.equal(_flat(frozen.base_parameters()), base)  # bit-identical
    assert torch.equal(_flat(reference.base_parameters()), base)
    for (name, p), q in zip(frozen.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name  # the same model to float rounding
    assert not torch.allclose(_flat([frozen.l1.a]), _flat([LoRANet().l1.a]))  # the adapter trained


class _AfterNoise(FederatedCallback):
    order = 300

    def __init__(self):
        self.updates, self.sums = [], []

    def on_client_end(self, *, client) -> None:
        self.updates.append(client.payload["update"].detach().clone())

    def on_aggregate(self, *, server) -> None:
        self.sums.append(server.aggregate["update"].detach().clone())


@pytest.mark.parametrize("placement", ["local", "central"])
def test_noise_falls_on_the_trainable_entries_only_with_its_std(log_dir, placement):
    # clients that do not move (lr 0) send zero updates: what arrives is the noise alone
    seen = _AfterNoise()
    model = LoRANet(width=64, lr=0.0)
    C, z, n = 1.0, 2.0, 5
    _fit(log_dir, model, rounds=2, plugins=[UpdateClipping(C), GaussianNoise(noise_multiplier=z, placement=placement),
                                            seen])
    trainable = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in model.parameters()])
    assert int(trainable.sum()) == adapter_count(model) == 2 * (10 + 64) + 2 * (64 + 64)
    for u in seen.updates:
        assert u.numel() == adapter_count(model)  # the payload: the adapter's entries
    std = z * C * (n**0.5 if placement == "local" else 1.0)  # local: the sum of n clients' noise
    for s in seen.sums:  # the server reads the sum at full length
        assert s.numel() == trainable.numel()
        assert torch.count_nonzero(s[~trainable]) == 0
        assert torch.count_nonzero(s[trainable]) == int(trainable.sum())
        assert 0.85 * std < float(s[trainable].std()) < 1.15 * std


class UnfreezeAt(LoRANet):
    """The base of the first layer joins training in round ``at`` (gradual unfreezing)."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_train_epoch_start(self):
        if self.current_epoch >= self.at:
            self.l1.base.requires_grad_(True)


def test_a_layer_unfrozen_between_rounds_joins_the_payload(log_dir):
    model, comm = UnfreezeAt(2), RecordingComm()
    before = _flat(model.l1.base.parameters())
    _fit(log_dir, model, rounds=4, comm=comm, algorithm=DPFedAvg(clip=0.5, noise_multiplier=0.5))
    base1 = sum(p.numel() for p in model.l1.base.parameters())
    extras = comm.sums[0] - adapter_count(model)
    # unfrozen during round 2 (by the module's hook), so part of the update from round 3 on
    assert comm.sums == [adapter_count(model) + extras] * 3 + [adapter_count(model) + base1 + extras]
    assert not torch.equal(_flat(model.l1.base.parameters()), before)


def test_the_aggregator_gathers_the_trainable_entries_and_sums_them_at_full_length():
    layout = PayloadLayout([Segment("update", 6), Segment("n", 1, "data")])
    agg = PayloadAggregator(layout, torch.device("cpu"))
    agg.start(2, {"update": 10.0, "n": 1.0})
    mask = torch.tensor([False, True, True, False, False, True])
    agg.restrict(mask)  # after start: the round is laid out again
    assert agg.layout.size == 4 and agg.update_rows(1) is None  # executors write full updates; take gathers
    for k in range(2):
        agg.take(torch.arange(6.0) + 10 * k)
        agg.client_views()["n"].fill_(1.0)
        agg.fold()
    with pytest.raises(RuntimeError, match="already taken"):
        agg.restrict(None)
    sent = RecordingComm()
    sums = agg.reduce(sent)
    assert sent.sums == [4]
    assert sums["update"].tolist() == [0.0, 12.0, 14.0, 0.0, 0.0, 20.0] and sums["n"].item() == 2.0
    agg.restrict(None)  # every parameter trainable again: full rows, executors may train into them
    agg.start(1, {"update": 10.0, "n": 1.0})
    assert agg.layout is layout and agg.update_rows(1).shape == (1, 6)
    with pytest.raises(ConfigError, match="every parameter frozen"):
        agg.restrict(torch.zeros(6, dtype=torch.bool))
