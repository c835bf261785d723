"""The time per round that CorrelatedNoise's noise generation adds, on W2's CNN (0.88M parameters).

For each strategy: the seconds per round of drawing the round's rows of ``Z`` from the keyed stream,
the streaming generator's step (``(L Z)_t``) and the add onto the aggregate, against GaussianNoise's
central draw (independent noise, the same stream kind), at the model's ``d``. Also the one-off time
to optimise the factor (``banded``, ``blt``; cached on disk afterwards) and the secret state's size.

    OMP_NUM_THREADS=1 python benchmarks/correlated_noise_cost.py [--rounds 100] [--groups 10] [--threads 1]

``--study`` runs issue 32's study instead (configs/ftrl_*.yaml's task: the quickstart's digits, 200
clients, 5 cyclic groups of 40, ``--rounds`` rounds): final test accuracy over ``--seeds`` seeds at
epsilon 1, 3, 10 (delta 1e-4) for independent noise, tree, banded and BLT under cyclic participation,
amplified banded (Poisson 0.5 inside the group), and DP-FedAvg with Poisson sampling (q = 0.2):

    OMP_NUM_THREADS=1 python benchmarks/correlated_noise_cost.py --study --rounds 30 --seeds 3
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


STUDY = {  # name: (trainer sampling settings, noise plugin factory)
    "independent": ({"sampling": "cyclic"}, lambda eps: ("CorrelatedNoise", "independent", eps)),
    "tree": ({"sampling": "cyclic"}, lambda eps: ("CorrelatedNoise", "tree", eps)),
    "banded": ({"sampling": "cyclic"}, lambda eps: ("CorrelatedNoise", "banded", eps)),
    "blt": ({"sampling": "cyclic"}, lambda eps: ("CorrelatedNoise", "blt", eps)),
    "amplified banded": ({"sampling": "amplified_cyclic", "sampling_rate": 0.5},
                         lambda eps: ("CorrelatedNoise", "banded", eps)),
    "DP-FedAvg Poisson": ({"sampling": "poisson", "sampling_rate": 0.2}, lambda eps: ("GaussianNoise", None, eps)),
}


def study_run(name: str, eps: float, seed: int, rounds: int) -> tuple[float, float]:
    """(final test accuracy, the ledger's epsilon) of one run of the study."""
    import lightning as L

    from dpfl_lightning import FederatedTrainer
    from dpfl_lightning.data import Digits
    from dpfl_lightning.models import MLPClassifier
    from dpfl_lightning.plugins import CorrelatedNoise, GaussianNoise, UpdateClipping

    sampling, noise = STUDY[name]
    kind, strategy, target = noise(eps)
    plugin = CorrelatedNoise(strategy, target_epsilon=target, delta=1e-4) if kind == "CorrelatedNoise" else \
        GaussianNoise(target_epsilon=target, delta=1e-4)
    L.seed_everything(seed, verbose=False)
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=40 if sampling["sampling"] != "poisson" else None,
                               local_epochs=2, batch_size=8, seed=seed, eval_every=rounds, test_after_fit=True,
                               plugins=[UpdateClipping(1.0), plugin], log_dir=tempfile.mkdtemp(),
                               enable_progress_bar=False, enable_summary=False, num_threads=1, **sampling)
    trainer.fit(MLPClassifier(in_features=64, hidden=[64], num_classes=10, lr=0.5),
                Digits(num_clients=200, partition="iid"))
    return float(trainer.final_metrics["test_acc"]), trainer.epsilon()


def study(rounds: int, seeds: int) -> None:
    import statistics
    import warnings

    warnings.simplefilter("ignore")
    print(f"| method (T = {rounds}, 5 groups) | eps 1 | eps 3 | eps 10 |")
    print("|---|---|---|---|")
    for name in STUDY:
        cells = []
        for eps in (1.0, 3.0, 10.0):
            accs = [study_run(name, eps, seed, rounds)[0] for seed in range(seeds)]
            cells.append(f"{statistics.mean(accs):.3f} +- {statistics.pstdev(accs):.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", action="store_true")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--float64", action="store_true", help="draw the rows in float64 (the plugin does for a float64 model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.study:
        study(args.rounds, args.seeds)
        return
    d = sum(p.numel() for p in cnn().parameters())
    random, T = rng.RandomSource(0), args.rounds
    aggregate = torch.zeros(d)
    print(f"W2 CNN: d = {d:,} parameters; T = {T} rounds, {args.groups} cyclic groups, {args.threads} thread(s)")

    def gaussian(t):
        random.stream(t, rng.SERVER_CLIENT, rng.CENTRAL_NOISE).add_normal_(aggregate, 0.1)

    base = per_round(gaussian, T)
    print(f"{'GaussianNoise (independent)':<30} {base * 1e3:8.2f} ms/round")
    cache = tempfile.mkdtemp()
    dtype = torch.float64 if args.float64 else torch.float32
    for kind in ("independent", "tree", "banded", "blt"):
        start = time.perf_counter()
        strategy = build_strategy(kind, mf.prefix_sum(T), args.groups, cache_dir=cache)
        built = time.perf_counter() - start

        def normal(t, rows):
            return random.stream(t, rng.SERVER_CLIENT, rng.CENTRAL_NOISE, tag="CorrelatedNoise").normal(
                (rows, d), 1.0, dtype=dtype)

        gen = noise_generator(strategy, d, normal)

        def step(t):
            aggregate.add_(gen.next(0.1).to(aggregate.dtype))

        cost = per_round(step, T)
        state = max(1, sum(x.numel() for x in gen.state_tensors()))
        print(f"CorrelatedNoise {kind:<14} {cost * 1e3:8.2f} ms/round (+{(cost - base) * 1e3:6.2f} vs independent); "
              f"factor {built:6.2f} s; state {state / d:.0f} x d = {state * dtype.itemsize / 2**20:.1f} MiB ({dtype})")


if __name__ == "__main__":
    main()
