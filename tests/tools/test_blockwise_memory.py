"""The blockwise walk's memory, measured: the CPU allocator's peak (``cpu_peak.CpuPeak``)
of one forward+backward, against explicit's and against the cost model's estimate.

Why it falls: the walk goes row block by row block, so the float32 dq and running
output exist for one row block, and K/V for one tile (a row block against a key
block); explicit keeps K/V of every key for backward and makes their grads at once.
"""
import pytest

from mindspeed_laga.tools.cases import Case, MLAShape
from mindspeed_laga.tools.measure import predicted_peak, run_on_rank
from mindspeed_laga.tools.runspec import RunSpec

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

# DeepSeek-V3's proportions (d_n = d_v = 2 d_r, d_c = 4 d_n) at a size that runs in seconds
SHAPE = MLAShape(seq_len=1024, batch=1, heads=8, qk_head_dim=32, rope_dim=16, v_head_dim=32,
                 kv_lora_rank=128)
EXPLICIT = RunSpec("explicit", "explicit")
ONE_BLOCK = RunSpec("laga+recompute", "laga", recompute_kv=True)
BLOCKWISE = RunSpec("laga+blockwise", "laga", recompute_kv=True, kv_block_size=128)


def _case(spec):
    return Case(spec=spec, kernel="auto", dtype="float32", shape=SHAPE, cp_algo="allgather",
                layout="contiguous")


@pytest.fixture(scope="module")
def peaks():
    out = {}
    for spec in (EXPLICIT, ONE_BLOCK, BLOCKWISE):
        peak = run_on_rank(_case(spec), 0, 1, None, cpu_peak=True)["peak_bytes"]
        assert peak, "the CPU allocator's peak could not be read"
        out[spec.name] = peak
    return out


def test_blockwise_peaks_below_explicit(peaks):
    assert peaks["laga+blockwise"] <= 0.8 * peaks["explicit"], peaks


def test_smaller_blocks_lower_the_peak(peaks):
    """One block of every key holds K/V of the whole sequence and whole-segment accumulators."""
    assert peaks["laga+blockwise"] < 0.6 * peaks["laga+recompute"], peaks


@pytest.mark.parametrize("spec", (EXPLICIT, ONE_BLOCK, BLOCKWISE), ids=lambda s: s.name)
def test_model_peak_is_near_the_measurement(peaks, spec):
    """An estimate: within 2x either way of the allocator's peak on CPU (as on CUDA)."""
    model = sum(t.bytes for t in predicted_peak(_case(spec), 1, 0, "cpu"))
    assert 0.5 <= peaks[spec.name] / model <= 2, (spec.name, peaks[spec.name], model)
