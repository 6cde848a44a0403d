"""What the user typed on the command line, not what differs from a default: each option
given, by its argparse dest and the spelling used. An option given twice (or under two of
its names, ``--seq-len`` and ``--seq-lens``) is refused: argparse would keep the last
value silently. A command that takes only some options refuses the others when typed,
even at their default value."""
from __future__ import annotations

import argparse
from typing import Dict, List, Sequence


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _action(parser: argparse.ArgumentParser, token: str):
    """The action ``token`` names: exactly, or as argparse's unique prefix of a long option."""
    name = token.split("=", 1)[0]
    actions = parser._option_string_actions
    if name in actions:
        return name, actions[name]
    if name.startswith("--"):
        matches = [s for s in actions if s.startswith(name)]
        if len({id(actions[s]) for s in matches}) == 1:
            return matches[0], actions[matches[0]]
    return None, None


def typed_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Dict[str, str]:
    """{dest: the option string typed} for ``argv`` (the command's own arguments); ValueError
    naming an option typed more than once."""
    seen: Dict[str, List[str]] = {}
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            continue
        flag, action = _action(parser, token)
        if action is None or action.dest == "help":
            continue
        seen.setdefault(action.dest, []).append(flag)
    for dest, flags in seen.items():
        if len(flags) > 1:
            names = sorted(set(flags))
            if len(names) > 1:
                raise ValueError(f"{' and '.join(names)} name one option, given twice; give it "
                                 "once (the last would win silently)")
            raise ValueError(f"{flags[0]} is given {len(flags)} times; give it once (the last "
                             "would win silently)")
    return {dest: flags[0] for dest, flags in seen.items()}


def typed_outside(args, others) -> List[str]:
    """The options of ``others`` ((dest, flag, parsed default) each: what a command does not
    take) that were typed; without ``typed`` (a namespace built by hand), those whose value
    differs from the default."""
    typed = getattr(args, "typed", None)
    if typed is not None:
        return [typed[dest] for dest, _, _ in others if dest in typed]
    return [flag for dest, flag, default in others if getattr(args, dest, default) != default]


def given(args, dest: str) -> bool:
    """Whether the user typed the option stored at ``dest`` (as argparse's own namespace
    without ``typed``: whether it differs from None)."""
    typed = getattr(args, "typed", None)
    return dest in typed if typed is not None else getattr(args, dest, None) is not None
