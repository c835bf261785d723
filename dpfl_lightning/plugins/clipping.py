"""UpdateClipping: DP-FedAvg's client-update clipping.

Implements ``clip(u, C) = u * min(1, C / ||u||)`` of paper 000 Alg. 1 line 8 and paper 003 Alg. 1
option (i) (line 10). Sensitivity of the cohort's sum: ``C`` (add/remove one client), ``2C``
(replace one client). Given several segments (e.g. SCAFFOLD's ``update`` and ``dc``), their joint
norm is clipped.
"""

from __future__ import annotations

from dpfl_lightning.plugins.sensitivity import SensitivityBound


class UpdateClipping(SensitivityBound):
    """Scale every client's contribution with L2 norm above ``max_norm`` down to ``max_norm``.

    Args:
        max_norm: the clipping threshold ``C`` (> 0).
        segments: payload segments clipped jointly (default ``["update"]``).
        log_norms: also log the mean raw norm and the fraction of clipped clients (un-noised
            statistics: refused in a DP run unless ``log_client_metrics=True``).
    """

    only_if_above = True
