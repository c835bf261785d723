"""Presets: each paper's algorithm as a named list of plugins plus the trainer settings it needs.

Pass one as ``FederatedTrainer(algorithm=DPFedAvg(...))`` or in YAML as
``trainer.algorithm: {class_path: dpfl_lightning.algorithms.DPFedAvg, init_args: {...}}``.
Extra plugins given next to a preset run after it where their order allows.
"""

from __future__ import annotations

from dpfl_lightning.plugins import GaussianNoise, ServerOptimizer, UpdateClipping, UpdateNormalization
from dpfl_lightning.plugins.base import FederatedCallback


class Algorithm:
    """A named set of plugins. ``normalize_update_by_lr`` is passed on to the trainer."""

    name = "algorithm"
    normalize_update_by_lr = False

    def plugins(self) -> list[FederatedCallback]:
        raise NotImplementedError

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


PRESETS = {cls.name: cls for cls in (FedAvg, DPFedAvg, DPFedAvgLocal, DPNormFedAvg, DPFedAvgClipLR)}
