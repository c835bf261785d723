"""CorrelatedNoise: DP-FTRL's noise, correlated across rounds by a matrix factorization (central).

The server adds ``(L Z)_t`` to round ``t``'s sum of clipped updates before its step, where ``C`` is a
factorization's right factor, ``L C = I`` and ``Z``'s rows are ``N(0, (z sens C_t)^2 I_d)``: the run
releases ``C g + Z``, the Gaussian mechanism with noise multiplier ``z`` for a sensitivity ``sens`` of
``C`` under the participation pattern (:mod:`dpfl_lightning.privacy.matrix_factorization`). The server
step sees ``A (g + L Z)``, whose noise ``A L Z`` is smaller than independent noise's for the
workload ``A`` (prefix sums for server SGD, the momentum workload with server momentum).

Strategies (``strategy=``): ``tree`` (online tree aggregation with Honaker's estimator, restarted
every ``2**tree_height`` rounds; Kairouz et al., ICML 2021; by default at the height with the least
error for the workload under the participation pattern, which is never worse than independent noise
or one tree), ``banded`` (a ``bands``-banded Toeplitz
``C`` optimised for the workload; Choquette-Choo et al., NeurIPS 2023), ``blt`` (a buffered linear
Toeplitz ``C`` with ``buffers`` buffers optimised for the participation pattern; Dvijotham et al.
2024, McMahan et al. 2024), ``independent`` (``C = I``: DP-FedAvg's independent noise under the same
participation and accounting).

Participation (the trainer's ``sampling``, enforced by the sampler and read by the ledger):
``cyclic`` (``b`` groups, group ``t mod b`` in round ``t``: participations ``b`` apart, at most
``ceil(T / b)``, no amplification) or, for ``banded`` and ``independent``, ``amplified_cyclic``
(Poisson sampling inside the round's group, accounted per participation as a Poisson-sampled
Gaussian). Any other sampler is refused.

Threat model: central (a trusted aggregator adds the noise; the guarantee is towards anyone who
sees the models). The noise is scaled by the clip bound in force in each round (adaptive clipping
moves it) before it enters the mechanism's state, so every round's fresh rows are ``z sens C_t``.
Frozen parameters: the noise covers the trainable entries only (the count must not change during
the run). The mechanism's state (the last ``bands - 1`` noise rows, the BLT's buffers, the tree's
node estimates) is a secret: it is never checkpointed or logged. A resumed simulation rebuilds it
from the keyed streams (bit for bit). Secure mode cannot (the secret keying it is gone): a secure
resume at round ``r`` restarts the mechanism with a new factorization of the same strategy for the
remaining ``T - r`` rounds, and the ledger composes the segments, each over its own rounds with its
own sensitivity under the participation pattern restricted to them (the first segment's release is
``C[:r, :r] g + Z[:r]``, a Gaussian of multiplier ``z sens(C) / sens(C[:r, :r])``). The restart
rounds are public (the checkpoint's round), and the run says so.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any

import torch

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated import frozen
from dpfl_lightning.federated.payload import UPDATE
from dpfl_lightning.federated.releases import MetricRelease
from dpfl_lightning.federated.sampling import CYCLIC
from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, FederatedCallback
from dpfl_lightning.plugins.calibrated_noise import CalibratedNoise
from dpfl_lightning.plugins.gaussian_noise import check_noise_multiplier
from dpfl_lightning.privacy import matrix_factorization as mf
from dpfl_lightning.privacy.correlated_noise import noise_generator
from dpfl_lightning.privacy.mechanisms import Mechanism, Stream
from dpfl_lightning.privacy.mf_optimize import banded, blt
from dpfl_lightning.privacy.mf_optimize import tree_height as best_tree_height
from dpfl_lightning.privacy.mf_sensitivity import sensitivity_details
from dpfl_lightning.plugins.sensitivity import required_update_bound

STRATEGIES = ("tree", "banded", "blt", "independent")
AMPLIFIABLE = ("banded", "independent")
_TAG = "CorrelatedNoise"


def default_cache_dir() -> str:
    """Where optimised factors are cached: ``$DPFL_CACHE_DIR/factorizations``, else
    ``~/.cache/dpfl_lightning/factorizations``."""
    root = os.environ.get("DPFL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dpfl_lightning")
    return os.path.join(root, "factorizations")


def build_strategy(kind: str, workload: mf.Workload, groups: int, bands: int | None = None, buffers: int = 4,
                   tree_height: int | None = None, cache_dir: str | None = None) -> mf.Strategy:
    """The strategy ``kind`` for ``workload``'s rounds under cyclic participation in ``groups`` groups
    (``tree_height=None``: the restart height with the least error, :func:`~dpfl_lightning.privacy.
    mf_optimize.tree_height`). Optimised factors and the tree's height are computed with one thread
    (the same bits on every rank and thread count) and cached in ``cache_dir``: every rank computes or
    reads the same factor, no broadcast is needed."""
    T = workload.T
    if kind == "independent":
        return mf.independent(T)
    if kind == "tree" and tree_height is not None:
        return mf.tree(T, tree_height)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if kind == "tree":
            return mf.tree(T, best_tree_height(workload, min(groups, T), -(-T // groups), cache_dir=cache_dir))
        if kind == "banded":
            return banded(workload, min(groups, T) if bands is None else bands, cache_dir=cache_dir)
        return blt(workload, buffers, min_sep=min(groups, T), max_participations=-(-T // groups), cache_dir=cache_dir)
    finally:
        torch.set_num_threads(threads)


class CorrelatedNoise(CalibratedNoise, FederatedCallback):
    """Correlated Gaussian noise across rounds on the sum of clipped updates (see the module docstring).

    Args:
        strategy: ``"tree"``, ``"banded"``, ``"blt"`` or ``"independent"``.
        noise_multiplier: ``z``, the Gaussian multiplier of the whole stream (``Z``'s rows have std
            ``z sens C``). Give it or ``target_epsilon``.
        target_epsilon / delta / accountant: calibrate ``z`` before training.
        bands: ``banded``'s number of bands (default and maximum: the sampler's number of groups).
        buffers: ``blt``'s number of buffers (2-6 typical).
        tree_height: ``tree`` restarts every ``2**tree_height`` rounds (default: the height whose
            ``sens^2 ||A L||_F^2`` is least for the run's participations, from 0, independent noise, to
            one tree; T = 64, 16 participations: 3, prefix-sum error 15.63 against one tree's 31.72).
        server_momentum: the server SGD momentum the factorization is optimised for (it must equal
            the ServerOptimizer's).
        cache_dir: where optimised factors are cached (default :func:`default_cache_dir`).
    """

    order = ORDER_ADD_NOISE
    state_key = "CorrelatedNoise"

    def __init__(self, strategy: str = "banded", noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, delta: float | None = None, accountant: str = "rdp",
                 bands: int | None = None, buffers: int = 4, tree_height: int | None = None,
                 server_momentum: float = 0.0, cache_dir: str | None = None) -> None:
        require(strategy in STRATEGIES, "CorrelatedNoise.strategy", strategy, "unknown strategy",
                f"use one of {', '.join(STRATEGIES)}")
        require((noise_multiplier is None) != (target_epsilon is None), "CorrelatedNoise",
                {"noise_multiplier": noise_multiplier, "target_epsilon": target_epsilon},
                "exactly one of noise_multiplier and target_epsilon must be set",
                "pass noise_multiplier=... or target_epsilon=... (with delta)")
        check_noise_multiplier("CorrelatedNoise", noise_multiplier, False)
        self.check_target_epsilon("CorrelatedNoise", target_epsilon)
        require(delta is None or 0 < delta < 1, "CorrelatedNoise.delta", delta, "must be in (0, 1)",
                "set delta well below 1/num_clients")
        require(bands is None or (isinstance(bands, int) and bands >= 1), "CorrelatedNoise.bands", bands,
                "must be an integer >= 1", "leave it unset (the number of cyclic groups) or give a smaller one")
        require(0.0 <= server_momentum < 1.0, "CorrelatedNoise.server_momentum", server_momentum, "must be in [0, 1)",
                "set the ServerOptimizer's momentum")
        self.strategy_name, self.noise_multiplier, self.target_epsilon = strategy, noise_multiplier, target_epsilon
        self.delta, self.accountant = delta, accountant
        self.bands, self.buffers, self.tree_height = bands, buffers, tree_height
        self.server_momentum = float(server_momentum)
        self.cache_dir = cache_dir
        self.strategy: mf.Strategy | None = None
        self.sensitivity_details = None
        self.scales: list[float] = []  # each round's std of Z's rows: public (z, sens and the bound in force)
        self._generator = None
        self.starts = [0]  # the rounds at which the mechanism (re)started: public (secure resumes)
        self._before: tuple = ()  # the earlier segments' accounted streams
        self._replaces = None  # the stream in force when the checkpoint was written
        self._restart_note = ""
        self._height_note = ""

    # ------------------------------------------------------------------ set-up
    def setup(self, *, ctx) -> None:
        kind = ctx.sampler.kind
        if kind not in CYCLIC:
            raise ConfigError("trainer.sampling", kind, f"CorrelatedNoise accounts cyclic participation (a client "
                              f"takes part at most every b rounds); {kind} sampling lets a client take part in "
                              "consecutive rounds (or in every round), which the factorization's sensitivity and "
                              "the ledger do not cover", "set trainer.sampling='cyclic' with clients_per_round=m "
                              "(b = ceil(M/m) groups), or 'amplified_cyclic' with sampling_rate for banded")
        if kind == "amplified_cyclic" and self.strategy_name not in AMPLIFIABLE:
            raise ConfigError("CorrelatedNoise.strategy", self.strategy_name, "amplification by sampling inside the "
                              "cyclic groups is proven for banded factorizations (columns b apart do not overlap), "
                              "not for a tree or a BLT", "use strategy='banded', or sampling='cyclic'")
        self._bound = required_update_bound(ctx, self, "CorrelatedNoise", self.strategy_name,
                                            "the noise is scaled to a norm bound on the update")
        self.rounds, self.groups = ctx.rounds, ctx.sampler.groups
        if self.bands is not None and self.bands > min(self.groups, self.rounds):
            raise ConfigError("CorrelatedNoise.bands", self.bands, f"a {self.bands}-banded C needs participations "
                              f"at least {self.bands} rounds apart, and cyclic participation gives "
                              f"{min(self.groups, self.rounds)}", f"set bands <= {min(self.groups, self.rounds)}, or "
                              "fewer clients_per_round (more groups)")
        self.rate = ctx.sampler.accounted().rate if kind == "amplified_cyclic" else 1.0
        self._segment(0)
        self._secure = ctx.secure
        if self.target_epsilon is not None:
            if self.delta is None:
                self.delta = ctx.privacy.default_delta("client")
            self.noise_multiplier = 1.0  # a placeholder: the run calibrates it (see `calibration`)

    def _segment(self, start: int) -> None:
        """Build the factorization of the segment of rounds ``start .. rounds - 1`` (``T`` rounds of it):
        participations ``min(b, T)`` apart, at most ``ceil(T / b)``, in the segment's own round numbers."""
        self.start, self.T = start, self.rounds - start
        self.min_sep, self.k = min(self.groups, self.T), -(-self.T // self.groups)
        self.workload = mf.momentum(self.T, self.server_momentum)
        bands = None if self.bands is None else min(self.bands, self.min_sep)
        self.strategy = build_strategy(self.strategy_name, self.workload, self.groups, bands, self.buffers,
                                       self.tree_height, self.cache_dir or default_cache_dir())
        self.sensitivity_details = self.strategy.sensitivity_details(self.min_sep, self.k)
        self._height_note = self._worse_than_independent() if self.strategy_name == "tree" else ""

    def _worse_than_independent(self) -> str:
        """A warning when a ``tree_height`` the user gave has a larger workload error than independent
        noise under the same participations (``k ||A||_F^2``: ``C = I`` has sensitivity ``sqrt(k)``)."""
        if self.tree_height is None:
            return ""
        A = self.workload.matrix()
        tree = self.sensitivity ** 2 * float((A @ self.strategy.inverse).pow(2).sum())
        independent = self.k * float(A.pow(2).sum())
        if tree <= independent:
            return ""
        rms = lambda e: math.sqrt(e / self.T)  # noqa: E731 - the root-mean-square error per output and unit z
        return (f"CorrelatedNoise(strategy='tree', tree_height={self.tree_height}): with {self.k} participations "
                f"{self.min_sep} rounds apart over {self.T} rounds its {self.workload.name} error is {rms(tree):.4g} "
                f"per round (root mean square, z = 1), more than independent noise's {rms(independent):.4g} at the "
                "same epsilon. Fix: leave tree_height unset (the height with the least error), or use "
                "strategy='banded'")

    def _prefix(self, stream: Stream, n: int) -> Stream:
        """The current segment's stream as released by its first ``n`` rounds: for one Gaussian over the
        stream, ``C``'s rows complete by then on those rounds (``C[:n, :n]`` for a square ``C``) with the
        sensitivity under the pattern restricted to them; per-participation and tree events count rounds."""
        bare = dataclasses.replace(stream, rounds=n, start=0, before=(), replaces=None)
        if stream.kind != "gaussian":
            return bare
        C = self.strategy.C
        rows = (C[:, n:] == 0).all(dim=1) if n < self.T else torch.ones(C.shape[0], dtype=torch.bool)
        sens = sensitivity_details(C[rows][:, :n], min(self.groups, n), -(-n // self.groups)).value
        return dataclasses.replace(bare, noise_multiplier=stream.noise_multiplier * self.sensitivity / sens)

    def _restart(self, starts: list[int], r: int) -> None:
        """A secure resume at round ``r``: rebuild the public history of segments (``starts``) and start
        a new factorization for rounds ``r .. rounds - 1``."""
        self._before, self._replaces = (), None
        for a, b in zip(starts, starts[1:]):
            self._segment(a)
            declared = self.stream()
            self._before, self._replaces = self._before + (self._prefix(declared, b - a),), declared
        self._segment(starts[-1])
        if r > starts[-1]:
            declared = self.stream()
            self._before, self._replaces = self._before + (self._prefix(declared, r - starts[-1]),), declared
            self._segment(r)
            starts = starts + [r]
        self.starts = starts
        self._restart_note = (f"CorrelatedNoise: secure-mode resume at round {r + 1}: the noise state cannot be "
                              f"rebuilt (its secret was never saved), so a new {self.strategy_name} factorization "
                              f"covers rounds {self.start + 1}-{self.rounds} (sensitivity {self.sensitivity:.4g}); "
                              f"the ledger composes the {len(self.starts)} segments (restarts at rounds "
                              f"{', '.join(str(a + 1) for a in self.starts[1:])})")

    @property
    def sensitivity(self) -> float:
        """``sens``: the L2 sensitivity of ``C`` under the participation pattern, for unit clip bound."""
        return self.sensitivity_details.value

    @property
    def calibration(self) -> tuple[float, float, str] | None:
        return None if self.target_epsilon is None else (self.target_epsilon, self.delta, self.accountant)

    def use_noise_multiplier(self, z: float) -> None:
        self.noise_multiplier = float(z)

    def stream(self) -> Stream:
        """How the ledger accounts this mechanism (:class:`~dpfl_lightning.privacy.mechanisms.Stream`)."""
        z, sens = float(self.noise_multiplier), self.sensitivity
        common = dict(rounds=self.T, min_sep=self.min_sep, workload=self.workload.name, strategy=self.strategy_name,
                      start=self.start, before=self._before, replaces=self._replaces)
        if self.rate < 1:  # per participation: a column of norm <= 1, noise z sens C
            return Stream("participations", z * sens, rate=self.rate, sensitivity=sens, **common)
        if self.strategy_name == "tree" and self.k == 1:  # dp_accounting's single-epoch tree event
            return Stream("tree", z * sens, restart_every=2 ** self.strategy.params["height"], sensitivity=sens,
                          **common)
        return Stream("gaussian", z, **common)

    def privacy_mechanisms(self, *, ctx) -> list[Mechanism]:
        s = self.stream()
        span = f"{self.T} rounds" if not self.start else f"rounds {self.start + 1}-{self.rounds} (restarted)"
        what = f"{self.strategy_name} correlated noise over {span} (noise multiplier {s.z:.4g}" \
               f", sensitivity {self.sensitivity:.4g} of C under participations {self.min_sep} rounds apart, at most " \
               f"{self.k}" + (f", Poisson rate {self.rate:g} inside the group" if self.rate < 1 else "") + ")"
        return [Mechanism.correlated("CorrelatedNoise", s, (UPDATE,), what)]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [MetricRelease("noise_std", "public", "CorrelatedNoise",
                              "the std of the round's correlated noise per coordinate (from z, C and the bound)")]

    def on_fit_start(self, *, ctx) -> None:
        if ctx.is_global_zero and self._restart_note:
            warnings.warn(self._restart_note, UserWarning, stacklevel=2)
        if ctx.is_global_zero and self._height_note:
            warnings.warn(self._height_note, UserWarning, stacklevel=2)
        if ctx.is_global_zero:
            self.warn_if_useless("CorrelatedNoise", self.noise_multiplier, self._bound(),
                                 "raise target_epsilon, or train fewer rounds")

    # ------------------------------------------------------------------ rounds
    def before_round(self, *, plan, server) -> None:
        self._round_scale = float(self.noise_multiplier) * self.sensitivity * self._bound()

    def _generator_for(self, d: int, random: rng.RandomSource, round_idx: int, dtype: torch.dtype):
        """The segment's generator at ``round_idx`` (its rows keyed by the run's round numbers). Rows and
        state are in the aggregate's float precision (float32 unless the model is float64): over T = 1000
        rounds at d = 2000 the float32 recursions stay within 2.4e-7 (BLT), 1.6e-7 (banded) and 6.2e-7
        (tree) of float64's, relative, per round and in the prefix sum -- the rounding of the float32
        aggregate the noise is added to."""
        if self._generator is not None and self._generator.d != d:
            raise ConfigError("CorrelatedNoise", f"round {round_idx + 1}", f"the trainable part changed from "
                              f"{self._generator.d} to {d} entries during the run, and the correlated noise's "
                              "state has the first dimension", "keep the same parameters trainable for the whole "
                              "run (freeze or unfreeze before fit)")
        if self._generator is None:
            def normal(t: int, rows: int) -> torch.Tensor:
                stream = random.stream(self.start + t, rng.SERVER_CLIENT, rng.CENTRAL_NOISE, tag=_TAG)
                return stream.normal((rows, d), 1.0, dtype=dtype)

            self._generator = noise_generator(self.strategy, d, normal)
        if self._generator.round != round_idx - self.start:
            self._resume(round_idx)
        return self._generator

    def _resume(self, round_idx: int) -> None:
        if self._secure:  # a secure resume restarts the mechanism at the checkpoint's round (load_state_dict)
            raise ConfigError("resume", f"round {round_idx + 1}", "secure mode cannot rebuild a correlated-noise "
                              f"state, and the mechanism was restarted at round {self.start + 1}",
                              "resume from the checkpoint the run restarted from")
        if len(self.scales) < round_idx:
            raise ConfigError("resume", f"round {round_idx + 1}", "the checkpoint holds no scales for the rounds "
                              "before it", "resume from a checkpoint written by this CorrelatedNoise")
        self._generator.resume(round_idx - self.start, self.scales[self.start:round_idx])

    def on_aggregate(self, *, server) -> None:
        x, mask, t = server.aggregate[UPDATE], server.plan.trainable, server.round_idx
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        gen = self._generator_for(frozen.count(mask, x.numel()), server.random, t, dtype)
        noise = gen.next(self._round_scale)
        del self.scales[t:]
        self.scales.append(self._round_scale)
        noise = noise.to(device=x.device, dtype=x.dtype)  # drawn on the CPU (keyed streams), added where x is
        if mask is None:
            x.add_(noise)
        else:
            x[mask] += noise

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        t = server.round_idx
        t -= self.start
        metrics["noise_std"] = self._round_scale * math.sqrt(float(self.strategy.covariance()[t, t])) \
            if self.T <= 4096 else self._round_scale

    # ------------------------------------------------------------------ state: public scales and restart rounds only
    def state_dict(self) -> dict[str, Any]:
        state = {"scales": list(self.scales), "strategy": self.strategy_name, "starts": list(self.starts)}
        state.update(CalibratedNoise.state_dict(self))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        CalibratedNoise.load_state_dict(self, {k: v for k, v in state.items() if k == "noise_multiplier"})
        self.scales = [float(s) for s in state.get("scales", [])]
        starts = [int(a) for a in state.get("starts", [0])]
        if self.scales and getattr(self, "_secure", False):
            self._restart(starts, len(self.scales))
        elif starts != [0]:
            raise ConfigError("resume", starts, "the checkpoint's correlated noise was restarted by a secure-mode "
                              "resume, and this run is not in secure mode", "resume with secure=True")


def check_server_optimizer(optimizer: str, momentum: float, nesterov: bool, mechanisms: list) -> None:
    """Refuse a server optimizer whose iterates are not the workload a correlated-noise mechanism was
    optimised for (prefix sums for SGD, the momentum workload for SGD with that momentum)."""
    for m in mechanisms:
        s = getattr(m, "stream", None)
        if s is None:
            continue
        expected = mf.momentum(s.rounds, momentum).name if optimizer == "sgd" and not nesterov else None
        if expected != s.workload:
            raise ConfigError("ServerOptimizer", {"optimizer": optimizer, "momentum": momentum, "nesterov": nesterov},
                              f"{m.source}'s factorization is optimised for the '{s.workload}' workload (server SGD "
                              f"{'with momentum ' + s.workload[8:] if s.workload != 'prefix' else 'without momentum'})"
                              ", and this server optimizer's iterates are another function of the noisy updates, so "
                              "the noise would not cancel as planned", "use ServerOptimizer('sgd', momentum=m) with "
                              "CorrelatedNoise(server_momentum=m) (no nesterov, adam or adagrad)")
