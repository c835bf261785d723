"""A light import: ``import dpfl_lightning`` and ``dpfl --help`` load none of the heavy libraries a run
may need (they load when it does), in a fresh interpreter each."""

import json
import os
import subprocess
import sys

HEAVY = ("opacus", "scipy", "matplotlib", "dp_accounting", "wandb", "torch", "lightning")
# What is measured is which modules a probe loads, never how long it takes: the timeout only ends a
# hung probe, so it is far above the slowest probe on a loaded machine (the probes that import torch,
# Lightning and Opacus took 70-74 s each on 2 cores at a load average of 8).
TIMEOUT_S = 900
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    return sorted(m for m in HEAVY if m in loaded)


def test_importing_the_package_loads_nothing_heavy():
    assert _loaded_after("import dpfl_lightning") == []


def test_dpfl_help_loads_nothing_heavy():
    code = "import sys\nsys.argv = ['dpfl', '--help']\nfrom dpfl_lightning.cli.command import main\nmain()"
    assert _loaded_after(code) == []


def test_the_package_names_still_import_and_a_plain_plugin_does_not_load_opacus():
    code = ("from dpfl_lightning import FederatedTrainer, FederatedLightningModule, FederatedDataModule\n"
            "from dpfl_lightning.plugins import GaussianNoise, UpdateClipping, DPSGD\n"
            "assert FederatedTrainer.__name__ == 'FederatedTrainer' and DPSGD.__name__ == 'DPSGD'")
    assert "opacus" not in _loaded_after(code)


def test_a_dpsgd_run_loads_opacus_when_it_sets_up(tmp_path):
    code = (f"import sys; sys.path.insert(0, 'tests')\n"
            "from helpers import TinyClassifier, quiet_trainer, tiny_data\n"
            "from dpfl_lightning.plugins import DPSGD\n"
            f"quiet_trainer({str(tmp_path)!r}, rounds=1, clients_per_round=2, "
            "plugins=[DPSGD(noise_multiplier=1.0)]).fit(TinyClassifier(), tiny_data(num_clients=4))")
    assert "opacus" in _loaded_after(code)


def test_the_sweep_launcher_imports_without_torch():
    assert _loaded_after("import dpfl_lightning.tracking.sweep") == []
