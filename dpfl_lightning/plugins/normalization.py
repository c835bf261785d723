"""UpdateNormalization: DP-NormFedAvg's client-update normalization.

Implements ``norm(u, C) = C * u / ||u||`` of paper 003 (Das et al.), Alg. 1 option (ii) (line 11):
every update is rescaled to norm exactly ``C`` (to rounding, never above), so small updates are
not drowned by noise proportional to ``C`` (Sec. 3.1). Sensitivity of the cohort's sum: ``C``
(add/remove one client). An all-zero update stays zero (its direction is undefined); its norm 0
is within the bound.
"""

from __future__ import annotations

from dpfl_lightning.plugins.sensitivity import SensitivityBound


class UpdateNormalization(SensitivityBound):
    """Rescale every non-zero client contribution to L2 norm ``max_norm`` (the scaling factor ``C``).

    Args:
        max_norm: the scaling factor ``C`` (> 0).
        segments: payload segments normalized jointly (default ``["update"]``).
        log_norms: also log the mean raw norm (un-noised: refused in a DP run unless
            ``log_client_metrics=True``).
    """

    only_if_above = False
