"""The README's "When LAGA pays" table is what ``mindspeed-laga plan`` predicts: every row's
bytes ratio and times are recomputed from the JSON of the plan command the README gives
for it, formatted as the table writes them (ratios to 3 significant digits, times in ms
with two decimals below 100 ms, whole ms above)."""
import json
import re
import shlex
from pathlib import Path

import pytest

from support.cli_runs import run_cli

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
INTRA, CROSS = "910b-intra-node", "910b-cross-node"


def table_rows():
    """The cells of every row of the table under "## When LAGA pays"."""
    section = README.split("## When LAGA pays", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[1:]]


def plan_commands():
    """The plan command lines under the table, each with its ``# and --cp-algo X`` twin."""
    section = README.split("## When LAGA pays", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        if line.startswith("mindspeed-laga plan"):
            command, _, comment = line.partition("#")
            argv = shlex.split(command)[2:]
            out.append(argv)
            twin = re.search(r"and (--cp-algo \w+)", comment)
            if twin:
                algo = argv.index("--cp-algo")
                out.append(argv[:algo] + twin.group(1).split() + argv[algo + 2:])
    return out


# per plan command, in the README's order of commands (each allgather line, then its ulysses
# twin): the table row it gives, and the CP algorithm of that row
ROWS = [
    (0, "allgather"), (2, "ulysses"), (1, "allgather"), (3, "ulysses"), (4, "hybrid"), (5, "dsa"),
]


def ratio(x: float) -> str:
    """3 significant digits, trailing zeros kept (1.80x, 17.8x, 106x)."""
    return f"{x:.{max(0, 2 - len(str(int(x))) + 1)}f}x"


def ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def times(explicit: float, laga: float) -> str:
    return f"{ms(explicit)} / {ms(laga)} ms ({explicit / laga:.2f}x)"


def plan_json(capsys, argv):
    code, out, err = run_cli(capsys, "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def dense_cells(plan, algo):
    """bytes, time in a node, time across nodes (the hybrid row: the node table's time)."""
    if algo == "hybrid":
        rows = {r["variant"]: r["total_s"] for r in plan["nodes"]["rows"]}
        wire = plan["algos"][algo]["notes"]["comm_explicit_over_laga_wire"]
        return ratio(wire), times(rows["explicit"], rows["laga"]), ""
    cells = [ratio(plan["algos"][algo]["notes"]["comm_explicit_over_laga_wire"])]
    for link in (INTRA, CROSS):
        rows = plan["time"][link]["rows"][algo]
        cells.append(times(rows["explicit"]["total_s"], rows["laga"]["total_s"]))
    return cells


def dsa_cells(plan):
    paths = plan["dsa"]["paths"]
    both = {p: sum(paths[p][d]["received_bytes"] for d in ("forward", "backward")) for p in paths}
    forward = paths["host kvallgather"]["forward"]["received_bytes"] / paths["laga"]["forward"]["received_bytes"]
    return [f"{ratio(both['host kvallgather'] / both['laga'])} (forward {ratio(forward)})"]


def test_the_table_and_its_commands_line_up():
    assert len(table_rows()) == len(plan_commands()) == len(ROWS)


@pytest.mark.parametrize("index", range(len(ROWS)))
def test_row_is_what_plan_predicts(capsys, index):
    row_index, algo = ROWS[index]
    row, argv = table_rows()[row_index], plan_commands()[index]
    plan = plan_json(capsys, argv)
    expected = dsa_cells(plan) if algo == "dsa" else dense_cells(plan, algo)
    for cell, want in zip(row[2:], expected):
        assert want in cell, f"README row {row[:2]}: {cell!r} should hold {want!r} (plan {' '.join(argv)})"
