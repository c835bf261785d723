"""Preemption: a signal asks the run to stop at the end of the round, with a checkpoint.

Schedulers announce the end of a job with a signal: Slurm sends ``SIGTERM`` when it preempts or
cancels a job (and ``SIGKILL`` after its grace time), and ``--signal=USR1@120`` sends ``SIGUSR1``
120 s before the time limit; a person presses Ctrl-C (``SIGINT``). While ``fit`` runs,
:class:`SignalWatch` only records such a signal. At the end of every round the ranks agree on it
(a signal may reach one rank only: the flag is all-reduced), and then every rank stops together:
the round that was running finishes, a checkpoint is written atomically (whatever
``checkpoint_every`` says), rank 0 prints the exact command that continues the run, and ``fit``
raises :class:`Preempted`, a ``SystemExit`` with status ``128 + signal number`` (143 for
``SIGTERM``, 138 for ``SIGUSR1``, 130 for Ctrl-C): the status a process killed by that signal
reports, which job scripts and schedulers read as "terminated by the signal". A resumed run
reaches the same model as one that was never interrupted.

A Ctrl-C while a stop is pending stops at once (``KeyboardInterrupt``). A round is never cut short: give Slurm's
``--signal`` more lead time than a round and a checkpoint write take.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import sys
import textwrap
import threading
from typing import Any

import torch

from dpfl_lightning.errors import report_failure

#: the signals that ask a run to stop after the round: the scheduler's, Slurm's ``--signal``, Ctrl-C
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preempted(SystemExit):
    """``fit`` stopped on a signal after writing a checkpoint; the exit status is
    ``128 + signal number``. ``checkpoint`` is the file to resume from, ``rounds_done`` its round."""

    def __init__(self, signum: int, checkpoint: str, rounds_done: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.checkpoint = checkpoint
        self.rounds_done = rounds_done

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} after round {self.rounds_done}; "
                f"checkpoint {self.checkpoint}")


#: what a first Ctrl-C says (at once: the round may take a while)
INTERRUPT_NOTICE = "interrupt: the run stops after this round, with a checkpoint (Ctrl-C again to stop at once)"


def terminal_width() -> int | None:
    """The width of the terminal stderr is on (``None`` for a file or a pipe: lines are not wrapped
    there), as rich sees it (``COLUMNS`` and ``TTY_COMPATIBLE`` count)."""
    from rich.console import Console

    console = Console(stderr=True)
    return console.width if console.is_terminal else None


def wrap_notice(text: str, width: int | None) -> str:
    """``text`` wrapped between words to ``width`` (continuation lines indented; a path or any
    other word longer than the line is never broken); unchanged for ``width=None``."""
    if not width:
        return text
    return textwrap.fill(text, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


class SignalWatch:
    """Records the first of :data:`SIGNALS` that arrives while installed (``with SignalWatch():``).

    The handlers only set a flag (and print one notice for Ctrl-C: above the live progress bar of
    :meth:`watch` when there is one, else wrapped to the terminal's width); the previous handlers
    come back on exit. Outside the main thread nothing is installed (Python delivers signals there
    only)."""

    def __init__(self, announce: bool = True) -> None:
        self.received = 0
        self.announce = announce
        self.display: Any = None
        self._previous: dict[int, Any] = {}

    def watch(self, display: Any) -> None:
        """The run's live console display (:class:`~dpfl_lightning.tracking.loggers.RoundProgress`): a notice
        goes above it (``display.notice(text)``, ``False`` when it is not live) and it is stopped
        (``display.close()``) once a stop is agreed, before the run prints how to resume."""
        self.display = display

    def __enter__(self) -> SignalWatch:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.received:
            raise KeyboardInterrupt  # Ctrl-C while a stop is pending: stop now
        if not self.received:
            self.received = signum
            if self.announce and signum == signal.SIGINT:
                self._notice(INTERRUPT_NOTICE)

    def _notice(self, text: str) -> None:
        """Through the live display (rich wraps it and draws the bar again below it), else a raw
        write (no buffered stream is touched inside the handler) wrapped to the terminal's width."""
        try:
            if self.display is not None and self.display.notice(text):
                return
        except Exception:  # noqa: BLE001 - the notice must never break the run; write it raw instead
            pass
        os.write(2, ("\n" + wrap_notice(text, terminal_width()) + "\n").encode(errors="replace"))

    def agreed(self, comm: Any, device: torch.device) -> int:
        """The signal any rank received (0: none); every rank calls this at the same point. When it
        is not 0 the run stops now: the live display is closed first, so that what the stop prints
        (the checkpoint, the resume command) comes after the bar, not under a bar drawn again."""
        if comm is None or comm.size == 1:
            signum = self.received
        else:
            flag = torch.tensor([float(self.received)], dtype=torch.float64, device=device)
            signum = int(comm.allreduce_max_(flag).item())
        if signum and self.display is not None:
            self.display.close()
        return signum


def _python() -> str:
    """``python`` when that is this interpreter on the PATH, else the interpreter's full path."""
    found = shutil.which("python")
    same = found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)
    return "python" if same else sys.executable


def _without_resume(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            out.append(arg)
    return out


def resume_command(checkpoint: str, argv: list[str] | None = None, world_size: int = 1) -> str | None:
    """The command line that continues this run from ``checkpoint``: the ``dpfl`` command it was
    started with (under ``mpiexec -n P`` for ``P`` ranks), its ``--resume`` replaced; ``None``
    when the run was not started by the ``dpfl`` command (a Python script)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return None
    main = argv[0].replace(os.sep, "/")
    if world_size > 1 and (os.path.basename(main) == "dpfl" or main.endswith("dpfl_lightning/__main__.py")):
        head = ["mpiexec", "-n", str(world_size), _python(), "-m", "mpi4py", "-m", "dpfl_lightning"]
    elif os.path.basename(main) == "dpfl":
        head = ["dpfl"]
    elif main.endswith("dpfl_lightning/__main__.py"):
        head = [_python(), "-m", "dpfl_lightning"]
    else:
        return None
    return shlex.join(head + _without_resume(argv[1:]) + ["--resume", checkpoint])


def how_to_resume(checkpoint: str, world_size: int, width: int | None = None) -> str:
    """``resume with: <command>`` (or, for a Python script, the ``fit`` call). On a terminal of
    ``width`` columns that the line does not fit, the command goes on a line of its own, whole: a
    command to copy is never broken (a terminal narrower than it folds that line only)."""
    command = resume_command(checkpoint, world_size=world_size)
    if command is None:
        text = (f"resume with: trainer.fit(module, data, ckpt_path={checkpoint!r}) "
                "(or ckpt_path='last': the newest checkpoint of the run, if there is one)")
        return wrap_notice(text, width)
    if width and len(f"resume with: {command}") > width:
        return f"resume with:\n  {command}"
    return f"resume with: {command}"


def resume_hint(checkpoint: str, rounds_done: int, signum: int, world_size: int) -> list[str]:
    """What rank 0 prints when a run stops on a signal (wrapped to the terminal's width; one line
    each in a file or a pipe)."""
    width = terminal_width()
    return [wrap_notice(f"preempted: {signal.Signals(signum).name} received; stopped after round {rounds_done}, "
                        f"checkpoint written to {checkpoint}", width), how_to_resume(checkpoint, world_size, width)]


def interrupt_hint(checkpoint: str, world_size: int) -> list[str]:
    """What rank 0 prints when a second Ctrl-C stopped the run at once (wrapped as :func:`resume_hint`)."""
    width = terminal_width()
    if not os.path.isfile(checkpoint):
        return [wrap_notice("interrupted: no checkpoint was written (set checkpoint_every; or press Ctrl-C once: the "
                            "run then stops after the round with a checkpoint)", width)]
    return [wrap_notice(f"interrupted: the rounds after the newest checkpoint ({checkpoint}) are lost", width),
            how_to_resume(checkpoint, world_size, width)]


def finalize_mpi_at_exit() -> None:
    """Have MPI finalized when the process exits after a run stopped on a signal: the ``SystemExit``
    then ends every rank with its status, where ``python -m mpi4py`` would turn a non-zero exit into
    an ``MPI_Abort`` of the job (with a message that reads like a crash, racing the ranks' output).
    Registered after mpi4py's own exit handler, it runs before it; a process that goes on (a caller
    that caught the exit) keeps MPI until then."""
    global _finalize_registered
    if not _finalize_registered and "mpi4py.MPI" in sys.modules:
        _finalize_registered = True
        atexit.register(_finalize_mpi)


_finalize_registered = False


def _finalize_mpi() -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def report_fit_failure(exc: BaseException, comm: Any, checkpoint_dir: str) -> None:
    """What a failed ``fit`` says before it tears down: a failing rank's reason, out before any rank
    aborts the job; after Ctrl-C, how to resume from the last checkpoint (rank 0)."""
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    if size > 1 and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
        report_failure(exc, rank, size)
    if isinstance(exc, KeyboardInterrupt) and rank == 0:
        for line in interrupt_hint(os.path.join(checkpoint_dir, "last.ckpt"), size):
            print(line, file=sys.stderr, flush=True)
