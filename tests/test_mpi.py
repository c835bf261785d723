"""Launch the MPI tests (tests/mpi) under ``mpiexec -n 2 python -m mpi4py``; check that a rank that
fails ends the whole job with its error shown instead of hanging, and that a SIGTERM to ``mpiexec``
stops the quickstart with a checkpoint and a resume command that reaches the uninterrupted model."""

import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import torch

from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.cli.command import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
# Timeouts end a hung launch, never judge speed: each is far above its run's time on a loaded machine.
SUITE_TIMEOUT_S = 2400
RUN_TIMEOUT_S = 600


def test_mpi_suite_under_two_ranks():
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "-x",
                           "-p", "no:cacheprovider", "tests/mpi"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=SUITE_TIMEOUT_S)
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
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode != 0
    assert "dpfl: error (rank 1): RuntimeError: boom on rank 1" in proc.stderr  # one line, before the abort


def test_the_failing_rank_s_reason_reaches_the_output_before_the_abort(tmp_path):
    # The launcher's proxy forwards a rank's stderr; an MPI_Abort right after a write ended it before it
    # forwarded the last line in ~1 of 10 runs (60 KB of traceback before it). report_failure waits until
    # the line was read. errors.py is loaded on its own (the package would import torch: seconds a run).
    script = tmp_path / "report.py"
    script.write_text(textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("errors", {os.path.join(ROOT, 'dpfl_lightning', 'errors.py')!r})
        errors = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(errors)
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.Get_rank() == 1:
            sys.stderr.write(("  File ..., line 1, in training_step" + " " * 64 + "\\n") * 600)
            errors.report_failure(RuntimeError("boom on rank 1"), 1, 2)
            comm.Abort(1)
        comm.Barrier()  # rank 0 waits, as in a round's all-reduce
    """))
    runs = [subprocess.Popen(["mpiexec", "-n", "2", sys.executable, str(script)], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(16)]
    outputs = [proc.communicate(timeout=RUN_TIMEOUT_S) for proc in runs]
    assert all(proc.returncode != 0 for proc in runs)
    lost = [i for i, (_, err) in enumerate(outputs) if "dpfl: error (rank 1): RuntimeError: boom on rank 1" not in err]
    assert lost == []


QUICKSTART = ["--config", "configs/quickstart.yaml", "--trainer.rounds", "20", "--trainer.clients_per_round", "10",
              "--trainer.local_epochs", "1", "--trainer.num_threads", "1", "--trainer.enable_progress_bar", "false"]


def test_sigterm_to_mpiexec_checkpoints_and_the_printed_command_resumes_the_quickstart(tmp_path, monkeypatch):
    # The quickstart as the README runs it (its own config, relative paths), under two ranks; the signal
    # goes to mpiexec, which forwards it to the ranks (as Slurm's, through the batch script).
    os.makedirs(tmp_path / "configs")
    shutil.copy(os.path.join(ROOT, "configs", "quickstart.yaml"), tmp_path / "configs")
    os.makedirs(tmp_path / "ref")
    launch = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "dpfl_lightning", "fit"]
    proc = subprocess.Popen(launch + QUICKSTART, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = tmp_path / "runs" / "quickstart" / "version_0" / "checkpoints" / "round-000005.ckpt"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    command = next(ln for ln in err.splitlines() if ln.startswith("resume with: "))[len("resume with: "):]
    assert command.endswith(" --resume runs/quickstart/version_0/checkpoints/last.ckpt")  # the README's line
    stopped = ckpt.load(str(tmp_path / "runs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"))["round"]
    assert 5 <= stopped < 20

    # The printed command, run here in one process (a two-rank checkpoint resumes on any number of ranks;
    # two ranks resuming: tests/mpi/test_preemption_ranks.py), then the same run uninterrupted.
    words = shlex.split(command)
    assert words[:3] == ["mpiexec", "-n", "2"] and words[4:8] == ["-m", "mpi4py", "-m", "dpfl_lightning"]
    monkeypatch.chdir(tmp_path)
    main(words[8:])
    final = ckpt.load(os.path.join("runs", "quickstart", "version_0", "checkpoints", "last.ckpt"))  # resumed in place
    assert final["round"] == 20
    monkeypatch.chdir(tmp_path / "ref")
    shutil.copytree(tmp_path / "configs", "configs")
    main(["fit"] + QUICKSTART)
    uninterrupted = ckpt.load(os.path.join("runs", "quickstart", "version_0", "checkpoints", "last.ckpt"))
    assert torch.equal(final["global_params"], uninterrupted["global_params"])
