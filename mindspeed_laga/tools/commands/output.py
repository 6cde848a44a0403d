"""What every subcommand prints alike: one-line errors, byte sizes, ratios, table
cells, and output paths checked before any work starts."""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

GiB = 2 ** 30
MiB = 2 ** 20


def one_line_errors(parser: argparse.ArgumentParser, prog: str):
    """Argument errors as one line and exit 2 (argparse would add a usage block)."""
    def error(message):
        print(f"mindspeed-laga {prog}: error: {message}", file=sys.stderr)
        sys.exit(2)
    parser.error = error


def finite_float(text: str) -> float:
    """An argparse type: a finite number (nan and inf would poison every figure)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def check_output_path(flag: str, path: Optional[str]) -> None:
    """ValueError naming ``flag`` unless ``path`` can be written (checked before running)."""
    if not path or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: directory {folder!r} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path!r}: directory {folder!r} is not writable")


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def pad(header: str, fmt: str) -> str:
    """A column header padded to the width and alignment of its cell format."""
    width = int("".join(ch for ch in fmt.split(":")[1] if ch.isdigit() or ch == ".").split(".")[0] or 0)
    return header.ljust(width) if "<" in fmt else header.rjust(width)
