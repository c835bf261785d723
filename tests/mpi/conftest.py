"""Tests in this folder run on every rank of ``mpiexec -n 2 python -m mpi4py -m pytest tests/mpi``
(``tests/test_mpi.py`` launches them); a plain ``pytest`` run skips them."""

import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/helpers.py

from dpfl_lightning.comm import launched_with_mpi  # noqa: E402

SKIP_REASON = "run by tests/test_mpi.py under mpiexec -n 2 (python -m mpi4py)"


def _world():
    if not launched_with_mpi():
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD


def pytest_collection_modifyitems(config, items):
    comm = _world()
    if comm is None or comm.Get_size() < 2:
        here = os.path.dirname(os.path.abspath(__file__))
        skip = pytest.mark.skip(reason=SKIP_REASON)
        for item in items:
            if str(item.path).startswith(here + os.sep):  # this hook sees the whole session's items
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """A plain run lists skips without their reason (only with -rs): say why these are skipped."""
    here = os.path.dirname(os.path.abspath(__file__))
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if str(r.fspath).startswith(here + os.sep)
               or str(getattr(r, "location", ("",))[0]).startswith("tests/mpi")]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} tests in tests/mpi skipped: {SKIP_REASON}")


@pytest.fixture
def comm():
    return _world()


@pytest.fixture
def shared_tmp(comm):
    """A directory every rank sees (created by rank 0)."""
    path = tempfile.mkdtemp(prefix="dpfl-mpi-") if comm.Get_rank() == 0 else None
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
