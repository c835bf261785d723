"""Same configuration and seed, same model, whichever front door: Python (after
``lightning.seed_everything(seed)``, as with Lightning) or ``dpfl fit``; a Python run whose model was
built from an unseeded generator is told so; a Python run saves the model's and the data module's
classes and settings as the command line does."""

import hashlib
import warnings

import lightning as L
import pytest
import torch

from dpfl_lightning import FederatedTrainer
from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.algorithms import DPFedAvg
from dpfl_lightning.cli.command import main
from dpfl_lightning.data import Digits
from dpfl_lightning.models import MLPClassifier

CONFIG = """
trainer:
  rounds: 2
  clients_per_round: 8
  sampling: poisson
  batch_size: 8
  seed: {seed}
  num_threads: 1
  checkpoint_every: 2
  enable_progress_bar: false
  enable_summary: false
  log_dir: {log_dir}
  run_name: cli
  algorithm:
    class_path: dpfl_lightning.algorithms.DPFedAvg
    init_args: {{clip: 1.0, noise_multiplier: 1.0}}
model:
  class_path: dpfl_lightning.models.MLPClassifier
  init_args: {{in_features: 64, hidden: [32], num_classes: 10, lr: 0.3}}
data:
  class_path: dpfl_lightning.data.Digits
  init_args: {{num_clients: 40, partition: dirichlet, alpha: 0.5}}
"""


def _python_run(log_dir, seed, name="api"):
    """The configuration above, written in Python."""
    model = MLPClassifier(in_features=64, hidden=[32], num_classes=10, lr=0.3)
    trainer = FederatedTrainer(rounds=2, clients_per_round=8, sampling="poisson", batch_size=8, seed=seed,
                               num_threads=1, checkpoint_every=2, enable_progress_bar=False, enable_summary=False,
                               log_dir=log_dir, run_name=name, algorithm=DPFedAvg(clip=1.0, noise_multiplier=1.0))
    module = trainer.fit(model, Digits(num_clients=40, partition="dirichlet", alpha=0.5))
    return module.global_params.clone(), ckpt.load(f"{trainer.checkpoint_dir}/last.ckpt")


def _hash(params):
    return hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("seed", [0, 7])
def test_python_and_cli_give_the_same_model_and_configuration(tmp_path, seed):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(seed=seed, log_dir=tmp_path))
    main(["fit", "--config", str(cfg)])
    cli = ckpt.load(str(tmp_path / "cli" / "version_0" / "checkpoints" / "last.ckpt"))

    hashes = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):  # three runs in one process (a notebook): the global generator moved in between
            L.seed_everything(seed, verbose=False)
            params, saved = _python_run(str(tmp_path), seed, f"api{i}")
            hashes.add(_hash(params))
    assert hashes == {_hash(cli["global_params"])}
    assert not [w for w in caught if "seed_everything" in str(w.message)]
    assert saved["config"]["model"] == cli["config"]["model"]
    assert saved["config"]["data"] == cli["config"]["data"]  # names the data module and all its settings


def test_a_model_built_from_an_unseeded_generator_is_reported(tmp_path):
    torch.seed()  # a fresh random seed, as in a new process
    with pytest.warns(UserWarning, match=r"Fix: call lightning.seed_everything\(0\) before building the model"):
        _python_run(str(tmp_path), 0)
    L.seed_everything(0, verbose=False)
    with pytest.warns(UserWarning, match=r"trainer.seed=3, but .* was seeded with 0"):
        _python_run(str(tmp_path), 3)
