"""Options ``baton up`` takes on behalf of the processes it starts and passes on to them unchanged.

Each option is defined once, by the component's own CLI (``worker.main.add_worker_options``,
``router.main.add_routing_options``); ``baton up`` adds the same definitions with their defaults suppressed, so
only what the user typed is passed on and every default stays the component's own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

_FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction)  # noqa: SLF001 - argparse's own types


def add_passthrough(parser: argparse.ArgumentParser, title: str,
                    add_options: Callable[[argparse._ArgumentGroup], None]) -> list[argparse.Action]:
    """Add a component's options to ``parser`` under ``title``; returns them, for ``argv_of``."""
    group = parser.add_argument_group(title)
    before = len(parser._actions)
    add_options(group)
    actions = parser._actions[before:]
    for action in actions:
        if action.help:  # say the component's default, which stands when the option is not given
            action.help = action.help.replace("%(default)s", str(action.default))
        action.default = argparse.SUPPRESS
    return actions


def argv_of(args: argparse.Namespace, actions: Sequence[argparse.Action]) -> list[str]:
    """The command-line words that give ``actions``' values the user set (and only those)."""
    words: list[str] = []
    for action in actions:
        if action.dest not in vars(args):
            continue
        flag, value = action.option_strings[0], getattr(args, action.dest)
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            words.append(action.option_strings[0 if value else 1])
        else:
            words += [flag] if isinstance(action, _FLAG_ACTIONS) else [flag, str(value)]
    return words
