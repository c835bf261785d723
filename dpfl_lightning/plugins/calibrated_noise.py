"""What a noise plugin whose multiplier a target epsilon may set shares with the others
(:class:`~dpfl_lightning.plugins.GaussianNoise`, :class:`~dpfl_lightning.plugins.DPSGD`): the check of
the target, the warning when the noise drowns every update, and the multiplier in checkpoints. A
calibrated run resumed later keeps the noise it ran with: recalibrating for other settings would make
the ledger misreport the rounds already run."""

from __future__ import annotations

import math
import warnings
from typing import Any

from dpfl_lightning.errors import require

#: a noise multiplier this large drowns every update (a warning at the start of training)
USELESS_MULTIPLIER = 100.0


class CalibratedNoise:
    """Mixin: ``target_epsilon`` (or ``None``) and ``noise_multiplier`` (calibrated at set-up)."""

    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    delta: float | None = None

    @staticmethod
    def check_target_epsilon(owner: str, target_epsilon: float | None) -> None:
        if target_epsilon is not None:
            require(math.isfinite(target_epsilon) and target_epsilon > 0, f"{owner}.target_epsilon", target_epsilon,
                    "must be a finite number > 0", "set a positive epsilon, e.g. 3.0")

    def warn_if_useless(self, owner: str, z: float | None, bound: float | None, fix: str) -> None:
        """Warn when the noise std is :data:`USELESS_MULTIPLIER` times the norm bound or more (``z``
        the noise multiplier std / bound, ``bound`` the norm bound): the model then learns close to
        nothing, whether the std was given (explicit ``std`` / ``noise_multiplier``) or calibrated
        from ``target_epsilon`` (an unreachable target, e.g. 1e-6). A warning in both cases, not a
        refusal: such a run is legal and private, only useless. The calibrated multiplier is a
        function of the configuration alone (target, delta, rounds, sampling), never of client data,
        so saying it releases nothing. ``fix``: what to change (the plugin's own settings)."""
        if z is None or not z >= USELESS_MULTIPLIER:
            return
        at = f" at clip norm {bound:.4g}" if bound else ""
        std = f"{z * bound:.4g}" if bound else f"{z:.4g} x the clip norm"
        head = f"{owner}: "
        if self.target_epsilon is not None:
            delta = "" if self.delta is None else f" (delta={self.delta:g})"
            head += f"target_epsilon={self.target_epsilon:g}{delta} calibrates the noise std to {std}{at}: "
        warnings.warn(f"{head}the noise std is {z:.4g}x the clip norm, orders of magnitude above any update: the "
                      f"model will learn close to nothing; {fix}", RuntimeWarning, stacklevel=3)

    def state_dict(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier} if self.target_epsilon is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.noise_multiplier = state["noise_multiplier"]
