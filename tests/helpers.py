"""Small models, data and trainers shared by the tests."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from dpfl_lightning import FederatedTrainer
from dpfl_lightning.data import FederatedDataModule, SyntheticLogistic
from dpfl_lightning.plugins.callback import FederatedCallback


class TinyClassifier(L.LightningModule):
    """An ordinary LightningModule, written as a user would."""

    def __init__(self, in_features: int = 10, num_classes: int = 10, lr: float = 0.1, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, num_classes))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("my_train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("my_val_loss", F.cross_entropy(logits, y))
        self.log("my_val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TiedWeights(TinyClassifier):  # one parameter in two layers (as an embedding and its output layer)
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10))
        self.net[2].weight = self.net[0].weight


class AliasedLayer(TinyClassifier):  # one layer under two names
    def __init__(self):
        super().__init__()
        self.head = self.net[2]


class TiedAndAliased(TinyClassifier):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)
        self.b.weight = self.a.weight
        self.net = torch.nn.Sequential(self.a, torch.nn.ReLU(), self.b)


class _ScaledLinear(nn.Module):  # a parameter of its own and a child: Opacus takes it whole (functorch)
    def __init__(self, a: int, b: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(b))
        self.lin = nn.Linear(a, b)

    def forward(self, x):
        return self.lin(x) * self.scale


class AliasedInsideAWholeLayer(TinyClassifier):  # a child of such a layer, also under a second name
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(_ScaledLinear(10, 16), nn.ReLU(), nn.Linear(16, 10))
        self.first = self.net[0].lin


class PositionalEmbedding(TinyClassifier):
    """GPT-2's input layer in miniature: token embeddings plus a learned position embedding ``pos``
    on position ids ``arange(T)``, then a linear head on the mean over positions. ``positions``:
    ``"shared"``, the ids of shape ``(1, T)`` that the batch shares (GPT-2's default); ``"expanded"``,
    the same ids expanded to ``(B, T)``; ``"mixed"``, the shared ids and ``pos`` run again on
    per-record ids (the record's tokens); ``"flattened"``, expanded ids and the head run on the
    ``B * T`` positions as rows (tokens as records)."""

    def __init__(self, positions: str = "shared", length: int = 5, vocab: int = 10, d: int = 8):
        super().__init__()
        del self.net
        torch.manual_seed(0)
        self.positions, self.length, self.vocab = positions, length, vocab
        self.tok, self.pos, self.head = nn.Embedding(vocab, d), nn.Embedding(length, d), nn.Linear(d, 10)

    def forward(self, x):
        tokens = (x[:, : self.length].abs() * 3).long().clamp(max=self.vocab - 1)  # (B, T) of 10 "tokens"
        B, T = tokens.shape
        ids = torch.arange(T, device=x.device)[None]
        if self.positions in ("expanded", "flattened"):
            ids = ids.expand(B, T)
        h = torch.tanh(self.tok(tokens) + self.pos(ids))
        if self.positions == "mixed":
            h = h + self.pos(tokens.clamp(max=T - 1))
        if self.positions == "flattened":
            return self.head(h.reshape(B * T, -1)).view(B, T, -1).mean(1)
        return self.head(h.mean(1))


class ExpandedPositions(PositionalEmbedding):
    def __init__(self):
        super().__init__("expanded")


def tiny_data(num_clients: int = 20, samples: int = 12, dim: int = 10, seed: int = 0, **kw) -> SyntheticLogistic:
    return SyntheticLogistic(num_clients=num_clients, samples_per_client=samples, test_samples_per_client=4,
                             dim=dim, seed=seed, **kw)


def quiet_trainer(log_dir: str, **kw) -> FederatedTrainer:
    kw.setdefault("num_threads", 1)
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("enable_summary", False)
    kw.setdefault("batch_size", 4)
    return FederatedTrainer(log_dir=log_dir, **kw)


class Recorder(FederatedCallback):
    """Records every client's update as the plugins before it left it (place it with ``order``)."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.updates: list[torch.Tensor] = []
        self.clients: list[int] = []
        self.aggregates: list[torch.Tensor] = []

    def on_client_end(self, *, client) -> None:
        self.updates.append(client.update.detach().clone())
        self.clients.append(client.client)

    def on_aggregate(self, *, server) -> None:
        self.aggregates.append(server.aggregate.update_sum.detach().clone())


def torch_lrs(make_scheduler, steps: int, lr: float = 0.1) -> list[float]:
    """The lr of each of ``steps`` consecutive optimizer steps of one plain torch run, whose
    scheduler ``make_scheduler(optimizer)`` builds: the reference a federated schedule is held to."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def record_client_secrets(monkeypatch) -> list:
    """The SecAgg client secrets every ``ClientSecrets`` made from now on (appended as they are made)."""
    from dpfl_lightning.comm import secagg

    made = []
    init = secagg.ClientSecrets.__init__

    def recording_init(self, client, round_idx, key_source):
        init(self, client, round_idx, key_source)
        made.append(self)

    monkeypatch.setattr(secagg.ClientSecrets, "__init__", recording_init)
    return made


def neighbouring_data(change: str | None, num_clients: int, records: int, marker_at: int = 2) -> FederatedDataModule:
    """``num_clients`` clients of ``records`` records (10 features, 10 classes; a fixed test set of 12);
    ``change`` alters client 3's: ``"marker"`` (record ``marker_at`` set to 1000), ``"huge"`` (record 1
    times 1e4) or ``"fewer"`` (its first 6 records only), for the neighbouring-dataset attacks."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(num_clients * records, 10, generator=g), torch.arange(num_clients * records) % 10
    gt = torch.Generator().manual_seed(1)
    xt, yt = torch.randn(12, 10, generator=gt), torch.arange(12) % 10
    clients = [list(range(c * records, (c + 1) * records)) for c in range(num_clients)]
    if change == "marker":
        x[clients[3][marker_at]] = 1000.0
    elif change == "huge":
        x[clients[3][1]] *= 1e4
    elif change == "fewer":
        clients[3] = clients[3][:6]
    return FederatedDataModule.from_tensors(x, y, xt, yt, client_indices=clients)


def exact_gaussian_epsilon(zs, delta: float) -> float:
    """Independently of the package: the exact epsilon of Gaussian mechanisms of multipliers ``zs``
    composed (one Gaussian of multiplier ``(sum z^-2)^(-1/2)``), the root of Balle & Wang's (2018,
    Thm 8) ``delta(eps) = Phi(1/(2z) - eps z) - e^eps Phi(-1/(2z) - eps z)``, with scipy's normal cdf."""
    import math

    from scipy import optimize
    from scipy.stats import norm

    z = sum(float(x) ** -2 for x in zs) ** -0.5

    def excess(eps):
        return norm.cdf(0.5 / z - eps * z) - math.exp(eps) * norm.cdf(-0.5 / z - eps * z) - delta

    if excess(0.0) <= 0:
        return 0.0
    return optimize.brentq(excess, 0.0, 200.0, xtol=1e-14)
