"""Where a fit stands: whether it should stop (and why), the released rows so far, where its CSV log
went. The trainer owns it; the Lightning side reads and stops through it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunStatus:
    history: list[dict[str, float]] = field(default_factory=list)  # the released row of every round
    should_stop: bool = False
    stop_reason: str | None = None
    current_round: int = 0
    csv_log_dir: str | None = None  # rank 0's CSV log folder, once the loggers exist

    def stop(self, reason: str) -> None:
        """Stop before the next round (every rank decides alike: the reason is a public function)."""
        self.should_stop = True
        self.stop_reason = reason
