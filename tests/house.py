"""The package's structure, read from its source: every import (function-level and
``TYPE_CHECKING`` ones too) between its top-level parts, the cycles among them, and every function's
length. Used by tests/test_house.py; ``python tests/house.py`` prints both."""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dpfl_lightning")
PACKAGE = "dpfl_lightning"


def source_files() -> list[str]:
    out = []
    for folder, _, files in os.walk(ROOT):
        out += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _modules() -> set[str]:
    return {module_name(p) for p in source_files()}


def imports_of(path: str, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in the file."""
    tree = ast.parse(open(path).read())
    here = module_name(path)
    is_package = path.endswith("__init__.py")
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts if is_package else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            if not base.startswith(PACKAGE):
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != here}


def part(module: str) -> str:
    """``dpfl_lightning.run.setup`` -> ``run``; the package's own ``__init__`` is ``__init__``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def part_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for path in source_files():
        src = part(module_name(path))
        graph.setdefault(src, set())
        graph[src].update(part(m) for m in imports_of(path, modules) if part(m) != src)
    return graph


# Which part may import which (the layers of the package, foundation first). Every part of the
# package must be listed: a new one is placed on purpose. The README's "Code layout" shows the same.
FOUNDATION = {"errors", "lazy", "moved", "rng", "problems"}
ALLOWED: dict[str, set[str]] = {
    **{p: set() for p in FOUNDATION},
    "models": {"problems"},
    "comm": {"errors"},
    "privacy": {"errors", "rng"},
    "federated": {"errors", "rng", "comm", "privacy"},
    "module": {"errors", "federated", "models"},
    "data": {"errors", "rng", "problems", "federated", "module"},
    "plugins": {"errors", "rng", "lazy", "federated", "privacy", "module", "data"},
    "executor": {"errors", "rng", "federated", "module", "data", "plugins"},
    "tracking": {"errors", "rng", "privacy", "federated"},
    "run": {"errors", "rng", "comm", "privacy", "federated", "module", "data", "plugins", "executor", "tracking"},
    "lightning": {"errors", "rng", "comm", "federated", "module", "data", "plugins", "run"},
    "algorithms": {"errors", "plugins"},
    "trainer": {"errors", "rng", "comm", "privacy", "federated", "module", "data", "plugins", "executor", "tracking",
                "run", "lightning", "algorithms"},
    "__init__": {"errors", "lazy", "moved"},
    "cli": {"__init__", "errors", "rng", "comm", "privacy", "federated", "module", "data", "plugins", "executor",
            "tracking", "run", "lightning", "algorithms", "trainer", "models"},
    "__main__": {"cli"},
}


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"src -> dst"`` for every import between parts that :data:`ALLOWED` does not allow, and
    ``"src (not placed)"`` for a part it does not list."""
    out = [f"{src} (not placed)" for src in sorted(graph) if src not in ALLOWED]
    return out + [f"{src} -> {dst}" for src in sorted(graph) if src in ALLOWED
                  for dst in sorted(graph[src] - ALLOWED[src])]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def function_lengths() -> list[tuple[int, str]]:
    """``(lines, "file:function")`` of every function and method, longest first."""
    out = []
    for path in source_files():
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{os.path.relpath(path, ROOT)}:{node.name}"))
    return sorted(out, reverse=True)


if __name__ == "__main__":
    print("cycles among top-level parts:", cycles(part_graph()) or "none")
    for n, name in function_lengths()[:10]:
        print(f"{n:5d}  {name}")
