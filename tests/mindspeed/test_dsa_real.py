"""Sparse MLA (DSA): LAGA against MindSpeed-LLM's real ``CustomMLASelfAttention`` with the
DSA indexer, on the master sources (tests/support/dsa_real.py: CP 1, 2 and 4, ulysses'
contiguous and kvallgather's zigzag split, float64; output, every grad, the top-k picks
and the indexer loss against the host's own forward at CP 1; with packed documents at CP 2
and 4 against the host's forward on each document alone; GLM-5.2's shared picks as a chain
of Compute and Share layers)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

# minutes of float64 host forwards at CP 1, 2 and 4: the real-host matrix, run by the Ascend
# leg only (tests/conftest.py)
pytestmark = [pytest.mark.ascend, pytest.mark.hosts]


@pytest.mark.timeout(1200)
def test_dsa_equals_the_hosts_forward_at_cp1(host_sources):
    script = Path(__file__).resolve().parents[1] / "support" / "dsa_real.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=dict(os.environ, **host_sources), timeout=1100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "real DSA CustomMLASelfAttention: ok" in proc.stdout, proc.stdout[-4000:]
    assert proc.stdout.count("max relative error") == 19, proc.stdout[-4000:]

