"""benchmarks/gpu_check.sh's CPU dry run: every check of the GPU script runs at tiny sizes (the 2-rank
launches under mpiexec and under torch.distributed alone included) and passes, so the script works
the day it meets a GPU."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 600  # ends a hung launch; the dry run takes ~30 s on a loaded 2-core machine


def test_the_gpu_check_s_dry_run_passes_every_check(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu_dry_run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    wanted = {"launcher", "time_W2", "time_L10", "gpu_equals_cpu_W2", "gpu_equals_cpu_L10", "ranks", "nccl_one_rank",
              "dpsgd", "bf16", "secure", "noise_streams", "control_variates_resume", "fold_big"}
    assert wanted <= set(results)
    assert {name: r for name, r in results.items() if "error" in r or "skipped" in r or r.get("ok") is False} == {}
    # the CPU stands in for the GPU: the two runs are the same run
    assert results["gpu_equals_cpu_W2"]["relative_difference"] == 0.0
    # both launchers ran, every communicator and workload compared against the 1-rank model
    assert set(results["ranks"]["same_bits"]) == {"mpi/W2", "mpi/L10", "gloo/W2", "gloo/L10",
                                                  "torch-gloo/W2", "torch-gloo/L10"}
    assert all(results["ranks"]["same_bits"].values())
    for workload in ("W2", "L10"):
        assert results[f"time_{workload}"]["hand"] > 0 and results[f"time_{workload}"]["framework"] > 0
    assert "gpu_check: 13 ok, 0 FAIL, 0 ERROR, 0 SKIPPED" in proc.stdout
