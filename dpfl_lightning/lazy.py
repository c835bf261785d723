"""Names a package exports that load on first use (PEP 562), so importing the package stays light."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def exports(package: str, where: dict[str, str], own: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's ``__getattr__`` and ``__dir__``: ``where`` maps each exported name to the module
    that defines it; ``own`` is the package's ``globals()``."""

    def getattr_(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted(set(own) | set(where))

    return getattr_, dir_
