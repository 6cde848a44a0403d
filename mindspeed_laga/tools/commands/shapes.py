"""Command-line options for an MLA shape, shared by ``verify`` and ``bench``; ``plan`` names
the head dims from the same table."""
from __future__ import annotations

import argparse
from typing import NamedTuple

from ..mla_shape import MLAShape


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


# Small and DeepSeek-shaped: DeepSeek-V3's 128/64/128/512 divided by 8, 16 heads.
CPU_DEFAULT = MLAShape(seq_len=256, batch=1, heads=16, qk_head_dim=16, rope_dim=8,
                       v_head_dim=16, kv_lora_rank=64)


class SizeFlag(NamedTuple):
    """A size flag: its argparse dest, the MLAShape (or ModelDims) field it sets, what it is."""

    dest: str
    field: str
    what: str

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


# The MLA head dims every command names alike: verify and bench take them as an MLAShape, plan
# as overrides of a preset's ModelDims.
HEAD_DIMS = (
    SizeFlag("heads", "heads", "attention heads n"),
    SizeFlag("qk_head_dim", "qk_head_dim", "per-head query/key width without RoPE, d_n"),
    SizeFlag("qk_pos_emb_head_dim", "rope_dim", "RoPE width shared by the heads, d_r"),
    SizeFlag("v_head_dim", "v_head_dim", "per-head value width d_v"),
    SizeFlag("kv_lora_rank", "kv_lora_rank", "latent width d_c"),
)
SHAPE_ARGS = (SizeFlag("seq_len", "seq_len", "full sequence length in tokens"),
              SizeFlag("micro_batch", "batch", "sequences per micro-batch")) + HEAD_DIMS


def add_shape_args(parser: argparse.ArgumentParser, default: MLAShape = CPU_DEFAULT,
                   seq_len: bool = True):
    """The shape flags; ``seq_len=False`` for a command that takes its lengths elsewhere
    (bench's --seq-lens)."""
    g = parser.add_argument_group("MLA shape (defaults: DeepSeek-V3 dims / 8, 16 heads)")
    for size in SHAPE_ARGS:
        if size.field == "seq_len" and not seq_len:
            continue
        value = getattr(default, size.field)
        g.add_argument(size.flag, type=positive_int, default=value, help=f"{size.what} (default {value})")


def shape_from_args(args, seq_len=None) -> MLAShape:
    dims = {size.field: getattr(args, size.dest) for size in SHAPE_ARGS if size.field != "seq_len"}
    return MLAShape(seq_len=seq_len or args.seq_len, **dims)


# The longest sequence the tools answer for: its S x S (query, key) pairs must count in int64,
# as the kernels' masks and the cost model's pair counts do.
MAX_SEQ_LEN = 3_037_000_499  # floor(sqrt(2**63 - 1))


def check_seq_len_bound(flag: str, seq_len: int) -> None:
    """ValueError naming ``flag`` past :data:`MAX_SEQ_LEN`."""
    if seq_len > MAX_SEQ_LEN:
        raise ValueError(f"{flag} {seq_len} is past the longest sequence the tools answer for, "
                         f"{MAX_SEQ_LEN:,} tokens (its S x S query-key pairs must count in int64); "
                         "give a shorter length")
