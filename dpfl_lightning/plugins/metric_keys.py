"""The metric keys a plugin's ``on_round_end`` writes, read from its code at set-up.

A DP run withholds every metric a plugin logs without declaring it in ``released_metrics`` (it
counts as an un-noised client statistic, :mod:`dpfl_lightning.federated.releases`). Which keys a run
actually met cannot be said: a key written under a data condition would tell something about one
client. What the code writes can: :func:`written_keys` reads the source of the plugin's
``on_round_end`` (and of the ones it reaches through ``super().on_round_end``) and collects the keys
it stores into ``metrics`` -- ``metrics["k"] = ...``, ``metrics[f"k_{x}"] = ...`` (the family
``k_*``), ``metrics.update({"k": ...})``, ``metrics.update(k=...)``, ``metrics.setdefault("k", ...)``.
Keys computed another way, or ``metrics`` handed to another function, are reported as lines the
set-up cannot read. The result depends on the plugin's class alone, never on data.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field

from dpfl_lightning.federated.releases import ReleaseList, sources_of
from dpfl_lightning.plugins.callback import FederatedCallback

_WRITERS = ("update", "setdefault", "__setitem__")
_READERS = ("dict", "list", "tuple", "set", "sorted", "len", "iter", "any", "all", "sum", "max", "min", "str", "repr",
            "print", "isinstance")


@dataclass
class WrittenKeys:
    """``keys``: exact keys and ``prefix*`` families; ``opaque``: ``(file, line)`` of writes whose key
    the code computes (or where ``metrics`` goes to another function); ``readable``: the source was
    found."""

    keys: list[str] = field(default_factory=list)
    opaque: list[tuple[str, int]] = field(default_factory=list)
    readable: bool = True


def _key_of(node: ast.AST) -> str | None:
    """A key written as a literal (``"k"``), or a family ``prefix*`` for an f-string or a sum that
    starts with a literal; ``None`` when the code computes it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    prefix = None
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        prefix = str(node.values[0].value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _key_of(node.left)
        prefix = left[:-1] if left is not None and left.endswith("*") else left
    return f"{prefix}*" if prefix else None


def _is_metrics(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "metrics"


def _calls_super(tree: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "on_round_end"
               and isinstance(n.func.value, ast.Call) and isinstance(n.func.value.func, ast.Name)
               and n.func.value.func.id == "super" for n in ast.walk(tree))


def _scan(tree: ast.AST, where: str, first_line: int, out: WrittenKeys) -> None:
    def opaque(node: ast.AST) -> None:
        out.opaque.append((where, first_line + node.lineno - 1))

    found: list[tuple[int, int, str]] = []

    def key(node: ast.AST, at: ast.AST) -> None:
        k = _key_of(node)
        if k is None:
            opaque(at)
        else:
            found.append((at.lineno, at.col_offset, k))

    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Subscript) and _is_metrics(sub.value):
                    key(sub.slice, sub)
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and _is_metrics(func.value) and func.attr in _WRITERS:
            if func.attr == "update":
                for arg in node.args:
                    if isinstance(arg, ast.Dict) and all(k is not None for k in arg.keys):
                        for k in arg.keys:
                            key(k, arg)
                    else:
                        opaque(arg)
                for kw in node.keywords:
                    if kw.arg is None:
                        opaque(kw.value)
                    else:
                        key(ast.Constant(kw.arg), node)
            elif node.args:
                key(node.args[0], node)
        elif any(_is_metrics(a) for a in [*node.args, *(kw.value for kw in node.keywords)]) and not (
                isinstance(func, ast.Attribute) and func.attr == "on_round_end") and not (  # super()'s: read next
                isinstance(func, ast.Name) and func.id in _READERS):
            opaque(node)
    for _, _, k in sorted(found):  # in the order the code writes them
        if k not in out.keys:
            out.keys.append(k)
    out.opaque.sort()


def written_keys(plugin: FederatedCallback) -> WrittenKeys:
    """The keys ``plugin``'s ``on_round_end`` writes (see the module docstring)."""
    out = WrittenKeys()
    mro = [c for c in type(plugin).__mro__ if c not in (FederatedCallback, object)]
    owners = [c for c in mro if "on_round_end" in vars(c)]
    for cls in owners:
        func = vars(cls)["on_round_end"]
        try:
            lines, first = inspect.getsourcelines(func)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):  # defined where its source cannot be read (exec, a REPL)
            out.readable = False
            return out
        _scan(tree, inspect.getsourcefile(func) or cls.__qualname__, first, out)
        if not _calls_super(tree):
            break
    return out


def undeclared_metrics(plugins: list, releases: ReleaseList) -> tuple[dict[str, list[str]], list[str]]:
    """For each plugin (by class name, the ``source`` its metrics are looked up under): the keys its
    ``on_round_end`` writes that its ``released_metrics`` does not declare; and a sentence for each
    plugin with writes the set-up cannot read."""
    missing: dict[str, list[str]] = {}
    unread: list[str] = []
    for p in plugins:
        if type(p).on_round_end is FederatedCallback.on_round_end:
            continue
        name = type(p).__name__
        found = written_keys(p)
        keys = [k for k in found.keys if not releases.declares(k, sources_of(p))]
        if keys:
            missing[name] = keys
        if not found.readable:
            unread.append(f"{name}.on_round_end (its source cannot be read)")
        elif found.opaque and not any(r.source in sources_of(p) and r.key.endswith("*") for r in releases.declared):
            lines = ", ".join(f"line {line}" for _, line in found.opaque)
            unread.append(f"{name}.on_round_end ({found.opaque[0][0]}, {lines}: a key the code computes, or metrics "
                          "handed to another function)")
    return missing, unread


def undeclared_warning(missing: dict[str, list[str]], unread: list[str]) -> str | None:
    """The set-up's one warning of a DP run about plugin metrics it will withhold, from code alone."""
    if not missing and not unread:
        return None
    parts = []
    if missing:
        named = "; ".join(f"{name} logs {', '.join(repr(k) for k in keys)}" for name, keys in missing.items())
        parts.append(f"{named} in on_round_end without declaring them in released_metrics, so this DP run counts "
                     "each as an un-noised client statistic and withholds it from every log")
    if unread:
        parts.append("keys written by " + "; ".join(unread) + " are withheld unless released_metrics declares them")
    example = next(iter(missing), None) or unread[0].split(".")[0]
    key = missing[example][0] if missing else "my_metric"
    return ("dpfl: " + "; ".join(parts) + f". Fix: return MetricRelease({key!r}, kind, {example!r}) from "
            f"{example}.released_metrics (from dpfl_lightning.plugins import MetricRelease; kind 'public' for a "
            "function of the settings, 'noised' for one of noised releases, 'unaccounted' to keep it withheld "
            "without this warning; the source must be the plugin's class name or a base class's)")
