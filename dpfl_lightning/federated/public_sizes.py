"""What a DP run may say about how many records a client holds: nothing, unless it is public.

A client's record count is its data: a neighbouring dataset holds one record more or fewer in one
client. Under ``local_epochs`` a client's batches per round follow its count (``ceil(n / B)`` per
epoch), and so would every value computed from them -- ``self.trainer.estimated_stepping_batches``
(a ``OneCycleLR`` sized by it, whose learning rate ``LearningRateMonitor`` logs),
``self.trainer.num_training_batches`` (a scheduler's steps per epoch), ``self.global_step`` where an
evaluation reads it, DP-SGD's sampling rate ``B / n`` and its steps (the epsilon it reports).

The rule, in a DP run: every such value is computed from the public number of records per client
``N`` (``trainer.records_per_client``, or the data module's where its split gives every client that
many by construction, :attr:`FederatedDataModule.public_records_per_client
<dpfl_lightning.data.module.FederatedDataModule.public_records_per_client>`), as Opacus takes a
dataset's size to be public -- or it is withheld:

- with ``N``, a local epoch is ``ceil(N / B)`` batches for every client, whatever it holds (a
  shuffled client's passes over its own records repeat or end as that needs), and what the module
  sees of its run's length is the same for every client;
- without ``N``, under ``local_epochs`` or gradient accumulation, reading
  ``estimated_stepping_batches`` or ``num_training_batches`` is refused (:func:`withheld_error`),
  the same way on every neighbour, at set-up where ``configure_optimizers`` reads them; under
  ``local_steps`` without accumulation every client takes the same public number of steps already;
- DP-SGD accounts from ``N`` only: every record is in a batch with probability ``B / N`` (Poisson;
  ``B`` of ``max(n, N)`` slots without replacement for fixed-size batches), ``ceil(N / B)`` steps per
  local epoch, one profile for every client; a DP-SGD run without ``N`` is refused
  (:func:`dpsgd_error`): its guarantee would name the smallest client's count.

``tests/test_neighbours.py`` checks it with neighbours one client larger and one smaller.
"""

from __future__ import annotations

from typing import Any

from dpfl_lightning.errors import ConfigError

SETTING = "trainer.records_per_client"


def public_records(settings: Any, data: Any) -> int | None:
    """``N``: ``trainer.records_per_client``, else the data module's count by construction, else ``None``."""
    if settings.records_per_client is not None:
        return int(settings.records_per_client)
    return getattr(data, "public_records_per_client", None)


def withheld_error(name: str) -> ConfigError:
    """Reading ``self.trainer.<name>`` in a DP run whose clients' batches per round follow their sizes."""
    return ConfigError(SETTING, None, f"self.trainer.{name} would be computed from the clients' record counts "
                       "(under local_epochs, or with gradient accumulation, a client's batches per round follow its "
                       "records), and a DP run may not release them, not even through a learning rate",
                       "set trainer.records_per_client=N, a public number of records per client (every client's "
                       "local epoch is then ceil(N / batch_size) batches), or train local_steps without "
                       "accumulate_grad_batches")


def dpsgd_error() -> ConfigError:
    """A DP-SGD run with no public number of records per client."""
    return ConfigError(SETTING, None, "DPSGD's accountant would take each client's sampling rate (batch_size / n) "
                       "and steps per local epoch (ceil(n / batch_size)) from its record count n, so the epsilon it "
                       "reports and prints would depend on the smallest client's size",
                       "set trainer.records_per_client=N, the number of records per client the run takes as public "
                       "(as Opacus takes the dataset size): every record is then sampled with probability "
                       "batch_size / N and a local epoch is ceil(N / batch_size) steps, for every client")
