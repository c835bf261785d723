"""The behaviour every refactor must keep: the final global model and the final epsilon of every
shipped config in ``configs/`` (3 rounds) and of ``benchmarks/rank_invariance.py``'s run (3 rounds,
each placement).

``tests/data/behaviour_hashes.json`` holds, for each run, the SHA-256 of the final model's bytes, the
final epsilon, a summary of the model that survives float rounding (its size, norms, sum, eight fixed
coordinates, two fixed +-1 projections, and the norms of its move from the initial model) with a
tolerance for each of its numbers, and the fingerprint of the environment it was recorded in (Python,
platform, the versions of the numerical libraries, the CPU and the SIMD paths torch and numpy take).
A run is bit-reproducible only within one environment: another kernel, numpy release or CPU changes
the last bits of a sum, and a few rounds of training carry them into the model's hash. So
``tests/test_behaviour_hashes.py`` (1 rank) and ``tests/mpi/test_behaviour_ranks.py`` (2 ranks)
compare

- in the recorded environment: the SHA-256 and the epsilon exactly;
- in any other: each number of the summary within its tolerance, and epsilon within ``EPSILON_RTOL``.

A number's tolerance is measured when recording: ``SAFETY`` (10) times the most it moves over
``calibrations()``: the same run under torch's portable kernels and every SIMD path below this CPU's
(``ATEN_CPU_CAPABILITY=default``, ``=avx2`` on an AVX-512 CPU: what another CPU runs), and from an
initial model moved by ``PERTURBATION`` (1e-6, about 17 float32 ulps: larger than any kernel path's
rounding, which moved these runs by 10-20x less), at least ``FLOOR`` (about one float32 ulp). A
tolerance taken from one CPU's drift alone was no bound for another: a mechanism that rounds to
integers (``QUANTIZING``) turns a last-bit difference into another integer, and an AVX-512 CPU moved
the Skellam quickstart 20x further than the portable kernels had. Such a run is compared on what
averages a flipped integer out (norms, sum, projections, its move's norms), never on single
coordinates, with tolerances from the perturbed start, which flips more integers than a CPU does;
epsilon, a function of public settings computed in float64, within ``EPSILON_RTOL`` everywhere. Runs
that amplify rounding (DP-SGD) get wide tolerances, smooth ones narrow: a 1% change of the learning
rate still fails the plain and the quantizing runs (``tests/test_behaviour_hashes.py``). ``.ci/run``
runs these tests under each of those kernel paths and under numpy's baseline (no runtime dispatch).

The checks that need no table are exact everywhere: the same run twice gives the same hash, and two
ranks reach one rank's hash. Record anew only for a change that is meant to change behaviour, and say
why in the commit. One command, in any environment (its fingerprint replaces the old one; every other
environment then compares within tolerance, so a record here breaks no other machine):

    python tests/behaviour.py --record

Without ``--record`` it prints each run's comparison against the table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import gzip
import hashlib
import json
import math
import os
import platform
import re
import sys
import tempfile
from importlib import metadata

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "tests", "data", "behaviour_hashes.json")
ROUNDS = 3
ROUNDS_FOR = {"dp_scaffold_synthetic.yaml": 7}  # its warm start takes 5 rounds
PLACEMENTS = ("central", "local", "distributed")
MODEL_RTOL = 1e-6  # where no tolerance was recorded
SAFETY, FLOOR = 10.0, 1e-7  # a recorded tolerance: 10x the drift another kernel path causes, >= ~1 float32 ulp
EPSILON_RTOL = 1e-6  # accountants drift across environments: 1.4e-8 measured (dp_scaffold_synthetic, RDP)
PERTURBATION = 1e-6  # relative move of the initial weights: ~17 float32 ulps, 10-20x any kernel path's drift measured
QUANTIZING = ("DiscreteDistributedNoise",)  # plugins that round to integers: a last-bit change can flip an integer
COORDINATES = 8
# What can change the bits of a run: the numerical libraries, and the CPU paths they dispatch to.
PACKAGES = ("torch", "numpy", "scipy", "scikit-learn", "dp-accounting", "opacus", "lightning", "torchmetrics", "mpmath")
CPU_SETTINGS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE",
                "NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES")
SIMD_FLAG = re.compile(r"sse\w*|ssse3|avx\w*|fma\w*|f16c|amx\w*|neon|asimd\w*|sve\d*|sme\d*")


def shipped_configs() -> list[str]:
    """Every ``dpfl fit`` config in configs/ (the sweeps' base configs too, not the sweep files)."""
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    paths += sorted(glob.glob(os.path.join(ROOT, "configs", "sweeps", "*_base.yaml")))
    return [os.path.relpath(p, ROOT) for p in paths]


def run_keys() -> list[str]:
    return shipped_configs() + [f"rank_invariance/{p}" for p in PLACEMENTS]


# ---- the environment ------------------------------------------------------------------------------

def _cpu() -> tuple[str, str]:
    """The CPU's model name and its SIMD flags (Linux; elsewhere what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine(), ""
    model = re.search(r"^(model name|Hardware|CPU part)\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^(flags|Features)\s*:\s*(.*)$", info, re.M)
    simd = sorted({f for f in flags.group(2).split() if SIMD_FLAG.fullmatch(f)}) if flags else []
    return (model.group(2).strip() if model else platform.machine()), " ".join(simd)


def _numpy_cpu_features() -> str:
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as features
    return " ".join(sorted(k for k, on in features.items() if on))


def environment() -> dict[str, str]:
    """The fingerprint of this environment: equal fingerprints run the same bits."""
    import torch

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "absent"

    model, simd = _cpu()
    fingerprint = {"python": f"{platform.python_implementation()} {platform.python_version()}",
                   "platform": " ".join([platform.system(), platform.machine(), *platform.libc_ver()]).strip(),
                   "cpu": model, "cpu_simd_flags": simd,
                   "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                   "numpy_cpu_features": _numpy_cpu_features()}
    fingerprint.update({package: version(package) for package in PACKAGES})
    fingerprint.update({f"${name}": os.environ[name] for name in CPU_SETTINGS if name in os.environ})
    return fingerprint


# ---- one run's record -----------------------------------------------------------------------------

def digest(params) -> str:
    return hashlib.sha256(params.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def summary(params, initial=None) -> dict[str, object]:
    """What float rounding moves only slightly: size, norms, sum, fixed coordinates, +-1 projections,
    and the norms of the move from the initial model (``initial``, if known).

    The projections' signs come from integer arithmetic on the index (no RNG, no library), and are
    scaled by 1/sqrt(size) so that, like a coordinate, they are of the size of the model's RMS. The
    move's norms are what tells a change in a run whose model moves by a few float32 ulps in 3 rounds
    (the quadratic configs): a 1% learning-rate change moves them by ~1%, rounding by far less."""
    x = params.detach().cpu().double().flatten().numpy()
    n = x.size
    at = sorted({round(k * (n - 1) / (COORDINATES - 1)) for k in range(COORDINATES)})
    i = np.arange(n, dtype=np.uint64)
    signs = [1.0 - 2.0 * ((((i + k) * np.uint64(2654435761)) >> np.uint64(13)) & np.uint64(1)).astype(np.float64)
             for k in (1, 2)]
    out = {"size": int(n), "norm2": float(np.sqrt(np.dot(x, x))), "norm1": float(np.abs(x).sum()),
           "sum": float(x.sum()), "coordinates": {str(j): float(x[j]) for j in at},
           "projections": [float(np.dot(s, x) / math.sqrt(n)) for s in signs], "moved": None}
    if initial is not None and initial.numel() == n:
        d = x - initial.detach().cpu().double().flatten().numpy()
        out["moved"] = {"norm2": float(np.sqrt(np.dot(d, d))), "norm1": float(np.abs(d).sum())}
    return out


def record_of(params, epsilon: float, initial=None, quantized: bool = False) -> dict[str, object]:
    return {"sha256": digest(params), "epsilon": None if math.isinf(epsilon) else float(epsilon),
            "model": summary(params, initial), "quantized": quantized}


def _quantizes(trainer) -> bool:
    return any(type(p).__name__ in QUANTIZING for p in trainer.plugins)


def _signs(n: int, k: int = 3):
    """Fixed +-1 signs of ``n`` indices from integer arithmetic on the index (no RNG, no library)."""
    i = np.arange(n, dtype=np.uint64)
    return 1.0 - 2.0 * ((((i + k) * np.uint64(2654435761)) >> np.uint64(13)) & np.uint64(1)).astype(np.float64)


@contextlib.contextmanager
def initial_model(perturb: float = 0.0):
    """Within: ``FederatedTrainer.fit`` notes the model it is given, as one flat vector in the order of
    its parameters (the order of the trainer's flat buffers), in the list this yields. ``perturb`` > 0
    first moves each initial weight ``w`` to ``w (1 + perturb s)`` with fixed signs ``s`` (the
    calibration's stand-in for another CPU's rounding, made larger than any: ``PERTURBATION``)."""
    import torch

    from dpfl_lightning import FederatedTrainer

    seen: list = []
    fit = FederatedTrainer.fit

    def noting_fit(self, module, *args, **kwargs):
        if hasattr(module, "parameters"):
            with torch.no_grad():
                for j, p in enumerate(module.parameters() if perturb else ()):
                    s = torch.as_tensor(_signs(p.numel(), j), dtype=p.dtype).reshape(p.shape)
                    p.mul_(1 + perturb * s)
            seen.append(torch.cat([p.detach().flatten() for p in module.parameters()]).clone())
        return fit(self, module, *args, **kwargs)

    FederatedTrainer.fit = noting_fit
    try:
        yield seen
    finally:
        FederatedTrainer.fit = fit


# ---- the runs -------------------------------------------------------------------------------------

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


def fresh_run_config(config: str, extra: tuple[str, ...] = (), perturb: float = 0.0) -> dict[str, object]:
    """``dpfl fit --config <config> [extra]`` for 3 rounds in this process: the final model's record
    (``perturb``: see ``initial_model``)."""
    from dpfl_lightning.cli.command import build_parser, parse, run_fit

    os.environ.setdefault("WANDB_MODE", "disabled")
    rounds = ROUNDS_FOR.get(os.path.basename(config), ROUNDS)
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["fit", "--config", os.path.join(ROOT, config), "--trainer.rounds", str(rounds),
                "--trainer.log_dir", tmp, "--trainer.enable_progress_bar", "false",
                "--trainer.num_threads", "1", *_data_arguments(config, tmp), *extra]
        parser = build_parser()
        with initial_model(perturb) as initial:
            trainer = run_fit(parser, parse(parser, argv))
        eps = trainer.epsilon()
    return record_of(trainer.module.global_params, eps, initial[0] if initial else None, _quantizes(trainer))


def fresh_run_rank_invariance(placement: str, communicator: str = "auto", perturb: float = 0.0) -> dict[str, object]:
    """benchmarks/rank_invariance.py's DP-FedAvg run (3 rounds) under however many ranks launched this
    (``communicator="local"``: this rank alone)."""
    if os.path.join(ROOT, "benchmarks") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from rank_invariance import fit

    with initial_model(perturb) as initial:
        trainer, module = fit(placement, ROUNDS, communicator=communicator)
    return record_of(module.global_params, trainer.epsilon(), initial[0] if initial else None, _quantizes(trainer))


@functools.lru_cache(maxsize=None)
def _cached(key: str, perturb: float = 0.0) -> str:
    run = (fresh_run_rank_invariance(key.split("/")[1], perturb=perturb) if key.startswith("rank_invariance/")
           else fresh_run_config(key, perturb=perturb))
    return json.dumps(run)


def run(key: str, perturb: float = 0.0) -> dict[str, object]:
    """The record of run ``key`` (a config's path or ``rank_invariance/<placement>``), computed once per
    process: the table's check and the same-environment checks share it."""
    return json.loads(_cached(key, perturb))


# ---- the table and the comparison -----------------------------------------------------------------

def load_table(path: str = TABLE) -> dict[str, object]:
    with open(path) as f:
        return json.load(f)


def quantities(record: dict[str, object]) -> dict[str, tuple[float, float]]:
    """The summary's numbers, each with the scale its tolerance is relative to: the norms themselves,
    the sum the 1-norm, coordinates and projections the model's RMS, the move's norms themselves."""
    m = record["model"]
    tiny = sys.float_info.min
    rms = max(m["norm2"] / math.sqrt(m["size"]), tiny)
    out = {"norm2": (m["norm2"], max(m["norm2"], tiny)), "norm1": (m["norm1"], max(m["norm1"], tiny)),
           "sum": (m["sum"], max(m["norm1"], tiny))}
    out.update({f"coordinate {j}": (v, rms) for j, v in m["coordinates"].items()})
    out.update({f"projection {k}": (v, rms) for k, v in enumerate(m["projections"])})
    out.update({f"moved {k}": (v, max(v, tiny)) for k, v in (m.get("moved") or {}).items()})
    return out


def tolerances(native: dict[str, object], perturbed: dict[str, object]) -> dict[str, float]:
    """Each quantity's relative tolerance: ``SAFETY`` times how far it moved when only the CPU kernels
    changed (``perturbed``: the same run under ``ATEN_CPU_CAPABILITY=default``), at least ``FLOOR``."""
    here, there = quantities(native), quantities(perturbed)
    return {q: max(FLOOR, SAFETY * abs(there[q][0] - v) / scale) for q, (v, scale) in here.items() if q in there}


def _epsilon_differences(want, got, exact: bool) -> list[str]:
    if want is None or got is None or exact:
        return [] if got == want else [f"epsilon: {got!r} against the recorded {want!r}"]
    if abs(got - want) <= EPSILON_RTOL * abs(want):
        return []
    return [f"epsilon: {got!r} against the recorded {want!r} (off by {abs(got - want) / abs(want):.1e}, "
            f"tolerance {EPSILON_RTOL:.0e})"]


def _summary_differences(recorded: dict[str, object], observed: dict[str, object]) -> list[str]:
    want, got = quantities(recorded), quantities(observed)
    if recorded["model"]["size"] != observed["model"]["size"] or set(want) != set(got):
        return [f"model size: {observed['model']['size']} against the recorded {recorded['model']['size']}"]
    rtol = recorded.get("tolerance") or {}
    out = []
    for q, (value, scale) in want.items():
        if recorded.get("quantized") and q.startswith("coordinate"):
            continue  # one flipped integer moves single coordinates; the norms, sum and projections average it
        off, allowed = abs(got[q][0] - value) / scale, rtol.get(q, MODEL_RTOL)
        if off > allowed:
            out.append(f"{q}: {got[q][0]!r} against the recorded {value!r} (off by {off:.1e} of its scale "
                       f"{scale:.3g}; tolerance {allowed:.1e})")
    return out


def differences(recorded: dict[str, object], observed: dict[str, object], exact: bool) -> list[str]:
    """How ``observed`` differs from ``recorded``: bit for bit when ``exact`` (the recorded environment),
    otherwise each number of the model's summary within its recorded tolerance (``MODEL_RTOL`` where
    none was recorded) and epsilon within ``EPSILON_RTOL``."""
    out = _epsilon_differences(recorded["epsilon"], observed["epsilon"], exact)
    if not exact:
        return out + _summary_differences(recorded, observed)
    if observed["sha256"] != recorded["sha256"]:
        loose = "differs beyond tolerance too" if _summary_differences(recorded, observed) else (
            "is within tolerance: only the bits moved; a library or CPU setting the fingerprint misses?")
        out.append(f"sha256: {observed['sha256'][:16]}... against the recorded {recorded['sha256'][:16]}... "
                   f"(the model's summary {loose})")
    return out


def fingerprint_differences(recorded: dict[str, str], here: dict[str, str]) -> list[str]:
    return [f"{k}: {here.get(k, '(unset)')!r} here, {recorded.get(k, '(unset)')!r} recorded"
            for k in sorted(set(recorded) | set(here)) if recorded.get(k) != here.get(k)]


def check(key: str, observed: dict[str, object], table: dict[str, object] | None = None) -> list[str]:
    """``differences`` against the table's record of ``key``, exact iff this is the recorded environment."""
    table = load_table() if table is None else table
    exact = table["environment"] == environment()
    return differences(table["runs"][key], observed, exact)


def _report(key: str, observed: dict[str, object], table: dict[str, object] | None) -> str:
    line = f"{key:<44}{observed['sha256'][:16]}  {observed['epsilon']}"
    if table is None or key not in table["runs"]:
        return line
    found = check(key, observed, table)
    return line + ("  ok" if not found else "  DIFFERS: " + "; ".join(found))


def calibrations() -> list[tuple[str, dict[str, str], float]]:
    """The perturbed runs a tolerance is measured on: (name, environment settings, ``perturb``). torch's
    portable kernels and every SIMD path below this CPU's (what another CPU runs), and this CPU's kernels
    from an initial model moved by ``PERTURBATION`` (larger than any kernel path's rounding)."""
    import torch

    native = torch.backends.cpu.get_cpu_capability()
    out = [("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}, 0.0)] if native != "DEFAULT" else []
    if native.startswith("AVX512"):
        out.append(("ATEN_CPU_CAPABILITY=avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, 0.0))
    return out + [(f"initial model x (1 +- {PERTURBATION:g})", {}, PERTURBATION)]


def calibrated(runs: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    """``runs`` with each one's ``tolerance``: per quantity the largest of ``tolerances`` over the same
    runs under each of ``calibrations()``, each in a subprocess."""
    import subprocess

    found = {key: {} for key in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for name, settings, perturb in calibrations():
            print(f"calibrating: {name}")
            out = os.path.join(tmp, "runs.json")
            env = {**os.environ, **settings, "WANDB_MODE": "disabled"}
            subprocess.run([sys.executable, os.path.abspath(__file__), "--calibrate", out, "--perturb", repr(perturb)],
                           env=env, check=True, stdout=subprocess.DEVNULL)
            perturbed = load_table(out)
            for key, run in runs.items():
                for q, t in tolerances(run, perturbed[key]).items():
                    found[key][q] = max(t, found[key].get(q, 0.0))
    return {key: {**run, "tolerance": found[key]} for key, run in runs.items()}


def _write(path: str, content: dict[str, object]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(content, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help=f"write {os.path.relpath(TABLE, ROOT)}")
    ap.add_argument("--calibrate", metavar="PATH", help="(used by --record) write the runs' records to PATH")
    ap.add_argument("--perturb", type=float, default=0.0, help="(with --calibrate) see initial_model")
    args = ap.parse_args()
    if args.calibrate:
        _write(args.calibrate, {key: run(key, args.perturb) for key in run_keys()})
        return
    old = load_table() if os.path.exists(TABLE) else None
    old = old if old is not None and "environment" in old else None  # none yet, or the 1-environment format
    if old is not None:
        same = old["environment"] == environment()
        print("the recorded environment: exact comparison" if same else
              "another environment than the recorded one (tolerance):\n  "
              + "\n  ".join(fingerprint_differences(old["environment"], environment())))
    runs = {key: run(key) for key in run_keys()}
    for key, observed in runs.items():
        print(_report(key, observed, old))
    if args.record:
        _write(TABLE, {"about": "tests/behaviour.py; re-record with: python tests/behaviour.py --record",
                       "environment": environment(), "runs": calibrated(runs)})
        print(f"wrote {os.path.relpath(TABLE, ROOT)}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
