"""What every subcommand prints alike: one-line errors, byte sizes, ratios, table
cells, output paths checked before any work starts, and a sharing DSA model's layer mix."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Optional

from ..torchrun_env import torchrun_rank

GiB = 2 ** 30
MiB = 2 ** 20


def refuse(line: str) -> None:
    """A refusal on stderr, once per job: under torchrun every rank refuses alike and only
    rank 0 prints it."""
    if torchrun_rank() == 0:
        print(line, file=sys.stderr)


def one_line_errors(parser: argparse.ArgumentParser, prog: str):
    """Argument errors as one line and exit 2 (argparse would add a usage block)."""
    def error(message):
        refuse(f"mindspeed-laga {prog}: error: {message}")
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


STDOUT = "-"  # a report option's path for standard output


def claim_stdout(paths) -> object:
    """The stream the command's own text goes to: stdout, or stderr when a report (``paths``:
    {flag: path}) takes stdout with ``-``; ValueError when two reports claim it."""
    claims = [flag for flag, path in paths.items() if path == STDOUT]
    if len(claims) > 1:
        raise ValueError(f"{' and '.join(f'{c} -' for c in claims)}: both name standard output, "
                         "which holds one report; give one of them a file")
    return sys.stderr if claims else sys.stdout


def check_output_path(flag: str, path: Optional[str]) -> None:
    """ValueError naming ``flag`` unless ``path`` can be written: proven by writing, before
    anything runs (a permission bit says nothing about /proc or a full device)."""
    if not path or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file name")
    if not os.path.isdir(folder):
        blocking = _file_on_the_way(folder)
        if blocking:
            raise ValueError(f"{flag} {path!r}: {blocking!r} is a file, not a directory; give a "
                             "path under a directory")
        raise ValueError(f"{flag} {path!r}: directory {folder!r} does not exist; create it first")
    try:
        _prove_writable(path)
    except OSError as exc:
        raise ValueError(f"{flag} {path!r} cannot be written ({exc.strerror or exc}); give "
                         "another path") from None


def _file_on_the_way(folder: str) -> Optional[str]:
    """The nearest existing ancestor of ``folder`` (itself included) when it is not a directory."""
    while folder and not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    return folder if folder and not os.path.isdir(folder) else None


# A probe that met a peer rank's probe of the same path tries again, this many times.
PROBE_TRIES, PROBE_WAIT_S = 100, 0.01


def _prove_writable(path: str) -> None:
    """Write one byte where the output will go, and leave things as they were. Under
    torchrun every rank proves the same path at once: a rank that meets a peer's probe
    (made, or gone, between its look and its open) tries again once it has passed."""
    for _ in range(PROBE_TRIES - 1):
        try:
            return _prove_once(path)
        except (FileExistsError, FileNotFoundError):
            time.sleep(PROBE_WAIT_S)
    _prove_once(path)


def _prove_once(path: str) -> None:
    if not os.path.exists(path):
        with open(path, "xb") as f:  # a new file: write, flush to the device, remove
            try:
                f.write(b"\0")
                f.flush()
                os.fsync(f.fileno())
            finally:
                os.unlink(path)
    elif os.path.isfile(path):
        # an existing file is replaced by the run: open it for writing (not creating it, so
        # a peer's probe removed meanwhile leaves no empty file behind)
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
    else:  # a device or pipe (/dev/full, /dev/null): a byte written now is what the run does
        with open(path, "wb") as f:
            f.write(b"\0")
            f.flush()


# One dtype vocabulary for every subcommand: both spellings name the same dtype.
DTYPE_SPELLINGS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                   "float16": "float16", "fp32": "float32", "float32": "float32"}


def dtype_arg(supported):
    """An argparse type: a dtype in either spelling (bf16 or bfloat16, ...) -> its full name,
    one of ``supported`` (full names)."""
    short = {full: abbrev for abbrev, full in DTYPE_SPELLINGS.items() if abbrev != full}

    def parse(text: str) -> str:
        name = DTYPE_SPELLINGS.get(text.lower())
        allowed = ", ".join(f"{short[d]}/{d}" for d in supported)
        if name is None or name not in supported:
            raise argparse.ArgumentTypeError(f"{text!r} is not a dtype this command runs; use "
                                             f"one of {allowed}")
        return name
    parse.__name__ = "dtype"
    return parse


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def pad(header: str, fmt: str) -> str:
    """A column header padded to the width and alignment of its cell format."""
    width = int("".join(ch for ch in fmt.split(":")[1] if ch.isdigit() or ch == ".").split(".")[0] or 0)
    return header.ljust(width) if "<" in fmt else header.rjust(width)


def mix_line(mix: dict) -> str:
    """The model's layer mix in words (plan --dsa and bench --dsa say it alike)."""
    widths = mix["values_per_token"]
    return (f"layer mix (--index-topk-freq {mix['freq']} --index-skip-topk-offset "
            f"{mix['offset']}, {mix['layers']} layers): {mix['computing']} compute their picks "
            f"and gather {widths['computing']:,} values/token, {mix['reusing']} reuse them and "
            f"gather {widths['reusing']:,}; {mix['mean_values_per_token']:,.1f} on average")
