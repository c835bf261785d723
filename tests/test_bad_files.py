"""Bad data files end with one line naming the setting (exit status 2), never a traceback, and
never with advice to unpickle; the bundled MNIST and .npz configurations run on good files."""

import gzip
import os
import subprocess
import sys

import numpy as np
import pytest

from dpfl_lightning.cli import command as cli
from dpfl_lightning.data import NpzFile
from dpfl_lightning.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NPZ_CONFIG = os.path.join(ROOT, "configs", "npz_fedavg.yaml")
MNIST_CONFIG = os.path.join(ROOT, "configs", "mnist_dpfedavg.yaml")
SMALL = ["--trainer.rounds", "2", "--trainer.clients_per_round", "4", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_summary", "false", "--trainer.num_threads", "1", "--data.init_args.num_clients", "8"]


def _good_arrays(n=80, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return {"x_train": rng.random((n, 64), dtype=np.float32), "y_train": np.arange(n) % classes,
            "x_test": rng.random((20, 64), dtype=np.float32), "y_test": np.arange(20) % classes}


def _npz(tmp_path, name, **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


def _garbage(tmp_path):
    path = tmp_path / "garbage.npz"
    path.write_bytes(os.urandom(2000))
    return str(path)


def _truncated(tmp_path):
    good = _npz(tmp_path, "good.npz", **_good_arrays())
    with open(good, "rb") as f:
        data = f.read()
    path = tmp_path / "truncated.npz"
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def _object_array(tmp_path):
    arrays = _good_arrays()
    arrays["y_train"] = np.array([{"label": int(v)} for v in arrays["y_train"]], dtype=object)
    return _npz(tmp_path, "pickled.npz", **arrays)


def _npy(tmp_path):
    path = tmp_path / "array.npz"
    with open(path, "wb") as f:
        np.save(f, np.zeros((4, 4)))
    return str(path)


def _labels(tmp_path, y):
    arrays = _good_arrays()
    arrays["y_train"] = y
    return _npz(tmp_path, "labels.npz", **arrays)


def _assert_one_line(err, *needles):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("dpfl: error")]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    assert "Traceback" not in err and "allow_pickle" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    assert "Fix:" in errors[0]


def _dpfl(path, log_dir):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "dpfl_lightning", "fit", "--config", NPZ_CONFIG,
                             "--data.init_args.path", path, *SMALL, "--trainer.log_dir", log_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def test_cli_bad_files_exit_2_with_one_line(tmp_path):
    """The command as a user runs it (a subprocess): garbage bytes and labels outside the model's
    classes, both at set-up."""
    cases = {"garbage": (_garbage(tmp_path), ("data.path=", "garbage.npz", "not an .npz archive")),
             "labels": (_labels(tmp_path, np.arange(80) % 13),
                        ("data.path=", "labels.npz", "training labels span 0..12", "model.init_args.num_classes=10"))}
    # both at once: they spend most of their time importing
    procs = {name: _dpfl(path, str(tmp_path / "runs")) for name, (path, _) in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, err)
        _assert_one_line(err, *cases[name][1])
    assert not os.path.exists(tmp_path / "runs")  # refused before anything was written


@pytest.mark.parametrize("make,needle", [
    (_truncated, "truncated or corrupt"),
    (_object_array, "object (pickled) array"),
    (_npy, "single .npy array"),
    (lambda p: _labels(p, np.arange(80) % 10 - 1), "negative labels"),
    (lambda p: _labels(p, (np.arange(80) % 10) + 0.5), "non-integer labels"),
    (lambda p: _labels(p, np.arange(79) % 10), "y_train has shape [79], expected [80]"),
])
def test_bad_npz_files_are_one_config_error(tmp_path, capsys, make, needle):
    path = make(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", NPZ_CONFIG, "--data.init_args.path", path, *SMALL,
                  "--trainer.log_dir", str(tmp_path / "runs")])
    assert info.value.code == 2
    _assert_one_line(capsys.readouterr().err, "data.path=", needle)


def test_npz_labels_checked_against_declared_classes(tmp_path):
    data = NpzFile(_labels(tmp_path, np.arange(80) % 10), num_clients=4, num_classes=5)
    with pytest.raises(ConfigError, match=r"data\.path=.*labels span 0\.\.9, but data\.num_classes=5"):
        data.setup()
    data = NpzFile(_labels(tmp_path, np.arange(80) % 10), num_clients=4, num_classes=10)
    data.setup()
    assert data.num_clients == 4


def test_npz_config_runs(tmp_path):
    path = _npz(tmp_path, "digits.npz", **_good_arrays())
    cli.main(["fit", "--config", NPZ_CONFIG, "--data.init_args.path", path, *SMALL,
              "--trainer.log_dir", str(tmp_path / "runs")])
    assert os.path.isfile(tmp_path / "runs" / "npz_fedavg" / "version_0" / "metrics.csv")


def _idx(arr, magic):
    return np.array([magic, *arr.shape], dtype=">i4").tobytes() + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()


def test_mnist_config_runs_on_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "mnist"
    root.mkdir()
    files = {"train-images-idx3-ubyte": (rng.integers(0, 256, (40, 28, 28)), 0x803),
             "train-labels-idx1-ubyte": (np.arange(40) % 10, 0x801),
             "t10k-images-idx3-ubyte": (rng.integers(0, 256, (10, 28, 28)), 0x803),
             "t10k-labels-idx1-ubyte": (np.arange(10) % 10, 0x801)}
    for name, (arr, magic) in files.items():
        with gzip.open(root / (name + ".gz"), "wb") as f:
            f.write(_idx(arr, magic))
    cli.main(["fit", "--config", MNIST_CONFIG, "--data.init_args.root", str(root), *SMALL,
              "--trainer.log_dir", str(tmp_path / "runs")])
    assert os.path.isfile(tmp_path / "runs" / "mnist_dpfedavg" / "version_0" / "metrics.csv")
