"""``mindspeed-laga`` command line: one subcommand per module in ``commands/``."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import List, Optional

from .commands import SUBCOMMANDS
from .commands.output import refuse
from .commands.typed import subparser, typed_options


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so every ``finally`` that stops ranks runs."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mindspeed-laga",
        description="LAGA (Latent All-Gather Attention) for MLA under context parallelism.")
    parser.add_argument("--version", action="version", version=f"mindspeed-laga {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
    return parser


def version() -> str:
    """The installed distribution's version, read without importing the package (or torch)."""
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        return installed("mindspeed-laga")
    except PackageNotFoundError:
        return "unknown (not installed)"


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
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"mindspeed-laga {args.command}"
    try:
        with sigterm_unwinds():
            own = argv[argv.index(args.command) + 1:]
            args.typed = typed_options(subparser(parser, args.command), own)
            code = SUBCOMMANDS[args.command].run(args) or 0
            sys.stdout.flush()  # a closed pipe shows here, not at exit
            return code
    except BrokenPipeError:  # the reader stopped (`| head`): end quietly, as a killed writer
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ValueError, OSError) as exc:  # bad input, or an output that cannot be written
        refuse(f"{prog}: error: {exc}")
        return 2
    except Terminated:
        print(f"{prog}: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
