"""docs/RESULTS.md's ``$ mindspeed-laga plan ...`` excerpts are what the command prints: every
excerpt line ('...' marks what is left out) is a line of the command's output, every
line in the output's order, a part after '...' after the part before it (the answer comes
before the tables);
and the help of every command that takes --cp-algo states its default."""
import re
import shlex
from pathlib import Path

import pytest

from support.cli_runs import run_cli

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "RESULTS.md"


def plan_excerpts():
    """(argv, excerpt lines) of every plan command shown in a code block."""
    out = []
    for block in re.findall(r"```\n(.*?)```", RESULTS.read_text(), flags=re.S):
        parts = re.split(r"^\$ (mindspeed-laga plan[^\n]*)\n", block, flags=re.M)
        for command, body in zip(parts[1::2], parts[2::2]):
            out.append((shlex.split(command, comments=True)[2:], [ln for ln in body.splitlines() if ln.strip()]))
    return out


@pytest.mark.parametrize("argv, lines", plan_excerpts(), ids=lambda x: " ".join(x) if isinstance(x, list) and x and x[0].startswith("-") else None)
def test_results_excerpt_is_what_plan_prints(capsys, argv, lines):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 0, err
    printed = out.splitlines()
    at = 0
    for line in lines:
        if line.strip() == "...":
            continue  # lines left out: the next part comes later in the output
        assert line in printed[at:], f"not printed (in order) by plan {' '.join(argv)}: {line!r}"
        at = printed.index(line, at) + 1


@pytest.mark.parametrize("command, default", [("plan", "default: every algorithm compared"),
                                              ("bench", "default both"), ("verify", "default both")])
def test_help_states_the_cp_algo_default(capsys, command, default):
    code, out, err = run_cli(capsys, command, "--help")
    assert code == 0
    text = " ".join(out.split())
    assert default in text[text.index("--cp-algo {"):], text
