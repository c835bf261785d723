"""``python -m dpfl_lightning fit --config ...`` (under MPI: ``mpiexec -n 4 python -m mpi4py -m dpfl_lightning ...``)."""

from dpfl_lightning.cli.command import main

main()
