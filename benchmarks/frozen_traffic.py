"""Traffic and round time of a LoRA-like model: a client with frozen parameters sends and sums the
trainable entries of its update only, against the same run sending every entry (zeros at the frozen
ones, as before: the aggregator's ``restrict`` made a no-op).

The model of issue 28: a frozen base of two 256x256 linear layers and a 256x10 head without bias
(134,144 entries) with rank-2 adapters on the two layers (2,048 entries): 136,192 in all. DP-FedAvg
round: 20 of 100 clients, 1 local epoch of batch 10 on 20 samples, SGD lr 0.1, clipping at 1.0,
central Gaussian noise (multiplier 1.0), sequential executor, one process (under ``mpiexec -n 2``
the all-reduce itself also shrinks 66-fold). Reports the entries of every all-reduce, the median
round after a warm-up, the aggregator's part of a round alone (take, clip, fold, reduce: what the
change saves; the round time is dominated by local training through the frozen base), and its
per-client gather and per-round scatter.

    python benchmarks/frozen_traffic.py [--rounds 10] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from dpfl_lightning import FederatedTrainer
from dpfl_lightning.federated.aggregation import PayloadAggregator
from dpfl_lightning.algorithms import DPFedAvg
from dpfl_lightning.comm import LocalCommunicator
from dpfl_lightning.data import SyntheticLogistic
from dpfl_lightning.federated.payload import PayloadLayout, Segment


class LoRALinear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(fan_in, fan_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, fan_in) * 0.05)
        self.b = nn.Parameter(torch.zeros(fan_out, rank))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class LoRANet(L.LightningModule):
    def __init__(self, width: int = 256, rank: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = LoRALinear(width, width, rank), LoRALinear(width, width, rank)
        self.head = nn.Linear(width, 10, bias=False)
        self.head.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.l2(torch.relu(self.l1(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Counting(LocalCommunicator):
    def __init__(self) -> None:
        self.entries: list[int] = []

    def allreduce_sum_(self, tensor):
        self.entries.append(tensor.numel())
        return tensor


@contextlib.contextmanager
def every_entry_sent():
    """The run as before the change: the rows hold every entry, zero at the frozen ones."""
    restrict = PayloadAggregator.restrict
    PayloadAggregator.restrict = lambda self, trainable: None
    try:
        yield
    finally:
        PayloadAggregator.restrict = restrict


def one_run(rounds: int, threads: int, full: bool) -> tuple[list[int], float, int, int]:
    model = LoRANet()
    d = sum(p.numel() for p in model.parameters())
    d_t = sum(p.numel() for p in model.parameters() if p.requires_grad)
    data = SyntheticLogistic(num_clients=100, samples_per_client=20, test_samples_per_client=2, dim=256, seed=0)
    comm = Counting()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = FederatedTrainer(log_dir=tmp, rounds=rounds, clients_per_round=20, batch_size=10, seed=0,
                                   num_threads=threads, enable_progress_bar=False, enable_summary=False,
                                   algorithm=DPFedAvg(clip=1.0, noise_multiplier=1.0), eval_every=10**6)
        trainer.comm = comm
        with every_entry_sent() if full else contextlib.nullcontext():
            trainer.fit(model, data)
    return comm.entries, statistics.median(trainer.round_times[2:]), d, d_t


def gather_scatter_us(threads: int) -> tuple[float, float]:
    """The aggregator's extra work with frozen parameters: gathering one client's trainable
    entries, and writing the round's sum back at full length (microseconds)."""
    torch.set_num_threads(threads)
    mask = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in LoRANet().parameters()])
    index = mask.nonzero().squeeze(1)
    d, d_t = mask.numel(), index.numel()
    update, row = torch.randn(d), torch.empty(d_t)
    full, total = torch.zeros(d, dtype=torch.float64), torch.randn(d_t, dtype=torch.float64)
    out = []
    for f in (lambda: torch.index_select(update, 0, index, out=row), lambda: full.zero_().index_copy_(0, index, total)):
        for _ in range(100):
            f()
        t0 = time.perf_counter()
        for _ in range(2000):
            f()
        out.append((time.perf_counter() - t0) / 2000 * 1e6)
    return out[0], out[1]


def aggregation_ms(threads: int, restricted: bool, clients: int = 20, repeats: int = 30) -> float:
    """The aggregator's part of a round alone (median ms): every client's update taken into its row,
    clipped to norm 1, folded; the exact all-reduce (one process) and the sums read back."""
    torch.set_num_threads(threads)
    mask = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in LoRANet().parameters()])
    layout = PayloadLayout([Segment("update", mask.numel()), Segment("nonfinite", 1, "control")])
    agg = PayloadAggregator(layout, torch.device("cpu"))
    update = torch.randn(mask.numel()) * mask  # zero at the frozen entries, as the executor leaves them
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        agg.start(clients, {"update": 1.0, "nonfinite": 1.0})
        agg.restrict(mask if restricted else None)
        for _ in range(clients):
            agg.take(update)
            row = agg.client_views()["update"]
            row.mul_(1.0 / max(float(torch.linalg.vector_norm(row)), 1.0))
            agg.fold()
        agg.reduce(LocalCommunicator())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    sent: dict[bool, list[int]] = {}
    for _ in range(args.repeats):  # alternated: the machine's drift hits both alike
        for full in (True, False):
            entries, median, d, d_t = one_run(args.rounds, args.threads, full)
            times[full].append(median)
            sent[full] = entries
    print(f"model: {d:,} parameters, {d_t:,} trainable ({d / d_t:.1f}x fewer)")
    for full, label in ((True, "every entry sent (before)"), (False, "trainable entries only")):
        entries = sent[full]
        print(f"{label:28s} all-reduce entries {entries[0]:>8,}   median round "
              f"{statistics.median(times[full]) * 1e3:7.1f} ms  (repeats: "
              + ", ".join(f"{t * 1e3:.1f}" for t in times[full]) + ")")
    full_ms, part_ms = aggregation_ms(args.threads, False), aggregation_ms(args.threads, True)
    print(f"aggregation alone, 20 clients: every entry {full_ms:.2f} ms, trainable entries {part_ms:.2f} ms a round")
    g, s = gather_scatter_us(args.threads)
    print(f"gather of one client's trainable entries {g:.1f} us; scatter of the round's sum {s:.1f} us")


if __name__ == "__main__":
    main()
