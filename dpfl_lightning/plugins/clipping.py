"""UpdateClipping: DP-FedAvg's client-update clipping.

Implements ``clip(u, C) = u * min(1, C / ||u||)`` of paper 000 Alg. 1 line 8 and paper 003 Alg. 1
option (i) (line 10). Sensitivity of the cohort's sum: ``C`` (add/remove one client).
"""

from __future__ import annotations

from dpfl_lightning.plugins.sensitivity import SensitivityBound


class UpdateClipping(SensitivityBound):
    """Scale every client update with L2 norm above ``max_norm`` down to ``max_norm``.

    Args:
        max_norm: the clipping threshold ``C`` (> 0).
        log_norms: also log the mean raw update norm and the fraction of clipped clients. These
            statistics of raw updates are not privatized; leave off for a private run.
    """

    only_if_above = True
