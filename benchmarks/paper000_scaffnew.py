"""Paper 000 App. D style check of Corollary 1 on an L2-regularised logistic regression.

N = 10 clients with different feature means and labelling vectors (heterogeneous), d = 10, 50
records each, full local gradients, loss ``mean log(1 + exp(-y x^T w)) + (lam / 2) ||w||^2``: every
f_i is lam-strongly convex everywhere and L_i = lam + lambda_max(X_i^T X_i) / (4 n_i) smooth;
L = max L_i. Near x* the curvature is larger than lam: ``--mu local`` (default) uses the smallest
Hessian eigenvalue of any f_i at x*, ``--mu global`` uses lam (Theorem 1's worst case, which makes
Corollary 1 pessimistic here: with it the best T measured is T*/4).
DP-ScaffNew (Alg. 2) runs with eta = 1/L, clipping at C and the noise of Lemma 1 for the number of
communications it makes, ``sigma^2 = v C^2 (p T) ln(1/delta) / eps^2`` (v = 1, the paper's
normalisation). epsilon is chosen so that Corollary 1's T* is about 4 / ln(1 / (1 - mu/L)).

Two sweeps, 3 seeds each (seeds change the coin and the noise), E[psi_T] estimated by the mean of
``psi_T = N ||x_T - x*||^2 + (eta/p)^2 sum_i ||h_i - grad f_i(x*)||^2``:

1. p over {1/4, 1/2, 1, 2, 4} x p* at T = T*: does the best expected number of local steps 1/p
   track 1/p*?
2. T over {1/4, 1/2, 1, 2, 4} x T* at p = p* (more iterations need more noise per message for the
   same epsilon): does T* predict the best T?

Next to each measured psi_T the table prints Theorem 1's bound (eq. (2)).

    python benchmarks/paper000_scaffnew.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from dpfl_lightning import FederatedDataModule, FederatedTrainer
from dpfl_lightning.algorithms import DPScaffNew
from dpfl_lightning.privacy.theory import initial_lyapunov, privacy_sigma, scaffnew_bound, scaffnew_optimal

N, D, n, LAM, DELTA = 10, 10, 50, 0.05, 1e-5


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_common = torch.randn(D, generator=g, dtype=torch.float64)
    xs, ys = [], []
    for _ in range(N):
        m = torch.randn(D, generator=g, dtype=torch.float64)
        w_i = w_common + torch.randn(D, generator=g, dtype=torch.float64)
        x = m + torch.randn(n, D, generator=g, dtype=torch.float64)
        y = torch.where(x @ w_i + 0.5 * torch.randn(n, generator=g, dtype=torch.float64) > 0, 1.0, -1.0)
        xs.append(x), ys.append(y.double())
    return torch.stack(xs), torch.stack(ys)  # [N, n, D], [N, n]


def client_loss(w, x, y):
    return F.softplus(-y * (x @ w)).mean() + LAM / 2 * (w * w).sum()


def solve(xs, ys):
    """x* of the mean objective and h* = grad f_i(x*), in float64 (L-BFGS to a gradient ~1e-12)."""
    w = torch.zeros(D, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1, max_iter=500, tolerance_grad=1e-14, tolerance_change=0, history_size=50,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = sum(client_loss(w, x, y) for x, y in zip(xs, ys)) / N
        loss.backward()
        return loss

    opt.step(closure)
    w_star = w.detach()
    grads = []
    for x, y in zip(xs, ys):
        wi = w_star.clone().requires_grad_(True)
        client_loss(wi, x, y).backward()
        grads.append(wi.grad.detach())
    return w_star, torch.stack(grads)


class L2Logistic(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.w = nn.Parameter(torch.zeros(D))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return client_loss(self.w, x, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def run(data, eta, p, T, eps, C, seed, w_star, h_star):
    rounds = max(1, round(p * T))  # the expected number of communications of T local iterations
    sigma = privacy_sigma(p, rounds / p, eps, DELTA, C)
    trainer = FederatedTrainer(rounds=rounds, batch_size=None, seed=seed, eval_every=10**9, num_threads=1,
                               algorithm=DPScaffNew(p=p, clip=C, noise_multiplier=sigma / C),
                               log_dir=tempfile.mkdtemp(), enable_progress_bar=False, enable_summary=False)
    trainer.fit(L2Logistic(eta), data)
    x = trainer.module.global_params.double()
    h = torch.stack([trainer.client_states[c]["h"].double() for c in range(N)])
    return N * float(((x - w_star) ** 2).sum()) + (eta / p) ** 2 * float(((h - h_star) ** 2).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--mu", choices=("local", "global"), default="local",
                    help="local: the smallest Hessian eigenvalue of any f_i at x*; global: lam (valid everywhere)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    xs, ys = problem()
    data = FederatedDataModule.from_tensors(xs.reshape(-1, D).float(), ys.reshape(-1).float(),
                                            client_indices=[range(i * n, (i + 1) * n) for i in range(N)])
    w_star, h_star = solve(xs, ys)
    L_ = max(LAM + float(torch.linalg.eigvalsh(x.T @ x / n)[-1]) / 4 for x in xs)
    mu_local = min(float(torch.linalg.eigvalsh(torch.func.hessian(client_loss)(w_star, x, y))[0]) for x, y in zip(xs, ys))
    mu = LAM if args.mu == "global" else mu_local
    eta = 1.0 / L_
    # the message norm at x0 after 1/p* steps, doubled: clipping rarely acts (the analysis assumes it never does)
    grad0 = max(float(torch.linalg.vector_norm(torch.func.grad(client_loss)(torch.zeros(D, dtype=torch.float64), x, y)))
                for x, y in zip(xs, ys))
    p_star = math.sqrt(mu / L_)
    C = 2 * eta * grad0 / p_star
    psi0 = initial_lyapunov(eta, p_star, N * float((w_star**2).sum()), float((h_star**2).sum()))
    lam_ = math.log(1 / (1 - mu / L_))
    K = C * C * N * D * math.log(1 / DELTA)
    eps = math.sqrt(math.exp(4.0) * K / (psi0 * lam_))  # Corollary 1's log argument e^4
    opt = scaffnew_optimal(mu, L_, eps, DELTA, C, N, D, psi0)
    T_star = opt.T_integer
    print(f"mu={mu:.4g} ({args.mu}; lam={LAM:g}, local {mu_local:.4g}) L={L_:.4g} eta*=1/L={eta:.4g} p*={p_star:.4f} (1/p*={1 / p_star:.2f}) C={C:.4g} "
          f"eps={eps:.4g} delta={DELTA:g} psi0={psi0:.4g} T*={T_star} ({opt.expected_rounds:.1f} expected rounds); "
          f"{args.seeds} seeds")

    def row(label, p, T):
        psi = []
        for seed in range(args.seeds):
            psi.append(run(data, eta, p, T, eps, C, seed, w_star, h_star))
        bound = scaffnew_bound(eta, p, T, mu=mu, L=L_, epsilon=eps, delta=DELTA, C=C, N=N, d=D,
                               psi0=initial_lyapunov(eta, p, N * float((w_star**2).sum()), float((h_star**2).sum())))
        sd = statistics.stdev(psi) if len(psi) > 1 else 0.0
        print(f"{label:<10}{p:>8.4f}{1 / p:>8.2f}{T:>7d}{statistics.mean(psi):>13.4g}{sd:>11.3g}{bound:>14.4g}",
              flush=True)
        return statistics.mean(psi)

    head = f"{'':<10}{'p':>8}{'1/p':>8}{'T':>7}{'mean psi_T':>13}{'sd':>11}{'Thm 1 bound':>14}"
    print("\n1. p sweep at T = T*\n" + head)
    by_p = {f: row(f"{f:g} p*", min(1.0, f * p_star), T_star) for f in (0.25, 0.5, 1, 2, 4)}
    print(f"best p: {min(by_p, key=by_p.get):g} p*")
    print("\n2. T sweep at p = p*\n" + head)
    by_t = {f: row(f"{f:g} T*", p_star, max(1, round(f * T_star))) for f in (0.25, 0.5, 1, 2, 4)}
    print(f"best T: {min(by_t, key=by_t.get):g} T*")


if __name__ == "__main__":
    main()
