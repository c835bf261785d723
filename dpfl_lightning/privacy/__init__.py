"""Privacy accounting: what each mechanism releases, epsilon from dp_accounting / Opacus,
noise calibration, and the per-round ledger with an optional budget."""

from dpfl_lightning.privacy.accountants import ACCOUNTANTS, Epsilon, GaussianRelease, epsilon
from dpfl_lightning.privacy.calibrate import calibrate_noise, max_steps

__all__ = ["ACCOUNTANTS", "Epsilon", "GaussianRelease", "calibrate_noise", "epsilon", "max_steps"]
