"""The behaviour every refactor must keep to the bit: the SHA-256 of the final global model and the
final epsilon of every shipped config in ``configs/`` (3 rounds) and of
``benchmarks/rank_invariance.py``'s run (3 rounds, each placement).

``tests/data/behaviour_hashes.json`` holds the values recorded before a behaviour-preserving move;
``tests/test_behaviour_hashes.py`` (1 rank) and ``tests/mpi/test_behaviour_ranks.py`` (2 ranks)
compare against them. Record anew only for a change that is meant to change behaviour, and say why
in the commit:

    python tests/behaviour.py --record
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import math
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "tests", "data", "behaviour_hashes.json")
ROUNDS = 3
ROUNDS_FOR = {"dp_scaffold_synthetic.yaml": 7}  # its warm start takes 5 rounds
PLACEMENTS = ("central", "local", "distributed")


def shipped_configs() -> list[str]:
    """Every ``dpfl fit`` config in configs/ (the sweeps' base configs too, not the sweep files)."""
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    paths += sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "*_base.yaml")))
    return [os.path.relpath(p, ROOT) for p in paths]


def _write_mnist(d: str, n_train: int = 120, n_test: int = 30) -> None:
    rng = np.random.default_rng(0)
    os.makedirs(d, exist_ok=True)
    arrays = (("train-images-idx3-ubyte", rng.integers(0, 256, (n_train, 28, 28)), 0x803),
              ("train-labels-idx1-ubyte", np.arange(n_train) % 10, 0x801),
              ("t10k-images-idx3-ubyte", rng.integers(0, 256, (n_test, 28, 28)), 0x803),
              ("t10k-labels-idx1-ubyte", np.arange(n_test) % 10, 0x801))
    for name, arr, magic in arrays:
        with gzip.open(os.path.join(d, name + ".gz"), "wb") as f:
            f.write(np.array([magic, *arr.shape], dtype=">i4").tobytes() + arr.astype(np.uint8).tobytes())


def _write_npz(path: str) -> None:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    np.savez(path, x_train=x[:1400] / 16, y_train=y[:1400], x_test=x[1400:] / 16, y_test=y[1400:])


def _data_arguments(config: str, tmp: str) -> list[str]:
    """Files the config reads from disk, written small (nothing is downloaded)."""
    name = os.path.basename(config)
    if name == "mnist_dpfedavg.yaml":
        _write_mnist(os.path.join(tmp, "mnist"))
        return ["--data.init_args.root", os.path.join(tmp, "mnist"), "--data.init_args.num_clients", "12",
                "--trainer.clients_per_round", "4"]
    if name == "npz_fedavg.yaml":
        _write_npz(os.path.join(tmp, "digits.npz"))
        return ["--data.init_args.path", os.path.join(tmp, "digits.npz")]
    if name == "pfl_digits.yaml":  # DP-SGD's accountant plans total_epochs = local_epochs x rounds
        return ["--trainer.algorithm.init_args.total_epochs", str(ROUNDS)]
    return []


def digest(params) -> str:
    return hashlib.sha256(params.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def run_config(config: str) -> dict[str, object]:
    """``dpfl fit --config <config>`` for 3 rounds in this process: the final model's hash and epsilon."""
    from dpfl_lightning.cli import build_parser, parse, run_fit

    os.environ.setdefault("WANDB_MODE", "disabled")
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["fit", "--config", os.path.join(ROOT, config), "--trainer.rounds", str(ROUNDS_FOR.get(os.path.basename(config), ROUNDS)),
                "--trainer.log_dir", tmp, "--trainer.enable_progress_bar", "false",
                "--trainer.num_threads", "1", *_data_arguments(config, tmp)]
        parser = build_parser()
        trainer = run_fit(parser, parse(parser, argv))
        eps = trainer.epsilon()
    return {"sha256": digest(trainer.module.global_params), "epsilon": None if math.isinf(eps) else eps}


def run_rank_invariance(placement: str) -> dict[str, object]:
    """benchmarks/rank_invariance.py's DP-FedAvg run (3 rounds) under however many ranks launched this."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from rank_invariance import fit

    trainer, module = fit(placement, ROUNDS)
    return {"sha256": digest(module.global_params), "epsilon": trainer.epsilon()}


def recorded() -> dict[str, dict[str, object]]:
    with open(TABLE) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help=f"write {os.path.relpath(TABLE, ROOT)}")
    args = ap.parse_args()
    table = {c: run_config(c) for c in shipped_configs()}
    table.update({f"rank_invariance/{p}": run_rank_invariance(p) for p in PLACEMENTS})
    for key, value in table.items():
        print(f"{key:<44}{value['sha256'][:16]}  {value['epsilon']}")
    if args.record:
        os.makedirs(os.path.dirname(TABLE), exist_ok=True)
        with open(TABLE + ".tmp", "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(TABLE + ".tmp", TABLE)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
