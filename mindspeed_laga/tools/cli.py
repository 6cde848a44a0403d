"""``mindspeed-laga`` command line: one subcommand per module in ``commands/``."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from typing import List, Optional

from .commands import SUBCOMMANDS


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so every ``finally`` that stops ranks runs."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mindspeed-laga",
        description="LAGA (Latent All-Gather Attention) for MLA under context parallelism.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
    return parser


@contextlib.contextmanager
def sigterm_unwinds():
    """SIGTERM (what ``timeout`` and schedulers send) handled like SIGINT: by default it
    kills this process at once and the spawned ranks, the fork server and the resource
    tracker run on; raised as :class:`Terminated` it stops them on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"mindspeed-laga {args.command}"
    try:
        with sigterm_unwinds():
            return SUBCOMMANDS[args.command].run(args) or 0
    except (ValueError, OSError) as exc:  # bad input, or an output that cannot be written
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"{prog}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
