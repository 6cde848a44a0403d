"""``mindspeed-laga`` command line: one subcommand per module in ``commands/``."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .commands import SUBCOMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mindspeed-laga",
        description="LAGA (Latent All-Gather Attention) for MLA under context parallelism.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args) or 0
    except (ValueError, OSError) as exc:  # bad input, or an output that cannot be written
        print(f"mindspeed-laga {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
