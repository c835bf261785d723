"""Paper 000 on an L2-regularised logistic regression: Corollary 1 (App. D) and the local-step sweep
of DP-FedAvg against DP-ScaffNew at a fixed number of iterations (Observations 1 and 3).

Clients with different feature means and labelling vectors (heterogeneous), full local gradients,
loss ``mean log(1 + exp(-y x^T w)) + (lam / 2) ||w||^2``: every f_i is lam-strongly convex
everywhere and L_i = lam + lambda_max(X_i^T X_i) / (4 n_i) smooth; L = max L_i, eta = 1/L. Near x*
the curvature is larger than lam: ``--mu local`` (default) uses the smallest Hessian eigenvalue of
any f_i at x*, ``--mu global`` uses lam (Theorem 1's worst case).

Iterations, as Alg. 2 counts them. ``T`` is the number of local iterations; after each one a shared
coin (probability ``p``) decides whether the clients communicate. The framework's DP-ScaffNew runs
one *round* per communication, with ``Geometric(p)`` local steps drawn from the coin keyed by
(seed, round). A run of exactly ``T`` iterations is therefore the rounds whose steps fit in ``T``
(the coins are public functions of the seed: :func:`coin_schedule` draws them as the plugin does,
and the run checks that the plugin drew the same), followed by ``T - (their steps)`` local
iterations whose coins were all 0: no message, the clients' iterates ``x_T^(i)`` move away from the
server's ``x`` (Alg. 2 line 11); :meth:`Setting.uncommunicated_tail` takes those steps in float64.

1. ``--study corollary`` (N = 10 clients, d = 10, 50 records each): Corollary 1 in Lemma 1's units.
   DP-ScaffNew with clipping at C and Lemma 1's noise ``sigma^2 = v C^2 p T ln(1/delta) / eps^2`` with
   v = 1 (the paper leaves v unspecified: this epsilon is a normalisation, *not* a privacy
   guarantee; it is chosen so that T* is about 4 / ln(1 / (1 - mu/L)), which needs a large value).
   E[psi_T] is the mean over seeds of Theorem 1's stacked Lyapunov function on the clients'
   iterates, ``psi_T = sum_i ||x_T^(i) - x*||^2 + (eta/p)^2 sum_i ||h_i - grad f_i(x*)||^2``. Sweeps
   p over {1/4, 1/2, 1, 2, 4} p* at T = T*, and T over {1/4, 1/2, 1, 2, 4} T* at p = p*; next to
   each measured psi_T, Theorem 1's bound (eq. (2)).

2. ``--study sweep`` (N = 100 clients, d = 2, 20 records each: local DP at epsilon <= 10 needs many
   clients per dimension): the paper's Figure 2 experiment at real (epsilon, delta = 1e-5)
   guarantees towards the server. T iterations in all; DP-FedAvg (Alg. 1) with tau local steps and
   T / tau rounds, DP-ScaffNew (Alg. 2) with p = 1/tau (tau expected local steps); the same clip C;
   each client's Gaussian noise calibrated by the framework (``GaussianNoise(target_epsilon=...)``,
   the ledger's accountant, replace-one neighbours) for the messages the run sends: T / tau for
   DP-FedAvg, the realised number of communications for DP-ScaffNew (known from the seed before
   training). Prints ``f(x_T) - f*`` of the final server model, mean over seeds, for each tau, and
   the best tau per epsilon; Observation 3 predicts that the best tau grows as epsilon shrinks.

    python benchmarks/paper000_scaffnew.py --study corollary [--seeds 3]
    python benchmarks/paper000_scaffnew.py --study sweep [--eps 1 3 10] [--taus 1 2 4 8 16 48] [--T 48] [--seeds 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from dpfl_lightning import FederatedDataModule, FederatedTrainer, rng
from dpfl_lightning.plugins import GaussianNoise, ScaffNew, ServerOptimizer, UpdateClipping
from dpfl_lightning.plugins.scaffnew import geometric_steps
from dpfl_lightning.privacy.theory import initial_lyapunov, privacy_sigma, scaffnew_bound, scaffnew_optimal

LAM, DELTA = 0.05, 1e-5


def problem(N: int, D: int, n: int, seed: int = 0):
    """N clients with n records in R^D each: client i's features ~ N(m_i, I), labels from its own
    w_i = w + N(0, I) (heterogeneous); float64, [N, n, D] and [N, n]."""
    g = torch.Generator().manual_seed(seed)
    w_common = torch.randn(D, generator=g, dtype=torch.float64)
    xs, ys = [], []
    for _ in range(N):
        m = torch.randn(D, generator=g, dtype=torch.float64)
        w_i = w_common + torch.randn(D, generator=g, dtype=torch.float64)
        x = m + torch.randn(n, D, generator=g, dtype=torch.float64)
        y = torch.where(x @ w_i + 0.5 * torch.randn(n, generator=g, dtype=torch.float64) > 0, 1.0, -1.0)
        xs.append(x), ys.append(y.double())
    return torch.stack(xs), torch.stack(ys)


def client_loss(w, x, y):
    return F.softplus(-y * (x @ w)).mean() + LAM / 2 * (w * w).sum()


def global_loss(w, xs, ys) -> float:
    return float(sum(client_loss(w, x, y) for x, y in zip(xs, ys)) / len(xs))


def solve(xs, ys):
    """x* of the mean objective and h* = grad f_i(x*), in float64 (L-BFGS to a gradient ~1e-12)."""
    w = torch.zeros(xs.shape[-1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1, max_iter=500, tolerance_grad=1e-14, tolerance_change=0, history_size=50,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = sum(client_loss(w, x, y) for x, y in zip(xs, ys)) / len(xs)
        loss.backward()
        return loss

    opt.step(closure)
    w_star = w.detach()
    grads = torch.stack([torch.func.grad(client_loss)(w_star, x, y) for x, y in zip(xs, ys)])
    return w_star, grads


class L2Logistic(L.LightningModule):
    def __init__(self, lr: float, dim: int) -> None:
        super().__init__()
        self.lr = lr
        self.w = nn.Parameter(torch.zeros(dim))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return client_loss(self.w, x, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# ------------------------------------------------------------------------------------------------
# T iterations of Alg. 2
# ------------------------------------------------------------------------------------------------
def coin_schedule(seed: int, p: float, T: int) -> tuple[list[int], int]:
    """The local steps of the rounds (communications) within ``T`` iterations, and the iterations
    left after the last communication. The coins come from the stream the ScaffNew plugin draws
    from, keyed by (seed, round): public in a simulation, so the run's releases are known."""
    source, steps, used = rng.RandomSource(seed), [], 0
    while True:
        u = source.stream(len(steps), rng.SERVER_CLIENT, rng.COIN).uniform(1).item()
        k = geometric_steps(u, p)
        if used + k > T:
            return steps, T - used
        steps.append(k)
        used += k



class Setting:
    """One problem: its data, x*, h* = (grad f_i(x*))_i, f*, L, mu, eta = 1/L and p* = sqrt(mu/L)."""

    def __init__(self, N: int, D: int, n: int, mu_kind: str = "local") -> None:
        self.N, self.D, self.n, self.mu_kind = N, D, n, mu_kind
        self.xs, self.ys = problem(N, D, n)
        self.data = FederatedDataModule.from_tensors(
            self.xs.reshape(-1, D).float(), self.ys.reshape(-1).float(),
            client_indices=[range(i * n, (i + 1) * n) for i in range(N)])
        self.w_star, self.h_star = solve(self.xs, self.ys)
        self.f_star = global_loss(self.w_star, self.xs, self.ys)
        self.L = max(LAM + float(torch.linalg.eigvalsh(x.T @ x / n)[-1]) / 4 for x in self.xs)
        hess = torch.func.hessian(client_loss)
        self.mu_local = min(float(torch.linalg.eigvalsh(hess(self.w_star, x, y))[0]) for x, y in zip(self.xs, self.ys))
        self.mu = LAM if mu_kind == "global" else self.mu_local
        self.eta = 1.0 / self.L
        self.p_star = math.sqrt(self.mu / self.L)
        self.x0 = torch.zeros(D, dtype=torch.float64)
        self.grad0 = max(float(torch.linalg.vector_norm(torch.func.grad(client_loss)(self.x0, x, y)))
                         for x, y in zip(self.xs, self.ys))

    def psi0(self, p: float) -> float:
        return initial_lyapunov(self.eta, p, self.N * float((self.w_star**2).sum()), float((self.h_star**2).sum()))

    def psi(self, x_clients: torch.Tensor, h: torch.Tensor, p: float) -> float:
        """Theorem 1's psi_T on the stacked client iterates and control variates."""
        return (float(((x_clients - self.w_star) ** 2).sum())
                + (self.eta / p) ** 2 * float(((h - self.h_star) ** 2).sum()))

    def suboptimality(self, x: torch.Tensor) -> float:
        return global_loss(x, self.xs, self.ys) - self.f_star

    def uncommunicated_tail(self, x: torch.Tensor, h: torch.Tensor, steps: int) -> torch.Tensor:
        """The clients' iterates after ``steps`` local iterations without communication (Alg. 2
        lines 6 and 11) from the server model ``x`` with control variates ``h`` [N, D]; float64."""
        xi = x.double().expand(self.N, self.D).clone()
        grad = torch.func.vmap(torch.func.grad(client_loss))
        for _ in range(steps):
            xi = xi - self.eta * (grad(xi, self.xs, self.ys) - h)
        return xi

    def fit(self, rounds: int, plugins: list, seed: int, local_steps: int | None = None,
            executor: str = "sequential") -> FederatedTrainer:
        trainer = FederatedTrainer(rounds=rounds, local_steps=local_steps, batch_size=None, seed=seed,
                                   eval_every=10**9, num_threads=1, plugins=plugins, executor=executor,
                                   log_dir=tempfile.mkdtemp(), enable_progress_bar=False, enable_summary=False)
        trainer.fit(L2Logistic(self.eta, self.D), self.data)
        return trainer


def noise_plugin(C: float, *, sigma: float | None = None, eps: float | None = None) -> GaussianNoise:
    """Local Gaussian noise: Lemma 1's fixed std (Corollary 1 study) or calibrated to (eps, DELTA)."""
    if eps is not None:
        return GaussianNoise(target_epsilon=eps, delta=DELTA, placement="local")
    return GaussianNoise(noise_multiplier=sigma / C, placement="local")


def run_scaffnew(s: Setting, p: float, T: int, C: float, seed: int, **noise) -> dict:
    """DP-ScaffNew (Alg. 2) for exactly T iterations: the server model ``x``, the control variates
    ``h`` [N, D], the number of communications, the noise multiplier ``z`` and the ``tail``."""
    steps, tail = coin_schedule(seed, p, T)
    if not steps:  # the first coin 1 would come after T: nothing is released, x and h stay at 0
        return {"x": s.x0, "h": torch.zeros(s.N, s.D, dtype=torch.float64), "comms": 0, "z": math.nan, "tail": tail}
    plugin, gauss = ScaffNew(p), noise_plugin(C, **noise)
    trainer = s.fit(len(steps), [plugin, UpdateClipping(C), gauss, ServerOptimizer("sgd", lr=1.0)], seed)
    assert plugin.steps == steps, "the ScaffNew plugin drew other coins than coin_schedule"
    h = torch.stack([trainer.client_states[c]["h"].double() for c in range(s.N)])
    return {"x": trainer.module.global_params.double(), "h": h, "comms": len(steps), "z": gauss.noise_multiplier,
            "tail": tail}


def run_fedavg(s: Setting, tau: int, T: int, C: float, seed: int, eps: float) -> dict:
    """DP-FedAvg (Alg. 1): T / tau rounds of tau local steps (vectorised clients: plain SGD)."""
    gauss = noise_plugin(C, eps=eps)
    trainer = s.fit(T // tau, [UpdateClipping(C), gauss, ServerOptimizer("sgd", lr=1.0)], seed, tau, "vmap")
    return {"x": trainer.module.global_params.double(), "comms": T // tau, "z": gauss.noise_multiplier}


# ------------------------------------------------------------------------------------------------
# 1. Corollary 1 (Lemma 1's units, v = 1)
# ------------------------------------------------------------------------------------------------
def study_corollary(s: Setting, seeds: int) -> None:
    # the message norm at x0 after 1/p* steps, doubled: clipping rarely acts (the analysis assumes it never does)
    C = 2 * s.eta * s.grad0 / s.p_star
    psi0 = s.psi0(s.p_star)
    lam_ = math.log(1 / (1 - s.mu / s.L))
    K = C * C * s.N * s.D * math.log(1 / DELTA)
    eps = math.sqrt(math.exp(4.0) * K / (psi0 * lam_))  # Corollary 1's log argument e^4
    opt = scaffnew_optimal(s.mu, s.L, eps, DELTA, C, s.N, s.D, psi0)
    T_star = opt.T_integer
    print(f"1. Corollary 1 (N={s.N}, d={s.D}, {s.n} records each): mu={s.mu:.4g} ({s.mu_kind}; lam={LAM:g}, local "
          f"{s.mu_local:.4g}) L={s.L:.4g} eta*=1/L={s.eta:.4g} p*={s.p_star:.4f} (1/p*={1 / s.p_star:.2f}) C={C:.4g} "
          f"psi0={psi0:.4g} T*={T_star} iterations ({opt.expected_rounds:.1f} expected communications); {seeds} seeds")
    print(f"   epsilon={eps:.4g} in Lemma 1's units, delta={DELTA:g}: v = 1 is a normalisation chosen so that "
          "T* ~ 4 / ln(1/(1-mu/L)), not a privacy guarantee")

    def row(label, p, T):
        psi, comms = [], []
        for seed in range(seeds):
            r = run_scaffnew(s, p, T, C, seed, sigma=privacy_sigma(p, T, eps, DELTA, C))
            psi.append(s.psi(s.uncommunicated_tail(r["x"], r["h"], r["tail"]), r["h"], p))
            comms.append(r["comms"])
        bound = scaffnew_bound(s.eta, p, T, mu=s.mu, L=s.L, epsilon=eps, delta=DELTA, C=C, N=s.N, d=s.D,
                               psi0=s.psi0(p))
        sd = statistics.stdev(psi) if len(psi) > 1 else 0.0
        print(f"   {label:<8}{p:>8.4f}{1 / p:>8.2f}{T:>7d}{statistics.mean(comms):>8.1f}{statistics.mean(psi):>13.4g}"
              f"{sd:>11.3g}{bound:>14.4g}", flush=True)
        return statistics.mean(psi)

    head = f"   {'':<8}{'p':>8}{'1/p':>8}{'T':>7}{'comms':>8}{'mean psi_T':>13}{'sd':>11}{'Thm 1 bound':>14}"
    print("\n   p sweep at T = T*\n" + head)
    by_p = {f: row(f"{f:g} p*", min(1.0, f * s.p_star), T_star) for f in (0.25, 0.5, 1, 2, 4)}
    print(f"   best p: {min(by_p, key=by_p.get):g} p*")
    print("\n   T sweep at p = p*\n" + head)
    by_t = {f: row(f"{f:g} T*", s.p_star, max(1, round(f * T_star))) for f in (0.25, 0.5, 1, 2, 4)}
    print(f"   best T: {min(by_t, key=by_t.get):g} T*")


# ------------------------------------------------------------------------------------------------
# 2. Local steps at a real epsilon (Observations 1 and 3)
# ------------------------------------------------------------------------------------------------
def sweep_table(s: Setting, name: str, epsilons: list[float], taus: list[int], T: int, C: float,
                seeds: int) -> dict[tuple[int, float], float]:
    """Print and return mean f(x_T) - f* for every (tau, eps) of one algorithm."""
    print(f"\n   {name} ({'tau local steps, T/tau rounds' if name == 'DP-FedAvg' else 'p = 1/tau, T iterations'})")
    print("   " + f"{'tau':>5}" + "".join(f"{f'eps={e:g}':>24}" for e in epsilons))
    table = {}
    for tau in taus:
        cells = []
        for e in epsilons:
            runs = [run_fedavg(s, tau, T, C, seed, e) if name == "DP-FedAvg"
                    else run_scaffnew(s, 1.0 / tau, T, C, seed, eps=e) for seed in range(seeds)]
            table[tau, e] = statistics.mean(s.suboptimality(r["x"]) for r in runs)
            comms = statistics.mean(r["comms"] for r in runs)
            zs = [r["z"] for r in runs if r["comms"]]
            z = f"{statistics.mean(zs):.3g}" if zs else "-"
            cells.append(f"{table[tau, e]:.4f} [{comms:g}; {z}]")
        print("   " + f"{tau:>5}" + "".join(f"{c:>24}" for c in cells), flush=True)
    best = {e: min(taus, key=lambda t: table[t, e]) for e in epsilons}
    print("   best tau: " + ", ".join(f"eps={e:g}: {best[e]}" for e in epsilons))
    return table


def study_sweep(s: Setting, epsilons: list[float], taus: list[int], T: int, C: float, seeds: int) -> None:
    bad = [tau for tau in taus if T % tau]
    if bad:
        raise SystemExit(f"--taus {bad}: not divisors of --T {T} (DP-FedAvg runs T / tau whole rounds); "
                         "pick divisors, as the paper does")
    print(f"2. Local-step sweep (N={s.N}, d={s.D}, {s.n} records each; 1/p*={1 / s.p_star:.2f}): T={T} iterations, "
          f"eta=1/L={s.eta:.4g}, clip C={C:g} (||x*||={float(torch.linalg.vector_norm(s.w_star)):.3g}), each client's "
          f"Gaussian noise calibrated to (eps, delta={DELTA:g}) towards the server for the run's messages; seeds "
          f"0..{seeds - 1}; f(x_0)-f*={s.suboptimality(s.x0):.4f}.")
    print("   cells: f(x_T)-f* of the server model, mean over seeds [mean communications; noise multiplier z]")
    for name in ("DP-FedAvg", "DP-ScaffNew"):
        table = sweep_table(s, name, epsilons, taus, T, C, seeds)
        if len(epsilons) < 2:
            continue
        order = [min(taus, key=lambda t: table[t, e]) for e in sorted(epsilons, reverse=True)]
        verdict = ("holds" if all(a <= b for a, b in zip(order, order[1:])) and order[0] < order[-1]
                   else "does not show")
        print(f"   {name}: best tau as epsilon shrinks {order}: Observation 3 (more local steps at a smaller "
              f"epsilon) {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", choices=("corollary", "sweep", "all"), default="all")
    ap.add_argument("--seeds", type=int, default=None, help="default: 3 (corollary), 2 (sweep)")
    ap.add_argument("--mu", choices=("local", "global"), default="local",
                    help="corollary: local = the smallest Hessian eigenvalue of any f_i at x*; global = lam")
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 3.0, 10.0], help="sweep: target epsilons")
    ap.add_argument("--taus", type=int, nargs="+", default=[1, 2, 4, 8, 16, 48], help="sweep: local steps (divide T)")
    ap.add_argument("--T", type=int, default=48, help="sweep: total local iterations")
    ap.add_argument("--clip", type=float, default=0.3, help="sweep: clip C")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # the model starts at x0 = 0 whatever torch's global generator holds
    warnings.filterwarnings("ignore", message="trainer.seed=", category=UserWarning)
    if args.study in ("corollary", "all"):
        t0 = time.perf_counter()
        study_corollary(Setting(10, 10, 50, args.mu), args.seeds or 3)
        print(f"   ({time.perf_counter() - t0:.0f} s)\n", flush=True)
    if args.study in ("sweep", "all"):
        t0 = time.perf_counter()
        study_sweep(Setting(100, 2, 20), args.eps, args.taus, args.T, args.clip, args.seeds or 2)
        print(f"   ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
