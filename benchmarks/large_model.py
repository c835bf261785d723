"""A 46M-parameter model on the CPU: peak memory per rank and seconds per round, against a minimal
hand-written loop, for 2 and 8 clients per round (memory must not grow with the clients).

Model: MLP 3072-4096-4096-4096-10 (46.2M parameters, 185 MB in float32); each client takes one
local SGD step on a batch of 10; update clipping at 1.0 and central Gaussian noise (the DP-FedAvg
round of ``round_overhead.py``). Each variant runs in its own process; "extra" is the peak resident
memory minus the resident memory just before training (the libraries and the data).

    python benchmarks/large_model.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from round_overhead import clip_and_add  # the hand loops' shared client update

SIZES = [3072, 4096, 4096, 4096, 10]
CLIENTS, SAMPLES, CLIP, Z = 32, 10, 1.0, 1.0


def net() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(SIZES[:-1], SIZES[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(CLIENTS * SAMPLES, SIZES[0], generator=g), torch.randint(0, 10, (CLIENTS * SAMPLES,), generator=g)


def hand(rounds: int, per_round: int) -> list[float]:
    x, y = data()
    model = net()
    params = list(model.parameters())
    global_w = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        total = [torch.zeros_like(w) for w in global_w]
        for c in torch.randperm(CLIENTS, generator=g)[:per_round].tolist():
            with torch.no_grad():
                for p, w in zip(params, global_w):
                    p.copy_(w)
            opt = torch.optim.SGD(params, lr=0.1)
            sel = torch.arange(c * SAMPLES, (c + 1) * SAMPLES)
            loss = F.cross_entropy(model(x[sel]), y[sel])
            opt.zero_grad()
            loss.backward()
            opt.step()
            clip_and_add(total, params, global_w, CLIP)
        with torch.no_grad():
            for w, t in zip(global_w, total):
                w.add_((t + Z * CLIP * torch.randn(t.shape, generator=g)) / per_round)
        times.append(time.perf_counter() - t0)
    return times


def framework(rounds: int, per_round: int) -> list[float]:
    from dpfl_lightning import FederatedDataModule, FederatedLightningModule, FederatedTrainer
    from dpfl_lightning.plugins import GaussianNoise, UpdateClipping

    x, y = data()
    dm = FederatedDataModule.from_tensors(x, y, client_indices=[range(c * SAMPLES, (c + 1) * SAMPLES)
                                                                for c in range(CLIENTS)])
    module = FederatedLightningModule(net(), loss_fn=F.cross_entropy, lr=0.1, task="regression")
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=per_round, local_steps=1, batch_size=SAMPLES,
                               plugins=[UpdateClipping(CLIP), GaussianNoise(noise_multiplier=Z)], eval_every=10**9,
                               log_dir=tempfile.mkdtemp(), enable_progress_bar=False, enable_summary=False,
                               num_threads=torch.get_num_threads())
    trainer.fit(module, dm)
    return trainer.round_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--per_round", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        import dpfl_lightning  # noqa: F401 - the libraries count in the baseline, not in the extra memory

        data()
        base = rss_mb()
        times = (hand if args.worker == "hand" else framework)(args.rounds, args.per_round)
        print(json.dumps({"s": sorted(times)[len(times) // 2], "peak": peak_mb(), "base": base}))
        return
    params = sum(p.numel() for p in net().parameters())
    print(f"MLP {'-'.join(map(str, SIZES))}: {params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MB; "
          f"{args.threads} thread(s); median of {args.rounds} rounds")
    print(f"{'variant':<32}{'s/round':>9}{'peak MB':>9}{'extra MB':>10}{'extra / params':>16}")
    for per_round in (2, 8):
        res = {}
        for worker in ("hand", "framework"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", worker, "--rounds",
                                  str(args.rounds), "--threads", str(args.threads), "--per_round", str(per_round)],
                                 capture_output=True, text=True, check=True).stdout
            res[worker] = json.loads(out.strip().splitlines()[-1])
        for worker, r in res.items():
            extra = r["peak"] - r["base"]
            print(f"{worker + f', {per_round} clients/round':<32}{r['s']:>9.3f}{r['peak']:>9.0f}{extra:>10.0f}"
                  f"{extra / (params * 4 / 2**20):>16.2f}")
        over = (res["framework"]["peak"] - res["framework"]["base"]) - (res["hand"]["peak"] - res["hand"]["base"])
        print(f"{'framework - hand loop':<32}{res['framework']['s'] / res['hand']['s']:>8.2f}x{'':>9}{over:>10.0f}"
              f"{over / (params * 4 / 2**20):>16.2f}")


if __name__ == "__main__":
    main()
