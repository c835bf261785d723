"""Privacy accounting: what mechanisms release, the guarantees they give and towards whom,
epsilon from dp_accounting / Opacus, and noise calibration. (The per-round ledger is a plugin:
:class:`dpfl_lightning.plugins.PrivacyLedger`.)

May import: the foundation (``errors``, ``rng``) only: accounting never sees a model, a client or a run.
"""

from dpfl_lightning.privacy.accountants import ACCOUNTANTS, Epsilon, GaussianRelease, Release, create_accountant, epsilon
from dpfl_lightning.privacy.calibrate import calibrate_noise, max_steps
from dpfl_lightning.privacy.mechanisms import Mechanism

__all__ = ["ACCOUNTANTS", "create_accountant", "Epsilon", "GaussianRelease", "Mechanism", "Release", "calibrate_noise", "epsilon", "max_steps"]
