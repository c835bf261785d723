"""The federated round's vocabulary, below every part that trains: what a round is and what moves.

Owns: :mod:`~.plan` (the round plan plugins may edit), :mod:`~.sampling` (which clients take part;
every rank draws the same cohort), :mod:`~.placement` (which rank trains which client),
:mod:`~.payload` (what a client sends: named segments in one row), :mod:`~.aggregation` (rows
folded into per-rank sums and all-reduced exactly), :mod:`~.secure_sum` (integer rows summed modulo
``2^b`` under SecAgg masks), :mod:`~.short_rounds` (how often a secure sum with dropouts is short:
settings alone), :mod:`~.releases` (what a DP run may log,
gather or checkpoint), :mod:`~.public_sizes` (what a DP run may say of a client's record count) and :mod:`~.frozen` (frozen parameters are not part of an update).

May import: ``comm``, ``privacy`` and the foundation (``errors``, ``rng``). It never imports the
module wrapper, data, plugins, executors or the run.
"""
