"""The bridge to Lightning: what a :class:`~dpfl_lightning.FederatedTrainer` shows a Lightning user.

Owns: :mod:`~.semantics` (what an ordinary LightningModule sees in a federated run, and what is
refused at set-up), :mod:`~.callbacks` (Lightning callbacks at the round level) and
:mod:`~.trainer_options` (which ``lightning.Trainer`` arguments a ``FederatedTrainer`` takes).
What drives one client's Lightning loop lives in :mod:`dpfl_lightning.module`; the run's Lightning
checkpoint and ``validate | test | predict`` in :mod:`dpfl_lightning.run`.

May import: ``run``, ``plugins``, ``module``, ``data``, ``federated``, ``comm`` and the foundation
(``errors``, ``rng``); only the trainer and the command line import it.
"""
