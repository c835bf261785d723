"""SCAFFOLDCommit: deprecated, a no-op kept so that configs and code that name it still run.

It used to update SCAFFOLD's ``c_i`` from the ``dc`` each client sent, after the bounding and noise
plugins, because no plugin could see the release. :class:`~dpfl_lightning.plugins.SCAFFOLD` now does
that itself in ``on_client_released`` (see :meth:`FederatedCallback.on_client_released`), in any
plugin order: drop ``scaffold.commit`` from the plugins.
"""

from __future__ import annotations

import warnings
from typing import Any

from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, FederatedCallback


class SCAFFOLDCommit(FederatedCallback):
    """Deprecated no-op (see the module docstring); warns when made.

    Args:
        scaffold: the :class:`~dpfl_lightning.plugins.SCAFFOLD` it used to update (ignored).
    """

    order = ORDER_ADD_NOISE + 50

    def __init__(self, scaffold: Any = None) -> None:
        warnings.warn("SCAFFOLDCommit (scaffold.commit) is deprecated and does nothing: SCAFFOLD updates c_i from "
                      "the dc each client sent itself. Fix: remove it from the plugins", DeprecationWarning,
                      stacklevel=2)
        self._scaffold = scaffold
