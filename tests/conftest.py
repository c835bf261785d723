import os

os.environ["WANDB_MODE"] = "disabled"  # never a live W&B run from a test, whatever the shell says
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def log_dir(tmp_path):
    return str(tmp_path / "runs")
