"""SCAFFOLDCommit: SCAFFOLD's ``c_i`` update from the ``dc`` each client sent.

:class:`~dpfl_lightning.plugins.SCAFFOLD` computes ``dc = c_i+ - c_i`` (paper 001 Alg. 1 line 14)
while the client trains, before the bounding and noise plugins run; with client-level DP they clip
``(update, dc)`` and noise them. The server adds the ``dc`` it receives to ``c``
(``c <- c + (1/M) sum dc``, line 20), so for ``c`` to stay the mean of the ``c_i`` each client must
add the same ``dc``: the one it sent, clipped and (local or distributed) noised. This plugin runs
after the noise and does that update, ``c_i <- c_i + dc_sent``, for the SCAFFOLD it belongs to.

Create it through its SCAFFOLD and list both::

    scaffold = SCAFFOLD()
    plugins = [scaffold, scaffold.commit, UpdateClipping(C, segments=["update", "dc"]),
               GaussianNoise(noise_multiplier=z, placement="local", segments=["update", "dc"])]

SCAFFOLD refuses a run in which a plugin bounds or noises ``dc`` and this plugin is missing.
"""

from __future__ import annotations

from typing import Any

from dpfl_lightning.plugins.base import ORDER_ADD_NOISE, FederatedCallback


class SCAFFOLDCommit(FederatedCallback):
    """After the noise: each client adds the ``dc`` it sent to its ``c_i`` (see the module docstring).

    Args:
        scaffold: the :class:`~dpfl_lightning.plugins.SCAFFOLD` whose ``c_i`` it updates.
    """

    order = ORDER_ADD_NOISE + 50  # after every client-side bound and noise

    def __init__(self, scaffold: Any) -> None:
        self._scaffold = scaffold

    def on_client_end(self, *, client) -> None:
        self._scaffold.commit_sent(client)
