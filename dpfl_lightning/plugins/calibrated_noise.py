"""What a noise plugin whose multiplier a target epsilon may set shares with the others
(:class:`~dpfl_lightning.plugins.GaussianNoise`, :class:`~dpfl_lightning.plugins.DPSGD`): the check of
the target, and the multiplier in checkpoints. A calibrated run resumed later keeps the noise it ran
with: recalibrating for other settings would make the ledger misreport the rounds already run."""

from __future__ import annotations

import math
from typing import Any

from dpfl_lightning.errors import require


class CalibratedNoise:
    """Mixin: ``target_epsilon`` (or ``None``) and ``noise_multiplier`` (calibrated at set-up)."""

    target_epsilon: float | None = None
    noise_multiplier: float | None = None

    @staticmethod
    def check_target_epsilon(owner: str, target_epsilon: float | None) -> None:
        if target_epsilon is not None:
            require(math.isfinite(target_epsilon) and target_epsilon > 0, f"{owner}.target_epsilon", target_epsilon,
                    "must be a finite number > 0", "set a positive epsilon, e.g. 3.0")

    def state_dict(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier} if self.target_epsilon is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.noise_multiplier = state["noise_multiplier"]
