"""Paper 001 (DP-SCAFFOLD), Table 1: the largest number of rounds T for epsilon = 3 towards a third
party, l = 0.05, s = 0.2, M = 100 users, R = 4000 records per user, delta = 1 / (M R).

For each (sigma_g, K): the T printed in the paper, the T of our implementation of the paper's
accountant (``paper001.max_rounds``), and the T of the modern dp_accounting accountants
(``paper001.modern_max_rounds``):

- ``rec/cl``:  record-level RDP, K T sampled-without-replacement Gaussian steps, z = sigma_g,
  no user sampling (method="record", noise_view="client");
- ``part/cl``: the same steps, user sampling counted through revealed participation
  (method="participation", noise_view="client"; valid towards the server too);
- ``rec/agg``, ``part/agg``: the same with the paper's aggregate noise z = sigma_g sqrt(lM)
  (noise_view="aggregate"): the accounting compared like for like with the paper's.

The last row (sigma_g = 1e6) shows the limit sigma_g -> inf of the paper's bound.

    python benchmarks/paper001_table1.py
"""

from __future__ import annotations

import math
import time

from dpfl_lightning.privacy.paper001 import (
    TABLE1_SETTING,
    TABLE1_T,
    max_rounds,
    modern_epsilon,
    modern_max_rounds,
    paper_epsilon,
)

KS = (1, 5, 10, 20, 40)
MODERN = (("rec/cl", "record", "client"), ("part/cl", "participation", "client"),
          ("rec/agg", "record", "aggregate"), ("part/agg", "participation", "aggregate"))


def _setting() -> tuple[float, dict]:
    run = dict(TABLE1_SETTING)
    return run.pop("target_epsilon"), run


def timing(repeats: int = 200) -> tuple[float, float, float]:
    """Seconds for one paper epsilon: cold (no cached curve) and warm; one modern epsilon, warm."""
    _, run = _setting()
    t0 = time.perf_counter()
    paper_epsilon(12.345, 7, 400, **run)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in range(repeats):
        paper_epsilon(12.345, 7, 400 + t, **run)
    warm = (time.perf_counter() - t0) / repeats
    modern_epsilon(12.345, 7, 400, **run)
    t0 = time.perf_counter()
    for t in range(repeats):
        modern_epsilon(12.345, 7, 400 + t, **run)
    modern = (time.perf_counter() - t0) / repeats
    return cold, warm, modern


def main() -> None:
    target, run = _setting()
    print(f"Paper 001 Table 1: epsilon = {target}, l = {run['l']}, s = {run['s']}, M = {run['M']}, "
          f"R = {run['R']}, delta = 1/(M R)")
    header = (f"{'sigma_g':>8} {'K':>3} | {'paper':>6} {'ours':>6} {'diff':>5} | "
              + " ".join(f"{n:>9}" for n, _, _ in MODERN))
    print(header)
    print("-" * len(header))
    mismatches = 0
    for sigma_g in (*TABLE1_T, 1e6):
        for k in KS:
            published = TABLE1_T.get(sigma_g, {}).get(k)
            ours = max_rounds(target, sigma_g, k, **run)
            modern = [modern_max_rounds(target, sigma_g, k, **run, method=m, noise_view=v) if sigma_g < 1e6 else None
                      for _, m, v in MODERN]
            diff = "" if published is None else f"{ours - published:+d}"
            mismatches += published is not None and ours != published
            cells = " ".join(f"{'-' if t is None else t:>9}" for t in modern)
            print(f"{sigma_g:>8g} {k:>3} | {'-' if published is None else published:>6} {ours:>6} {diff:>5} | {cells}")
    warm_rounds = math.ceil(1 / run["l"])  # DP-SCAFFOLD-warm: ceil(M / m) rounds meet every user once
    print(f"\nDP-SCAFFOLD-warm spends ceil(M/m) = {warm_rounds} of these rounds on the warm start (the model "
          f"does not move): rounds left to train at sigma_g = 40: "
          + ", ".join(f"K={k}: {max_rounds(target, 40.0, k, **run) - warm_rounds}" for k in KS))
    cold, warm, modern = timing()
    print(f"\ncells where our paper-accountant T differs from the published T: {mismatches}")
    print(f"one paper epsilon: {cold * 1e3:.2f} ms cold (Steps 1-2 computed), {warm * 1e3:.3f} ms warm; "
          f"one modern epsilon (warm): {modern * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
