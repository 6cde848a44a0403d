"""scripts/dev/host_time.py, the command beside the host-time figures of docs/RESULTS.md
section 12: it runs, and each ``--without`` guarantee it removes is one the timed LAGA
forward really ran (fewer launches without it, and fewer still without all three)."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "host_time.py"


@pytest.mark.timeout(300)
def test_host_time_times_laga_with_and_without_each_guarantee(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the ranks import its worker by name
    script = importlib.import_module("host_time")
    assert script.main(["--repeats", "2", "--warmup", "1", "--layers", "2",
                        "--without", "all"]) == 0
    out = capsys.readouterr().out
    for clock in ("cpu:", "wall:"):
        assert clock in out
    launches = ast.literal_eval(re.search(r"per rank: (\{.*\})", out).group(1))
    laga, without = launches["laga"], {k[len("laga without "):]: v for k, v in launches.items()
                                       if k.startswith("laga without ")}
    assert set(without) == {"in_band", "weight_hash", "nonfinite_guard", "all"}
    assert launches["host"][0] < laga[0]
    for part, ops in without.items():
        assert ops[0] < laga[0], (part, ops, laga)
    assert without["all"][0] < min(v[0] for k, v in without.items() if k != "all")
