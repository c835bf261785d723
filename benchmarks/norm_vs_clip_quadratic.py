"""Paper 003 App. F: DP-NormFedAvg against DP-FedAvg with clipping on the quadratic problem.

n = 100 clients, d = 200, f_i(w) = 1/2 (w - w_i*)^T A_i A_i^T (w - w_i*); E = 20 full-gradient local
steps, K = 500 rounds, full participation, eta = beta, initialisation I1, (eps, delta) = (5, 1e-6)
for the whole run. Both algorithms send u = (w_k - w_{k,E}) / eta (Alg. 1 line 9), bound it by C
(clip or normalize) and add the distributed Gaussian noise of line 12; with the same seed they draw
exactly the same noise vectors, as in the paper. Prints the final suboptimality f(w_K) - f(w*),
mean and standard deviation over seeds, for every (C, eta).

    python benchmarks/norm_vs_clip_quadratic.py [--rounds 500] [--C 100 50 40] [--lr 0.001] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch

N, D, RANK, E, EPS, DELTA = 100, 200, 20, 20, 5.0, 1e-6


def noise_multiplier(rounds: int) -> float:
    """Smallest z with eps <= EPS after ``rounds`` Gaussian mechanisms (full participation, PLD)."""
    from dpfl_lightning.privacy import calibrate_noise

    return calibrate_noise(EPS, DELTA, steps=rounds, sampling_rate=1.0, accountant="pld")


def run(args: tuple[str, float, float, int, int, float]) -> tuple[str, float, float, int, float]:
    algo, C, lr, seed, rounds, z = args
    torch.set_num_threads(1)
    from dpfl_lightning import FederatedTrainer
    from dpfl_lightning.algorithms import DPFedAvgClipLR, DPNormFedAvg
    from dpfl_lightning.data import QuadraticClients
    from dpfl_lightning.models import QuadraticModel

    preset = (DPNormFedAvg(scale=C, noise_multiplier=z, placement="distributed", server_lr=lr) if algo == "norm"
              else DPFedAvgClipLR(clip=C, noise_multiplier=z, placement="distributed", server_lr=lr))
    with tempfile.TemporaryDirectory() as log_dir:
        trainer = FederatedTrainer(rounds=rounds, local_steps=E, batch_size=None, algorithm=preset, seed=seed,
                                   eval_every=rounds, executor="vmap", num_threads=1, log_dir=log_dir,
                                   enable_progress_bar=False, enable_summary=False)
        trainer.fit(QuadraticModel(N, D, RANK, init="I1", lr=lr), QuadraticClients(N, D, RANK))
    return algo, C, lr, seed, trainer.history[-1]["suboptimality"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--C", type=float, nargs="+", default=[100.0, 50.0, 40.0])
    ap.add_argument("--lr", type=float, nargs="+", default=[0.001])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    z = noise_multiplier(args.rounds)
    jobs = [(a, C, lr, s, args.rounds, z) for C in args.C for lr in args.lr for s in args.seeds for a in ("clip", "norm")]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run, jobs))
    print(f"paper 003 App. F: n={N}, d={D}, E={E}, K={args.rounds}, full participation, init I1, "
          f"(eps, delta)=({EPS}, {DELTA}) -> noise multiplier {z:.3f}; seeds {args.seeds}")
    print(f"{'C':>6} {'eta':>7} {'clip: f(w_K)-f*':>20} {'norm: f(w_K)-f*':>20} {'clip/norm':>10}")
    for C in args.C:
        for lr in args.lr:
            vals = {a: [r[4] for r in results if r[0] == a and r[1] == C and r[2] == lr] for a in ("clip", "norm")}
            m = {a: statistics.mean(v) for a, v in vals.items()}
            sd = {a: statistics.stdev(v) if len(v) > 1 else 0.0 for a, v in vals.items()}
            print(f"{C:>6g} {lr:>7g} {m['clip']:>12.4f} ± {sd['clip']:<6.4f}{m['norm']:>12.4f} ± {sd['norm']:<6.4f}"
                  f"{m['clip'] / m['norm']:>10.2f}")


if __name__ == "__main__":
    main()
