"""The release list: what a DP run may log, gather across ranks or checkpoint.

Anything a run writes down is a release about the clients' data. In a DP run only these kinds are
released:

- ``public``: a function of the settings and of public state (the round, a fixed cohort size, the
  privacy ledger's epsilon, a noise level);
- ``noised``: a function of noised releases only (post-processing: a global step size computed
  from noised sums, an adaptive clip norm driven by a noisy count);
- ``evaluation``: the global model evaluated on the data module's global test set. When that set is
  drawn from the clients' own data (:attr:`FederatedDataModule.test_set_from_clients`) the run's
  privacy line says these metrics are unaccounted releases about those clients.

Everything else is ``unaccounted``: computed from client data without noise (the training loss a
module logs, per-client evaluations, the number of skipped clients, clipping statistics, wall-clock
times that depend on the cohort). A DP run withholds it -- from the CSV, W&B, the console summary,
the history and the checkpoints -- unless the user sets ``log_client_metrics=True``, in which case
the run's privacy line lists it as released and not accounted.

Plugins declare the metrics they log (:meth:`FederatedCallback.released_metrics`); a key a plugin
logs without declaring it counts as ``unaccounted``. The set-up of a DP run reads the plugins' code for
such keys and warns once, naming them (:mod:`dpfl_lightning.plugins.metric_keys`: from code, not data).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfl_lightning.errors import require

KINDS = ("public", "noised", "evaluation", "unaccounted")
RELEASABLE = ("public", "noised", "evaluation")



def sources_of(plugin: object) -> tuple[str, ...]:
    """The ``source`` names under which ``plugin``'s metrics are declared: its class's and its base
    classes' names, so that a subclass inheriting ``released_metrics`` (its base's declarations, with
    the base's name as source) keeps them."""
    return tuple(c.__name__ for c in type(plugin).__mro__)

@dataclass(frozen=True)
class MetricRelease:
    """A metric a run may log: ``key`` exactly, or every key starting with ``key[:-1]`` when ``key``
    ends with ``*``."""

    key: str
    kind: str
    source: str
    why: str = ""

    def __post_init__(self) -> None:
        require(self.kind in KINDS, f"{self.source}.released_metrics", self.kind, "unknown kind of release",
                f"use one of {KINDS}")

    def matches(self, key: str) -> bool:
        return key.startswith(self.key[:-1]) if self.key.endswith("*") else key == self.key


class ReleaseList:
    """The metrics a run declared, and the filter every logged row goes through.

    Args:
        private: a DP mechanism is declared in the run (otherwise nothing is withheld).
        opt_in: ``log_client_metrics=True``: unaccounted metrics are released knowingly.
    """

    def __init__(self, private: bool, opt_in: bool) -> None:
        self.private = private
        self.opt_in = opt_in
        self.declared: list[MetricRelease] = []
        self.withheld: set[str] = set()
        self.released_unaccounted: set[str] = set()
        self.released_kinds: dict[str, str] = {}  # every key released, with its kind
        self.record_path: str | None = None  # rank 0 of a DP run: where released_kinds is written
        #: keys the plugins' code writes without declaring them (read from the code at set-up: public)
        self.undeclared: list[str] = []

    def record_to(self, path: str, evaluation_from_clients: bool) -> None:
        """Write the kind of every released key to ``path`` (JSON; keys already released before a
        resume kept) whenever a new one is released: ``dpfl sweep`` decides from it whether a metric
        may select. Only released keys are named (the CSV has them): never a withheld one."""
        import json
        import os

        self.record_path, self._from_clients = path, bool(evaluation_from_clients)
        if os.path.isfile(path):
            with open(path) as f:
                self.released_kinds.update(json.load(f).get("kinds", {}))

    def declare(self, *releases: MetricRelease) -> None:
        self.declared.extend(releases)

    def declares(self, key: str, source: str | tuple[str, ...]) -> bool:
        """Whether ``source`` declared ``key``: a key, or a family ``prefix*`` covered by a declared family.
        ``source``: a class name, or the names of a plugin's classes (:func:`sources_of`)."""
        names = (source,) if isinstance(source, str) else tuple(source)
        for r in (r for r in self.declared if r.source in names):
            family = key.endswith("*")
            if (not family and r.matches(key)) or (family and r.key.endswith("*") and key.startswith(r.key[:-1])):
                return True
        return False

    def kind(self, key: str, source: str | tuple[str, ...] | None = None) -> str:
        """The kind of ``key`` as declared (by ``source``, when given: a class name or the names of a
        plugin's classes, :func:`sources_of`); ``unaccounted`` if undeclared."""
        names = None if source is None else (source,) if isinstance(source, str) else tuple(source)
        for r in self.declared:
            if (names is None or r.source in names) and r.matches(key):
                return r.kind
        return "unaccounted"

    def allows(self, kind: str) -> bool:
        return not self.private or kind in RELEASABLE or self.opt_in

    def filter(self, metrics: dict[str, float], kinds: dict[str, str]) -> dict[str, float]:
        """The part of ``metrics`` a run may release; ``kinds`` gives each key's kind."""
        out = {}
        for key, value in metrics.items():
            kind = kinds.get(key, "unaccounted")
            if self.allows(kind):
                out[key] = value
                if self.record_path is not None and self.released_kinds.get(key) != kind:
                    self.released_kinds[key] = kind
                    self._write_record()
                if self.private and kind == "unaccounted":
                    self.released_unaccounted.add(key)
            else:
                self.withheld.add(key)
        return out

    def _write_record(self) -> None:
        import json
        import os

        tmp = f"{self.record_path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"kinds": self.released_kinds, "evaluation_from_clients": self._from_clients}, f, indent=1)
        os.replace(tmp, self.record_path)

    def describe(self) -> list[str]:
        """Lines for the run's privacy statement."""
        lines = []
        if self.private and self.opt_in and self.released_unaccounted:
            lines.append("released on request and NOT accounted (log_client_metrics=True): "
                         + ", ".join(sorted(self.released_unaccounted)))
        if self.private and not self.opt_in:
            lines.append(self.withheld_line())
        if self.private and not self.opt_in:  # round_time_s is recorded every round, and withheld
            lines.append("timing is not covered: dpfl's WandbLogger turns W&B's system statistics (CPU, memory, disk, "
                         "network, threads), system metadata and console capture off in a DP run, and dpfl sweep "
                         "records no durations of DP runs, but W&B's _timestamp/_runtime, the console's elapsed time "
                         "and the log files' modification times still say when each round ended, which depends on "
                         "the cohort's data; give the logs to untrusted readers without their clocks")
        return lines


    def withheld_line(self) -> str:
        """What a DP run withholds, said from its set-up alone: the names it knows before training (the
        round times, the metrics its plugins declared ``unaccounted``, the keys their code writes
        without declaring them: :mod:`dpfl_lightning.plugins.metric_keys`) and the rest generically.

        Which keys a run met in training is not said: a key logged only under a data condition (a
        module's ``if (y == 9).any(): self.log("saw_nine", ...)``, a plugin's statistic logged when a
        client is small) would tell, by its name alone, something about one client's data that no
        mechanism accounts. :attr:`withheld` keeps them for the process itself; it is never written."""
        known = ["round_time_s"] + sorted({r.key for r in self.declared if r.kind == "unaccounted"}
                                          | set(self.undeclared))
        return ("withheld from the logs (un-noised client statistics): " + ", ".join(known) + ", and whatever "
                "else the module, its callbacks or plugins log from client data (which keys were logged is not "
                "said either: it can depend on one client's data); log_client_metrics=True releases them, "
                "not accounted")


class MetricKinds(dict):
    """The release kind of every metric key a run has produced (``public``, ``evaluation``,
    ``unaccounted``, ...), which :meth:`ReleaseList.filter` reads."""

    def tag(self, metrics: dict[str, float], kind: str) -> dict[str, float]:
        """Record ``kind`` for every key of ``metrics``; return ``metrics``."""
        for key in metrics:
            self[key] = kind
        return metrics


def learning_rate_kind(step_interval: bool, steps_are_public: bool) -> str:
    """The release kind of the scheduled learning rates and momenta a run logs (``LearningRateMonitor``'s
    ``lr-*`` / ``momentum-*``), decided from the settings alone.

    They are the reference client's schedule at ``round * S`` (``S``: its optimizer steps per round).
    An ``interval="epoch"`` scheduler steps once per round: a function of the round, ``public`` (one
    sized by ``estimated_stepping_batches`` reads ``S``, which a DP run refuses where ``S`` is not
    public: :mod:`dpfl_lightning.federated.public_sizes`). An ``interval="step"`` one is ``public``
    only where ``S`` is: ``trainer.records_per_client`` set, or ``local_steps`` set and no gradient
    accumulation (``accumulate_grad_batches`` counts batches per epoch, which follow the client's
    size). Under ``local_epochs`` ``S`` is the largest client's number of batches, so the logged rate
    is a function of one client's record count: ``unaccounted``, whether or not the clients' sizes
    happen to differ in this run. Deciding from whether they differ would itself say something about
    one client (a neighbour with one client smaller flips whether the column is written)."""
    return "unaccounted" if step_interval and not steps_are_public else "public"

