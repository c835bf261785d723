"""What secure aggregation's masks cost per round (:mod:`dpfl_lightning.comm.secagg`), on one core.

For each cohort, one round of the whole cohort simulated in one process (the sum of every client's
work, and the server's), in seconds:

- ``keys+shares``: every client's X25519 key pair and self-mask seed, and the Shamir shares of both
  for its holders (``SecAggRound(...)``);
- ``agreement``: every client's X25519 exchanges and HKDF with its neighbours;
- ``expansion``: every client's masked row (AES-256-CTR expansion of ``k + 1`` masks of ``d`` words);
- ``sum``: the modular sum of the survivors' masked rows;
- ``unmask``: the server's reconstruction of the survivors' self-mask seeds and the dropped clients'
  keys (``round(n/10)`` clients dropped), and the removal of their masks.

Simulation mode (keys from the seed; secure mode costs the same but for ``os.urandom``). Each phase:
the best of ``--repeats`` rounds (seeds 0, 1, ...), the CPU being shared.

    python benchmarks/secagg_cost.py [--d 10000] [--bits 16] [--repeats 3] [--cases 20:full,1000:k]
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch

from dpfl_lightning import rng
from dpfl_lightning.comm.secagg import SecAggRound, mod_sum


def default_neighbours(n: int) -> int:
    """The cost point of SecAgg+ used here: ``2 ceil(log2 n)`` (even); see the module docstring of
    :mod:`dpfl_lightning.comm.secagg` for choosing ``k`` against corruption and dropouts."""
    return 2 * math.ceil(math.log2(n))


def one_round(n: int, k: int | None, d: int, bits: int, seed: int = 0) -> dict[str, float]:
    cohort = list(range(n))
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 1 << bits, (n, d), generator=g, dtype=torch.int64)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    r = SecAggRound(cohort, bits, d, 0, rng.RandomSource(seed), neighbours=k)
    times["keys+shares"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for c in cohort:
        r.agree(c)
    times["agreement"] = time.perf_counter() - t0
    dropped = sorted(random.Random(seed).sample(cohort, round(n / 10)))
    survivors = [c for c in cohort if c not in set(dropped)]
    t0 = time.perf_counter()
    masked = torch.stack([r.mask(c, rows[c]) for c in survivors])
    times["expansion"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    total = mod_sum(masked, bits)
    times["sum"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = r.unmask(total, survivors, dropped)
    times["unmask"] = time.perf_counter() - t0
    if not torch.equal(out, mod_sum(rows[survivors], bits)):
        raise AssertionError("the unmasked sum differs from the survivors' sum")
    times["t"], times["k"], times["dropped"] = r.threshold, r.graph.degree, len(dropped)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=10_000)
    ap.add_argument("--bits", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per case; each phase's best is printed")
    ap.add_argument("--cases", type=str, default="20:full,100:full,100:k,1000:k",
                    help="n:full (SecAgg's complete graph) or n:k (SecAgg+, k = 2 ceil(log2 n)) or n:<k>")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; d={args.d}, bits={args.bits}, 10% dropped; seconds per round "
          f"(all clients' work plus the server's; best of {args.repeats} rounds per phase)")
    one_round(5, None, 16, args.bits)  # warm-up: first calls into the libraries
    cols = ["keys+shares", "agreement", "expansion", "sum", "unmask"]
    header = f"{'n':>6}{'k':>6}{'t':>5}{'drop':>6}" + "".join(f"{c:>13}" for c in cols)
    print(header + f"{'total':>10}{'per client':>12}")
    for case in args.cases.split(","):
        n_text, k_text = case.split(":")
        n = int(n_text)
        k = None if k_text == "full" else default_neighbours(n) if k_text == "k" else int(k_text)
        runs = [one_round(n, k, args.d, args.bits, seed) for seed in range(args.repeats)]
        t = {key: min(run[key] for run in runs) for key in runs[0]}  # the CPU is shared: best of the rounds
        total = sum(t[c] for c in cols)
        client = (t["keys+shares"] + t["agreement"] + t["expansion"]) / n
        print(f"{n:>6}{int(t['k']):>6}{int(t['t']):>5}{int(t['dropped']):>6}" + "".join(f"{t[c]:>13.3f}" for c in cols)
              + f"{total:>10.2f}{client:>12.4f}")


if __name__ == "__main__":
    main()
