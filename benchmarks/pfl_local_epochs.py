"""Paper 004's (E, R) study on data that is here: at a fixed total of T = E x R local epochs, does
averaging after every epoch, (E, R) = (1, T), give the best accuracy under DP-SGD?

Setting (paper 004 Sec. 5, scaled to scikit-learn's digits): k = 10 clients, each an i.i.d. 10th of
the training set, all clients in every round; every client runs DP-SGD (Opacus; Poisson batches
of expected size 16, every record sampled with probability 16/143 for the public count of 143
records per client, clipping C = 1.0, SGD lr 0.3, momentum 0.5) and the server averages the
models (the PFL preset). T = 20; the noise is calibrated once per budget for the whole run (the
number of DP-SGD steps does not depend on the split), at delta = 1e-5, for paper 004's MNIST
budgets eps = 2.93 and 1.2; "no DP" is the same FedAvg with plain SGD. Prints the test accuracy
after the last round, mean +- std over seeds, and the DP-SGD overhead per round.

    python benchmarks/pfl_local_epochs.py [--seeds 5] [--total-epochs 20] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor

K_CLIENTS, BATCH, LR, MOMENTUM, CLIP, DELTA = 10, 16, 0.3, 0.5, 1.0, 1e-5
# the public records per client DP-SGD accounts (digits' 1437 training records split as 143 or 144 a
# client; the smallest, so every client is accounted at the rate B / 143 it was before this setting)
RECORDS = 143


def run(job: tuple[str, float | None, int, int, int]) -> tuple[str, int, int, float, float, float]:
    label, eps, E, R, seed = job
    import torch

    torch.set_num_threads(1)
    from dpfl_lightning import FederatedTrainer
    from dpfl_lightning.algorithms import PFL, FedAvg
    from dpfl_lightning.data import Digits
    from dpfl_lightning.models import MLPClassifier

    algorithm = FedAvg() if eps is None else PFL(target_epsilon=eps, delta=DELTA, max_grad_norm=CLIP, total_epochs=E * R)
    torch.manual_seed(seed)
    model = MLPClassifier(in_features=64, hidden=[32], num_classes=10, lr=LR, momentum=MOMENTUM)
    with tempfile.TemporaryDirectory() as log_dir:
        trainer = FederatedTrainer(rounds=R, local_epochs=E, batch_size=BATCH, algorithm=algorithm, seed=seed,
                                   records_per_client=RECORDS,
                                   eval_every=R, num_threads=1, log_dir=log_dir, enable_progress_bar=False,
                                   enable_summary=False)
        trainer.fit(model, Digits(num_clients=K_CLIENTS, partition="iid", seed=seed))
    last = trainer.history[-1]
    times = trainer.round_times  # a DP run's rows withhold round_time_s
    secs = statistics.mean(times[:-1]) if R > 1 else times[-1]
    return label, E, R, last["val_acc"], last.get("epsilon", float("nan")), secs / E  # seconds per local epoch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--total-epochs", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    T = args.total_epochs
    splits = [(E, T // E) for E in (1, 2, 4, 5, 10, 20) if T % E == 0]
    budgets = [("no DP", None), ("eps=2.93", 2.93), ("eps=1.2", 1.2)]
    jobs = [(label, eps, E, R, s) for label, eps in budgets for E, R in splits for s in range(args.seeds)]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(run, jobs))
    print(f"paper 004 (E, R) study on digits: k={K_CLIENTS} clients, T={T}, batch {BATCH}, C={CLIP}, "
          f"delta={DELTA}, {args.seeds} seeds; test accuracy after the last round")
    header = f"{'(E, R)':>9}" + "".join(f"{label:>20}" for label, _ in budgets)
    print(header)
    for E, R in splits:
        cells = []
        for label, _ in budgets:
            accs = [r[3] for r in results if r[0] == label and r[1] == E]
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            cells.append(f"{statistics.mean(accs):>13.3f} ± {sd:.3f}")
        print(f"{f'({E}, {R})':>9}" + "".join(f"{c:>20}" for c in cells))
    for label, _ in budgets[1:]:
        eps = [r[4] for r in results if r[0] == label]
        print(f"{label}: ledger epsilon after the run {min(eps):.3f}..{max(eps):.3f} (record-level, towards the server)")
    plain = statistics.median(r[5] for r in results if r[0] == "no DP")
    dp = statistics.median(r[5] for r in results if r[0] != "no DP")
    print(f"seconds per local epoch of the 10 clients (median): SGD {plain:.4f}, DP-SGD {dp:.4f}, ratio {dp / plain:.2f}")


if __name__ == "__main__":
    main()
