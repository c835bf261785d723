"""Seconds per round: the framework against minimal hand-written PyTorch loops, in one table.

The DP-FedAvg round of the performance issue: sample 50 of 1000 clients (uniform without
replacement), 1 local epoch of batch 10 on 50 samples per client, SGD lr 0.1, update clipping at
1.0, central Gaussian noise with multiplier 1.0.

- W1: MLP 60-200-10 (14k parameters) on synthetic 10-class data (paper 001's generator, d = 60);
- W2: CNN conv5-32, pool, conv5-64, pool, fc 1600-512-10 (0.88M parameters) on 3x32x32 inputs.

Rows: the hand-written loop (sample, copy the global weights in, a fresh SGD per client, shuffled
batches, the update, clipping, summing, one noise draw, the global step); the same loop with the
SGD step written out (no ``torch.optim`` bookkeeping, which the framework skips for plain SGD too:
the fairest baseline for the per-step overhead); the framework with one
rank; the framework with two MPI ranks (``mpiexec -n 2``, launched by this script, each rank with
at most half the cores as threads; the hand loop is one process); the vectorised executor
(``executor="vmap"``); a hand-written ``torch.func.vmap`` loop. Every other process uses
``--threads`` torch threads. Rounds after a warm-up; the table reports the median round and its
ratio to the hand-written loop of the same workload, measured in the same run.

``--interleave`` adds rows where each 1-rank framework round (sequential and vmap) is followed, in
the same process, by a round of the matching hand-written loop, and reports the median of the
per-round ratios: the machine's drift hits both alike.

    python benchmarks/round_overhead.py [--rounds 12] [--threads 1] [--workloads W1,W2] [--repeats 3] [--interleave]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import lightning as L
from dpfl_lightning import FederatedTrainer
from dpfl_lightning.data import SyntheticLogistic
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.federated.placement import available_cpus
from dpfl_lightning import FederatedDataModule

M, M_ROUND, SAMPLES, BATCH, LR, CLIP, Z = 1000, 50, 50, 10, 0.1, 1.0, 1.0


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(60, 200), nn.ReLU(), nn.Linear(200, 10))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 512), nn.ReLU(), nn.Linear(512, 10))


NETS = {"W1": mlp, "W2": cnn}


class Classifier(L.LightningModule):
    """What a user writes: the net, cross-entropy, SGD."""

    def __init__(self, workload: str = "W1"):
        super().__init__()
        torch.manual_seed(0)
        self.net = NETS[workload]()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def make_data(workload: str) -> FederatedDataModule:
    if workload == "W1":
        data = SyntheticLogistic(num_clients=M, samples_per_client=SAMPLES, test_samples_per_client=0, dim=60)
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(M * SAMPLES, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (M * SAMPLES,), generator=g)
        data = FederatedDataModule.from_tensors(x, y, client_indices=[range(c * SAMPLES, (c + 1) * SAMPLES)
                                                                      for c in range(M)])
    data.setup()
    return data


@torch.no_grad()
def clip_and_add(total: list[torch.Tensor], params: list[torch.Tensor], global_w: list[torch.Tensor], clip: float) -> None:
    """The hand loops' client update: ``local - global``, clipped to norm ``clip``, added to ``total``."""
    delta = [p - w for p, w in zip(params, global_w)]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in delta]))
    factor = min(1.0, clip / max(float(norm), 1e-12))
    for t, d in zip(total, delta):
        t.add_(d, alpha=factor)


def hand_written_rounds(data, workload: str, rounds: int, seed: int, inline_sgd: bool = False) -> list[float]:
    loop = hand_loop(data, workload, seed, inline_sgd)
    return [next(loop) for _ in range(rounds)]


def hand_loop(data, workload: str, seed: int, inline_sgd: bool = False) -> Iterator[float]:
    """The hand-written rounds, one per ``next()``, each returning its seconds. ``inline_sgd``: the
    SGD step written out (``grad = None``, backward, ``p -= lr * grad``) instead of
    ``torch.optim.SGD``'s ``zero_grad`` and ``step``, which the framework also skips for plain SGD."""
    x, y = data.in_memory_tensors
    client_idx = data._train_idx
    torch.manual_seed(seed)
    net = NETS[workload]()
    params = list(net.parameters())
    global_w = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(seed)
    while True:
        t0 = time.perf_counter()
        cohort = torch.randperm(M, generator=g)[:M_ROUND].tolist()
        total = [torch.zeros_like(w) for w in global_w]
        for c in cohort:
            with torch.no_grad():
                for p, w in zip(params, global_w):
                    p.copy_(w)
            opt = None if inline_sgd else torch.optim.SGD(params, lr=LR)
            idx = client_idx[c][torch.randperm(SAMPLES, generator=g)]
            for i in range(0, SAMPLES, BATCH):
                sel = idx[i : i + BATCH]
                loss = F.cross_entropy(net(x[sel]), y[sel])
                if opt is None:
                    for p in params:
                        p.grad = None
                    loss.backward()
                    with torch.no_grad():
                        for p in params:
                            p.add_(p.grad, alpha=-LR)
                else:
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            clip_and_add(total, params, global_w, CLIP)
        with torch.no_grad():
            for w, t in zip(global_w, total):
                w.add_((t + Z * CLIP * torch.randn(t.shape, generator=g)) / M_ROUND)
        yield time.perf_counter() - t0


def hand_written_vmap_rounds(data, workload: str, rounds: int, seed: int) -> list[float]:
    loop = hand_vmap_loop(data, workload, seed)
    return [next(loop) for _ in range(rounds)]


def hand_vmap_loop(data, workload: str, seed: int) -> Iterator[float]:
    """The same round with the cohort trained together: ``vmap(grad)`` over stacked parameters."""
    x, y = data.in_memory_tensors
    client_idx = torch.stack(data._train_idx)
    torch.manual_seed(seed)
    net = NETS[workload]()
    names = [n for n, _ in net.named_parameters()]
    global_w = {n: p.detach().clone() for n, p in net.named_parameters()}

    def loss(params, xb, yb):
        return F.cross_entropy(torch.func.functional_call(net, params, (xb,)), yb)

    grad = torch.func.vmap(torch.func.grad(loss))
    g = torch.Generator().manual_seed(seed)
    while True:
        t0 = time.perf_counter()
        cohort = torch.randperm(M, generator=g)[:M_ROUND]
        params = {n: w.unsqueeze(0).repeat(M_ROUND, *([1] * w.dim())) for n, w in global_w.items()}
        order = torch.argsort(torch.rand(M_ROUND, SAMPLES, generator=g), dim=1)
        idx = torch.gather(client_idx[cohort], 1, order)
        for i in range(0, SAMPLES, BATCH):
            sel = idx[:, i : i + BATCH]
            grads = grad(params, x[sel], y[sel])
            for n in names:
                params[n].sub_(grads[n], alpha=LR)
        with torch.no_grad():
            delta = {n: params[n] - global_w[n].unsqueeze(0) for n in names}
            norms = torch.sqrt(sum((delta[n].reshape(M_ROUND, -1) ** 2).sum(1) for n in names))
            factor = torch.clamp(CLIP / norms.clamp_min(1e-12), max=1.0)
            for n in names:
                s = (delta[n] * factor.view(-1, *([1] * (delta[n].dim() - 1)))).sum(0)
                global_w[n].add_((s + Z * CLIP * torch.randn(s.shape, generator=g)) / M_ROUND)
        yield time.perf_counter() - t0


class Interleaved(FederatedCallback):
    """Runs one round of a hand-written loop after every framework round (the last plugin), so the
    two are timed back to back on the same machine state."""

    order = 10**6

    def __init__(self, loop: Iterator[float]) -> None:
        self.loop, self.times = loop, []

    def on_round_end(self, *, server, metrics) -> None:
        self.times.append(next(self.loop))


def interleaved_ratios(data, workload: str, rounds: int, executor: str = "sequential",
                       inline_sgd: bool = False) -> tuple[float, float, list[float]]:
    """Median seconds of the framework's rounds and of the hand loop's rounds run right after each,
    and every round's ratio (the first rounds and the last, which evaluates, left out)."""
    loop = hand_vmap_loop(data, workload, 0) if executor == "vmap" else hand_loop(data, workload, 0, inline_sgd)
    hand = Interleaved(loop)
    fw = framework_rounds(data, workload, rounds + 3, 0, executor, plugins=[hand])  # minus the last round
    own = [f - h for f, h in zip(fw, hand.times)][2:]  # a round's time includes the hand round after it
    ratios = [f / h for f, h in zip(own, hand.times[2:])]
    return statistics.median(own), statistics.median(hand.times[2:]), ratios


CHOICES: dict[tuple[str, str], str] = {}  # (workload, executor) -> what trained the clients (auto's choice)


def framework_rounds(data, workload: str, rounds: int, seed: int, executor: str = "sequential",
                     communicator: str = "auto", plugins: list | None = None) -> list[float]:
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=M_ROUND, local_epochs=1, batch_size=BATCH,
                               plugins=[UpdateClipping(CLIP), GaussianNoise(noise_multiplier=Z, placement="central")]
                               + list(plugins or []),
                               eval_every=10**9, seed=seed, log_dir=tempfile.mkdtemp(), enable_progress_bar=False,
                               enable_summary=False, executor=executor, communicator=communicator,
                               num_threads=torch.get_num_threads())
    trainer.fit(Classifier(workload), data)
    CHOICES[(workload, executor)] = getattr(trainer.executor, "choice", trainer.executor.name)
    return trainer.round_times[:-1]  # the last round also evaluates


def two_ranks(workload: str, rounds: int, threads: int) -> float:
    """Median round of the framework under ``mpiexec -n 2`` (one process per rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", os.path.abspath(__file__), "--worker", workload,
           "--rounds", str(rounds), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["median"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", type=str, default="W1,W2")
    ap.add_argument("--repeats", type=int, default=1, help="measure every row this many times, in turn")
    ap.add_argument("--interleave", action="store_true",
                    help="also time every 1-rank framework round against a hand round run right after it")
    ap.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:  # one rank of the two-rank row
        times = framework_rounds(make_data(args.worker), args.worker, args.rounds + 1, 0)[1:]
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps({"median": statistics.median(times)}))
        return
    print(f"DP-FedAvg round: {M_ROUND} of {M} clients x {SAMPLES} samples, 1 epoch of batch {BATCH}, clip {CLIP}, "
          f"central z={Z}; torch {torch.__version__}, {args.threads} thread(s) per process, median of {args.rounds} rounds")
    if args.repeats > 1:
        print(f"every row measured {args.repeats} times in turn; s/round and ratio are medians over the repeats "
              "(each ratio against the hand loop of the same repeat), range: the ratios' min-max")
    print(f"{'workload':<9}{'row':<34}{'s/round':>10}{'x hand loop':>13}" + (f"{'range':>16}" if args.repeats > 1 else ""))
    for workload in args.workloads.split(","):
        data = make_data(workload)
        hand_written_rounds(data, workload, 1, 99)  # warm-up
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeats):  # rows in turn, so a slower stretch of the machine hits every row
            for name, t in one_pass(data, workload, args.rounds, args.threads).items():
                runs.setdefault(name, []).append(t)
        base = runs["hand-written loop"]
        for name, ts in runs.items():
            ratios = [t / b for t, b in zip(ts, base)]
            line = f"{workload:<9}{name:<34}{statistics.median(ts):>10.4f}{statistics.median(ratios):>13.3f}"
            if args.repeats > 1:
                line += f"{min(ratios):>8.3f}-{max(ratios):.3f}"
            print(line)
        if args.interleave:
            print_interleaved(data, workload, args.rounds)


def print_interleaved(data, workload: str, rounds: int) -> None:
    """Rows where each framework round is followed by a hand round (ratio: the median over rounds,
    range: the middle half of the rounds' ratios): a drifting machine slows both alike."""
    names = {("sequential", False): "dpfl 1 rank : hand, interleaved",
             ("sequential", True): "dpfl 1 rank : hand inline SGD, intl.",
             ("vmap", False): "dpfl vmap : hand vmap, interleaved",
             ("auto", False): "dpfl auto : hand, interleaved"}
    for (executor, inline_sgd), name in names.items():
        try:
            fw, hand, ratios = interleaved_ratios(data, workload, rounds, executor, inline_sgd)
        except Exception as exc:  # noqa: BLE001 - the table says why
            print(f"{workload:<9}{executor}, interleaved: refused ({type(exc).__name__})")
            continue
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"{workload:<9}{name:<34}{fw:>10.4f}{statistics.median(ratios):>13.3f}{q1:>8.3f}-{q3:.3f}"
              f"   (hand {hand:.4f} s)" + (f"  auto chose: {CHOICES[(workload, 'auto')]}" if executor == "auto" else ""))


def one_pass(data, workload: str, rounds: int, threads: int) -> dict[str, float]:
    """Every row once: the median seconds per round of each."""
    rows = {}
    rows["hand-written loop"] = statistics.median(hand_written_rounds(data, workload, rounds, 0))
    rows["hand loop, SGD step inline"] = statistics.median(hand_written_rounds(data, workload, rounds, 0, inline_sgd=True))
    rows["dpfl_lightning, 1 rank"] = statistics.median(framework_rounds(data, workload, rounds + 2, 0)[1:])
    # two ranks share the cores: more threads than cores / 2 per rank would oversubscribe them
    per_rank = max(1, min(threads, available_cpus() // 2))
    rows[f"dpfl_lightning, 2 ranks x {per_rank} thr"] = two_ranks(workload, rounds, per_rank)
    try:
        rows["dpfl_lightning, vmap, 1 rank"] = statistics.median(framework_rounds(data, workload, rounds + 2, 0, "vmap")[1:])
    except Exception as exc:  # noqa: BLE001 - the table says why
        rows[f"dpfl_lightning, vmap: refused ({type(exc).__name__})"] = float("nan")
    rows["hand-written vmap loop"] = statistics.median(hand_written_vmap_rounds(data, workload, rounds, 0))
    return rows


if __name__ == "__main__":
    main()
