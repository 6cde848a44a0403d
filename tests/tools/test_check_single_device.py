"""scripts/check_single_device.py prints each row's tolerance and ok/FAIL, then one verdict;
a 1% error in LAGA's output fails its float32 rows (exit 1)."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_single_device.py"


def load():
    spec = importlib.util.spec_from_file_location("check_single_device", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_rows_carry_tolerance_and_verdict(monkeypatch, capsys):
    monkeypatch.setenv("S", "32")
    script = load()
    monkeypatch.setattr(script, "OPTIONS", {"": {}, "trim": {"trim_causal_prefix": True}})  # CI time
    assert script.main() == 0
    lines = capsys.readouterr().out.splitlines()
    rows = lines[1:-1]
    assert rows and all("(tolerance " in r and r.endswith(" ok") for r in rows), rows
    assert lines[-1].startswith("OK: every form")
    laga = script.api.FORMS["laga"]
    monkeypatch.setitem(script.api.FORMS, "laga", lambda *a, **k: laga(*a, **k) * 1.01)
    monkeypatch.setattr(script, "OPTIONS", {"": {}})
    assert script.main() == 1
    out = capsys.readouterr().out.splitlines()
    f32 = [r for r in out if r.startswith("laga ") and " float32 " in r]
    assert f32 and all(r.endswith("FAIL") for r in f32), out  # 1% > 1e-5 (bf16 allows 1.6%)
    assert out[-1].startswith("FAILED: ")
