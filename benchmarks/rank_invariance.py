"""Same seed, 1, 2 and 4 ranks: the final global model is bit-identical.

Runs DP-FedAvg (clipping + noise in each placement) on synthetic data under ``mpiexec -n P`` for
each P, one torch thread per rank, and prints the SHA-256 of the final parameters and the seconds
per round. (On a 2-core machine 4 ranks oversubscribe the cores: compare the hashes, not the times.)

    python benchmarks/rank_invariance.py [--ranks 1 2 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile


def fit(placement: str, rounds: int, communicator: str = "auto"):
    """The DP-FedAvg run of this benchmark (every rank of the launch calls it): ``(trainer, module)``.
    ``communicator="local"`` runs it on the calling rank alone (one rank's reference inside a launch)."""
    from dpfl_lightning import FederatedTrainer
    from dpfl_lightning.data import SyntheticLogistic
    from dpfl_lightning.models import MLPClassifier
    from dpfl_lightning.plugins import GaussianNoise, ServerOptimizer, UpdateClipping

    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as log_dir:
        trainer = FederatedTrainer(rounds=rounds, clients_per_round=24, batch_size=10, seed=7, num_threads=1,
                                   communicator=communicator,
                                   plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement=placement),
                                            ServerOptimizer("sgd", lr=1.0, momentum=0.5)],
                                   eval_every=rounds, log_dir=log_dir, enable_progress_bar=False, enable_summary=False)
        module = trainer.fit(MLPClassifier(in_features=60, hidden=[200]),
                             SyntheticLogistic(num_clients=200, samples_per_client=50, test_samples_per_client=5, dim=60))
    return trainer, module


def worker(placement: str, rounds: int, out: str) -> None:
    trainer, module = fit(placement, rounds)
    if trainer.rank == 0:
        digest = hashlib.sha256(module.global_params.cpu().numpy().tobytes()).hexdigest()
        secs = sum(trainer.round_times) / len(trainer.round_times)  # round_time_s is withheld from a DP run's rows
        with open(out, "w") as f:
            json.dump({"sha256": digest, "s_per_round": secs, "world": trainer.world_size}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--worker", nargs=2, metavar=("PLACEMENT", "OUT"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.rounds, args.worker[1])
        return
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    print(f"{'placement':<12}{'ranks':>6}{'s/round':>10}  sha256 of final parameters")
    ok = True
    for placement in ("central", "local", "distributed"):
        digests = set()
        for p in args.ranks:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                subprocess.run(["mpiexec", "-n", str(p), sys.executable, "-m", "mpi4py", __file__, "--rounds",
                                str(args.rounds), "--worker", placement, tmp.name], check=True, env=env)
                with open(tmp.name) as f:
                    r = json.load(f)
            digests.add(r["sha256"])
            print(f"{placement:<12}{r['world']:>6}{r['s_per_round']:>10.3f}  {r['sha256'][:32]}")
        ok &= len(digests) == 1
    print("identical across rank counts:", "yes" if ok else "NO")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
