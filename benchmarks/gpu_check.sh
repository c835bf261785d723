#!/usr/bin/env bash
# benchmarks/gpu_check.py in one command, on a machine that may lack the project's dependencies:
# installs the wheels of .whl/ (if the folder is there) into /tmp/site, the MPICH wheel into
# /tmp/site-mpich (its mpiexec and libmpi, for mpi4py), shows the GPUs and the versions, and runs the
# checks under a hard time limit. Arguments go to gpu_check.py:
#
#   bash benchmarks/gpu_check.sh --out "$OUT/gpu_check.json"
#
# GPU_CHECK_WHEELS (default .whl), GPU_CHECK_SITE (default /tmp/site), GPU_CHECK_PYTHON (default
# python3), GPU_CHECK_TIMEOUT (seconds, default 280).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
# one machine: the ranks meet on the loopback interface (a container's hostname may resolve to an
# address its processes cannot connect to)
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} \
    NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
py=${GPU_CHECK_PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-.whl}
site=${GPU_CHECK_SITE:-/tmp/site}
pip_install() { "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$@"; }
if ! "$py" -m pip --version >/dev/null 2>&1; then  # no pip: unpack the wheels (the same files, no metadata checks)
    pip_install() {
        "$py" - "$@" <<'PY'
import glob, os, shutil, stat, sys, zipfile
dest, wheels = sys.argv[2], sys.argv[3:]  # after --target or --prefix
for whl in wheels:
    zipfile.ZipFile(whl).extractall(dest)
for data in glob.glob(os.path.join(dest, "*.data", "data")):  # the MPICH wheel's bin/ and lib/
    for sub in os.listdir(data):
        shutil.copytree(os.path.join(data, sub), os.path.join(dest, sub), dirs_exist_ok=True)
    for f in glob.glob(os.path.join(dest, "bin", "*")):
        os.chmod(f, os.stat(f).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PY
    }
fi

if compgen -G "$wheels/*.whl" >/dev/null; then
    start=$SECONDS
    others=$(ls "$wheels"/*.whl | grep -v '/mpich-')
    if [ -n "$others" ] && ! pip_install --target "$site" $others; then  # one at a time: a bad wheel costs only itself
        for w in $others; do pip_install --target "$site" "$w" || echo "gpu_check.sh: could not install $w"; done
    fi
    mpich=$(ls "$wheels"/mpich-*.whl 2>/dev/null | head -1)
    if [ -n "$mpich" ]; then  # --target drops a wheel's data lib/ (libmpi.so.12); a prefix keeps bin/ and lib/
        pip_install --prefix "$site-mpich" "$mpich"
        export PATH="$site-mpich/bin:$PATH" MPI4PY_LIBMPI="$site-mpich/lib/libmpi.so.12"
    fi
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "the $(ls "$wheels"/*.whl | wc -l) wheels of $wheels: installed in $((SECONDS - start)) s"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
"$py" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA',
torch.version.cuda, '| GPUs', torch.cuda.device_count())"
command -v mpiexec >/dev/null && echo "mpiexec: $(command -v mpiexec)" || echo "mpiexec: not found"
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-280}" "$py" benchmarks/gpu_check.py "$@"
