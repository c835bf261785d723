"""The one error type users see for bad input."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting has a value the framework cannot run with.

    The message names the setting, the value, what is wrong and how to fix it, on one line, so the
    command-line front end can print it as is and exit non-zero.
    """

    def __init__(self, setting: str, value: object, problem: str, fix: str) -> None:
        self.setting = setting
        self.value = value
        super().__init__(f"{setting}={value!r}: {problem}. Fix: {fix}.")


class NonFiniteUpdateError(RuntimeError):
    """A client produced a NaN or infinite update; nothing of the round was applied."""


def require(condition: bool, setting: str, value: object, problem: str, fix: str) -> None:
    """Raise :class:`ConfigError` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(setting, value, problem, fix)
