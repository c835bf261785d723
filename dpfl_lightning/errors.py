"""The one error type users see for bad input, and how a failure reaches the output under MPI."""

from __future__ import annotations

import fcntl
import struct
import sys
import termios
import time


class ConfigError(ValueError):
    """A setting has a value the framework cannot run with.

    The message names the setting, the value, what is wrong and how to fix it, on one line, so the
    command-line front end can print it as is and exit non-zero.
    """

    def __init__(self, setting: str, value: object, problem: str, fix: str) -> None:
        self.setting = setting
        self.value = value
        self.problem = problem
        super().__init__(f"{setting}={value!r}: {problem}. Fix: {fix}.")


class NonFiniteUpdateError(RuntimeError):
    """A client produced a NaN or infinite update; nothing of the round was applied."""


class ReleaseWriteError(TypeError):
    """A plugin assigned or deleted a segment of the read-only release in ``on_client_released``.

    The message names the plugin, the hook, the segment and the rule on one line (a ``TypeError``,
    as the mapping's own refusal was, so code that caught that still does).
    """

    def __init__(self, plugin: str, what: str) -> None:
        self.plugin = plugin
        super().__init__(f"{plugin}.on_client_released {what}: the release is read-only (it is the row as it is "
                         "summed, after every on_client_end). Fix: keep what you derive from it in client.state or "
                         "in the plugin's own state, and change the payload in on_client_end")


#: the errors whose message is the whole story: the front end prints it as one line, without a traceback
ONE_LINE_ERRORS = (ConfigError, NonFiniteUpdateError, ReleaseWriteError)


def require(condition: bool, setting: str, value: object, problem: str, fix: str) -> None:
    """Raise :class:`ConfigError` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(setting, value, problem, fix)


# ---------------------------------------------------------------------------------------- under MPI
def unread_bytes(fd: int) -> int:
    """Bytes written to the pipe behind ``fd`` that its reader has not read yet (0 for a file or a
    terminal, or where the system cannot tell)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def drain_output(timeout_s: float = 2.0) -> None:
    """Flush stdout and stderr and wait (at most ``timeout_s``) until whoever reads them has. Under
    ``mpiexec`` a launcher proxy forwards each rank's output, and an ``MPI_Abort`` right after a
    write can end the proxy before it forwarded the last lines: the reason of a failure was lost."""
    deadline = time.monotonic() + timeout_s
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # closed, or replaced by an object without a file
            continue
        while unread_bytes(fd) > 0 and time.monotonic() < deadline:
            time.sleep(0.005)


def failure_line(exc: BaseException, rank: int, size: int) -> str:
    """``dpfl: error (rank r): <reason>`` on one line: the message of one of :data:`ONE_LINE_ERRORS`
    as it is, else the exception's type and first line."""
    text = str(exc) if isinstance(exc, ONE_LINE_ERRORS) else f"{type(exc).__name__}: {exc}"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"dpfl: error{f' (rank {rank})' if size > 1 else ''}: {first}"


def report_failure(exc: BaseException, rank: int, size: int) -> None:
    """Write ``exc``'s :func:`failure_line` to stderr and wait until it is read (see
    :func:`drain_output`), so that it reaches the job's output before any rank aborts the job."""
    print(failure_line(exc, rank, size), file=sys.stderr, flush=True)
    drain_output()
    try:
        exc.dpfl_reported = True  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - an exception type with __slots__
        pass


def was_reported(exc: BaseException) -> bool:
    """Whether :func:`report_failure` already wrote ``exc``'s line (a front end need not repeat it)."""
    return bool(getattr(exc, "dpfl_reported", False))
