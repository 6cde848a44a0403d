"""``mindspeed-laga COMMAND ...`` run in the test's own process: its exit code and what it
printed, and the check that a rejected argument is reported as one error line."""
from __future__ import annotations

from mindspeed_laga.tools import cli


def run_cli(capsys, command: str, *argv: str):
    """``(exit code, stdout, stderr)`` of ``mindspeed-laga COMMAND ARGV``; argparse's errors
    exit from inside parse_args, so a SystemExit gives the code."""
    try:
        code = cli.main([command, *argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(command: str, code, err: str, word: str):
    """Exit code 2 and a single stderr line, ``mindspeed-laga COMMAND: error: ...``, that
    holds ``word``; no traceback."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and word in lines[0], err
    assert lines[0].startswith(f"mindspeed-laga {command}: error:"), err
    assert "Traceback" not in err
