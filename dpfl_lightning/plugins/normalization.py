"""UpdateNormalization: DP-NormFedAvg's client-update normalization.

Implements ``norm(u, C) = C * u / ||u||`` of paper 003 (Das et al.), Alg. 1 option (ii) (line 11):
every update is rescaled to norm exactly ``C``, so small updates are not drowned by noise
proportional to ``C`` (Sec. 3.1). Sensitivity of the cohort's sum: ``C`` (add/remove one client).
An all-zero update stays zero (its direction is undefined); its norm 0 is within the bound.
"""

from __future__ import annotations

from dpfl_lightning.plugins.sensitivity import SensitivityBound


class UpdateNormalization(SensitivityBound):
    """Rescale every non-zero client update to L2 norm ``max_norm`` (the scaling factor ``C``).

    Args:
        max_norm: the scaling factor ``C`` (> 0).
        log_norms: also log the mean raw update norm (not privatized; leave off for a private run).
    """

    only_if_above = False
