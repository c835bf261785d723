"""The GPU path, checked and timed on one NVIDIA GPU (run where one is available):

1. W2 (the CNN of ``round_overhead.py``) per round on the GPU: the framework against the
   hand-written loop on the same GPU, the vectorised executor next to them;
2. two ranks sharing the GPU through the MPI path (CUDA tensors staged through pinned host memory)
   give the same bits as one rank (W1, deterministic kernels);
3. the NCCL path (torch.distributed bootstrapped from MPI) with one rank: a run, and its all-reduce
   of a 100M-value float64 aggregate timed; the exact fold of a 100M-parameter update timed;
4. DP-SGD (Opacus) on CUDA; bf16 autocast; secure mode on CUDA.

Every check records its result or its error; the last line is a JSON summary.

    python benchmarks/gpu_check.py [--rounds 5] [--out results.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

RESULTS: dict[str, object] = {}


def check(name):
    def deco(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - report and go on with the next check
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
            print(f"[{time.perf_counter() - t0:6.1f} s] {name}: {json.dumps(RESULTS[name], default=str)[:600]}",
                  flush=True)
        return run
    return deco


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()[:16]


def fit_w(workload, rounds, **kw):
    import round_overhead as ro
    from dpfl_lightning import FederatedTrainer
    from dpfl_lightning.plugins import GaussianNoise, UpdateClipping

    data = kw.pop("data", None) or ro.make_data(workload)
    ckpt_path = kw.pop("ckpt_path", None)
    plugins = kw.pop("plugins", None) or [UpdateClipping(ro.CLIP), GaussianNoise(noise_multiplier=ro.Z)]
    trainer = FederatedTrainer(rounds=rounds, clients_per_round=kw.pop("clients_per_round", ro.M_ROUND), local_epochs=1, batch_size=ro.BATCH,
                               plugins=plugins, eval_every=10**9, log_dir=tempfile.mkdtemp(), enable_progress_bar=False,
                               enable_summary=False, **kw)
    module = trainer.fit(ro.Classifier(workload), data, ckpt_path=ckpt_path)
    return trainer, module


@check("env")
def env():
    return {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": sys.version.split()[0]}


def hand_loop_gpu(workload, rounds):
    """round_overhead.py's hand-written loop with the data and the model on the GPU."""
    import round_overhead as ro
    import torch.nn.functional as F

    data = ro.make_data(workload)
    x, y = (t.cuda() for t in data.in_memory_tensors)
    idxs = [i.cuda() for i in data._train_idx]
    torch.manual_seed(0)
    net = ro.NETS[workload]().cuda()
    params = list(net.parameters())
    global_w = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(0)
    gc = torch.Generator(device="cuda").manual_seed(0)
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = [torch.zeros_like(w) for w in global_w]
        for c in torch.randperm(ro.M, generator=g)[: ro.M_ROUND].tolist():
            with torch.no_grad():
                for p, w in zip(params, global_w):
                    p.copy_(w)
            opt = torch.optim.SGD(params, lr=ro.LR)
            idx = idxs[c][torch.randperm(ro.SAMPLES, generator=g).cuda()]
            for i in range(0, ro.SAMPLES, ro.BATCH):
                sel = idx[i : i + ro.BATCH]
                loss = F.cross_entropy(net(x[sel]), y[sel])
                opt.zero_grad()
                loss.backward()
                opt.step()
            ro.clip_and_add(total, params, global_w, ro.CLIP)
        with torch.no_grad():
            for w, t in zip(global_w, total):
                w.add_((t + ro.Z * ro.CLIP * torch.randn(t.shape, generator=gc, device="cuda")) / ro.M_ROUND)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


@check("w2_round_seconds")
def w2(rounds):
    hand = statistics.median(hand_loop_gpu("W2", rounds + 1)[1:])
    trainer, _ = fit_w("W2", rounds + 2, accelerator="cuda")
    fw = statistics.median(trainer.round_times[1:-1])
    out = {"hand": hand, "framework": fw, "ratio": fw / hand, "device": str(trainer.run.device)}
    try:
        tv, _ = fit_w("W2", rounds + 2, accelerator="cuda", executor="vmap")
        out["vmap"] = statistics.median(tv.round_times[1:-1])
        out["vmap_ratio"] = out["vmap"] / hand
    except Exception as exc:  # noqa: BLE001
        out["vmap"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    hw1 = statistics.median(hand_loop_gpu("W1", rounds + 1)[1:])
    t1, _ = fit_w("W1", rounds + 2, accelerator="cuda")
    tv1, _ = fit_w("W1", rounds + 2, accelerator="cuda", executor="vmap")
    out.update({"w1_hand": hw1, "w1_framework": statistics.median(t1.round_times[1:-1]),
                "w1_vmap": statistics.median(tv1.round_times[1:-1])})
    return out


def _mpiexec(n, args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = ["mpiexec", "-n", str(n), sys.executable, "-m", "mpi4py", os.path.abspath(__file__), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"mpiexec -n {n} failed ({proc.returncode}): {proc.stdout[-800:]} {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@check("two_ranks_share_the_gpu_same_bits")
def two_ranks():
    one = _mpiexec(1, ["--worker", "bits", "--communicator", "mpi"])
    two = _mpiexec(2, ["--worker", "bits", "--communicator", "mpi"])
    return {"one": one, "two": two, "identical": one["hash"] == two["hash"]}


@check("nccl_one_rank")
def nccl():
    return _mpiexec(1, ["--worker", "nccl"])


@check("dpsgd_on_cuda")
def dpsgd():
    from dpfl_lightning.plugins import DPSGD

    trainer, module = fit_w("W1", 2, accelerator="cuda", plugins=[DPSGD(noise_multiplier=1.0)])
    return {"finite": bool(torch.isfinite(module.global_params).all()), "epsilon": trainer.history[-1].get("epsilon"),
            "device": str(module.global_params.device), "seconds_per_round": statistics.median(trainer.round_times)}


@check("bf16_autocast")
def bf16():
    trainer, module = fit_w("W2", 2, accelerator="cuda", precision="bf16-mixed")
    return {"finite": bool(torch.isfinite(module.global_params).all()), "dtype": str(module.global_params.dtype),
            "seconds_per_round": statistics.median(trainer.round_times)}


@check("secure_mode_on_cuda")
def secure():
    from dpfl_lightning.plugins import GaussianNoise, UpdateClipping

    trainer, module = fit_w("W1", 2, accelerator="cuda", secure=True,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local")])
    return {"finite": bool(torch.isfinite(module.global_params).all()), "epsilon": trainer.history[-1].get("epsilon"),
            "seconds_per_round": statistics.median(trainer.round_times)}


@check("noise_streams_on_cuda")
def noise_streams():
    """A CPU-keyed noise stream noising several CUDA tensors (GaussianNoise's segments, DP-SGD's
    parameters) must not repeat its draws from one tensor to the next."""
    from dpfl_lightning import rng

    stream = rng.RandomSource(1).stream(0, 0, rng.CLIENT_NOISE)
    x, y = torch.zeros(1000, device="cuda"), torch.zeros(1000, device="cuda")
    stream.add_normal_(x, 1.0)
    stream.add_normal_(y, 1.0)
    if torch.equal(x, y):
        raise AssertionError("two CUDA tensors noised from one stream got the same noise")
    return {"distinct": True, "std": float(torch.cat([x, y]).std())}


@check("control_variates_resume_on_cuda")
def control_variates_resume():
    """SCAFFOLD and ScaffNew keep per-client state; a run resumed on the GPU from a checkpoint (which
    loads on the CPU) must end where the uninterrupted run ends."""
    from dpfl_lightning.data import SyntheticLogistic
    from dpfl_lightning.plugins import SCAFFOLD, ScaffNew

    out = {}
    for name, make in (("SCAFFOLD", lambda: [SCAFFOLD()]), ("ScaffNew", lambda: [ScaffNew(p=0.5)])):
        kw = dict(accelerator="cuda", plugins=make(), seed=5, deterministic=True, clients_per_round=None,
                  data=SyntheticLogistic(num_clients=40, samples_per_client=50, test_samples_per_client=0, dim=60))
        full, ref = fit_w("W1", 4, checkpoint_every=2, **kw)
        ckpt = os.path.join(full.checkpoint_dir, "round-000002.ckpt")
        resumed, _ = fit_w("W1", 4, ckpt_path=ckpt, **{**kw, "plugins": make()})
        out[name] = {"same_bits": _hash(resumed.module.global_params) == _hash(ref.global_params),
                     "state_device": str(next(iter(next(iter(resumed.client_states.values())).values())).device)}
    return out


@check("fold_100m_on_gpu")
def fold_100m():
    from dpfl_lightning.federated.aggregation import PayloadAggregator
    from dpfl_lightning.comm import LocalCommunicator
    from dpfl_lightning.federated.payload import PayloadLayout, Segment

    d = 100_000_000
    agg = PayloadAggregator(PayloadLayout([Segment("update", d)]), torch.device("cuda"))
    agg.start(50, {"update": 1.0})
    u = torch.randn(d, device="cuda") * 1e-4
    times = []
    for _ in range(5):
        agg.client_views()
        agg.update_out.copy_(u)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        agg.fold()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    total = agg.reduce(LocalCommunicator())["update"]
    err = float((total - 5 * u.double()).abs().max())
    return {"fold_seconds": statistics.median(times), "max_error": err,
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30}


def worker_bits(communicator):
    trainer, module = fit_w("W1", 3, accelerator="cuda", communicator=communicator, deterministic=True, seed=3)
    if trainer.rank == 0:
        print(json.dumps({"hash": _hash(module.global_params), "ranks": trainer.world_size,
                          "communicator": type(trainer.comm).__name__}))


def worker_nccl():
    trainer, module = fit_w("W1", 2, accelerator="cuda", communicator="nccl")
    comm = trainer.comm
    t = torch.randn(100_000_000, dtype=torch.float64, device="cuda")
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        comm.allreduce_sum_(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    out = {"communicator": type(comm).__name__, "backend": getattr(comm, "backend", None),
           "finite": bool(torch.isfinite(module.global_params).all()), "allreduce_100m_f64_seconds": s,
           "gb_per_s": 0.8 / s}
    comm.close()
    if trainer.rank == 0:
        print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=str, default=None)
    ap.add_argument("--worker", type=str, default=None)
    ap.add_argument("--communicator", type=str, default="mpi")
    ap.add_argument("--only", type=str, default=None, help="comma-separated checks to run (default: all)")
    args = ap.parse_args()
    if args.worker == "bits":
        return worker_bits(args.communicator)
    if args.worker == "nccl":
        return worker_nccl()
    env()
    if not torch.cuda.is_available():
        print(json.dumps(RESULTS))
        return
    checks = {"two_ranks": two_ranks, "nccl": nccl, "dpsgd": dpsgd, "bf16": bf16, "secure": secure,
              "noise_streams": noise_streams,
              "control_variates_resume": control_variates_resume, "fold_100m": fold_100m,
              "w2": lambda: w2(args.rounds)}
    for name in (args.only.split(",") if args.only else checks):
        checks[name]()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print(json.dumps({k: (v if not isinstance(v, dict) or "trace" not in v else {"error": v["error"]})
                      for k, v in RESULTS.items()}, default=str))


if __name__ == "__main__":
    main()
