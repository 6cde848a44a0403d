"""What the subcommands' parsers share: the parser itself, and the CP algorithm flags of the
commands that offer hybrid CP (``plan``, ``bench``)."""
from __future__ import annotations

import argparse

from ...cp_algos import ALGOS
from ...vocab.names import CP_ALGOS, OWN_CP_ALGOS
from .output import one_line_errors
from .shapes import positive_int


def command_parser(sub, name: str, help: str, doc: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: the second paragraph of its module docstring ``doc``
    (the first names the command) as description, argument errors on one line."""
    p = sub.add_parser(name, help=help, description=doc.split("\n\n")[1])
    one_line_errors(p, name)
    return p


def add_cp_algo_args(parser: argparse.ArgumentParser, default: str, degree_help: str,
                     algo_note: str = "", degree_type=positive_int) -> None:
    """--cp-algo (allgather, ulysses, both of them, or hybrid) and the --ulysses-degree U that
    hybrid needs. The command's own: the default algo, what U means there, a note on hybrid,
    and U's type (``int`` where the command checks it with its other sizes)."""
    with_degree = " and ".join(n for n, a in ALGOS.items() if a.takes_ulysses_degree)
    parser.add_argument("--cp-algo", choices=CP_ALGOS + ("both",) + OWN_CP_ALGOS, default=default,
                        help=f"both = {' and '.join(CP_ALGOS)}; {with_degree} needs --ulysses-degree"
                             + algo_note)
    parser.add_argument("--ulysses-degree", type=degree_type, default=None, metavar="U",
                        help=degree_help)
