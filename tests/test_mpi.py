"""Launch the MPI tests (tests/mpi) under ``mpiexec -n 2 python -m mpi4py``, and check that a rank
that fails ends the whole job with its error shown instead of hanging."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def test_mpi_suite_under_two_ranks():
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "-x",
                           "-p", "no:cacheprovider", "tests/mpi"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "passed" in proc.stdout and "skipped" not in proc.stdout


def test_a_failing_rank_aborts_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        from helpers import TinyClassifier, quiet_trainer, tiny_data

        class Boom(TinyClassifier):
            def training_step(self, batch, batch_idx):
                if self.trainer.global_rank == 1:
                    raise RuntimeError("boom on rank 1")
                return super().training_step(batch, batch_idx)

        quiet_trainer({str(tmp_path)!r}, rounds=3, clients_per_round=6).fit(Boom(), tiny_data())
    """))
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", str(script)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "boom on rank 1" in proc.stderr + proc.stdout
