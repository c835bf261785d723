"""Paper 003 App. F: DP-NormFedAvg against DP-FedAvg with clipping on the quadratic problem.

n = 100 clients, d = 200, f_i(w) = 1/2 (w - w_i*)^T A_i A_i^T (w - w_i*); E = 20 full-gradient local
steps, K = 500 rounds, full participation, eta = beta, initialisation I1, (eps, delta) = (5, 1e-6)
for the whole run. Both algorithms send u = (w_k - w_{k,E}) / eta (Alg. 1 line 9), bound it by C
(clip or normalize) and add the distributed Gaussian noise of line 12; with the same seed they draw
exactly the same noise vectors, as in the paper. For every (C, eta), mean and standard deviation
over seeds of the suboptimality f(w) - f(w*) of two outputs:

- the last iterate w_K (what the paper's Figure 2 plots, round by round);
- Alg. 1's output (line 16): w_priv = w_k~ with k~ ~ unif[0, K - 1], i.e. one of w_0 ... w_{K-1}
  (w_0 is the initialisation). Two estimates: ``E_k`` is the expectation over k~ given the run's
  trajectory, mean_{k<K} (f(w_k) - f*) (exact, no draw), averaged over seeds; ``draw`` is one k~
  per seed drawn with numpy's generator seeded by (seed, 16), averaged over seeds.

Every round is evaluated (``eval_every=1``) to record f(w_1) ... f(w_K).

    python benchmarks/norm_vs_clip_quadratic.py [--rounds 500] [--C 100 50 40] [--lr 0.001] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

N, D, RANK, E, EPS, DELTA = 100, 200, 20, 20, 5.0, 1e-6


def noise_multiplier(rounds: int) -> float:
    """Smallest z with eps <= EPS after ``rounds`` Gaussian mechanisms (full participation, PLD)."""
    from dpfl_lightning.privacy import calibrate_noise

    return calibrate_noise(EPS, DELTA, steps=rounds, sampling_rate=1.0, accountant="pld")


def initial_suboptimality(lr: float) -> float:
    """f(w_0) - f*, computed in float64 from the model's own initialisation."""
    from dpfl_lightning.data import quadratic_problem
    from dpfl_lightning.models import QuadraticModel

    model, p = QuadraticModel(N, D, RANK, init="I1", lr=lr), quadratic_problem(N, D, RANK)
    with torch.no_grad():
        return float(model.losses(p.A, p.w_star_i, dtype=torch.float64).mean()) - model.f_star


def run(args: tuple[str, float, float, int, int, float]) -> tuple[str, float, float, int, list[float]]:
    """One run: f(w_k) - f* for k = 0 .. K."""
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
                                   eval_every=1, executor="vmap", num_threads=1, log_dir=log_dir,
                                   enable_progress_bar=False, enable_summary=False)
        trainer.fit(QuadraticModel(N, D, RANK, init="I1", lr=lr), QuadraticClients(N, D, RANK))
    return algo, C, lr, seed, [initial_suboptimality(lr)] + [row["suboptimality"] for row in trainer.history]


def outputs(trajectory: list[float], seed: int) -> tuple[float, float, float]:
    """(last iterate, E over k~ ~ unif[0, K-1], one drawn k~) of f(w_k) - f*; ``trajectory`` is k = 0 .. K."""
    K = len(trajectory) - 1
    k = int(np.random.default_rng([seed, 16]).integers(0, K))  # unif{0, ..., K-1}
    return trajectory[K], float(np.mean(trajectory[:K])), trajectory[k]


def cell(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--C", type=float, nargs="+", default=[100.0, 50.0, 40.0])
    ap.add_argument("--lr", type=float, nargs="+", default=[0.001])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    z = noise_multiplier(args.rounds)
    t0 = time.perf_counter()
    jobs = [(a, C, lr, s, args.rounds, z) for C in args.C for lr in args.lr for s in args.seeds for a in ("clip", "norm")]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run, jobs))
    print(f"paper 003 App. F: n={N}, d={D}, E={E}, K={args.rounds}, full participation, init I1, "
          f"(eps, delta)=({EPS}, {DELTA}) -> noise multiplier {z:.3f}; seeds {args.seeds}; "
          f"f(w_0)-f*={results[0][4][0]:.4f}")
    print("f(w) - f*, mean ± sd over seeds; last: w_K; E_k: expectation over Alg. 1's k~ ~ unif[0, K-1]; "
          "draw: one seeded k~ per seed")
    print(f"{'C':>6} {'eta':>7} {'output':>7} {'clip':>20} {'norm':>20} {'clip/norm':>10}")
    for C in args.C:
        for lr in args.lr:
            per = {a: [outputs(r[4], r[3]) for r in results if r[0] == a and r[1] == C and r[2] == lr]
                   for a in ("clip", "norm")}
            for i, label in enumerate(("last", "E_k", "draw")):
                v = {a: [o[i] for o in per[a]] for a in per}
                ratio = statistics.mean(v["clip"]) / statistics.mean(v["norm"])
                print(f"{C:>6g} {lr:>7g} {label:>7} {cell(v['clip']):>20} {cell(v['norm']):>20} {ratio:>10.2f}")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
