"""The time per round that CorrelatedNoise's noise generation adds, on W2's CNN (0.88M parameters).

For each strategy: the seconds per round of drawing the round's rows of ``Z`` from the keyed stream,
the streaming generator's step (``(L Z)_t``) and the add onto the aggregate, against GaussianNoise's
central draw (independent noise, the same stream kind), at the model's ``d``. Also the one-off time
to optimise the factor (``banded``, ``blt``; cached on disk afterwards) and the secret state's size.

    OMP_NUM_THREADS=1 python benchmarks/correlated_noise_cost.py [--rounds 100] [--groups 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from round_overhead import cnn  # noqa: E402

from dpfl_lightning import rng  # noqa: E402
from dpfl_lightning.plugins.correlated_noise import build_strategy  # noqa: E402
from dpfl_lightning.privacy import matrix_factorization as mf  # noqa: E402
from dpfl_lightning.privacy.correlated_noise import noise_generator  # noqa: E402


def per_round(fn, rounds: int) -> float:
    start = time.perf_counter()
    for t in range(rounds):
        fn(t)
    return (time.perf_counter() - start) / rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = sum(p.numel() for p in cnn().parameters())
    random, T = rng.RandomSource(0), args.rounds
    aggregate = torch.zeros(d)
    print(f"W2 CNN: d = {d:,} parameters; T = {T} rounds, {args.groups} cyclic groups, {args.threads} thread(s)")

    def gaussian(t):
        random.stream(t, rng.SERVER_CLIENT, rng.CENTRAL_NOISE).add_normal_(aggregate, 0.1)

    base = per_round(gaussian, T)
    print(f"{'GaussianNoise (independent)':<30} {base * 1e3:8.2f} ms/round")
    cache = tempfile.mkdtemp()
    for kind in ("independent", "tree", "banded", "blt"):
        start = time.perf_counter()
        strategy = build_strategy(kind, mf.prefix_sum(T), args.groups, cache_dir=cache)
        built = time.perf_counter() - start

        def normal(t, rows):
            return random.stream(t, rng.SERVER_CLIENT, rng.CENTRAL_NOISE, tag="CorrelatedNoise").normal(
                (rows, d), 1.0, dtype=torch.float64)

        gen = noise_generator(strategy, d, normal)

        def step(t):
            aggregate.add_(gen.next(0.1).to(aggregate.dtype))

        cost = per_round(step, T)
        state = max(1, sum(x.numel() for x in gen.state_tensors()))
        print(f"CorrelatedNoise {kind:<14} {cost * 1e3:8.2f} ms/round (+{(cost - base) * 1e3:6.2f} vs independent); "
              f"factor {built:6.2f} s; state {state / d:.0f} x d = {state * 8 / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
