"""FederatedDataModule: a dataset split over clients, with the batches each client trains on.

Build one from a LightningDataModule (:meth:`from_datamodule`), from tensors or datasets, or use a
built-in source (:mod:`dpfl_lightning.data.builtin`). Clients are virtual: the same module
serves every client a rank trains, by index.

Tensor-backed data (a ``TensorDataset``, or any dataset with ``in_memory=True``) stays in memory,
on the training device once :meth:`to` has run, and a batch is one index-select per tensor: no
DataLoader per client. Other datasets go through a ``DataLoader`` over the client's ``Subset``.

Shuffling uses the generator the trainer passes in, keyed by (seed, round, client).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler,
                              Subset, TensorDataset, default_collate, default_convert)

from dpfl_lightning.data.partition import PARTITIONS, partition
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.module.introspect import is_overridden
from dpfl_lightning.federated.plan import batch_shape
from dpfl_lightning.rng import Stream

Batch = Any


def labels_of(dataset: Dataset) -> np.ndarray:
    """Integer labels of a classification dataset (needed by the label-aware partitioners)."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        return np.asarray(dataset.tensors[1].cpu())
    for attr in ("targets", "labels", "y"):
        if hasattr(dataset, attr):
            return np.asarray(getattr(dataset, attr))
    if isinstance(dataset, Subset):
        return labels_of(dataset.dataset)[np.asarray(dataset.indices)]
    return np.asarray([_label_of_item(dataset[i]) for i in range(len(dataset))])


LABEL_KEYS = ("label", "labels", "y", "target", "targets")


def _label_of_item(item: Any) -> int:
    """The label of one record: the second element of a tuple, or a dict's ``label``-like key."""
    if isinstance(item, Mapping):
        key = next((k for k in LABEL_KEYS if k in item), None)
        if key is None:
            raise ConfigError("data.partition", sorted(item), "a label-aware partition needs each record's label, and "
                              f"these dict records have none of the keys {LABEL_KEYS}",
                              "use partition='iid', or add a 'label' key to the records")
        return int(item[key])
    if isinstance(item, (tuple, list)) and len(item) >= 2:
        return int(item[1])
    raise ConfigError("data.partition", type(item).__name__, "a label-aware partition needs each record's label, and "
                      "the records are neither (input, label) tuples nor dicts with a 'label' key",
                      "use partition='iid', or return (input, label) records")


def _is_default_collate(fn: Any) -> bool:
    return fn is None or fn is default_collate or fn is default_convert


def _single_loader(loader: Any, getter: str) -> DataLoader:
    if not isinstance(loader, DataLoader):
        raise ConfigError(f"datamodule.{getter}", type(loader).__name__, "must return one torch DataLoader (several "
                          "loaders, or other iterables, are not supported)", "return a single DataLoader")
    return loader


def _plain_loader(loader: DataLoader) -> bool:
    """A loader whose batches are consecutive slices of a TensorDataset (served from memory instead)."""
    return (isinstance(loader.dataset, TensorDataset) and _is_default_collate(loader.collate_fn)
            and type(loader.sampler) is SequentialSampler and type(loader.batch_sampler) is BatchSampler
            and not loader.drop_last and bool(loader.batch_size))


def _materialize(dataset: Dataset, chunk: int = 4096) -> tuple[torch.Tensor, ...]:
    parts = [default_collate([dataset[j] for j in range(i, min(i + chunk, len(dataset)))])
             for i in range(0, len(dataset), chunk)]
    if isinstance(parts[0], torch.Tensor):
        return (torch.cat(parts),)
    return tuple(torch.cat([p[k] for p in parts]) for k in range(len(parts[0])))


def record_sampling_rate(num_samples: int, batch_size: int | None) -> float:
    """The probability that a record is in one DP-SGD batch: ``min(B, n) / n`` (Poisson rate, or the
    sampled fraction for fixed-size batches). Batching and accounting both use this."""
    if not batch_size:
        return 1.0
    return min(int(batch_size), num_samples) / num_samples


class FederatedDataModule:
    """A training set split over ``num_clients`` clients, plus a global test set.

    Args:
        datamodule: a ``LightningDataModule``; its train dataset is partitioned (with its loader's
            ``collate_fn``), rounds are validated on its ``val_dataloader`` and the final test runs on
            its ``test_dataloader`` (each falls back to the other). An ``IterableDataset`` training
            set is refused.
        num_clients: ``M``, the number of (virtual) clients.
        partition: ``iid``, ``dirichlet`` (``alpha``), ``shards`` (``shards_per_client``: at most that
            many classes per client) or ``label_sorted`` (``iid_fraction``); see
            :mod:`dpfl_lightning.data.partition`.
        min_samples_per_client: ``dirichlet`` redraws until every client has this many samples.
        client_test_fraction: hold out this fraction of each client's data for per-client
            evaluation (``FederatedTrainer(eval_per_client=True)``).
        seed: seed of the partition.
        in_memory: keep the data as tensors (fast batches). ``None``: yes for ``TensorDataset``.
        eval_batch_size: batch size for evaluation.
    """

    def __init__(self, datamodule: Any = None, *, num_clients: int = 100, partition: str = "iid", alpha: float = 0.5,
                 shards_per_client: int = 2, iid_fraction: float = 0.0, min_samples_per_client: int = 1,
                 client_test_fraction: float = 0.0, seed: int = 0, in_memory: bool | None = None,
                 eval_batch_size: int = 1024) -> None:
        require(partition in PARTITIONS + ("natural",), "data.partition", partition, "unknown partitioner",
                f"use one of {', '.join(PARTITIONS)}")
        require(isinstance(num_clients, int) and num_clients >= 1, "data.num_clients", num_clients, "must be >= 1",
                "set num_clients to a positive integer")
        require(0.0 <= client_test_fraction < 1.0, "data.client_test_fraction", client_test_fraction,
                "must be in [0, 1)", "set client_test_fraction, e.g. 0.2")
        require(eval_batch_size >= 1, "data.eval_batch_size", eval_batch_size, "must be >= 1", "set a positive batch size")
        self.datamodule = datamodule
        self._num_clients = num_clients
        self.partition = partition
        self.alpha = alpha
        self.shards_per_client = shards_per_client
        self.iid_fraction = iid_fraction
        self.min_samples_per_client = min_samples_per_client
        self.client_test_fraction = client_test_fraction
        self.seed = seed
        self.in_memory = in_memory
        self.eval_batch_size = eval_batch_size
        self._given: tuple[Dataset, Dataset | None, list[torch.Tensor] | None] | None = None
        self._ready = False
        self.device = torch.device("cpu")
        self._collate: Callable[[list[Any]], Batch] = default_collate
        self._loaders: dict[str, DataLoader | None] = {}
        #: what the LightningDataModule's train_dataloader asked for that clients do not use
        #: (``batch_size``, a custom ``sampler``); the trainer warns when it differs from its own
        self.train_loader_info: dict[str, Any] = {}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_datamodule(cls, datamodule: Any, **kwargs: Any) -> FederatedDataModule:
        """Partition a LightningDataModule's training set."""
        return cls(datamodule, **kwargs)

    @classmethod
    def from_datasets(cls, train: Dataset, test: Dataset | None = None,
                      client_indices: Sequence[Sequence[int]] | None = None, **kwargs: Any) -> FederatedDataModule:
        """From datasets; give ``client_indices`` for data that is already split by client."""
        if client_indices is not None:
            kwargs.setdefault("num_clients", len(client_indices))
            kwargs["partition"] = "natural"
        dm = cls(**kwargs)
        natural = None if client_indices is None else [torch.as_tensor(list(ix), dtype=torch.int64) for ix in client_indices]
        dm._given = (train, test, natural)
        return dm

    @classmethod
    def from_tensors(cls, x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor | None = None,
                     y_test: torch.Tensor | None = None, **kwargs: Any) -> FederatedDataModule:
        test = TensorDataset(x_test, y_test) if x_test is not None else None
        return cls.from_datasets(TensorDataset(x, y), test, **kwargs)

    # ------------------------------------------------------------------ loading
    def load(self) -> tuple[Dataset, Dataset | None, list[torch.Tensor] | None]:
        """Return ``(train, test, client_indices)``; ``client_indices`` is ``None`` unless the data
        comes split by client. Built-in sources override this."""
        if self._given is not None:
            return self._given
        if self.datamodule is None:
            raise ConfigError("data", None, "no data given", "pass a LightningDataModule, datasets or tensors, "
                              "or use a built-in source such as dpfl_lightning.data.Digits")
        dm = self.datamodule
        self.prepare_data()  # once; in a run, only local rank 0 calls it (see prepare_data)
        dm.setup("fit")
        train_loader = _single_loader(dm.train_dataloader(), "train_dataloader")
        val_loader = test_loader = None
        if is_overridden(dm, "val_dataloader", "LightningDataModule"):
            val_loader = _single_loader(dm.val_dataloader(), "val_dataloader")
        if is_overridden(dm, "test_dataloader", "LightningDataModule"):
            dm.setup("test")
            test_loader = _single_loader(dm.test_dataloader(), "test_dataloader")
        self._loaders = {"train": train_loader, "val": val_loader, "test": test_loader}
        if not _is_default_collate(train_loader.collate_fn):
            self._collate = train_loader.collate_fn
        self.train_loader_info = {"batch_size": train_loader.batch_size}
        custom = train_loader.batch_sampler if type(train_loader.batch_sampler) is not BatchSampler else train_loader.sampler
        if type(custom) not in (RandomSampler, SequentialSampler, BatchSampler, type(None)):
            self.train_loader_info["sampler"] = type(custom).__name__
        # (``loader or other`` would call len() on the loader, which an IterableDataset does not have)
        held_out = test_loader if test_loader is not None else val_loader
        test = held_out.dataset if held_out is not None else None
        return train_loader.dataset, test, None

    def prepare_data(self, call: bool = True) -> None:
        """The LightningDataModule's ``prepare_data`` (downloads, once per machine), at most once.
        A run calls it on each node's local rank 0 and passes ``call=False`` on the other ranks after
        a barrier, as ``lightning.Trainer`` does (``prepare_data_per_node``)."""
        if getattr(self, "_prepared", False) or self.datamodule is None:
            self._prepared = True
            return
        if call:
            self.datamodule.prepare_data()
        self._prepared = True

    def setup(self) -> None:
        """Load and split the data (idempotent). Every rank computes the same split."""
        if self._ready:
            return
        train, test, natural = self.load()
        if isinstance(train, IterableDataset):
            setting, value = self._source_setting()
            raise ConfigError(setting, value, f"the training set is an IterableDataset ({type(train).__name__}): it has "
                              "no len() and no index, so its records cannot be split over clients",
                              "return a map-style Dataset (e.g. a TensorDataset of the records) from train_dataloader")
        self._check_label_range(train, test)
        if natural is not None:
            indices = [torch.as_tensor(ix, dtype=torch.int64) for ix in natural]
            self._num_clients = len(indices)
        else:
            # iid splits by position only: no labels needed (records may be dicts, sequences, ...)
            labels = np.zeros(len(train), dtype=np.int64) if self.partition == "iid" else labels_of(train)
            indices = partition(labels, self._num_clients, self.partition, self.seed, alpha=self.alpha,
                                shards_per_client=self.shards_per_client, iid_fraction=self.iid_fraction,
                                min_samples=self.min_samples_per_client)
        empty = [c for c, ix in enumerate(indices) if len(ix) == 0]
        require(not empty, "data.num_clients", self._num_clients, f"client(s) {empty[:5]} have no training data",
                "lower num_clients or change the partition")
        self._train_idx, self._test_idx = self._hold_out(indices)
        custom_collate = self._collate is not default_collate
        in_memory = (isinstance(train, TensorDataset) and not custom_collate) if self.in_memory is None else self.in_memory
        if in_memory and not isinstance(train, TensorDataset):
            first = train[0]
            setting, value = self._source_setting()
            require(not custom_collate and not isinstance(first, Mapping), setting, value,
                    "in_memory=True stacks (input, label) records into tensors, which would bypass the DataModule's "
                    "collate_fn or change dict records into tuples", "leave in_memory unset (or False)")
        self._train_ds, self._test_ds = train, test
        self._train_tensors = (tuple(train.tensors) if isinstance(train, TensorDataset) else _materialize(train)) if in_memory else None
        self._test_tensors = None
        test_loader = self._loaders.get("test")
        if test_loader is None and test is not None:
            test_loader = self._loaders.get("val")
        if test_loader is not None and not _plain_loader(test_loader):
            pass  # evaluated through the DataModule's own loader
        elif in_memory and test is not None and not isinstance(test, IterableDataset):
            self._test_tensors = tuple(test.tensors) if isinstance(test, TensorDataset) else _materialize(test)
        elif test_loader is not None:
            self._test_tensors = tuple(test_loader.dataset.tensors)
        val_loader = self._loaders.get("val")
        self._val_ds = val_loader.dataset if val_loader is not None else None
        self._val_tensors = tuple(val_loader.dataset.tensors) if val_loader is not None and _plain_loader(val_loader) else None
        self._check_finite()
        self._ready = True

    def _check_finite(self) -> None:
        """Count, at set-up, the records held in memory that hold NaN or inf (by split): their clients'
        updates will not be finite. The run says so before training (:meth:`warn_nonfinite`)."""
        self._nonfinite: dict[str, int] = {}
        for split, tensors in (("training", self._train_tensors), ("test", self._test_tensors),
                               ("validation", self._val_tensors)):
            bad = sum(int((~torch.isfinite(t)).reshape(len(t), -1).any(1).sum()) for t in tensors or ()
                      if t.is_floating_point() and t.dim() and not bool(torch.isfinite(t).all()))
            if bad:
                self._nonfinite[split] = bad
        self._nonfinite_said = False

    def warn_nonfinite(self, private: bool) -> None:
        """Say once, before training (a fit calls this after set-up, on rank 0), that records held in
        memory hold NaN or inf: the clients that train on them send non-finite updates
        (``trainer.on_nonfinite`` then stops the run or skips them). Never which records or clients;
        how many only outside a DP run: in a DP run the count would change with one client's data,
        so the run says only that some records are not finite (the threat model: README, "What the
        guarantee assumes")."""
        self.setup()
        found = getattr(self, "_nonfinite", None)
        if not found or getattr(self, "_nonfinite_said", False):
            return
        self._nonfinite_said = True
        setting, value = self._source_setting()
        for split, bad in found.items():
            what = f"some {split} records hold" if private else f"{bad} {split} record(s) hold"
            warnings.warn(f"{setting}={value}: {what} NaN or inf values; the clients that train on them send "
                          "non-finite updates (trainer.on_nonfinite='raise' stops the run when one is first sampled, "
                          "'skip' leaves them out). Fix: clean the data before training", UserWarning, stacklevel=3)

    # ------------------------------------------------------------------ label range
    _label_limits: tuple[tuple[int, str], ...] = ()

    def expect_labels(self, num_classes: int, setting: str) -> None:
        """Refuse at :meth:`setup` integer labels outside ``0..num_classes-1`` (a classifier with
        ``num_classes`` outputs would fail on them in the middle of training). ``setting`` names where
        the number comes from, e.g. ``model.init_args.num_classes`` (the CLI passes the model's)."""
        self._label_limits = (*self._label_limits, (int(num_classes), setting))

    def _source_setting(self) -> tuple[str, Any]:
        """The setting (and its value) that names this data in error messages."""
        return "data", type(self).__name__

    def _check_label_range(self, train: Dataset, test: Dataset | None) -> None:
        if not self._label_limits:
            return
        setting, value = self._source_setting()
        for split, ds in (("training", train), ("test", test)):
            cheap = isinstance(ds, TensorDataset) or any(hasattr(ds, a) for a in ("targets", "labels", "y"))
            if ds is None or (split == "test" and not cheap):
                continue
            y = labels_of(ds)
            if y.ndim != 1 or y.size == 0 or not np.issubdtype(y.dtype, np.integer):
                continue
            lo, hi = int(y.min()), int(y.max())
            for n, where in self._label_limits:
                if lo < 0 or hi >= n:
                    outside = int(((y < 0) | (y >= n)).sum())
                    fix = f"relabel the data as 0..{n - 1}" + (f" or set {where} >= {hi + 1}" if lo >= 0 else "")
                    raise ConfigError(setting, value, f"the {split} labels span {lo}..{hi}, but {where}={n} means "
                                      f"labels 0..{n - 1} ({outside} label(s) outside)", fix)

    def _hold_out(self, indices: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.client_test_fraction == 0.0:
            return indices, [ix[:0] for ix in indices]
        g = torch.Generator().manual_seed(self.seed + 7919)
        train, test = [], []
        for ix in indices:
            perm = ix[torch.randperm(len(ix), generator=g)]
            n_test = int(math.floor(self.client_test_fraction * len(ix)))
            if len(ix) - n_test < 1:
                n_test = len(ix) - 1
            test.append(torch.sort(perm[:n_test]).values)
            train.append(torch.sort(perm[n_test:]).values)
        return train, test

    def to(self, device: torch.device) -> FederatedDataModule:
        """Keep in-memory tensors and index lists on ``device`` (once, before training)."""
        self.setup()
        self.device = torch.device(device)
        if self._train_tensors is not None:
            self._train_tensors = tuple(t.to(device) for t in self._train_tensors)
            self._train_idx = [ix.to(device) for ix in self._train_idx]
            self._test_idx = [ix.to(device) for ix in self._test_idx]
        if self._test_tensors is not None:
            self._test_tensors = tuple(t.to(device) for t in self._test_tensors)
        if self._val_tensors is not None:
            self._val_tensors = tuple(t.to(device) for t in self._val_tensors)
        return self

    # ------------------------------------------------------------------ queries
    #: whether the global test set is drawn from the clients' own data (then evaluating on it is a
    #: release about those clients that no DP mechanism covers; a DP run says so)
    test_set_from_clients: bool = False

    @property
    def num_clients(self) -> int:
        return self._num_clients

    @property
    def in_memory_tensors(self) -> tuple[torch.Tensor, ...] | None:
        """The training tensors when the data is held in memory (else ``None``)."""
        self.setup()
        return self._train_tensors

    def client_indices(self, client: int) -> torch.Tensor:
        """The indices of the client's training records in the training set (on the data's device)."""
        self.setup()
        return self._train_idx[client]

    def client_num_samples(self, client: int) -> int:
        self.setup()
        return int(self._train_idx[client].numel())

    #: records every client holds by construction, a function of the data module's own settings
    #: (``SyntheticLogistic(samples_per_client=...)``), before ``client_test_fraction``; ``None`` where
    #: the split follows the data
    records_by_construction: int | None = None

    @property
    def public_records_per_client(self) -> int | None:
        """The records every client trains on by construction (:attr:`records_by_construction` less the
        held-out ``client_test_fraction``, as :meth:`_hold_out` takes it), or ``None``: what a run takes
        as ``trainer.records_per_client`` when that is unset (:mod:`dpfl_lightning.federated.public_sizes`)."""
        per = self.records_by_construction
        if per is None:
            return None
        held = min(int(math.floor(self.client_test_fraction * per)), per - 1)
        return per - held

    @property
    def has_test_set(self) -> bool:
        self.setup()
        return self._test_ds is not None

    @property
    def has_val_set(self) -> bool:
        """Whether there is a set to validate on every round: the DataModule's validation set, else the
        test set."""
        self.setup()
        return self._val_ds is not None or self._test_ds is not None

    @property
    def has_client_test_sets(self) -> bool:
        """Whether every client holds out ``client_test_fraction`` of its data for evaluation."""
        self.setup()
        return self.client_test_fraction > 0

    # ------------------------------------------------------------------ batches
    def client_batches(self, client: int, batch_size: int | None, *, epochs: int | None = None,
                       steps: int | None = None, stream: Stream | None = None,
                       sampling: str = "shuffle", records: int | None = None) -> Iterator[tuple[int, int, Batch]]:
        """Yield ``(epoch, batch_idx, batch)`` for one client's local training.

        ``sampling="shuffle"``: ``epochs`` passes over the client's data, reshuffled each pass, or
        exactly ``steps`` batches (passes repeat as needed); ``batch_size=None`` is the full local
        dataset (full gradients, as in papers 000 and 003).

        For DP-SGD (what its accountant assumes): ``"poisson"`` draws every batch independently,
        each record with probability ``batch_size / n`` (the batch size varies and can be 0);
        ``"fixed"`` draws every batch independently as ``batch_size`` records without replacement.
        One "epoch" is then ``ceil(n / batch_size)`` such draws.

        ``records`` (``N``, the run's public records per client): an epoch is ``ceil(N / batch_size)``
        batches, and ``epoch`` / ``batch_idx`` count them, whatever the client holds; a shuffled
        client's passes over its own records repeat or end as that needs. DP-SGD's ``poisson``
        draws every record with probability ``batch_size / N``; ``fixed`` draws ``batch_size`` of
        ``max(n, N)`` slots without replacement, the slots past the client's ``n`` records empty (a
        client of fewer records is a client of ``N`` padded with empty slots).

        Randomness comes from ``stream`` (shuffles from its ``randperm``, or its torch generator for
        a DataLoader; DP-SGD's batches from its uniforms, which are the CSPRNG's in secure mode)."""
        self.setup()
        idx = self._train_idx[client]
        n = idx.numel()
        bs, per_epoch = batch_shape(n, batch_size)
        shown = per_epoch if records is None else batch_shape(records, batch_size)[1]  # batches of an epoch
        total = steps if steps is not None else shown * (epochs or 1)
        if sampling != "shuffle":
            require(stream is not None, "sampling", sampling, "DP-SGD batches need a random stream",
                    "pass stream=RandomSource(...).stream(...)")
            yield from self._sampled_batches(idx, batch_size, total, shown, stream, sampling, records)
            return
        if records is None and steps is None:
            yield from self._passes(idx, bs, per_epoch, stream, epochs=epochs or 1)
            return
        for i, (_, _, batch) in enumerate(self._passes(idx, bs, per_epoch, stream, steps=total)):
            yield i // shown, i % shown, batch

    def _passes(self, idx: torch.Tensor, bs: int, per_epoch: int, stream: Stream | None, *,
                epochs: int | None = None, steps: int | None = None) -> Iterator[tuple[int, int, Batch]]:
        """Shuffled passes over a client's records: ``epochs`` of them, or ``steps`` batches."""
        n = idx.numel()
        shuffle = bs < n
        step = epoch = 0
        tensors = self._train_tensors
        # index_select is t[sel] for a contiguous t (~1 us cheaper); t[sel] keeps another layout
        # (channels_last images), which can change a convolution's results in the last bits
        gathers = [partial(t.index_select, 0) if t.is_contiguous() else t.__getitem__ for t in tensors or ()]
        on_cpu = idx.device.type == "cpu"
        while True:
            if tensors is not None:
                if shuffle:
                    perm = stream.randperm(n) if stream is not None else torch.randperm(n)
                    order = idx.index_select(0, perm if on_cpu else perm.to(idx.device))
                else:
                    order = idx
                for b in range(per_epoch):
                    sel = order[b * bs : (b + 1) * bs]
                    yield epoch, b, tuple([take(sel) for take in gathers])
                    step += 1
                    if steps is not None and step >= steps:
                        return
            else:
                loader = DataLoader(Subset(self._train_ds, idx.tolist()), batch_size=bs, shuffle=shuffle,
                                    generator=stream.generator if stream is not None else None,
                                    collate_fn=self._collate)
                for b, batch in enumerate(loader):
                    yield epoch, b, batch
                    step += 1
                    if steps is not None and step >= steps:
                        return
            epoch += 1
            if steps is None and epoch >= epochs:
                return

    def _sampled_batches(self, idx: torch.Tensor, batch_size: int | None, steps: int, per_epoch: int,
                         stream: Stream, sampling: str, records: int | None) -> Iterator[tuple[int, int, Batch]]:
        require(sampling in ("poisson", "fixed"), "sampling", sampling, "unknown batch sampling",
                "use shuffle, poisson or fixed")
        n = idx.numel()
        population = n if records is None else records  # what the accountant takes a client to hold
        rate = record_sampling_rate(population, batch_size)
        size = batch_shape(population, batch_size)[0]
        slots = max(n, population)
        for step in range(steps):
            if sampling == "poisson":
                chosen = idx[(stream.uniform(n) < rate).to(idx.device)]
            else:
                pick = stream.randperm(slots)[:size]
                chosen = idx[(pick[pick < n] if slots > n else pick).to(idx.device)]
            if self._train_tensors is not None:
                batch = tuple(t[chosen] for t in self._train_tensors)
            else:
                items = [self._train_ds[int(i)] for i in chosen.tolist()]
                batch = self._collate(items) if items else self._empty_batch()
            yield step // per_epoch, step % per_epoch, batch

    def _empty_batch(self) -> Batch:
        return _empty_like(self._collate([self._train_ds[0]]))

    def _sequential(self, tensors: tuple[torch.Tensor, ...] | None, dataset: Dataset | None,
                    idx: torch.Tensor | None, batch_size: int | None) -> Iterator[Batch]:
        bs = batch_size or self.eval_batch_size
        if tensors is not None:
            n = tensors[0].shape[0] if idx is None else idx.numel()
            for start in range(0, n, bs):
                if idx is None:
                    yield tuple(t[start : start + bs] for t in tensors)
                else:
                    sel = idx[start : start + bs]
                    yield tuple(t[sel] for t in tensors)
        elif dataset is not None:
            ds = dataset if idx is None else Subset(dataset, idx.tolist())
            yield from DataLoader(ds, batch_size=bs, shuffle=False, collate_fn=self._collate)

    def test_batches(self, batch_size: int | None = None) -> Iterator[Batch]:
        """The global test set, in order (a DataModule's ``test_dataloader``, else its validation set)."""
        self.setup()
        loader = self._loaders.get("test")
        if loader is None:
            loader = self._loaders.get("val")
        if loader is not None:
            return self._from_loader(loader, self._test_tensors)
        return self._sequential(self._test_tensors, self._test_ds, None, batch_size)

    def val_batches(self, batch_size: int | None = None) -> Iterator[Batch]:
        """The set validated on every round: a DataModule's ``val_dataloader`` (its batch size,
        ``collate_fn`` and sampler), else the test set."""
        self.setup()
        loader = self._loaders.get("val")
        if loader is None:
            return self.test_batches(batch_size)
        return self._from_loader(loader, self._val_tensors)

    def _from_loader(self, loader: DataLoader, tensors: tuple[torch.Tensor, ...] | None) -> Iterator[Batch]:
        if tensors is not None:  # the same batches, served from memory
            return self._sequential(tensors, None, None, loader.batch_size)
        return iter(loader)

    def client_eval_batches(self, client: int, batch_size: int | None = None) -> Iterator[Batch]:
        """The client's held-out data (``client_test_fraction``), else its training data."""
        self.setup()
        idx = self._test_idx[client] if self.client_test_fraction > 0 else self._train_idx[client]
        return self._sequential(self._train_tensors, self._train_ds, idx, batch_size)


def _empty_like(batch: Batch) -> Batch:
    """A batch of the same structure with no records (an empty Poisson batch)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return {k: _empty_like(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_empty_like(v) for v in batch)
    return batch
