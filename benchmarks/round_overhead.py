"""Seconds per round: the framework against a minimal hand-written PyTorch loop (workload W1).

W1: MLP 60-200-10 on synthetic 10-class data (paper 001's generator, d = 60), 1000 clients x 50
samples, 50 clients per round (uniform without replacement), 1 local epoch, batch 10, SGD lr 0.1,
update clipping at 1.0, central Gaussian noise with multiplier 1.0.

Both run in this process on the same data with the same torch threads; they alternate in blocks
of rounds and the table reports the median round of each. The hand-written loop does the same
work by hand: sample, copy the global weights in, a fresh SGD per client, shuffled batches, the
update, clipping, summing, one noise draw, the global step.

The last row runs the same workload with ``executor="vmap"`` (clients of a round trained together).

    python benchmarks/round_overhead.py [--rounds 20] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from dpfl_lightning import FederatedTrainer
from dpfl_lightning.data import SyntheticLogistic
from dpfl_lightning.models import MLPClassifier
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping

M, M_ROUND, SAMPLES, BATCH, LR, CLIP, Z = 1000, 50, 50, 10, 0.1, 1.0, 1.0


def hand_written_rounds(data: SyntheticLogistic, rounds: int, seed: int) -> list[float]:
    x, y = data._train_tensors
    client_idx = data._train_idx
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(60, 200), nn.ReLU(), nn.Linear(200, 10))
    params = list(net.parameters())
    global_w = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        cohort = torch.randperm(M, generator=g)[:M_ROUND].tolist()
        total = [torch.zeros_like(w) for w in global_w]
        for c in cohort:
            with torch.no_grad():
                for p, w in zip(params, global_w):
                    p.copy_(w)
            opt = torch.optim.SGD(params, lr=LR)
            idx = client_idx[c][torch.randperm(SAMPLES, generator=g)]
            for i in range(0, SAMPLES, BATCH):
                sel = idx[i : i + BATCH]
                loss = F.cross_entropy(net(x[sel]), y[sel])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                delta = [p - w for p, w in zip(params, global_w)]
                norm = torch.linalg.vector_norm(torch.cat([d.flatten() for d in delta]))
                factor = min(1.0, CLIP / max(float(norm), 1e-12))
                for t, d in zip(total, delta):
                    t.add_(d, alpha=factor)
        with torch.no_grad():
            for w, t in zip(global_w, total):
                w.add_((t + Z * CLIP * torch.randn(t.shape, generator=g)) / M_ROUND)
        times.append(time.perf_counter() - t0)
    return times


def framework_rounds(data: SyntheticLogistic, rounds: int, seed: int, log_dir: str, executor: str = "sequential") -> list[float]:
    model = MLPClassifier(in_features=60, hidden=[200], num_classes=10, lr=LR)
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=M_ROUND, local_epochs=1, batch_size=BATCH,
                               plugins=[UpdateClipping(CLIP), GaussianNoise(noise_multiplier=Z, placement="central")],
                               eval_every=10**9, seed=seed, log_dir=log_dir, enable_progress_bar=False,
                               enable_summary=False, executor=executor)
    trainer.fit(model, data)
    return trainer.round_times[:-1]  # the last round also evaluates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = SyntheticLogistic(num_clients=M, samples_per_client=SAMPLES, test_samples_per_client=0, dim=60)
    data.setup()
    fw, hw, vm = [], [], []
    with tempfile.TemporaryDirectory() as log_dir:
        framework_rounds(data, 2, 99, log_dir)  # warm-up
        framework_rounds(data, 2, 99, log_dir, "vmap")
        hand_written_rounds(data, 2, 99)
        for rep in range(args.repeats):
            fw += framework_rounds(data, args.rounds, rep, log_dir)[1:]
            hw += hand_written_rounds(data, args.rounds, rep)[1:]
            vm += framework_rounds(data, args.rounds, rep, log_dir, "vmap")[1:]
    f, h, v = statistics.median(fw), statistics.median(hw), statistics.median(vm)
    print(f"W1: {M} clients x {SAMPLES} samples, {M_ROUND} clients/round, 1 epoch, batch {BATCH}, "
          f"torch threads {torch.get_num_threads()}, {len(fw)} rounds each")
    print(f"{'':<22}{'s/round (median)':>18}{'min':>10}{'max':>10}")
    print(f"{'hand-written loop':<22}{h:>18.4f}{min(hw):>10.4f}{max(hw):>10.4f}")
    print(f"{'dpfl_lightning':<22}{f:>18.4f}{min(fw):>10.4f}{max(fw):>10.4f}")
    print(f"{'ratio (framework/hand)':<22}{f / h:>18.3f}")
    print(f"{'dpfl_lightning, vmap':<22}{v:>18.4f}{min(vm):>10.4f}{max(vm):>10.4f}   (executor='vmap': {h / v:.2f}x faster than the hand-written loop)")


if __name__ == "__main__":
    main()
