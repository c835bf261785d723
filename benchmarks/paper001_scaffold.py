"""Paper 001 (DP-SCAFFOLD) on its synthetic(alpha, beta) data (App. D.2), logistic regression.

``--study compare``: DP-SCAFFOLD-warm against DP-FedAvg (DP-SGD clients, paper 001 Alg. 2) under
heterogeneity, l = s = 0.2, sigma_g = 60, K = 50, with fewer rounds than the paper's T = 400;
test accuracy over seeds. The claim: DP-SCAFFOLD is clearly better.

``--study table1``: the shape of Table 1 for sigma_g = 40 (l = 0.05, s = 0.2): for each K the number
of rounds T that the paper's accountant allows at epsilon = 3 (``paper001.max_rounds``), then the
test accuracy of DP-SCAFFOLD-warm after those T rounds. The paper sees a peak at K = 5-20 and a
collapse at K = 40 (14.85% against 36.85% at K = 10). Two readings (``--reading``):

- ``short``: one warm-start round, no regularisation, the accuracy after the last round;
- ``paper``: as paper 001 runs it (Sec. 5, App. D.3): the warm start's ``ceil(M / m)`` rounds
  (20 at l = 0.05) counted inside T, an l2 regularisation of 5e-3 on the objective, and the test
  accuracy averaged over the last 10% of the rounds;
- ``paper_unit``: ``paper`` on the features paper 001 trains on (Sec. 5, "Datasets": "Features are
  first standardized, then each data point is normalized to have unit L2 norm"): each feature
  standardized with the training records' mean and standard deviation, then every record (train and
  test) scaled to norm 1 (the raw App. D.2 records have norms of about 15 at beta = 5, so every
  per-record gradient is clipped at C = 1). Paper 001's public code runs with ``normalise=1,
  standardize=1``.

At K = 40, T = 86 leaves 66 training rounds after the paper's 20 warm rounds.

Paper 001's noise ``(2C / sR) N(0, sigma_g^2)`` on the mean clipped gradient is DP-SGD's noise
multiplier ``z = 2 sigma_g`` (std ``z C`` on the sum, divided by the batch size ``sR``); local step
size ``eta_l = eta_0 / (s K)``, global step size 1, batches of ``sR`` records without replacement.

    python benchmarks/paper001_scaffold.py --study compare [--seeds 3] [--rounds 30]
    python benchmarks/paper001_scaffold.py --study table1 [--seeds 2] [--reading short|paper|paper_unit|both|all] [--ks 10 40]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time

import torch
from torch.utils.data import TensorDataset

from dpfl_lightning import FederatedTrainer
from dpfl_lightning.algorithms import DPSCAFFOLD, PFL
from dpfl_lightning.data import SyntheticLogistic
from dpfl_lightning.models import MLPClassifier
from dpfl_lightning.plugins import FederatedCallback
from dpfl_lightning.privacy import paper001

M, R, R_TEST, DIM = 100, 4000, 1000, 40
READINGS = {  # warm-start rounds (None: ceil(M / m)), l2 weight, fraction of the last rounds averaged, unit records
    "short": (1, 0.0, None, False),
    "paper": (None, 5e-3, 0.1, False),
    "paper_unit": (None, 5e-3, 0.1, True),
}


class UnitSyntheticLogistic(SyntheticLogistic):
    """Paper 001 Sec. 5's preprocessing on top of App. D.2's data: standardize every feature with the
    training records' mean and standard deviation, then scale every record to unit L2 norm."""

    def load(self):
        train, test, clients = super().load()
        x, y = train.tensors
        mean, std = x.mean(0), x.std(0).clamp_min(1e-12)

        def unit(v: torch.Tensor) -> torch.Tensor:
            z = (v - mean) / std
            return z / torch.linalg.vector_norm(z, dim=1, keepdim=True).clamp_min(1e-12)

        test = None if test is None else TensorDataset(unit(test.tensors[0]), test.tensors[1])
        return TensorDataset(unit(x), y), test, clients


class L2Regularisation(FederatedCallback):
    """Adds ``lam * w`` (the gradient of ``lam / 2 ||w||^2``) to every local step's gradient, after
    DP-SGD's clipping and noise (post-processing: the l2 term is not a function of any record)."""

    def __init__(self, lam: float) -> None:
        self.lam = lam

    def wrap_optimizer(self, *, client, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        inner = getattr(optimizer, "original_optimizer", optimizer)
        inner.register_step_pre_hook(lambda opt, args, kwargs: self._add(opt))
        return optimizer

    def _add(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(p.detach(), alpha=self.lam)


def run(algorithm: str, sigma_g: float, K: int, rounds: int, l: float, s: float, eta0: float, seed: int,
        alpha: float, beta: float, reading: str = "short") -> float:
    warm_rounds, lam, last, unit = READINGS[reading]
    data = (UnitSyntheticLogistic if unit else SyntheticLogistic)(
        num_clients=M, samples_per_client=R, test_samples_per_client=R_TEST // 10, dim=DIM, alpha=alpha, beta=beta,
        seed=0)
    z = 2 * sigma_g
    if algorithm == "dp_scaffold_warm":
        alg = DPSCAFFOLD(noise_multiplier=z, max_grad_norm=1.0, sampling="fixed", warm_start=True,
                         warm_start_rounds=warm_rounds)
    else:
        alg = PFL(noise_multiplier=z, max_grad_norm=1.0, sampling="fixed")
    tail = 0 if last is None else max(1, math.ceil(last * rounds))
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=int(l * M), local_steps=K, batch_size=int(s * R),
                               algorithm=alg, plugins=[L2Regularisation(lam)] if lam else [], seed=seed,
                               eval_every=1 if tail else 10**9, log_dir=tempfile.mkdtemp(), num_threads=1,
                               enable_progress_bar=False, enable_summary=False)
    torch.manual_seed(seed)
    model = MLPClassifier(in_features=DIM, hidden=[], num_classes=10, lr=eta0 / (s * K))
    trainer.fit(model, data)
    if not tail:
        return trainer.history[-1]["val_acc"]
    return statistics.mean(h["val_acc"] for h in trainer.history[-tail:])


def seeds_of(args) -> list[int]:
    """The seeds a study runs: `--seeds` of them from `--first_seed`."""
    return list(range(args.first_seed, args.first_seed + args.seeds))


def compare(args) -> None:
    seeds = seeds_of(args)
    print(f"synthetic({args.alpha:g}, {args.beta:g}), M={M}, R={R}, l=s=0.2, sigma_g=60 (z=120), K=50, "
          f"T={args.rounds} (paper: 400), eta_l = {args.eta0:g}/(sK); test accuracy over seeds {seeds[0]}..{seeds[-1]}")
    for alg in ("dp_fedavg", "dp_scaffold_warm"):
        accs = [run(alg, 60.0, 50, args.rounds, 0.2, 0.2, args.eta0, seed, args.alpha, args.beta)
                for seed in seeds]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"{alg:<18}{statistics.mean(accs):.3f} +- {sd:.3f}   {['%.3f' % a for a in accs]}", flush=True)


def table1(args) -> None:
    ks = tuple(args.ks)
    ts = {k: paper001.max_rounds(3.0, 40.0, k, l=0.05, s=0.2, R=R, M=M) for k in ks}
    print(f"Table 1 shape, sigma_g=40 (z=80), l=0.05, s=0.2, eps=3 by paper 001's accountant: T per K = {ts}; "
          f"paper: {paper001.TABLE1_T[40.0]}, accuracy (%) K=1 21.05, 5 34.50, 10 36.85, 20 33.24, 40 14.85")
    readings = {"both": ("short", "paper"), "all": tuple(READINGS)}.get(args.reading, (args.reading,))
    for reading in readings:
        for k in ks:
            t0 = time.perf_counter()
            accs = [run("dp_scaffold_warm", 40.0, k, ts[k], 0.05, 0.2, args.eta0, seed, args.alpha, args.beta, reading)
                    for seed in seeds_of(args)] if ts[k] > 1 else []
            mean = statistics.mean(accs) if accs else float("nan")
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            print(f"{reading:<6} K={k:<3} T={ts[k]:<4} accuracy {mean:.3f} +- {sd:.3f}   {['%.3f' % a for a in accs]}"
                  f"   ({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", choices=("compare", "table1"), default="compare")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first_seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--eta0", type=float, default=1.0)
    ap.add_argument("--alpha", type=float, default=5.0)
    ap.add_argument("--beta", type=float, default=5.0)
    ap.add_argument("--reading", choices=(*READINGS, "both", "all"), default="both",
                    help="table1: one warm round and the last accuracy, or as the paper, raw or unit records "
                         "(see the docstring); both = short and paper, all = the three")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 5, 10, 20, 40], help="table1: the K values")
    args = ap.parse_args()
    torch.set_num_threads(1)
    (compare if args.study == "compare" else table1)(args)


if __name__ == "__main__":
    main()
