"""Whether a ``bench`` fits this machine, checked before any rank starts.

A length or block size far past what the machine holds would otherwise fail inside
the ranks (an allocator error, an int64 overflow in the option handshake) as a
traceback per rank, after the fork server and every rank have started.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .output import GiB

F64 = 8
# The float64 reference keeps about this many [b, n, S, S] score-sized tensors alive at
# once in forward+backward (scores, masked scores, probabilities, their gradient).
REFERENCE_SCORE_COPIES = 4


def available_bytes() -> Optional[int]:
    """The host's MemAvailable (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_bytes(shape, peak_bytes: int, local_ranks: int) -> int:
    """Host bytes one run needs at its worst: every local rank holds the float64 full
    inputs and its own peak (the cost model's), then this process builds the float64
    reference with its S x S scores."""
    S, b, n = shape.seq_len, shape.batch, shape.heads
    inputs = F64 * (S * b * (n * (shape.qk_head_dim + shape.rope_dim) + shape.kv_lora_rank
                             + shape.rope_dim + n * shape.v_head_dim)
                    + n * (shape.qk_head_dim + shape.v_head_dim) * shape.kv_lora_rank)
    ranks = local_ranks * (inputs + peak_bytes)
    reference = 3 * inputs + REFERENCE_SCORE_COPIES * F64 * b * n * S * S
    return max(ranks, reference)


def check_fits(runs, models, local_ranks: int, available: Optional[int] = None,
               flag: str = "--seq-lens") -> None:
    """ValueError naming ``flag`` (bench's --seq-lens, verify's --seq-len) when the largest
    run needs more host memory than is available (``available``: bytes, default this host's
    MemAvailable)."""
    available = available_bytes() if available is None else available
    if available is None or not runs:
        return
    need, case = max(((run_bytes(c.shape, m.peak_bytes, local_ranks), c) for c, m in zip(runs, models)),
                     key=lambda pair: pair[0])
    refuse_past(need, available, case.shape.seq_len,
                f"float64 inputs on {local_ranks} rank(s), the float64 reference's S x S scores",
                "fewer --heads", flag)


def refuse_past(need: int, available: Optional[int], seq_len: int, what: str,
                fix: Optional[str] = None, flag: str = "--seq-lens") -> None:
    """The cap every bench (and verify) applies: ValueError naming ``flag`` when ``need``
    bytes (for ``what``) exceed ``available`` (None: unknown, nothing refused)."""
    if available is not None and need > available:
        shorter = "a shorter --seq-len" if flag == "--seq-len" else "shorter --seq-lens"
        raise ValueError(f"{flag}: S={seq_len} needs about {need / GiB:,.1f} GiB of host "
                         f"memory ({what}), {available / GiB:,.1f} GiB available; use "
                         f"{shorter}{' or ' + fix if fix else ''}")


def check_block_size(kv_block_size: Optional[int], seq_lens: Sequence[int]) -> None:
    """ValueError naming --kv-block-size when a block is longer than every sequence."""
    longest = max(seq_lens)
    if kv_block_size is not None and kv_block_size > longest:
        raise ValueError(f"--kv-block-size {kv_block_size} is longer than the longest sequence "
                         f"({longest}): one block would hold every key; use at most {longest}")
