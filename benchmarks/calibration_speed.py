"""Seconds to calibrate a noise multiplier, and to invert it (largest number of rounds).

The reference setting of the privacy issue: 10,000 rounds of Poisson client sampling at q = 0.05,
target (eps, delta) = (2, 1e-6). Each accountant's answer is checked (never above the target,
within 1% of it). Best of ``--repeats`` cold runs (caches cleared). The last rows run
``dp_accounting.mechanism_calibration.calibrate_dp_mechanism`` on the same problem (its bisection to
the same 1% of the noise multiplier) for comparison: the framework keeps whichever is faster at an
equal result.

    python benchmarks/calibration_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import dp_accounting
from dp_accounting import pld as dp_pld
from dp_accounting import rdp as dp_rdp
from dp_accounting.mechanism_calibration import LowerEndpointAndGuess, calibrate_dp_mechanism

from dpfl_lightning.privacy import GaussianRelease, calibrate_noise, epsilon, max_steps
from dpfl_lightning.privacy.accountants import _base_pld, rdp_curve

ROUNDS, Q, EPS, DELTA = 10_000, 0.05, 2.0, 1e-6


def _cold() -> None:
    rdp_curve.cache_clear()
    _base_pld.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"calibration: {ROUNDS} rounds, Poisson q={Q}, target eps={EPS}, delta={DELTA}")
    print(f"{'accountant':<11}{'z':>10}{'eps(z)':>10}{'calibrate s':>13}{'max_steps s':>13}")
    for acc in ("rdp", "pld"):
        best_cal = best_inv = float("inf")
        for _ in range(args.repeats):
            _cold()
            t0 = time.perf_counter()
            z = calibrate_noise(EPS, DELTA, ROUNDS, Q, accountant=acc)
            best_cal = min(best_cal, time.perf_counter() - t0)
            _cold()
            t0 = time.perf_counter()
            t = max_steps(z, EPS, DELTA, Q, accountant=acc)
            best_inv = min(best_inv, time.perf_counter() - t0)
        achieved = epsilon(GaussianRelease(z, "poisson", Q), ROUNDS, DELTA, acc).epsilon
        assert EPS * 0.99 <= achieved <= EPS and t >= ROUNDS
        print(f"{acc:<11}{z:>10.4f}{achieved:>10.4f}{best_cal:>13.3f}{best_inv:>13.3f}")
    fresh = {"rdp": dp_rdp.RdpAccountant, "pld": lambda: dp_pld.PLDAccountant(value_discretization_interval=1e-3)}
    for acc in ("rdp", "pld"):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            z = calibrate_dp_mechanism(fresh[acc], lambda z: dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(z)), ROUNDS), EPS, DELTA,
                LowerEndpointAndGuess(0.1, 1.0), tol=0.001)
            best = min(best, time.perf_counter() - t0)
        achieved = epsilon(GaussianRelease(z, "poisson", Q), ROUNDS, DELTA, acc).epsilon
        print(f"{'dp_acc ' + acc:<11}{z:>10.4f}{achieved:>10.4f}{best:>13.3f}{'':>13}")


if __name__ == "__main__":
    main()
