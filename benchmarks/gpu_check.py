"""The GPU path in one run of a few minutes: W2 and a 10M-parameter model, timed and checked.

Workloads: W2, the CNN of ``round_overhead.py`` (0.88M parameters) in its DP-FedAvg round (50 of
1000 clients, 1 epoch of batch 10 on 50 samples, SGD lr 0.1, clipping at 1.0, central noise z = 1);
L10, an MLP 3072-2048-2048-10 (10.5M parameters) in the same round with 20 of 200 clients of 20
samples. Each check records its result or its error and the run goes on; ``--out`` is rewritten
after every check, so a run cut short keeps what it measured:

1. ``time_W2``, ``time_L10``: seconds per round of the framework (1 rank, sequential and vmap
   executors) against the hand-written loop on the same GPU;
2. ``gpu_equals_cpu_*``: the model trained on the GPU is the one trained on the CPU, to float
   tolerance (2 rounds with clipping and no noise, since CUDA draws its noise from Philox and the CPU
   from a Mersenne Twister; deterministic kernels, TF32 off);
3. ``ranks``: 1 and 2 ranks on the GPU give the same bits (clipping and central noise), and the 2
   ranks' seconds per round. With two GPUs or more each rank has its own and they reduce over NCCL;
   NCCL refuses two ranks on one device, so on one GPU both ranks share it, once over MPI (CUDA
   tensors staged through pinned host memory) and once over gloo. Ranks start under ``mpiexec``
   where a 2-rank probe works, else as processes joined by torch.distributed alone (``--launcher``);
4. the NCCL path with one rank (one GPU only: two GPUs run it in 3.) and its all-reduce of 100M
   float64 values; DP-SGD (Opacus), bf16 autocast, secure mode, CUDA noise streams, control variates
   resumed on the GPU, the exact fold of a 100M-parameter update.

No check starts after ``--budget_s`` seconds. Without a GPU (or with ``--cpu_dry_run``) every path
runs on the CPU at tiny sizes, the 2-rank launches included (gloo standing in for NCCL), so the
script is known to run before it meets a GPU (``tests/test_gpu_check.py``).

    bash benchmarks/gpu_check.sh --out results.json   # installs the wheels of .whl/ first, if there
    python benchmarks/gpu_check.py [--out results.json] [--budget_s 200] [--launcher auto] [--cpu_dry_run]
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: the exact runs need it

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import lightning as L  # noqa: E402
import round_overhead as ro  # noqa: E402 - W2's net, the round's constants, the hand loops' clipping
from dpfl_lightning import FederatedDataModule, FederatedTrainer  # noqa: E402
from dpfl_lightning.comm import Communicator, MPICommunicator, TorchDistCommunicator  # noqa: E402
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping  # noqa: E402

L10_SIZES = (3072, 2048, 2048, 10)
TOLERANCE = 1e-3  # GPU vs CPU: |w_gpu - w_cpu| / |w_cpu - w_0|, float32 kernels summing in other orders
MARK = "GPU_CHECK "  # a worker's result lines start with it
START = time.perf_counter()
RESULTS: dict[str, Any] = {}
LAUNCH: dict[str, Any] = {"used": "mpiexec"}
RUNNING: list[subprocess.Popen] = []  # the launched ranks, killed with this process (see main)
EXACT: dict[str, Any] = {"mode": "torch"}  # "cudnn" once a kernel refused torch's deterministic mode


def mlp(sizes: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


@dataclasses.dataclass(frozen=True)
class Workload:
    """A net, its inputs' shape, and the round: ``per_round`` of ``clients`` clients of ``samples``
    samples each, one local epoch of batch ``batch``."""

    name: str
    net: Callable[[], nn.Module]
    shape: tuple[int, ...]
    clients: int
    per_round: int
    samples: int
    batch: int


@dataclasses.dataclass(frozen=True)
class Config:
    """What a run checks and at what size (a dry run: the CPU, tiny)."""

    dry: bool
    device: str
    gpus: int
    rounds: int  # timed rounds, after a warm-up
    exact_clients: int  # clients per round of the exact (CPU vs GPU, 1 vs 2 ranks) runs
    threads: int  # torch threads of every exact run, 1 rank and 2 alike (the CPU's bits depend on them)
    workloads: tuple[Workload, ...]
    big: int  # values of the fold and the all-reduce timed

    def flags(self) -> list[str]:
        """The command-line flags that give a worker this configuration."""
        return ["--rounds", str(self.rounds)] + (["--cpu_dry_run"] if self.dry else [])


def make_config(dry: bool, rounds: int | None) -> Config:
    if dry:
        wls = (Workload("W2", ro.cnn, (3, 32, 32), 8, 4, 10, 5),
               Workload("L10", functools.partial(mlp, (48, 32, 32, 10)), (48,), 8, 4, 10, 5))
        return Config(True, "cpu", 0, rounds or 2, 4, 1, wls, 1 << 16)
    wls = (Workload("W2", ro.cnn, (3, 32, 32), ro.M, ro.M_ROUND, ro.SAMPLES, ro.BATCH),
           Workload("L10", functools.partial(mlp, L10_SIZES), (L10_SIZES[0],), 200, 20, 20, ro.BATCH))
    return Config(False, "cuda", torch.cuda.device_count(), rounds or 5, 10, 4, wls, 100_000_000)


class Classifier(L.LightningModule):
    """What a user writes: the net (seeded), cross-entropy, SGD."""

    def __init__(self, net: Callable[[], nn.Module]):
        super().__init__()
        torch.manual_seed(0)
        self.net = net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=ro.LR)


@functools.lru_cache(maxsize=None)
def tensors(wl: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """The workload's inputs and labels (client ``c`` holds rows ``c * samples`` onwards), on the CPU."""
    g = torch.Generator().manual_seed(0)
    n = wl.clients * wl.samples
    return torch.randn(n, *wl.shape, generator=g), torch.randint(0, 10, (n,), generator=g)


def data(wl: Workload) -> FederatedDataModule:
    x, y = tensors(wl)
    dm = FederatedDataModule.from_tensors(x, y, client_indices=[range(c * wl.samples, (c + 1) * wl.samples)
                                                                for c in range(wl.clients)])
    dm.setup()
    return dm


def dp_round() -> list:
    return [UpdateClipping(ro.CLIP), GaussianNoise(noise_multiplier=ro.Z, placement="central")]


def fit(wl: Workload, device: str, rounds: int, plugins: list | None = None, comm: Communicator | None = None,
        **kw: Any) -> tuple[FederatedTrainer, Any]:
    """The framework's run of ``wl`` (DP-FedAvg unless ``plugins``); ``comm``: the process's communicator."""
    kw = {"clients_per_round": wl.per_round, "executor": "sequential", **kw}
    with tempfile.TemporaryDirectory() as logs:
        trainer = FederatedTrainer(rounds=rounds, local_epochs=1, batch_size=wl.batch, accelerator=device,
                                   plugins=dp_round() if plugins is None else plugins, eval_every=10**9,
                                   log_dir=logs, enable_progress_bar=False, enable_summary=False, **kw)
        trainer.comm = comm  # None: the trainer builds its own
        module = trainer.fit(Classifier(wl.net), data(wl))
    return trainer, module


def fit_resumable(wl: Workload, device: str, rounds: int, plugins: list, logs: str, **kw: Any):
    """``fit`` writing into ``logs`` (kept), for a check that resumes from the run's checkpoints."""
    ckpt_path = kw.pop("ckpt_path", None)
    trainer = FederatedTrainer(rounds=rounds, local_epochs=1, batch_size=wl.batch, accelerator=device,
                               plugins=plugins, eval_every=10**9, log_dir=logs, enable_progress_bar=False,
                               enable_summary=False, executor="sequential", **kw)
    return trainer, trainer.fit(Classifier(wl.net), data(wl), ckpt_path=ckpt_path)


@contextlib.contextmanager
def exact_kernels(mode: str):
    """Kernels whose bits are a function of their inputs, TF32 off; ``mode``: ``torch`` (the trainer's
    ``deterministic=True``) or ``cudnn`` (deterministic cuDNN only). Every flag is restored after."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic,
         torch.backends.cudnn.benchmark) = saved[:4]
        torch.use_deterministic_algorithms(saved[4])


def fit_exact(cfg: Config, wl: Workload, device: str, plugins: list, comm: Communicator | None = None):
    """The 2-round run whose bits the exact checks compare: seeded, deterministic kernels, TF32 off,
    ``cfg.threads`` threads. A kernel that refuses torch's deterministic mode switches every later
    exact run (the workers' too) to deterministic cuDNN alone, and the results say so."""
    kw = dict(clients_per_round=cfg.exact_clients, num_threads=cfg.threads, comm=comm)
    try:
        with exact_kernels(EXACT["mode"]):
            return fit(wl, device, 2, plugins, deterministic=EXACT["mode"] == "torch", **kw)
    except Exception as exc:  # noqa: BLE001 - only torch's refusal is retried
        if EXACT["mode"] != "torch" or "determinis" not in str(exc) or comm is not None:
            raise
        EXACT.update(mode="cudnn", why=f"{type(exc).__name__}: {str(exc)[:300]}")
        with exact_kernels("cudnn"):
            return fit(wl, device, 2, plugins, deterministic=False, **kw)


def digest(module: Any) -> str:
    return hashlib.sha256(module.global_params.detach().cpu().numpy().tobytes()).hexdigest()[:16]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hand_rounds(wl: Workload, device: str, rounds: int) -> list[float]:
    """round_overhead.py's hand-written DP-FedAvg round, data and model on ``device``: each round's seconds."""
    x, y = (t.to(device) for t in tensors(wl))
    torch.manual_seed(0)
    net = wl.net().to(device)
    params = list(net.parameters())
    global_w = [p.detach().clone() for p in params]
    g, gd = torch.Generator().manual_seed(0), torch.Generator(device=device).manual_seed(0)
    times = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        total = [torch.zeros_like(w) for w in global_w]
        for c in torch.randperm(wl.clients, generator=g)[: wl.per_round].tolist():
            with torch.no_grad():
                for p, w in zip(params, global_w):
                    p.copy_(w)
            opt = torch.optim.SGD(params, lr=ro.LR)
            idx = (c * wl.samples + torch.randperm(wl.samples, generator=g)).to(device)
            for i in range(0, wl.samples, wl.batch):
                sel = idx[i : i + wl.batch]
                loss = F.cross_entropy(net(x[sel]), y[sel])
                opt.zero_grad()
                loss.backward()
                opt.step()
            ro.clip_and_add(total, params, global_w, ro.CLIP)
        with torch.no_grad():
            for w, t in zip(global_w, total):
                w.add_((t + ro.Z * ro.CLIP * torch.randn(t.shape, generator=gd, device=device)) / wl.per_round)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def framework_seconds(trainer: FederatedTrainer) -> float:
    return statistics.median(trainer.round_times[1:-1])  # after a warm-up round; the last one also evaluates


def short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


# ---------------------------------------------------------------------------------------------- checks
def env(cfg: Config) -> dict:
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "cuda": cuda, "cuda_version": torch.version.cuda, "gpus": cfg.gpus,
            "device": torch.cuda.get_device_name(0) if cuda else None, "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "dry_run": cfg.dry,
            "params": {wl.name: sum(p.numel() for p in wl.net().parameters()) for wl in cfg.workloads}}


def time_workload(cfg: Config, wl: Workload) -> dict:
    """Median seconds per round: the hand loop, the framework with 1 rank, its vmap executor."""
    out: dict[str, Any] = {"hand": statistics.median(hand_rounds(wl, cfg.device, cfg.rounds + 1)[1:])}
    trainer, _ = fit(wl, cfg.device, cfg.rounds + 2)
    out["framework"] = framework_seconds(trainer)
    out["device"] = str(trainer.run.device)
    try:
        tv, _ = fit(wl, cfg.device, cfg.rounds + 2, executor="vmap")
        out["vmap"] = framework_seconds(tv)
    except Exception as exc:  # noqa: BLE001 - the table says why
        out["vmap_error"] = short(exc)
    return out


def gpu_equals_cpu(cfg: Config, wl: Workload) -> dict:
    """The exact run (clipping, no noise) on the CPU and on the GPU from the same initial model: the
    distance of the two final models, in units of how far training moved the CPU's."""
    final = {}
    for device in ("cpu", cfg.device):
        _, module = fit_exact(cfg, wl, device, [UpdateClipping(ro.CLIP)])
        final[device] = module.global_params.detach().cpu().double()
    cpu, gpu = final["cpu"], final[cfg.device]
    w0 = torch.cat([p.detach().flatten() for p in Classifier(wl.net).parameters()]).double()
    rel = float((gpu - cpu).norm() / (cpu - w0).norm())
    return {"ok": rel <= TOLERANCE, "relative_difference": rel, "tolerance": TOLERANCE,
            "max_abs_difference": float((gpu - cpu).abs().max()), "moved": float((cpu - w0).norm()),
            "kernels": EXACT["mode"]}


def rank_plan(cfg: Config) -> tuple[list[tuple[str, list[str]]], str]:
    """The 2-rank launches (launcher, communicators), and what is done, in words. Under ``mpiexec``
    the dry run also joins its ranks by torch.distributed alone, the communicator of the other launcher."""
    torch_only = LAUNCH["used"] == "torch"
    if cfg.dry:
        return [("torch", ["torch-gloo"])] if torch_only else [("mpiexec", ["mpi", "gloo", "torch-gloo"])], \
            "CPU dry run: 2 CPU ranks (gloo stands in for NCCL)"
    if cfg.gpus >= 2:
        return [(LAUNCH["used"], ["torch-nccl" if torch_only else "nccl"])], \
            "one GPU per rank (cuda:0, cuda:1), reduced over NCCL"
    how = ("torch.distributed gloo, CUDA tensors staged through the host" if torch_only else
           "MPI (CUDA tensors staged through pinned host memory), then torch.distributed gloo (CUDA tensors)")
    return [(LAUNCH["used"], ["torch-gloo"] if torch_only else ["mpi", "gloo"])], \
        f"one GPU: NCCL refuses two ranks on one device, so both ranks share cuda:0 over {how}"


def ranks(cfg: Config) -> dict:
    """1 rank in this process, 2 ranks launched: the same bits for every workload and communicator."""
    plan, how = rank_plan(cfg)
    one = {}
    for wl in cfg.workloads:
        try:
            one[wl.name] = digest(fit_exact(cfg, wl, cfg.device, dp_round())[1])
        except Exception as exc:  # noqa: BLE001 - the other workload still runs
            one[wl.name] = {"error": short(exc)}
    lines, errors = [], []
    for launcher, comms in plan:
        got, error = launch(cfg, 2, ["--worker", "ranks", "--comms", ",".join(comms), "--exact_mode", EXACT["mode"]],
                            launcher)
        lines += [{**r, "launcher": launcher} for r in got]
        errors += [error] if error else []
    same = {f"{r['comm']}/{r['workload']}": r["hash"] == one.get(r["workload"]) for r in lines if r["kind"] == "bits"}
    expected = sum(len(comms) for _, comms in plan) * len(cfg.workloads)
    out = {"ok": len(same) == expected and all(same.values()), "how": how, "launches": plan,
           "kernels": EXACT["mode"], "one_rank": one, "same_bits": same, "runs": lines}
    if errors:
        out["error"] = " | ".join(errors)
    return out


def nccl_one_rank(cfg: Config) -> dict:
    """A run and the timed all-reduce over NCCL, 1 rank (the dry run: gloo, started by the torch launcher,
    so that both launchers run)."""
    lines, error = launch(cfg, 1, ["--worker", "nccl"], "torch" if cfg.dry else None)
    out = {"ok": any(r["kind"] == "nccl" for r in lines) and not error, "runs": lines}
    if error:
        out["error"] = error
    return out


def dpsgd(cfg: Config) -> dict:
    from dpfl_lightning.plugins import DPSGD

    wl = cfg.workloads[1]  # (every client holds wl.samples records: the public count DP-SGD accounts)
    trainer, module = fit(wl, cfg.device, 2, [DPSGD(noise_multiplier=1.0)], clients_per_round=5,
                          records_per_client=wl.samples)
    return {"ok": bool(torch.isfinite(module.global_params).all()), "epsilon": trainer.history[-1].get("epsilon"),
            "device": str(module.global_params.device), "seconds_per_round": statistics.median(trainer.round_times)}


def bf16(cfg: Config) -> dict:
    trainer, module = fit(cfg.workloads[0], cfg.device, 2, precision="bf16-mixed", clients_per_round=cfg.exact_clients)
    return {"ok": bool(torch.isfinite(module.global_params).all()), "dtype": str(module.global_params.dtype),
            "seconds_per_round": statistics.median(trainer.round_times)}


def secure(cfg: Config) -> dict:
    """Secure mode (CSPRNG noise and sampling) on W2: half the exact runs' clients, local noise."""
    plugins = [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local")]
    clients = cfg.exact_clients // 2
    trainer, module = fit(cfg.workloads[0], cfg.device, 2, plugins, secure=True, clients_per_round=clients)
    return {"ok": bool(torch.isfinite(module.global_params).all()), "epsilon": trainer.history[-1].get("epsilon"),
            "seconds_per_round": statistics.median(trainer.round_times)}


def noise_streams(cfg: Config) -> dict:
    """A CPU-keyed noise stream noising several device tensors (GaussianNoise's segments, DP-SGD's
    parameters) must not repeat its draws from one tensor to the next."""
    from dpfl_lightning import rng

    stream = rng.RandomSource(1).stream(0, 0, rng.CLIENT_NOISE)
    x, y = torch.zeros(1000, device=cfg.device), torch.zeros(1000, device=cfg.device)
    stream.add_normal_(x, 1.0)
    stream.add_normal_(y, 1.0)
    return {"ok": not torch.equal(x, y), "std": float(torch.cat([x, y]).std())}


def control_variates_resume(cfg: Config) -> dict:
    """SCAFFOLD and ScaffNew keep per-client state; a run resumed on the device from a checkpoint
    (which loads on the CPU) must end where the uninterrupted run ends."""
    from dpfl_lightning.plugins import SCAFFOLD, ScaffNew

    wl = Workload("W1", ro.mlp, (60,), 40, 40, 10, 5)
    out: dict[str, Any] = {}
    for name, make in (("SCAFFOLD", lambda: [SCAFFOLD()]), ("ScaffNew", lambda: [ScaffNew(p=0.5)])):
        with tempfile.TemporaryDirectory() as logs:
            kw = dict(deterministic=True, clients_per_round=None, checkpoint_every=2)
            full, ref = fit_resumable(wl, cfg.device, 4, make(), logs, **kw)
            ckpt = os.path.join(full.checkpoint_dir, "round-000002.ckpt")
            resumed, module = fit_resumable(wl, cfg.device, 4, make(), logs, ckpt_path=ckpt, **kw)
            torch.use_deterministic_algorithms(False)
        state = next(iter(next(iter(resumed.client_states.values())).values()))
        out[name] = {"same_bits": digest(module) == digest(ref), "state_device": str(state.device)}
    out["ok"] = all(v["same_bits"] for v in out.values())
    return out


def fold_big(cfg: Config) -> dict:
    """The exact fold of a ``cfg.big``-parameter update on the device, and the sum of 5 folds."""
    from dpfl_lightning.comm import LocalCommunicator
    from dpfl_lightning.federated.aggregation import PayloadAggregator
    from dpfl_lightning.federated.payload import PayloadLayout, Segment

    agg = PayloadAggregator(PayloadLayout([Segment("update", cfg.big)]), torch.device(cfg.device))
    agg.start(50, {"update": 1.0})
    u = torch.randn(cfg.big, device=cfg.device) * 1e-4
    times = []
    for _ in range(5):
        agg.client_views()
        agg.update_out.copy_(u)
        sync(cfg.device)
        t0 = time.perf_counter()
        agg.fold()
        sync(cfg.device)
        times.append(time.perf_counter() - t0)
    err = float((agg.reduce(LocalCommunicator())["update"] - 5 * u.double()).abs().max())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cfg.device == "cuda" else None
    return {"ok": err < 1e-8, "values": cfg.big, "fold_seconds": statistics.median(times), "max_error": err,
            "peak_gb": peak}


# ---------------------------------------------------------------------------------------------- ranks
class TorchOnlyCommunicator(Communicator):
    """The ranks joined by torch.distributed alone, for a machine where ``mpiexec`` cannot start them:
    the rendezvous of :func:`launch` (``GPU_CHECK_RANK``, ``GPU_CHECK_WORLD``, ``GPU_CHECK_INIT``; under
    MPICH's ``mpiexec``, its ``PMI_RANK``, ``PMI_SIZE``); tensors over ``backend`` (CUDA tensors staged
    through the host under gloo), Python objects through torch's pickling collectives."""

    name = "torch_only"

    def __init__(self, backend: str) -> None:
        self.rank = int(os.environ.get("GPU_CHECK_RANK") or os.environ["PMI_RANK"])
        self.size = int(os.environ.get("GPU_CHECK_WORLD") or os.environ["PMI_SIZE"])
        self.local_rank, self.local_size, self.backend = self.rank, self.size, backend
        if backend == "nccl":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=os.environ["GPU_CHECK_INIT"], rank=self.rank,
                                world_size=self.size, timeout=timedelta(seconds=120))

    def _each(self, tensor: torch.Tensor, op: Callable[[torch.Tensor], Any]) -> torch.Tensor:
        staged = self.backend == "gloo" and tensor.device.type != "cpu"
        t = tensor.cpu() if staged else tensor
        op(t)
        if staged:
            tensor.copy_(t)
        return tensor

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._each(tensor, lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM))

    def allreduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._each(tensor, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self._each(tensor, lambda t: dist.broadcast(t, src=root))

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        out = [None] * self.size if self.rank == root else None
        dist.gather_object(obj, out, dst=root)
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=root)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def abort(self, code: int = 1) -> None:
        os._exit(code)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def make_comm(kind: str) -> Communicator:
    """``mpi``; ``nccl`` / ``gloo``: torch.distributed bootstrapped from MPI; ``torch-*``: without MPI."""
    if kind.startswith("torch-"):
        return TorchOnlyCommunicator(kind.split("-", 1)[1])
    return MPICommunicator() if kind == "mpi" else TorchDistCommunicator(kind, timeout_s=120)


def pick_launcher(choice: str) -> dict:
    """``mpiexec`` when a 2-rank probe under it sees 2 ranks (an mpi4py built for another MPI sees 1
    twice), else torch.distributed alone."""
    info: dict[str, Any] = {"asked": choice, "mpiexec": shutil.which("mpiexec")}
    ok = False
    if choice != "torch" and info["mpiexec"]:
        probe = ("from mpi4py import MPI; c = MPI.COMM_WORLD; seen = c.allgather((c.Get_rank(), c.Get_size()))\n"
                 "if c.Get_rank() == 0: print(seen, '|', MPI.Get_library_version().splitlines()[0].strip())")
        try:
            p = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", probe], capture_output=True, text=True,
                               timeout=60)
            ok = p.stdout.count("[(0, 2), (1, 2)] |") == 1  # once: rank 0 of one job of 2 ranks
            info["mpi_library"] = p.stdout.split("|")[-1].strip() or None
            info["probe"] = None if ok else (p.stdout + p.stderr)[-600:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["probe"] = short(exc)
    info["used"] = "mpiexec" if ok or choice == "mpiexec" else "torch"
    LAUNCH.update(info)
    return info


def launch(cfg: Config, n: int, worker_args: list[str], launcher: str | None = None) -> tuple[list[dict], str | None]:
    """This script's worker on ``n`` ranks, started by ``launcher`` (default: :data:`LAUNCH`'s): rank 0's
    result lines (a failed job keeps those it printed), and the job's error, if any."""
    launcher = launcher or LAUNCH["used"]
    script = [os.path.abspath(__file__), *worker_args, *cfg.flags()]
    timeout = max(30.0, cfg_budget_left() + 60)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPU_CHECK_INIT": "file://" + os.path.join(tmp, "rendezvous")}
        if launcher == "mpiexec":
            cmds = [(["mpiexec", "-n", str(n), sys.executable, "-m", "mpi4py", *script], env)]
        else:
            cmds = [([sys.executable, *script], {**env, "GPU_CHECK_RANK": str(r), "GPU_CHECK_WORLD": str(n)})
                    for r in range(n)]
        codes = run_together(cmds, tmp, timeout)
        out = open(os.path.join(tmp, "0.out")).read()
        err = "".join(open(os.path.join(tmp, f"{i}.err")).read()[-1500:] for i in range(len(cmds)))
    lines = [json.loads(s[len(MARK):]) for s in out.splitlines() if s.startswith(MARK)]
    if all(c == 0 for c in codes):
        return lines, None
    killed = f" (None: killed after {timeout:.0f} s)" if None in codes else ""
    return lines, f"{launcher} -n {n}: exit codes {codes}{killed}: {err[-2000:]}"


def run_together(cmds: list[tuple[list[str], dict]], tmp: str, timeout: float) -> list[int | None]:
    """Start every command (its output in ``tmp/i.out``, ``tmp/i.err``); when one fails or the time
    is up, kill the others. The exit codes (``None``: killed)."""
    procs = [subprocess.Popen(cmd, env=env, stdout=open(os.path.join(tmp, f"{i}.out"), "w"),
                              stderr=open(os.path.join(tmp, f"{i}.err"), "w"), start_new_session=True)
             for i, (cmd, env) in enumerate(cmds)]
    RUNNING[:] = procs
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + 10:
            break
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    kill_running()
    return codes


def kill_running() -> None:
    for p in RUNNING:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    RUNNING.clear()


def stop_on_sigterm(cfg: Config) -> None:
    """On ``timeout``'s SIGTERM: kill the launched ranks, print what was measured, exit 124."""
    def stop(signum, frame):
        kill_running()
        print(f"stopped by signal {signum} after {time.perf_counter() - START:.0f} s", flush=True)
        print_table(cfg)
        os._exit(124)

    signal.signal(signal.SIGTERM, stop)


def emit(comm: Communicator, result: dict) -> None:
    if comm.rank == 0:
        print(MARK + json.dumps(result, default=str), flush=True)


def worker(args: argparse.Namespace, cfg: Config) -> None:
    """One rank of a launch: ``ranks`` (the exact run and a timed run of every workload, for each
    communicator of ``--comms``) or ``nccl`` (1 rank: a run and the timed all-reduce)."""
    EXACT["mode"] = args.exact_mode
    comm: Communicator | None = None
    try:
        for i, kind in enumerate(args.comms.split(",") if args.worker == "ranks" else []):
            comm = make_comm(kind)
            for wl in cfg.workloads:
                trainer, module = fit_exact(cfg, wl, cfg.device, dp_round(), comm=comm)
                emit(comm, {"kind": "bits", "comm": kind, "workload": wl.name, "hash": digest(module),
                            "ranks": comm.size, "communicator": type(comm).__name__, "device": str(trainer.run.device)})
                if i == 0:
                    seconds = framework_seconds(fit(wl, cfg.device, cfg.rounds + 2, comm=comm)[0])
                    emit(comm, {"kind": "time", "comm": kind, "workload": wl.name, "framework": seconds})
            comm.close()
        if args.worker == "nccl":
            comm = make_comm(("torch-" if "GPU_CHECK_RANK" in os.environ else "") + ("gloo" if cfg.dry else "nccl"))
            emit(comm, {"kind": "nccl", **timed_allreduce(cfg, comm)})
            comm.close()
    except BaseException as exc:
        print(MARK + json.dumps({"kind": "error", "rank": getattr(comm, "rank", None), "error": short(exc)}),
              flush=True)
        raise


def timed_allreduce(cfg: Config, comm: Communicator) -> dict:
    trainer, module = fit(cfg.workloads[1], cfg.device, 2, comm=comm, clients_per_round=cfg.exact_clients)
    t = torch.randn(cfg.big, dtype=torch.float64, device=cfg.device)
    times = []
    for _ in range(5):
        sync(cfg.device)
        t0 = time.perf_counter()
        comm.allreduce_sum_(t)
        sync(cfg.device)
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    return {"communicator": type(comm).__name__, "backend": getattr(comm, "backend", None),
            "finite": bool(torch.isfinite(module.global_params).all()), "device": str(trainer.run.device),
            "allreduce_values": cfg.big, "allreduce_seconds": s, "gb_per_s": cfg.big * 8 / 1e9 / s}


# ---------------------------------------------------------------------------------------------- driver
BUDGET = {"s": float("inf")}


def cfg_budget_left() -> float:
    return BUDGET["s"] - (time.perf_counter() - START)


def run_check(name: str, fn: Callable[[], dict], out: str | None) -> None:
    """Run one check: its result, or its error, or that it was skipped (the time budget was spent)."""
    t0 = time.perf_counter()
    if cfg_budget_left() <= 0:
        RESULTS[name] = {"skipped": f"the {BUDGET['s']:.0f} s budget was spent"}
    else:
        try:
            RESULTS[name] = fn()
        except Exception as exc:  # noqa: BLE001 - report, and go on with the next check
            RESULTS[name] = {"error": short(exc), "trace": traceback.format_exc()[-1500:]}
    RESULTS[name]["seconds"] = round(time.perf_counter() - t0, 2)
    brief = {k: v for k, v in RESULTS[name].items() if k not in ("trace", "runs")}
    print(f"[{time.perf_counter() - START:6.1f} s] {name}: {json.dumps(brief, default=str)[:700]}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def verdict(result: dict) -> str:
    if "skipped" in result:
        return "SKIPPED"
    if "error" in result:
        return "ERROR"
    return "FAIL" if result.get("ok") is False else "ok"


def print_table(cfg: Config) -> None:
    e = RESULTS.get("env", {})
    where = f"{e.get('device')} x {cfg.gpus}" if not cfg.dry else "CPU dry run (tiny sizes)"
    print(f"\n== GPU check: {where} | torch {e.get('torch')} (CUDA {e.get('cuda_version')}) | python "
          f"{e.get('python')} | ranks via {LAUNCH['used']}" + (f" ({LAUNCH.get('mpi_library')})" if
                                                               LAUNCH.get("mpi_library") else ""), flush=True)
    print(f"{'workload':<9}{'row':<46}{'s/round':>10}{'x hand':>9}")
    runs = RESULTS.get("ranks", {}).get("runs", [])
    for wl in cfg.workloads:
        t = RESULTS.get(f"time_{wl.name}", {})
        rows = [("hand-written loop, 1 process", t.get("hand")), ("dpfl_lightning, 1 rank", t.get("framework")),
                ("dpfl_lightning, vmap executor, 1 rank", t.get("vmap"))]
        rows += [(f"dpfl_lightning, 2 ranks ({r['comm']})", r["framework"]) for r in runs
                 if r["kind"] == "time" and r["workload"] == wl.name]
        for name, s in rows:
            ratio = f"{s / t['hand']:>9.3f}" if s is not None and t.get("hand") else f"{'-':>9}"
            print(f"{wl.name:<9}{name:<46}{(f'{s:.4f}' if s is not None else 'n/a'):>10}{ratio}")
    print(f"{'check':<32}result")
    for name, result in RESULTS.items():
        if name != "env":
            print(f"{name:<32}{verdict(result)}{describe(result)}")
    counts = [verdict(r) for n, r in RESULTS.items() if n != "env"]
    print("gpu_check: " + ", ".join(f"{counts.count(v)} {v}" for v in ("ok", "FAIL", "ERROR", "SKIPPED")), flush=True)


def describe(result: dict) -> str:
    if "error" in result:
        return ": " + result["error"][:300].replace("\n", " ")
    if "relative_difference" in result:
        return f": GPU vs CPU relative difference {result['relative_difference']:.2e} (tolerance {TOLERANCE:.0e})"
    if "same_bits" in result:
        return f": same bits 1 vs 2 ranks {result['same_bits']}; {result['how']}"
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=str, default=None, help="write every check's result here (JSON)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; 2 in a dry run)")
    ap.add_argument("--budget_s", type=float, default=200.0, help="no check starts after this many seconds")
    ap.add_argument("--launcher", choices=("auto", "mpiexec", "torch"), default="auto",
                    help="how the 2-rank checks start their ranks (auto: mpiexec if a probe works)")
    ap.add_argument("--cpu_dry_run", action="store_true", help="every path on the CPU at tiny sizes")
    ap.add_argument("--only", type=str, default=None, help="comma-separated checks to run (default: all)")
    ap.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--comms", type=str, default="mpi", help=argparse.SUPPRESS)
    ap.add_argument("--exact_mode", type=str, default="torch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    dry = args.cpu_dry_run or not torch.cuda.is_available()
    cfg = make_config(dry, args.rounds)
    if args.worker:
        return worker(args, cfg)
    BUDGET["s"] = args.budget_s
    stop_on_sigterm(cfg)
    if dry and not args.cpu_dry_run:
        print("no CUDA device here: running the CPU dry run instead (every path, tiny sizes)", flush=True)
    checks = all_checks(cfg, args.launcher)
    for name in args.only.split(",") if args.only else checks:
        run_check(name, checks[name], args.out)
    print_table(cfg)
    if any(verdict(r) in ("FAIL", "ERROR") for r in RESULTS.values()):
        sys.exit(1)


def all_checks(cfg: Config, launcher: str) -> dict[str, Callable[[], dict]]:
    """Every check, most wanted first (a spent budget skips the last)."""
    checks: dict[str, Callable[[], dict]] = {"env": lambda: env(cfg), "launcher": lambda: pick_launcher(launcher)}
    for wl in cfg.workloads:
        checks[f"time_{wl.name}"] = functools.partial(time_workload, cfg, wl)
    for wl in cfg.workloads:
        checks[f"gpu_equals_cpu_{wl.name}"] = functools.partial(gpu_equals_cpu, cfg, wl)
    checks["ranks"] = lambda: ranks(cfg)
    if cfg.gpus < 2:
        checks["nccl_one_rank"] = lambda: nccl_one_rank(cfg)
    for fn in (dpsgd, bf16, secure, noise_streams, control_variates_resume, fold_big):
        checks[fn.__name__] = functools.partial(fn, cfg)
    return checks


if __name__ == "__main__":
    main()
