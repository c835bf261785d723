"""Command-line parse errors as one line: the key, what is wrong, and the closest valid key or class.

jsonargparse reports a bad option with its usage text and a nested account of every type it tried
(20-50 lines). :func:`one_line` reads that account and keeps what a user needs: which setting
(``trainer.roundz``, ``model.init_args.lrr``, ``--config``), what is wrong with it (no such option,
wrong type, unknown class, missing file, YAML syntax) and a fix, with the closest valid name found
by :mod:`difflib` ("did you mean trainer.rounds?"). Settings a ``lightning.Trainer`` user would try
(``max_epochs``, ``devices``, ``strategy``, ...) get what they are called here.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import textwrap
from collections.abc import Iterable
from typing import Any

import yaml

from dpfl_lightning.lightning.trainer_options import LIGHTNING_TRAINER_OPTIONS  # one table: the CLI and FederatedTrainer(...)

#: the base classes a setting takes, for "did you mean" among the classes known to this process
_BASES = {
    "model": ("lightning.pytorch.LightningModule",),
    "data": ("dpfl_lightning.data.module.FederatedDataModule", "lightning.pytorch.LightningDataModule"),
    "trainer.algorithm": ("dpfl_lightning.algorithms.Algorithm",),
    "trainer.plugins": ("dpfl_lightning.plugins.callback.FederatedCallback",),
    "trainer.loggers": ("lightning.pytorch.loggers.Logger",),
    "trainer.callbacks": ("lightning.pytorch.callbacks.Callback",),
}

#: where the bundled classes a setting takes are exported (listed by their short import path)
_HOMES = {
    "model": "dpfl_lightning.models",
    "data": "dpfl_lightning.data",
    "trainer.algorithm": "dpfl_lightning.algorithms",
    "trainer.plugins": "dpfl_lightning.plugins",
    "trainer.loggers": "dpfl_lightning.tracking.loggers",
}

#: what a setting's values are called in a message
_KINDS = {"model": "LightningModule", "data": "data module", "trainer.algorithm": "algorithm",
          "trainer.plugins": "plugin", "trainer.loggers": "logger", "trainer.callbacks": "callback"}


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _subclasses(base: type) -> Iterable[type]:
    seen, todo = set(), [base]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                yield sub


def _base_key(key: str) -> str:
    return re.sub(r"\.init_args$|\[\d+\]$", "", key)


def known_classes(key: str) -> dict[str, str]:
    """``{class name: import path}`` of the classes this process knows that ``key`` accepts: the
    bundled ones by their exported path (``dpfl_lightning.plugins.UpdateClipping``), then the other
    subclasses imported so far."""
    base_key = _base_key(key)
    bases = [b for b in (_import(path) for path in _BASES.get(base_key, ())) if b is not None]
    out: dict[str, str] = {}
    home = _HOMES.get(base_key)
    module = _module_of(f"{home}.x") if home and bases else None
    for name in sorted(n for n in dir(module) if not n.startswith("_")) if module else ():
        obj = getattr(module, name, None)
        if inspect.isclass(obj) and issubclass(obj, tuple(bases)) and obj not in bases:
            out[name] = f"{home}.{name}"
    for base in bases:
        for cls in [base, *_subclasses(base)]:
            name = cls.__name__
            if not name.startswith("_") and "<locals>" not in cls.__qualname__ and not cls.__module__.startswith("test"):
                out.setdefault(name, f"{cls.__module__}.{name}")
    return out


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``name`` (difflib's ratio, at least 0.6; case is ignored)."""
    pool = {c.lower(): c for c in candidates}
    found = difflib.get_close_matches(name.lower(), list(pool), n=1, cutoff=0.6)
    return pool[found[0]] if found else None


def init_arguments(cls: Any) -> list[str]:
    """The keyword arguments ``cls(...)`` accepts (following ``**kwargs`` into the bases)."""
    names: list[str] = []
    for klass in inspect.getmro(cls) if inspect.isclass(cls) else [cls]:
        try:
            params = inspect.signature(klass.__init__).parameters.values()
        except (TypeError, ValueError):
            continue
        names += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                  and p.name not in names]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def _did_you_mean(candidate: str | None, prefix: str = "") -> str:
    return f"did you mean {prefix}{candidate}?" if candidate else ""


def _join(*parts: str) -> str:
    return ". ".join(p[0].upper() + p[1:] if i else p for i, p in enumerate(q for q in parts if q))


# ---------------------------------------------------------------------------------------- cases
def _a(word: str) -> str:
    return f"an {word}" if word[:1].lower() in "aeiou" else f"a {word}"


def unknown_option(key: str, options: Iterable[str], command: str, value: str | None = None,
                   source: str = "") -> str:
    """``key`` is not an option of ``command`` (``options``: the valid dotted keys; ``source``:
    where it was given, e.g. ``in a --config file``)."""
    options = [o for o in options if o]
    section, _, leaf = key.rpartition(".")
    shown = (f"{key}={value}" if value is not None else key) + (f" ({source})" if source else "")
    if section == "trainer" and leaf in LIGHTNING_TRAINER_OPTIONS:
        return f"{shown}: FederatedTrainer has no {leaf} (a lightning.Trainer option). Fix: " \
               f"{LIGHTNING_TRAINER_OPTIONS[leaf]}"
    same = [o.rpartition(".")[2] for o in options if o.rpartition(".")[0] == section]
    near = closest(leaf, same)
    guess = f"{section}.{near}" if near and section else near or closest(key, options)
    where = f"{_a(section)} option" if section else f"an option of dpfl {command}"
    fix = _did_you_mean(guess) or f"see dpfl {command} --help"
    return f"{shown}: not {where}. Fix: {fix}"


def _module_of(name: str) -> Any:
    try:
        return importlib.import_module(name.rsplit(".", 1)[0])
    except Exception:  # noqa: BLE001 - not importable, for whatever reason
        return None


def _failed_import(module_name: str) -> str | None:
    """Why importing ``module_name`` fails when its file exists (its own code raised: a missing
    package it imports, a syntax error, ...): ``FILE line N: Error: text``; ``None`` when there is
    no such module, or it imports."""
    import importlib.util
    import traceback

    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:  # noqa: BLE001 - a parent package that fails: found below, by its own name
        spec = None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    try:
        importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module raised: report what it raised
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == spec.origin]
        line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else (frames[-1].lineno if frames else None)
        where = f"{spec.origin}{f' line {line}' if line else ''}"
        text = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        return f"{where}: {type(exc).__name__}: {text}"
    return None


def _import_failure(key: str, name: str) -> str | None:
    """The line for a class path whose module (or a parent package) exists but raises on import."""
    parts = name.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        failure = _failed_import(".".join(parts[:i]))
        if failure:
            file = failure.split(":", 1)[0].split(" line ")[0]
            return (f"{key}={name}: importing {'.'.join(parts[:i])} fails in its own code: {failure}. Fix: correct "
                    f"{os.path.basename(file)} (or install the package it imports)")
    return None


def _available(key: str) -> str:
    """The concrete classes ``key`` takes, by import path: the bundled ones and the user's imported so far."""
    bases = {path.rsplit(".", 1)[1] for path in _BASES.get(_base_key(key), ())}
    home = _HOMES.get(_base_key(key), "")
    paths = []
    for name, path in known_classes(key).items():
        bundled = path.rpartition(".")[0] == home  # not the modules' own paths of the exported classes
        if name not in bases and (bundled or not path.startswith("dpfl_lightning.")) and \
                not inspect.isabstract(_import(path)):
            paths.append(path)
    return ", ".join(sorted(paths)[:24])


def _not_accepted(key: str, name: str, cls: type) -> str:
    """``name`` is a class, but not one ``key`` takes (``--model torch.nn.Linear``)."""
    base_key = _base_key(key)
    kind = _KINDS.get(base_key, "class of the expected type")
    base_names = " or ".join(path.rsplit(".", 1)[1] for path in _BASES.get(base_key, ())) or kind
    torch_nn = _import("torch.nn.Module")
    if base_key == "model" and torch_nn is not None and issubclass(cls, torch_nn):
        return (f"{key}={name}: a plain torch.nn.Module, not a LightningModule (it has no training_step or "
                f"configure_optimizers). Fix: wrap it, model: {{class_path: dpfl_lightning.models.SupervisedModule, "
                f"init_args: {{net: {{class_path: {name}, init_args: {{...}}}}, loss_fn: "
                "torch.nn.functional.cross_entropy}}, or write a LightningModule around it")
    available = _available(key)
    fix = f"give {_a(kind)}: {available}" if available else f"give a subclass of {base_names}"
    return f"{key}={name}: {cls.__name__} is not {_a(kind)} (a subclass of {base_names}). Fix: {fix}"


def _class_not_found(key: str, name: str, detail: str = "") -> str:
    """``name`` (a short name or a class path) is not a class ``key`` accepts."""
    if "." in name:
        module = _module_of(name)
        if module is None:
            failure = _import_failure(key, name)
            if failure:
                return failure
            top = name.split(".")[0]
            return (f"{key}={name}: cannot import it ({detail or 'module not found'}). Fix: check the class path; "
                    f"for your own module, run dpfl in the directory that holds {top} (or {top}.py), or add that "
                    "directory to PYTHONPATH (PYTHONPATH=path/to/dir dpfl ...)")
        found = getattr(module, name.rsplit(".", 1)[1], None)
        if inspect.isclass(found):
            return _not_accepted(key, name, found)
        names = [n for n in dir(module) if not n.startswith("_")]  # dir(): lazily exported names too (PEP 562)
        here = [n for n in names if inspect.isclass(getattr(module, n, None))]
        guess = closest(name.rsplit(".", 1)[1], here)
        if guess:
            return f"{key}={name}: no such class. Fix: {_did_you_mean(f'{module.__name__}.{guess}')}"
        available = _available(key)
        fix = f"use one of {available}" if available else f"{module.__name__} defines no such class"
        return f"{key}={name}: no such class in {module.__name__}. Fix: {fix}"
    known = known_classes(key)
    guess = closest(name, known)
    listed = ", ".join(sorted(known.values())[:24])
    fix = _did_you_mean(guess) or f"give a class path (package.module.Class){f', one of {listed}' if listed else ''}"
    return f"{key}={name}: no such class. Fix: {fix}"


#: the words YAML or a command line may spell a non-finite float with
_NON_FINITE = {"nan", ".nan", "inf", "+inf", "-inf", ".inf", "+.inf", "-.inf", "infinity", "+infinity", "-infinity"}


def _non_finite(key: str, value: str, expected: str) -> str | None:
    if "float" in expected and value.strip().lower() in _NON_FINITE:
        return f"{key}={value.strip()}: must be a finite number. Fix: give a finite float for {key}"
    return None


def _type_name(text: str) -> str:
    """``<class 'int'>`` -> ``int``, ``<class 'NoneType'>`` -> ``null``; other type names as they are."""
    return "null" if "NoneType" in text else re.sub(r"<class '(?:[\w.]*\.)?(\w+)'>", r"\1", text.strip())


def _union_error(key: str, text: str) -> str | None:
    """jsonargparse's "Does not validate against any of the Union subtypes": the value, the types."""
    subtypes = re.search(r"Subtypes: \[(.*)\]", text)
    value = re.search(r"Given value: (.*)", text)
    if not subtypes or not value:
        return None
    names = [_type_name(t) for t in re.split(r",\s*(?![^\[]*\])", subtypes.group(1))]
    expected = " or ".join(names)
    finite = _non_finite(key, value.group(1), expected)
    if finite:
        return finite
    given = re.search(r"Given value type: <class '(\w+)'>", text)
    got = f" (got {_a(given.group(1))})" if given else ""
    return f"{key}={value.group(1).strip()}: expected {expected}{got}. Fix: give {' or '.join(_a(n) if n != 'null' else n for n in names)}"


def _type_error(key: str, text: str) -> str | None:
    m = re.search(r"Expected a <class '(\w+)'>\. Got value: (.*)", text)
    if m:
        return _non_finite(key, m.group(2), m.group(1)) or \
            f"{key}={m.group(2).strip()}: not {_a(m.group(1))}. Fix: give {_a(m.group(1))}"
    m = re.search(r"Expected a ([^\n.]+?)\.? Got value: (.*)", text)
    if m:
        return f"{key}={m.group(2).strip()}: expected {m.group(1).strip()}. Fix: give such a value"
    return None


def _class_problem(key: str, class_path: str, text: str) -> str:
    """A problem with a given ``class_path`` under ``key`` (its init_args or its import)."""
    m = re.search(r"Option '([^']+)' is not accepted", text)
    if m:
        cls = _import(class_path)
        args = init_arguments(cls) if cls is not None else []
        name = class_path.rsplit(".", 1)[-1]
        fix = _did_you_mean(closest(m.group(1), args), f"{key}.init_args.") or \
            f"{name} takes {', '.join(args) or 'no arguments'}"
        return f"{key}.init_args.{m.group(1)}: {name} has no argument {m.group(1)}. Fix: {fix}"
    m = re.search(r'Parser key "([^"]+)":\s*(.*)', text, re.S)
    if m:
        return explain_key(f"{key}.init_args.{m.group(1)}", m.group(2))
    m = re.search(r"No module named '([^']+)'", text) or re.search(r"has no attribute '([^']+)'", text)
    if m:
        return _class_not_found(key, class_path, m.group(0))
    m = re.search(r"does not correspond to a subclass of (\w+)", text)
    if m:
        return f"{key}={class_path}: not a {m.group(1)}. Fix: give a subclass of {m.group(1)}"
    first = next((ln.strip(" -") for ln in text.splitlines() if ln.strip(" -")), "invalid")
    return f"{key}={class_path}: {first}. Fix: see --{key}.help {class_path.rsplit('.', 1)[-1]}"


def _class_path_block(text: str) -> tuple[str, str] | None:
    """``(class path, what is wrong with it)`` of jsonargparse's "Problem with given class_path":
    the lines indented below that line (a nested key's own account included)."""
    m = re.search(r"^([ \t]*)(?:- )?Problem with given class_path '([^']+)':[ \t]*(.*)$", text, re.M)
    if not m:
        return None
    indent = len(m.group(1))
    lines = [m.group(3)] if m.group(3).strip() else []
    for ln in text[m.end():].splitlines()[1:]:
        if ln.strip() and len(ln) - len(ln.lstrip()) <= indent:
            break
        lines.append(ln)
    return m.group(2), textwrap.dedent("\n".join(lines)).strip()


def explain_key(key: str, text: str) -> str:
    """The line for jsonargparse's ``Parser key "KEY": TEXT``."""
    m = re.search(r"File does not exist: '([^']+)'", text)
    if m:
        return f"--{key} {m.group(1)}: no such file. Fix: give the path of an existing YAML file"
    found = _class_path_block(text)
    if found:
        return _class_problem(key, *found)
    m = re.search(r"Expected a dot import path string: (\S+)", text) or \
        re.search(r"Expected a path but (\S+) either not accessible", text)
    if m:
        return _class_not_found(key, m.group(1))
    typed = _type_error(key, text) if "Union subtypes" not in text else _union_error(key, text)
    if typed:
        return typed
    first = next((ln.strip(" -") for ln in text.splitlines() if ln.strip(" -")), "invalid value")
    return f"{key}: {first}"


def _yaml_problem(config_files: list[str]) -> str | None:
    for path in config_files:
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except OSError:
            continue
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            return f"--config {path}: not valid YAML{where}: {problem}. Fix: correct the YAML there"
    return None


def one_line(message: str, command: str, options: Iterable[str], commands: Iterable[str] = (),
             config_files: Iterable[str] = (), argv: Iterable[str] = ()) -> str:
    """One line for a jsonargparse error ``message`` met while parsing ``dpfl COMMAND``.

    Args:
        message: the error's text.
        command: the subcommand (``fit``, ``privacy calibrate``), or ``""`` when none was chosen.
        options: the dotted keys the subcommand accepts (its parser's destinations).
        commands: the valid subcommands (for a misspelled one).
        config_files: the ``--config`` files given (to locate a YAML syntax error).
        argv: the command line (to show the value of an unrecognised option).
    """
    message = message.strip()
    argv = list(argv)
    m = re.search(r"invalid choice: '([^']*)'", message)
    if m:
        guess = closest(m.group(1), commands)
        return f"{m.group(1)}: no such command. Fix: {_did_you_mean(guess) or 'use one of ' + ', '.join(commands)}"
    m = re.match(r"unrecognized arguments: (.*)", message, re.S)
    if m:
        token = next((t for t in m.group(1).split() if t.startswith("-")), m.group(1).split()[0])
        key, _, value = token.lstrip("-").partition("=")
        if not value and token in argv and argv.index(token) + 1 < len(argv):
            value = argv[argv.index(token) + 1]
        return unknown_option(key, options, command, value or None)
    m = re.search(r"does not accept option '([^']+)'", message)
    if m:
        return unknown_option(m.group(1), options, command, source="in a --config file")
    if message.startswith("Problems parsing config"):
        found = _yaml_problem(list(config_files))
        if found:
            return found
        return "--config: " + " ".join(message.split())[:200] + ". Fix: correct the YAML"
    m = re.search(r'expected "([^"]+)" to be one of \{([^}]*)\}, but it was not provided', message)
    if m:
        choices = ", ".join(commands) if m.group(1) == "command" and commands else m.group(2).replace(",", ", ")
        return f"no {m.group(1).rsplit('.', 1)[-1].replace('_', ' ')} given. Fix: use one of {choices}"
    m = re.search(r"the following arguments are required: (.*)", message) or \
        re.search(r'Key "([^"]+)" is required', message)
    if m:
        keys = [k.strip().split(".", 1)[-1] for k in m.group(1).split(",")]
        if not set(keys) <= {"model", "data"}:
            return f"{', '.join(keys)}: required but not given. Fix: see dpfl {command} --help"
        where = "pass --ckpt_path RUN_DIR (the run's config.yaml is read) or --config FILE" \
            if command in ("validate", "test", "predict") else "pass --config FILE"
        return f"{', '.join(keys)}: required but not given. Fix: {where} with {' and '.join(k + ':' for k in keys)} " \
               "sections (e.g. configs/quickstart.yaml)"
    m = re.match(r'Parser key "([^"]+)":\s*(.*)', message, re.S)
    if m:
        return explain_key(m.group(1), m.group(2))
    first = next((ln.strip() for ln in message.splitlines() if ln.strip()), message)
    return f"{first}. Fix: see dpfl {command} --help".replace("  ", " ")
