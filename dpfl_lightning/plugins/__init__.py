"""Plugins: one per file, each a :class:`FederatedCallback`. The names load on first use (PEP 562):
``from dpfl_lightning.plugins import UpdateClipping`` does not load Opacus (``DPSGD`` does, when a
DP-SGD run sets up).

The plugin API is exported here too: the base class and the hooks' contexts, what set-up hooks
return (``Segment``, ``Mechanism``, ``MetricRelease``) and the ``ORDER_*`` constants a plugin sets its
``order`` from (``order = ORDER_ADD_NOISE + 10``: after the noise, before the server step).

May import: ``data``, ``module``, ``federated``, ``privacy``, the foundation (``errors``, ``rng``,
``lazy``); :mod:`~.contexts` is what every hook receives. Plugins never import an executor, the run
or the trainer.
"""

from __future__ import annotations

from dpfl_lightning.lazy import exports

_LAZY = {
    "AdaptiveClip": "dpfl_lightning.plugins.adaptive_clipping",
    "Aggregate": "dpfl_lightning.federated.payload",
    "ClientContext": "dpfl_lightning.plugins.contexts",
    "CorrelatedNoise": "dpfl_lightning.plugins.correlated_noise",
    "DPSGD": "dpfl_lightning.plugins.dpsgd",
    "DiscreteDistributedNoise": "dpfl_lightning.plugins.discrete_distributed_noise",
    "FedEXP": "dpfl_lightning.plugins.fedexp",
    "FederatedCallback": "dpfl_lightning.plugins.callback",
    "Mechanism": "dpfl_lightning.privacy.mechanisms",
    "MetricRelease": "dpfl_lightning.federated.releases",
    "ORDER_ADD_NOISE": "dpfl_lightning.plugins.callback",
    "ORDER_BOUND_SENSITIVITY": "dpfl_lightning.plugins.callback",
    "ORDER_DEFAULT": "dpfl_lightning.plugins.callback",
    "ORDER_LEDGER": "dpfl_lightning.plugins.callback",
    "ORDER_LOCAL_TRAINING": "dpfl_lightning.plugins.callback",
    "ORDER_SERVER_OPTIMIZER": "dpfl_lightning.plugins.callback",
    "ORDER_SERVER_STEP": "dpfl_lightning.plugins.callback",
    "GaussianNoise": "dpfl_lightning.plugins.gaussian_noise",
    "PrivUnitRandomizer": "dpfl_lightning.plugins.privunit_randomizer",
    "PrivacyLedger": "dpfl_lightning.plugins.privacy_ledger",
    "ReleasedRow": "dpfl_lightning.plugins.contexts",
    "SCAFFOLD": "dpfl_lightning.plugins.scaffold",
    "ScaffNew": "dpfl_lightning.plugins.scaffnew",
    "Segment": "dpfl_lightning.federated.payload",
    "SensitivityBound": "dpfl_lightning.plugins.sensitivity",
    "ServerContext": "dpfl_lightning.plugins.contexts",
    "ServerOptimizer": "dpfl_lightning.plugins.server_optimizer",
    "SetupContext": "dpfl_lightning.plugins.contexts",
    "UpdateClipping": "dpfl_lightning.plugins.clipping",
    "UpdateNormalization": "dpfl_lightning.plugins.normalization",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = exports("dpfl_lightning.plugins", _LAZY, globals())
