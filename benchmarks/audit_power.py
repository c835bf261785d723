"""Can ``dpfl audit`` fail? Its verdict on five planted privacy bugs and on honest configurations.

The planted bugs (``tests/planted_bugs.py``) are user plugins that declare the honest mechanism, so
the ledger accounts it, and do less: central noise 2x below, a clip at 10 C, a clip skipped for half
the clients, local noise 4x below, central noise on half the coordinates. Each row runs ``dpfl audit``
in a fresh interpreter on a small configuration (500 clients of SyntheticLogistic, a 10-128-10 MLP,
Poisson q = 0.05, 20 rounds, clip 1, z = 2, 250 canaries) and prints what the command printed: the
ledger's epsilon (models), the Gaussian-fit estimate, the Gaussian-DP bound, the noise check's bound
on the observed std, the verdict and the exit status (0 consistent, 3 violated, 4 suspect, 5 cannot
detect). ``--shipped`` adds the shipped DP configs under ``configs/`` (slower: minutes each).

    PYTHONPATH=tests python benchmarks/audit_power.py [--shipped]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
P = "dpfl_lightning.plugins"
CLIP = {"class_path": f"{P}.UpdateClipping", "init_args": {"max_norm": 1.0}}


def noise(cls: str = f"{P}.GaussianNoise", **args) -> dict:
    return {"class_path": cls, "init_args": {"noise_multiplier": 2.0, **args}}


ROWS = {  # name -> (is a bug, plugins, trainer settings)
    "bug: noise 2x below (central)": (True, [CLIP, noise("planted_bugs.HalfNoise")], {}),
    "bug: clip at 10 C": (True, [{**CLIP, "class_path": "planted_bugs.LooseClip"}, noise()], {}),
    "bug: clip skipped for half": (True, [{**CLIP, "class_path": "planted_bugs.HalfSkippedClip"}, noise()], {}),
    "bug: local noise 4x below": (True, [CLIP, noise("planted_bugs.QuarterLocalNoise")], {}),
    "bug: noise on half the coords": (True, [CLIP, noise("planted_bugs.HalfCoordinateNoise")], {}),
    "honest: central, Poisson": (False, [CLIP, noise()], {}),
    "honest: central, uniform": (False, [CLIP, noise()], {"sampling": "uniform"}),
    "honest: local": (False, [CLIP, noise(placement="local")], {}),
    "honest: distributed": (False, [CLIP, noise(placement="distributed")], {}),
    "honest: adaptive clip, central": (False, [{"class_path": f"{P}.AdaptiveClip", "init_args": {}}, noise()], {}),
    "honest: adaptive clip, distr.": (False, [{"class_path": f"{P}.AdaptiveClip", "init_args": {"placement":
                                                                                              "distributed"}},
                                              noise(placement="distributed")], {}),
    "honest: central, uniform, z=1": (False, [CLIP, noise(noise_multiplier=1.0)], {"sampling": "uniform"}),
}
SHIPPED = ("quickstart.yaml", "adaptive_clipping_digits.yaml", "dp_scaffold_synthetic.yaml", "clip_quadratic.yaml",
           "normfedavg_quadratic.yaml", "cdp_fedexp_linear.yaml", "ldp_fedexp_privunit.yaml", "dp_scaffnew_quadratic.yaml")


def config(plugins: list, trainer: dict, log_dir: str) -> dict:
    t = {"rounds": 20, "clients_per_round": 25, "sampling": "poisson", "local_steps": 1, "batch_size": 4, "seed": 0,
         "num_threads": 1, "enable_progress_bar": False, "enable_summary": False, "log_dir": log_dir,
         "plugins": plugins, **trainer}
    return {"trainer": t,
            "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                      "init_args": {"in_features": 10, "hidden": [128], "num_classes": 10, "lr": 0.5}},
            "data": {"class_path": "dpfl_lightning.data.SyntheticLogistic",
                     "init_args": {"num_clients": 500, "samples_per_client": 12, "test_samples_per_client": 4,
                                   "dim": 10}}}


def audit(path: str, *args: str) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "dpfl_lightning.cli.command", "audit", "--config", path, *args],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return p.returncode, p.stdout, time.perf_counter() - t0


def summary(out: str) -> tuple[str, str, str, str, str]:
    """(ledger eps, estimate, GDP bound, noise check, verdict) from the command's output."""
    rows = [line for line in out.splitlines() if line.startswith(("only the final", "every round", "the server"))]
    noise_rows = [line for line in out.splitlines() if line.startswith("noise in")]
    first = rows[0].split() if rows else []
    ledger = next((w for w in first if w[0].isdigit()), "-")
    est = gdp = "-"
    if rows:  # the threat model with the largest estimate
        cells = [r[34:].split(None, 1)[1] if len(r) > 34 else "" for r in rows]
        est = max((c[:30].strip() for c in cells), key=lambda c: float(c.split()[0]) if c[:1].isdigit() else -1)
        gdp = max((c[30:64].strip() for c in cells), key=lambda c: float(c.split()[0]) if c[:1].isdigit() else -1)
    check = "; ".join(r[47:77].strip() for r in noise_rows) or "-"
    verdict = next((line.split(":")[0].replace("this audit cannot detect a violation here", "cannot detect")
                    for line in reversed(out.splitlines()) if line.startswith(
                        ("VIOLATED", "SUSPECT", "consistent", "this audit cannot"))), "-")
    return ledger, est, gdp, check, verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shipped", action="store_true", help="also audit the shipped DP configs")
    parser.add_argument("--only", default=None, help="rows whose name contains this")
    a = parser.parse_args()
    fmt = "{:<32} {:<9} {:<24} {:<18} {:<26} {:<18} {:>4} {:>6}"
    print(fmt.format("configuration", "ledger", "estimate", "GDP bound", "noise check", "verdict", "exit", "s"))
    with tempfile.TemporaryDirectory(prefix="audit-power-") as tmp:
        jobs = [(n, b, config(p, t, tmp), ("--canaries", "250")) for n, (b, p, t) in ROWS.items()]
        if a.shipped:
            jobs += [(f"shipped: {s}", False, str(ROOT / "configs" / s), ()) for s in SHIPPED]
        for name, _, cfg, args in jobs:
            if a.only and a.only not in name:
                continue
            path = cfg
            if isinstance(cfg, dict):
                path = os.path.join(tmp, "audit.yaml")
                Path(path).write_text(yaml.safe_dump(cfg))
            code, out, secs = audit(path, *args)
            print(fmt.format(name, *summary(out), code, f"{secs:.0f}"), flush=True)


if __name__ == "__main__":
    main()
