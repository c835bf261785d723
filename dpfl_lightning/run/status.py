"""Where a fit stands: whether it should stop (and why), the released rows so far, the ``version_N``
it writes, where its CSV log and checkpoints go. The trainer owns it; the Lightning side reads and
stops through it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunStatus:
    history: list[dict[str, float]] = field(default_factory=list)  # the released row of every round
    should_stop: bool = False
    stop_reason: str | None = None
    current_round: int = 0
    csv_log_dir: str | None = None  # rank 0's CSV log folder, once the loggers exist
    version: int | None = None  # the run's version_N this fit writes (every rank), once chosen
    checkpoint_dir: str | None = None  # where this fit's checkpoints go (every rank), once chosen

    def written_csv_log_dir(self) -> str:
        """``csv_log_dir``, or an ``AttributeError`` on a rank that writes no log (every rank but 0)."""
        if self.csv_log_dir is None:
            raise AttributeError("csv_log_dir: this rank wrote no CSV log")
        return self.csv_log_dir

    def stop(self, reason: str) -> None:
        """Stop before the next round (every rank decides alike: the reason is a public function)."""
        self.should_stop = True
        self.stop_reason = reason
