"""What keyed randomness costs: N(0, 1) draws per stream kind, against torch's own generator.

- ``torch.randn (manual_seed)``: torch's CPU generator seeded the usual way -- which keeps only 32
  bits of the seed (the old, unsound keying);
- ``simulation stream``: :mod:`dpfl_lightning.rng`'s 128-bit key expanded into the Mersenne
  Twister's whole state, then ``torch.randn`` (key derivation and expansion included);
- ``secure stream``: SHAKE-256 in counter mode, Box-Muller in float64, the sum of four Gaussians.

    python benchmarks/rng_cost.py [--threads 1] [--sizes 1e6,1e8]
"""

from __future__ import annotations

import argparse
import time

import torch

from dpfl_lightning import rng


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", type=str, default="1e6,1e8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sim, sec = rng.RandomSource(0), rng.RandomSource(0, rng.new_secret())
    print(f"torch {torch.__version__}, {args.threads} thread(s); seconds for n float32 N(0,1) draws (best of runs)")
    print(f"{'n':>12}{'torch.randn':>14}{'simulation':>14}{'ratio':>8}{'secure':>12}{'ratio':>8}")
    for n in (int(float(x)) for x in args.sizes.split(",")):
        repeats = 5 if n <= 10**7 else 1
        base = best_of(lambda: torch.randn(n, generator=torch.Generator().manual_seed(1234)), repeats)
        simulation = best_of(lambda: sim.stream(0, 1, rng.CLIENT_NOISE).normal((n,), 1.0), repeats)
        secure = best_of(lambda: sec.stream(0, 1, rng.CLIENT_NOISE).normal((n,), 1.0), max(1, repeats // 2))
        print(f"{n:>12.0e}{base:>14.4f}{simulation:>14.4f}{simulation / base:>8.2f}{secure:>12.3f}{secure / base:>8.1f}")
    small = best_of(lambda: [sim.stream(r, 1, rng.CLIENT_NOISE) for r in range(1000)], 3) / 1000
    print(f"opening one simulation stream (key + state expansion): {small * 1e6:.1f} us")


if __name__ == "__main__":
    main()
