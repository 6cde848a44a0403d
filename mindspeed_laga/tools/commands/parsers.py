"""What the subcommands' parsers share: the parser itself."""
from __future__ import annotations

import argparse

from .output import one_line_errors


def command_parser(sub, name: str, help: str, doc: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: the second paragraph of its module docstring ``doc``
    (the first names the command) as description, argument errors on one line."""
    p = sub.add_parser(name, help=help, description=doc.split("\n\n")[1])
    one_line_errors(p, name)
    return p

