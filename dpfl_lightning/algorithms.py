"""Presets: each paper's algorithm as a named list of plugins plus the trainer settings it needs.

Pass one as ``FederatedTrainer(algorithm=DPFedAvg(...))`` or in YAML as
``trainer.algorithm: {class_path: dpfl_lightning.algorithms.DPFedAvg, init_args: {...}}``.
Extra plugins given next to a preset run after it where their order allows.
"""

from __future__ import annotations

from dpfl_lightning.errors import require
from dpfl_lightning.plugins import DPSGD, GaussianNoise, ServerOptimizer, UpdateClipping, UpdateNormalization
from dpfl_lightning.plugins.adaptive_clipping import AdaptiveClip, update_noise_multiplier
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.plugins.fedexp import FedEXP as FedEXPPlugin
from dpfl_lightning.plugins.privunit_randomizer import PrivUnitRandomizer
from dpfl_lightning.plugins.scaffnew import ScaffNew as ScaffNewPlugin
from dpfl_lightning.plugins.scaffold import SCAFFOLD as SCAFFOLDPlugin


class Algorithm:
    """A named set of plugins. ``normalize_update_by_lr`` is passed on to the trainer."""

    name = "algorithm"
    normalize_update_by_lr = False

    def plugins(self) -> list[FederatedCallback]:
        raise NotImplementedError

    def validate(self, trainer) -> None:
        """Check the trainer settings the algorithm prescribes (called at set-up)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class FedAvg(Algorithm):
    """FedAvg (McMahan et al. 2017): average the client updates; optional server learning rate and
    momentum (``x <- x + lr * mean update``)."""

    name = "fedavg"

    def __init__(self, server_lr: float = 1.0, server_momentum: float = 0.0) -> None:
        self.server_lr = server_lr
        self.server_momentum = server_momentum

    def plugins(self) -> list[FederatedCallback]:
        return [ServerOptimizer("sgd", lr=self.server_lr, momentum=self.server_momentum)]


class DPFedAvg(Algorithm):
    """DP-FedAvg with update clipping (paper 000 Alg. 1; paper 003 Alg. 1 option (i)).

    Each client's update is clipped to ``clip`` and Gaussian noise with multiplier
    ``noise_multiplier`` (``sigma = z * clip``) is added: per client for ``placement="local"``
    (paper 000's local DP), once to the sum for ``"central"`` (McMahan et al. 2018), or in shares
    for ``"distributed"``.
    """

    name = "dp_fedavg"

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 1.0, placement: str = "central",
                 server_lr: float = 1.0, server_momentum: float = 0.0) -> None:
        self.clip = clip
        self.noise_multiplier = noise_multiplier
        self.placement = placement
        self.server_lr = server_lr
        self.server_momentum = server_momentum

    def bound(self) -> FederatedCallback:
        return UpdateClipping(self.clip)

    def plugins(self) -> list[FederatedCallback]:
        return [self.bound(), GaussianNoise(noise_multiplier=self.noise_multiplier, placement=self.placement),
                ServerOptimizer("sgd", lr=self.server_lr, momentum=self.server_momentum)]


class DPFedAvgLocal(DPFedAvg):
    """DP-FedAvg with local noise (paper 000 Alg. 1): every client sends
    ``clip(x_local - x) + N(0, sigma^2 I)``; nothing un-noised leaves a client."""

    name = "dp_fedavg_local"

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 1.0, server_lr: float = 1.0,
                 server_momentum: float = 0.0) -> None:
        super().__init__(clip, noise_multiplier, "local", server_lr, server_momentum)


class DPNormFedAvg(DPFedAvg):
    """DP-NormFedAvg (paper 003 Alg. 1 option (ii)): ``u = (w_k - w_{k,E}) / eta_k`` is normalized to
    norm ``C`` (``scale``), each client adds its share of the noise (``distributed``, line 12: the
    mean carries ``N(0, sigma^2)``), the server steps with ``beta`` (``server_lr``) and momentum."""

    name = "dp_normfedavg"
    normalize_update_by_lr = True

    def __init__(self, scale: float = 1.0, noise_multiplier: float = 1.0, placement: str = "distributed",
                 server_lr: float = 1.0, server_momentum: float = 0.0) -> None:
        super().__init__(scale, noise_multiplier, placement, server_lr, server_momentum)

    def bound(self) -> FederatedCallback:
        return UpdateNormalization(self.clip)


class DPFedAvgClipLR(DPFedAvg):
    """Paper 003 Alg. 1 option (i) exactly: like :class:`DPNormFedAvg` (update in gradient units,
    distributed noise, server ``beta``) but clipping instead of normalizing -- its baseline."""

    name = "dp_fedavg_clip"
    normalize_update_by_lr = True

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 1.0, placement: str = "distributed",
                 server_lr: float = 1.0, server_momentum: float = 0.0) -> None:
        super().__init__(clip, noise_multiplier, placement, server_lr, server_momentum)


class _DPSGDClients:
    """The DP-SGD client settings the presets with DP-SGD clients (PFL, DP-SCAFFOLD) share."""

    def _dpsgd_settings(self, noise_multiplier: float | None, target_epsilon: float | None, delta: float | None,
                        max_grad_norm: float, sampling: str, fix_model: bool, accountant: str) -> None:
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.max_grad_norm = max_grad_norm
        self.sampling = sampling
        self.fix_model = fix_model
        self.accountant = accountant

    def _dpsgd(self) -> DPSGD:
        return DPSGD(noise_multiplier=self.noise_multiplier, target_epsilon=self.target_epsilon, delta=self.delta,
                     max_grad_norm=self.max_grad_norm, sampling=self.sampling, fix_model=self.fix_model,
                     accountant=self.accountant)


class PFL(_DPSGDClients, Algorithm):
    """Paper 004 Alg. 1 (PFL): every client trains with DP-SGD for ``E`` local epochs (record-level
    DP towards the server), the server averages the models (FedAvg, ``theta = 1/k sum theta_i``).

    ``total_epochs`` (``T = E x R``) is checked against ``trainer.local_epochs * trainer.rounds``, so
    a sweep over (E, R) keeps the number of DP-SGD steps, hence the noise for a target epsilon,
    fixed (paper 004 Sec. 4: the best split at a fixed budget is E = 1, R = T).
    """

    name = "pfl"

    def __init__(self, noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 delta: float | None = None, max_grad_norm: float = 1.0, sampling: str = "poisson",
                 total_epochs: int | None = None, fix_model: bool = False, accountant: str = "rdp") -> None:
        self._dpsgd_settings(noise_multiplier, target_epsilon, delta, max_grad_norm, sampling, fix_model, accountant)
        self.total_epochs = total_epochs

    def plugins(self) -> list[FederatedCallback]:
        return [self._dpsgd(), ServerOptimizer("sgd", lr=1.0)]

    def validate(self, trainer) -> None:
        if self.total_epochs is None:
            return
        require(trainer.local_epochs is not None, "trainer.local_epochs", None,
                "PFL counts local work in epochs", "set trainer.local_epochs (E) instead of local_steps")
        require(trainer.local_epochs * trainer.rounds == self.total_epochs, "trainer.rounds", trainer.rounds,
                f"local_epochs x rounds = {trainer.local_epochs} x {trainer.rounds} != total_epochs = {self.total_epochs}",
                f"set rounds = total_epochs / local_epochs = {self.total_epochs / trainer.local_epochs:g}")


class SCAFFOLD(Algorithm):
    """SCAFFOLD (Karimireddy et al. 2020; paper 001 Alg. 1 with sigma_g = 0): control variates
    correct every local step by ``c - c_i``; the server steps with ``server_lr`` (``eta_g``)."""

    name = "scaffold"

    def __init__(self, server_lr: float = 1.0, warm_start: bool = False, warm_start_rounds: int | None = None) -> None:
        self.server_lr = server_lr
        self.warm_start = warm_start
        self.warm_start_rounds = warm_start_rounds

    def plugins(self) -> list[FederatedCallback]:
        # c_i follow the dc each client sent (SCAFFOLD reads it after every bound and noise)
        return [SCAFFOLDPlugin(self.warm_start, self.warm_start_rounds), ServerOptimizer("sgd", lr=self.server_lr)]


class DPSCAFFOLD(_DPSGDClients, SCAFFOLD):
    """DP-SCAFFOLD(-warm) (paper 001 Alg. 1): DP-SGD clients (per-record clipping ``max_grad_norm``,
    a ``noise_multiplier`` or a ``target_epsilon``) with SCAFFOLD's control variates, which cost no
    extra privacy (Claim 4.1). ``warm_start=True`` is DP-SCAFFOLD-warm (Sec. 3.3).

    ``noise_multiplier`` is DP-SGD's ``z`` (noise ``N(0, (z C)^2)`` on the sum of the clipped
    gradients, divided by the batch size), not the paper's ``sigma_g``: Alg. 1 adds
    ``(2C / sR) N(0, sigma_g^2)`` to the mean clipped gradient of a batch of ``sR`` records, i.e.
    ``sigma_g`` times the replace-one sensitivity ``2C / sR``, so ``z = 2 sigma_g`` (the ledger
    accounts a fixed-size batch under replace-one with multiplier ``z / 2 = sigma_g``). The paper's
    synthetic experiments (``sigma_g = 60``) are ``noise_multiplier=120``."""

    name = "dp_scaffold"

    def __init__(self, noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 delta: float | None = None, max_grad_norm: float = 1.0, sampling: str = "fixed",
                 server_lr: float = 1.0, warm_start: bool = True, warm_start_rounds: int | None = None,
                 accountant: str = "rdp", fix_model: bool = False) -> None:
        super().__init__(server_lr, warm_start, warm_start_rounds)
        self._dpsgd_settings(noise_multiplier, target_epsilon, delta, max_grad_norm, sampling, fix_model, accountant)

    def plugins(self) -> list[FederatedCallback]:
        return [self._dpsgd(), *super().plugins()]


class ScaffNew(Algorithm):
    """ScaffNew (Mishchenko et al. 2022): control variates ``h_i`` and a shared coin with
    probability ``p`` that ends a round's local steps (paper 000 Alg. 2 with sigma = 0, no clipping).
    Every client counts once in the mean (``trainer.weighting="uniform"``): the ``h_i`` sum to zero."""

    name = "scaffnew"

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def plugins(self) -> list[FederatedCallback]:
        return [ScaffNewPlugin(self.p), ServerOptimizer("sgd", lr=1.0)]


class DPScaffNew(ScaffNew):
    """DP-ScaffNew (paper 000 Alg. 2): each client sends ``clip(x_hat_i - x) + N(0, sigma^2 I)``
    (local DP; ``sigma = noise_multiplier * clip``), ``h_i`` follow the noisy messages."""

    name = "dp_scaffnew"

    def __init__(self, p: float = 0.5, clip: float = 1.0, noise_multiplier: float = 1.0) -> None:
        super().__init__(p)
        self.clip = clip
        self.noise_multiplier = noise_multiplier

    def plugins(self) -> list[FederatedCallback]:
        return [ScaffNewPlugin(self.p), UpdateClipping(self.clip),
                GaussianNoise(noise_multiplier=self.noise_multiplier, placement="local"), ServerOptimizer("sgd", lr=1.0)]


class FedEXP(Algorithm):
    """FedEXP (Jhunjhunwala et al. 2023; paper 002 eq. (2)): FedAvg with the adaptive global step
    size ``max(1, mean ||D_i||^2 / ||D_bar||^2)``; ``half=True`` and ``eps`` give the original
    paper's ``1/2`` and denominator constant. No DP. The means are uniform over the cohort
    (``trainer.weighting="uniform"``; the DP variants below too)."""

    name = "fedexp"

    def __init__(self, half: bool = False, eps: float = 0.0, average_last: int = 2) -> None:
        self.half = half
        self.eps = eps
        self.average_last = average_last

    def plugins(self) -> list[FederatedCallback]:
        return [FedEXPPlugin("plain", self.half, self.eps, average_last=self.average_last), ServerOptimizer("sgd", lr=1.0)]


class LDPFedEXP(Algorithm):
    """LDP-FedEXP (paper 002, Alg. 1): clipped updates randomized on the client -- Gaussian noise
    ``N(0, (z C)^2 I)`` (eq. (6)) or PrivUnit x ScalarDP with ``eps0 + eps1 + eps2`` (App. D, eq. (8))
    -- and the bias-corrected adaptive global step size computed from the randomized updates only."""

    name = "ldp_fedexp"

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 0.7, randomizer: str = "gaussian",
                 eps0: float = 2.0, eps1: float = 2.0, eps2: float = 2.0, average_last: int = 2) -> None:
        require(randomizer in ("gaussian", "privunit"), "LDPFedEXP.randomizer", randomizer, "unknown randomizer",
                "use 'gaussian' or 'privunit'")
        self.clip = clip
        self.noise_multiplier = noise_multiplier
        self.randomizer = randomizer
        self.eps0, self.eps1, self.eps2 = eps0, eps1, eps2
        self.average_last = average_last

    def plugins(self) -> list[FederatedCallback]:
        if self.randomizer == "gaussian":
            local = GaussianNoise(noise_multiplier=self.noise_multiplier, placement="local")
        else:
            local = PrivUnitRandomizer(self.eps0, self.eps1, self.eps2)
        return [UpdateClipping(self.clip), local,
                FedEXPPlugin(f"ldp_{self.randomizer}", average_last=self.average_last), ServerOptimizer("sgd", lr=1.0)]


class CDPFedEXP(Algorithm):
    """CDP-FedEXP (paper 002, Alg. 2): clipped updates, central noise ``N(0, (z C)^2 I)`` on their sum,
    and the adaptive step size from the sum of squared norms plus its own noise ``xi`` (eq. (7);
    ``sigma_xi`` defaults to ``d sigma^2 / M``), a second release the ledger composes (Prop. 4.2)."""

    name = "cdp_fedexp"

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 5.0, sigma_xi: float | None = None,
                 average_last: int = 2) -> None:
        self.clip = clip
        self.noise_multiplier = noise_multiplier
        self.sigma_xi = sigma_xi
        self.average_last = average_last

    def plugins(self) -> list[FederatedCallback]:
        return [UpdateClipping(self.clip), GaussianNoise(noise_multiplier=self.noise_multiplier, placement="central"),
                FedEXPPlugin("cdp", sigma_xi=self.sigma_xi, average_last=self.average_last),
                ServerOptimizer("sgd", lr=1.0)]


class AdaptiveClipping(Algorithm):
    """DP-FedAvg or DP-NormFedAvg with the clip norm (or scale) following a target quantile of the
    update norms (Andrew et al. 2021). The update noise multiplier is lowered to
    ``z_Delta = (z^-2 - (2 count_noise)^-2)^(-1/2)`` so that, with the noisy count, the run spends
    exactly the privacy of the non-adaptive run with ``noise_multiplier = z``."""

    name = "adaptive_clipping"

    def __init__(self, base: str = "dp_fedavg", noise_multiplier: float = 1.0, count_noise: float | None = None,
                 initial_clip: float = 1.0, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 placement: str = "central", server_lr: float = 1.0, server_momentum: float = 0.0) -> None:
        require(base in ("dp_fedavg", "dp_normfedavg"), "AdaptiveClipping.base", base, "unknown base algorithm",
                "use 'dp_fedavg' or 'dp_normfedavg'")
        self.base = base
        self.noise_multiplier = noise_multiplier
        self.count_noise = count_noise  # None: expected cohort / 20 (Andrew et al.), known at set-up
        self.initial_clip = initial_clip
        self.target_quantile = target_quantile
        self.learning_rate = learning_rate
        self.placement = placement
        self.server_lr = server_lr
        self.server_momentum = server_momentum
        self.normalize_update_by_lr = base == "dp_normfedavg"
        if count_noise is not None:  # refuse a split that cannot work now, not at set-up
            update_noise_multiplier(noise_multiplier, count_noise)
        self._noise: GaussianNoise | None = None

    @property
    def update_noise_multiplier(self) -> float:
        """``z_Delta``, the update's share of ``noise_multiplier`` (once the run is set up)."""
        return self._noise.noise_multiplier

    def plugins(self) -> list[FederatedCallback]:
        self._noise = GaussianNoise(noise_multiplier=self.noise_multiplier, placement=self.placement)
        return [AdaptiveClip(self.initial_clip, self.target_quantile, self.learning_rate, self.count_noise,
                             self.placement, normalize=self.base == "dp_normfedavg",
                             total_noise_multiplier=self.noise_multiplier, update_noise=self._noise),
                self._noise,
                ServerOptimizer("sgd", lr=self.server_lr, momentum=self.server_momentum)]


PRESETS = {cls.name: cls for cls in (FedAvg, DPFedAvg, DPFedAvgLocal, DPNormFedAvg, DPFedAvgClipLR, PFL, SCAFFOLD,
                                     DPSCAFFOLD, ScaffNew, DPScaffNew, FedEXP, LDPFedEXP, CDPFedEXP, AdaptiveClipping)}
