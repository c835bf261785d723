#!/usr/bin/env bash
# Run any dpfl command on NP ranks of this machine (one process per GPU, or per core group):
#   NP=4 launchers/mpirun.sh fit --config configs/quickstart.yaml
# `python -m mpi4py` makes an uncaught error on one rank abort every rank instead of hanging.
# SIGTERM, SIGUSR1 and Ctrl-C reach every rank: the run stops after the round with a checkpoint
# and prints the command that resumes it (exit status 128 + the signal).
# mpiexec comes with the `mpich` wheel (pip install -e ".[mpi]"): no system MPI is needed.
set -euo pipefail
NP="${NP:-2}"
exec mpiexec -n "$NP" python -m mpi4py -m dpfl_lightning "$@"
