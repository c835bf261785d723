"""Presets: each paper's algorithm as a named list of plugins plus the trainer settings it needs.

Pass one as ``FederatedTrainer(algorithm=DPFedAvg(...))`` or in YAML as
``trainer.algorithm: {class_path: dpfl_lightning.algorithms.DPFedAvg, init_args: {...}}``.
Extra plugins given next to a preset run after it where their order allows.
"""

from __future__ import annotations

from dpfl_lightning.errors import require
from dpfl_lightning.plugins import DPSGD, GaussianNoise, ServerOptimizer, UpdateClipping, UpdateNormalization
from dpfl_lightning.plugins.base import FederatedCallback


class Algorithm:
    """A named set of plugins. ``normalize_update_by_lr`` is passed on to the trainer."""

    name = "algorithm"
    normalize_update_by_lr = False

    def plugins(self) -> list[FederatedCallback]:
        raise NotImplementedError

    def validate(self, trainer) -> None:
        """Check the trainer settings the algorithm prescribes (called at set-up)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
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


class PFL(Algorithm):
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
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.max_grad_norm = max_grad_norm
        self.sampling = sampling
        self.total_epochs = total_epochs
        self.fix_model = fix_model
        self.accountant = accountant

    def plugins(self) -> list[FederatedCallback]:
        return [DPSGD(noise_multiplier=self.noise_multiplier, target_epsilon=self.target_epsilon, delta=self.delta,
                      max_grad_norm=self.max_grad_norm, sampling=self.sampling, fix_model=self.fix_model,
                      accountant=self.accountant),
                ServerOptimizer("sgd", lr=1.0)]

    def validate(self, trainer) -> None:
        if self.total_epochs is None:
            return
        require(trainer.local_epochs is not None, "trainer.local_epochs", None,
                "PFL counts local work in epochs", "set trainer.local_epochs (E) instead of local_steps")
        require(trainer.local_epochs * trainer.rounds == self.total_epochs, "trainer.rounds", trainer.rounds,
                f"local_epochs x rounds = {trainer.local_epochs} x {trainer.rounds} != total_epochs = {self.total_epochs}",
                f"set rounds = total_epochs / local_epochs = {self.total_epochs / trainer.local_epochs:g}")


PRESETS = {cls.name: cls for cls in (FedAvg, DPFedAvg, DPFedAvgLocal, DPNormFedAvg, DPFedAvgClipLR, PFL)}
