"""The distributed-DP study: continuous distributed Gaussian vs the distributed discrete Gaussian and
Skellam under secure aggregation, on configs/quickstart.yaml's task and cohort (digits, 200 clients,
a cohort of 40, 2 local epochs, batch 8, clip 1).

For each target epsilon (the ledger's main guarantee, client_distributed: towards the server, at the
run's delta) every mechanism is calibrated (``target_epsilon``), trained and reported with its
final test accuracy (mean and std over seeds), the wrap-around bound (settings alone), the ledger's
epsilon (and towards model observers), and seconds per round on this rank by stage (noise, rounding,
masks with the key exchange, unmasking+decoding).

``--sampling uniform`` (the papers' setting) draws a fixed cohort of 40: shares are sized for all 40
without dropouts, and with dropouts for the default ``min_survivors`` (the 1e-6 quantile of the
survivors' count; a shorter round is skipped, which releases nothing under a fixed-size sampler).
``--sampling poisson`` (the quickstart's sampler, 40 expected) hides the cohort: a short round stops
the run, the ledger charges the stop to the guarantee towards model observers, and the default
``min_survivors`` is the largest whose charge stays under 10% of delta (see DiscreteDistributedNoise).

    OMP_NUM_THREADS=1 python benchmarks/discrete_ddp_cost.py --sampling uniform --rounds 60 --seeds 0 1 2
    OMP_NUM_THREADS=1 python benchmarks/discrete_ddp_cost.py --sampling poisson --bits 16 --rounds 60 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import lightning
import numpy as np

from dpfl_lightning.data import Digits
from dpfl_lightning.models import MLPClassifier
from dpfl_lightning.plugins import DiscreteDistributedNoise, GaussianNoise, UpdateClipping
from dpfl_lightning.trainer import FederatedTrainer


SAMPLING = "poisson"  # --sampling: "uniform" (a fixed cohort of 40) or "poisson" (40 expected, hidden)


def run(noise, rounds: int, seed: int) -> dict:
    lightning.seed_everything(seed, verbose=False)
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=40, sampling=SAMPLING, local_epochs=2, batch_size=8,
                               seed=seed, plugins=[UpdateClipping(1.0), noise], eval_every=rounds,
                               test_after_fit=True, log_dir=tempfile.mkdtemp(), enable_progress_bar=False,
                               enable_summary=False, num_threads=1)
    t0 = time.perf_counter()
    trainer.fit(MLPClassifier(in_features=64, hidden=[64], num_classes=10, lr=0.5), Digits(num_clients=200,
                                                                                            partition="iid"))
    last = trainer.history[-1]
    out = {"acc": float(last.get("test_acc", float("nan"))), "epsilon": float(last["epsilon"]),
           "epsilon_models": float(last.get("epsilon_client_distributed_models", float("nan"))),
           "s_per_round": (time.perf_counter() - t0) / rounds}
    if isinstance(noise, DiscreteDistributedNoise):
        st = noise.stage_seconds
        out.update(noise_s=np.mean([s.noise for s in st]), rounding_s=np.mean([s.rounding for s in st]),
                   masks_s=np.mean([s.masks for s in st]), unmask_s=np.mean([s.unmask for s in st]),
                   wrap=noise.wraparound_round, gamma=noise.gamma, z=noise.noise_multiplier,
                   skipped=len(noise.skipped_rounds), min_survivors=noise.min_survivors,
                   shortfall=noise.shortfall_bound)
    else:
        out.update(z=noise.noise_multiplier)
    return out


def configs(eps: float, bits_list: list[int], dropouts: list[float], mechanisms: list[str]):
    if "gaussian" in mechanisms:
        yield "gaussian (continuous)", 0.0, None, GaussianNoise(target_epsilon=eps, placement="distributed")
    for mech in ("discrete_gaussian", "skellam"):
        for bits in bits_list if mech in mechanisms else []:
            for p in dropouts:
                yield mech, p, bits, DiscreteDistributedNoise(mech, target_epsilon=eps, bits=bits, dropout=p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 10.0])
    ap.add_argument("--bits", type=int, nargs="+", default=[12, 14, 16, 20, 32])
    ap.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--mechanisms", nargs="+", default=["gaussian", "discrete_gaussian", "skellam"])
    ap.add_argument("--sampling", choices=["poisson", "uniform"], default="poisson")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    global SAMPLING
    SAMPLING = a.sampling
    rows = []
    print("| eps | mechanism | bits | dropout | acc (std) | ledger eps | models eps | wrap bound/round | s/round |"
          " noise s | rounding s | masks s | unmask s | min survivors | stop bound |", flush=True)
    for eps in a.epsilons:
        for mech, p, bits, _ in configs(eps, a.bits, a.dropouts, a.mechanisms):
            res = []
            for seed in a.seeds:
                noise = next(n for m, q, b, n in configs(eps, a.bits, a.dropouts, a.mechanisms)
                             if (m, q, b) == (mech, p, bits))
                try:
                    res.append(run(noise, a.rounds, seed))
                except Exception as exc:  # a refused bit width: say so in the table
                    res.append({"error": str(exc).splitlines()[0][:90]})
                    break
            row = {"eps": eps, "mechanism": mech, "bits": bits, "dropout": p, "runs": res}
            rows.append(row)
            if "error" in res[0]:
                print(f"| {eps:g} | {mech} | {bits} | {p:g} | refused: {res[0]['error']} |", flush=True)
                continue

            def m(k: str) -> float:
                return float(np.mean([r.get(k, np.nan) for r in res]))

            std = float(np.std([r.get("acc", np.nan) for r in res]))
            print(f"| {eps:g} | {mech} | {bits or '-'} | {p:g} | {m('acc'):.3f} ({std:.3f}) | {m('epsilon'):.2f} | "
                  f"{m('epsilon_models'):.2f} | "
                  f"{m('wrap'):.1e} | {m('s_per_round'):.2f} | {m('noise_s'):.2f} | {m('rounding_s'):.3f} | "
                  f"{m('masks_s'):.3f} | {m('unmask_s'):.3f} | {m('min_survivors'):.0f} | {m('shortfall'):.1e} |",
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1, default=float)


if __name__ == "__main__":
    main()
