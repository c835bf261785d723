"""``dpfl <subcommand> --help`` without torch or Lightning.

The parsers of ``fit``, ``validate``, ``test``, ``predict``, ``audit`` and ``privacy epsilon`` are
built from the signatures of :class:`~dpfl_lightning.FederatedTrainer`, the models and the data
modules: building one imports torch and Lightning (tens of seconds on a loaded machine). Their help
needs none of that: :mod:`dpfl_lightning.cli.help_data` holds what their help shows (each option's
strings, metavar and expanded help text, the groups), captured from the full parsers, and
:func:`light_parser` rebuilds a parser from it that formats the same text with jsonargparse's own
formatter, at any terminal width. ``tests/test_startup.py`` checks that text against the full
parsers' help; after changing a signature or a docstring, regenerate the data with::

    python -m dpfl_lightning.cli.help
"""

from __future__ import annotations

import argparse
import os
import pprint
from typing import Any

from dpfl_lightning.cli.parsers import SIGNATURE_PARSERS, DpflArgumentParser, HelpFormatter

__all__ = ["help_spec", "light_parser", "print_help", "stored_spec", "write_data"]

_FIELDS = ("option_strings", "dest", "nargs", "metavar", "choices", "required", "help", "in_usage")


class _LightFormatter(HelpFormatter):
    """Formats the stored actions: their help is shown as stored (expanded when it was captured),
    and the actions jsonargparse keeps out of the usage line (``--help``, ``--print_config``, ...)
    stay out of it."""

    def _expand_help(self, action) -> str:
        return action.help or ""

    def _format_usage(self, usage, actions, *args: Any, **kwargs: Any) -> str:
        return super()._format_usage(usage, [a for a in actions if getattr(a, "in_usage", True)], *args, **kwargs)


def _captured_help(parser: argparse.ArgumentParser) -> dict[int, str]:
    """Each shown action's help text as the parser's formatter expands it (by ``id`` of the action)."""
    texts: dict[int, str] = {}

    class Capture(parser.formatter_class):  # type: ignore[name-defined,misc]
        def _expand_help(self, action) -> str:
            text = super()._expand_help(action)
            texts[id(action)] = text
            return text

    kept = parser.formatter_class
    parser.formatter_class = Capture
    try:
        parser.format_help()
    finally:
        parser.formatter_class = kept
    return texts


def help_spec(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """What ``parser``'s help shows, as plain data (see :func:`light_parser`)."""
    from jsonargparse._actions import filter_non_parsing_actions  # what jsonargparse leaves out of the usage

    assert not parser._mutually_exclusive_groups, "cli_help stores no mutually exclusive groups"
    texts = _captured_help(parser)
    in_usage = {id(a) for a in filter_non_parsing_actions(list(parser._actions))}
    actions = []
    for a in parser._actions:
        help_text = argparse.SUPPRESS if a.help == argparse.SUPPRESS else texts.get(id(a))
        actions.append((list(a.option_strings), a.dest, a.nargs, list(a.metavar) if isinstance(a.metavar, tuple)
                        else a.metavar, None if a.choices is None else [str(c) for c in a.choices], a.required,
                        help_text, id(a) in in_usage))
    index = {id(a): i for i, a in enumerate(parser._actions)}
    groups = [(g.title, g.description, [index[id(a)] for a in g._group_actions]) for g in parser._action_groups]
    return {"prog": parser.prog, "usage": parser.usage, "description": parser.description, "epilog": parser.epilog,
            "actions": actions, "groups": groups}


def light_parser(spec: dict[str, Any]) -> argparse.ArgumentParser:
    """A parser whose help is the one ``spec`` was captured from. It only prints help: its actions
    parse nothing."""
    p = DpflArgumentParser(prog=spec["prog"], usage=spec["usage"], description=spec["description"],
                           epilog=spec["epilog"], add_help=False, formatter_class=_LightFormatter)
    actions = []
    for row in spec["actions"]:
        f = dict(zip(_FIELDS, row))
        action = argparse.Action(f["option_strings"], f["dest"], nargs=f["nargs"], required=f["required"],
                                 metavar=tuple(f["metavar"]) if isinstance(f["metavar"], list) else f["metavar"],
                                 choices=f["choices"], default=argparse.SUPPRESS,
                                 help=argparse.SUPPRESS if f["help"] == argparse.SUPPRESS else f["help"])
        action.in_usage = f["in_usage"]
        actions.append(action)
    p._actions[:] = actions
    p._action_groups[:] = []
    for title, description, members in spec["groups"]:
        group = argparse._ArgumentGroup(p, title=title, description=description)
        group._group_actions[:] = [actions[i] for i in members]
        p._action_groups.append(group)
    return p


def stored_spec(command: str) -> dict[str, Any] | None:
    """The stored help data of ``dpfl COMMAND`` (``None``: the command's parser is light anyway)."""
    if command not in SIGNATURE_PARSERS:
        return None
    from dpfl_lightning.cli.help_data import ACTIONS, PARSERS

    spec = dict(PARSERS[command])
    spec["actions"] = [ACTIONS[i] for i in spec["actions"]]
    return spec


def print_help(command: str) -> bool:
    """Print ``dpfl COMMAND --help`` from the stored data; ``False`` if there is none for it."""
    spec = stored_spec(command)
    if spec is None:
        return False
    light_parser(spec).print_help()
    return True


def write_data(path: str | None = None) -> str:
    """Capture the signature parsers' help (building them: torch and Lightning load) into
    :mod:`dpfl_lightning.cli.help_data` (each distinct action once: the parsers share most);
    returns the file written."""
    from dpfl_lightning.cli.parsers import build_parser

    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "help_data.py")
    commands = build_parser().dpfl_subcommands
    rows: dict[str, int] = {}
    actions: list[tuple] = []
    parsers = {}
    for name in SIGNATURE_PARSERS:
        spec = help_spec(commands[name])
        for row in spec["actions"]:
            if repr(row) not in rows:
                rows[repr(row)] = len(actions)
                actions.append(row)
        parsers[name] = {**spec, "actions": [rows[repr(row)] for row in spec["actions"]]}
    text = ('"""What the help of the signature parsers shows (generated by ``python -m dpfl_lightning.cli.help``;\n'
            'tests/test_startup.py checks it against the full parsers). Do not edit by hand."""\n\n'
            "# fmt: off\n"
            f"ACTIONS = {pprint.pformat(actions, width=120)}\n\n"
            f"PARSERS = {pprint.pformat(parsers, width=120, sort_dicts=False, compact=True)}\n")
    with open(path, "w") as f:
        f.write(text)
    return path


if __name__ == "__main__":  # pragma: no cover
    print(f"wrote {write_data()}")
