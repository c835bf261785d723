"""Preemption: a real signal (delivered to this process at the end of a round) stops the run after
that round with a checkpoint, the resume command, status 128 + signal; resuming reaches the model
of the uninterrupted run. (Two ranks: tests/mpi/test_preemption_ranks.py; SIGTERM to mpiexec
running the quickstart: tests/test_mpi.py.)"""

import os
import signal
import subprocess
import time

import pytest
import torch

from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.run.preemption import Preempted, resume_command
from helpers import TinyClassifier, quiet_trainer, tiny_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SignalAt(FederatedCallback):
    """Sends this process ``signum`` (``times`` times) at the end of round ``at``, on rank ``rank``."""

    def __init__(self, signum: int, at: int, rank: int | None = None, times: int = 1) -> None:
        self.signum, self.at, self.rank, self.times = signum, at, rank, times
        self._my_rank = 0

    def setup(self, *, ctx) -> None:
        self._my_rank = ctx.rank

    def on_round_end(self, *, server, metrics) -> None:
        if server.round_idx + 1 == self.at and self.rank in (None, self._my_rank):
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def _trainer(log_dir, *extra, **kw):
    plugins = [UpdateClipping(1.0), GaussianNoise(noise_multiplier=0.5), *extra]
    return quiet_trainer(log_dir, rounds=5, clients_per_round=4, plugins=plugins, run_name="run", **kw)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_stops_after_the_round_and_the_resumed_run_matches(tmp_path, capfd, sig):
    ref = _trainer(str(tmp_path / "ref"))
    ref_module = ref.fit(TinyClassifier(), tiny_data())
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    trainer = _trainer(str(tmp_path / "run"), SignalAt(sig, at=2))  # checkpoint_every unset: written anyway
    with pytest.raises(Preempted) as stopped:
        trainer.fit(TinyClassifier(), tiny_data())
    assert stopped.value.code == 128 + sig and stopped.value.rounds_done == 2
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the previous handlers are back
    last = os.path.join(trainer.checkpoint_dir, "last.ckpt")
    assert stopped.value.checkpoint == last and ckpt.load(last)["round"] == 2
    err = capfd.readouterr().err
    assert f"preempted: {sig.name} received; stopped after round 2" in err
    assert f"ckpt_path={last!r}" in err  # a Python run: how to resume it

    resumed = _trainer(str(tmp_path / "run"))
    module = resumed.fit(TinyClassifier(), tiny_data(), ckpt_path="last")
    assert torch.equal(module.global_params, ref_module.global_params)
    assert [h["epsilon"] for h in resumed.history] == [h["epsilon"] for h in ref.history]


@pytest.mark.parametrize("every", [None, 1])
def test_a_second_ctrl_c_stops_at_once_with_the_newest_checkpoint_named(tmp_path, capfd, every):
    trainer = _trainer(str(tmp_path), SignalAt(signal.SIGINT, at=2, times=2), checkpoint_every=every)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(TinyClassifier(), tiny_data())
    last = os.path.join(trainer.checkpoint_dir, "last.ckpt")
    err = capfd.readouterr().err
    if every is None:
        assert not os.path.exists(last) and "interrupted: no checkpoint was written" in err
    else:  # round 2 was not finished (and not saved): the newest checkpoint is round 1's
        assert ckpt.load(last)["round"] == 1 and f"ckpt_path={last!r}" in err


def test_a_signal_in_the_last_round_lets_the_run_finish(tmp_path):
    trainer = _trainer(str(tmp_path), SignalAt(signal.SIGTERM, at=5))
    trainer.fit(TinyClassifier(), tiny_data())
    assert len(trainer.history) == 5


def test_resume_last_without_a_checkpoint_starts_from_round_zero(tmp_path):
    trainer = _trainer(str(tmp_path), checkpoint_every=5)
    trainer.fit(TinyClassifier(), tiny_data(), ckpt_path="last")
    assert len(trainer.history) == 5 and ckpt.load(os.path.join(trainer.checkpoint_dir, "last.ckpt"))["round"] == 5


def test_the_resume_command_is_the_start_command_with_resume_set():
    ck = "runs/quickstart/version_0/checkpoints/last.ckpt"
    argv = ["/venv/bin/dpfl", "fit", "--config", "configs/quickstart.yaml", "--trainer.rounds", "9"]
    assert resume_command(ck, argv) == f"dpfl fit --config configs/quickstart.yaml --trainer.rounds 9 --resume {ck}"
    again = argv + ["--resume", "old.ckpt"]
    assert resume_command(ck, again) == resume_command(ck, argv) == resume_command(ck, argv + ["--resume=old.ckpt"])
    module = ["/src/dpfl_lightning/__main__.py", "fit", "--config", "my run.yaml"]
    assert resume_command(ck, module).endswith(f" -m dpfl_lightning fit --config 'my run.yaml' --resume {ck}")
    two = resume_command(ck, module, world_size=2)
    assert two.startswith("mpiexec -n 2 ") and " -m mpi4py -m dpfl_lightning fit " in two
    assert resume_command(ck, ["train.py", "--lr", "0.1"]) is None  # a Python script: the hint names ckpt_path


FAKE_MPIEXEC = """#!/usr/bin/env bash
printf "%s\\n" "$@" > "$FAKE_DIR/mpiexec.args"
trap 'exit 138' USR1
trap 'exit 143' TERM
touch "$FAKE_DIR/started"
while :; do sleep 0.02; done
"""


def _slurm_job(tmp_path, restart_count, requeue="1"):
    """launchers/slurm.sbatch under a fake allocation: mpiexec and scontrol are stand-ins that record
    their arguments (mpiexec exits as a run stopped by the signal does)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("mpiexec", FAKE_MPIEXEC), ("scontrol", 'printf "%s\\n" "$@" > "$FAKE_DIR/scontrol.args"\n')):
        (bin_dir / name).write_text(text if text.startswith("#!") else "#!/usr/bin/env bash\n" + text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path), "SLURM_NTASKS": "8",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": str(restart_count),
           "DPFL_REQUEUE": requeue}
    script = os.path.join(ROOT, "launchers", "slurm.sbatch")
    return subprocess.Popen(["bash", script, "fit", "--config", "run.yaml"], env=env, cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_the_slurm_template_passes_the_signal_on_and_requeues(tmp_path, sig):
    job = _slurm_job(tmp_path, restart_count=0)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    job.send_signal(sig)  # what --signal=B:USR1@120 (or a preemption) does to the batch script
    _, err = job.communicate(timeout=30)
    assert job.returncode == 128 + sig
    assert (tmp_path / "mpiexec.args").read_text().split() == \
        "-n 8 -ppn 4 python -m mpi4py -m dpfl_lightning fit --config run.yaml".split()
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    assert "requeueing job 4242" in err


def test_a_requeued_slurm_job_resumes_from_the_last_checkpoint(tmp_path):
    job = _slurm_job(tmp_path, restart_count=1, requeue="0")
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=30)
    assert (tmp_path / "mpiexec.args").read_text().split()[-4:] == ["--config", "run.yaml", "--resume", "last"]
    assert not (tmp_path / "scontrol.args").exists()  # DPFL_REQUEUE=0
