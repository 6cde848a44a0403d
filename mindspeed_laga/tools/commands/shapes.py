"""Command-line options for an MLA shape, shared by ``verify`` and ``bench``."""
from __future__ import annotations

import argparse

from ..cases import MLAShape


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


def add_shape_args(parser: argparse.ArgumentParser, default: MLAShape = CPU_DEFAULT,
                   seq_len: bool = True):
    """The shape flags; ``seq_len=False`` for a command that takes its lengths elsewhere
    (bench's --seq-lens)."""
    g = parser.add_argument_group("MLA shape (defaults: DeepSeek-V3 dims / 8, 16 heads)")
    if seq_len:
        g.add_argument("--seq-len", type=positive_int, default=default.seq_len,
                       help=f"full sequence length in tokens (default {default.seq_len})")
    g.add_argument("--micro-batch", type=positive_int, default=default.batch,
                   help=f"sequences per micro-batch (default {default.batch})")
    g.add_argument("--heads", type=positive_int, default=default.heads,
                   help=f"attention heads n (default {default.heads})")
    g.add_argument("--qk-head-dim", type=positive_int, default=default.qk_head_dim,
                   help=f"per-head query/key width without RoPE, d_n (default {default.qk_head_dim})")
    g.add_argument("--qk-pos-emb-head-dim", type=positive_int, default=default.rope_dim,
                   help=f"RoPE width shared by the heads, d_r (default {default.rope_dim})")
    g.add_argument("--v-head-dim", type=positive_int, default=default.v_head_dim,
                   help=f"per-head value width d_v (default {default.v_head_dim})")
    g.add_argument("--kv-lora-rank", type=positive_int, default=default.kv_lora_rank,
                   help=f"latent width d_c (default {default.kv_lora_rank})")


def shape_from_args(args, seq_len=None) -> MLAShape:
    return MLAShape(seq_len=seq_len or args.seq_len, batch=args.micro_batch, heads=args.heads,
                    qk_head_dim=args.qk_head_dim, rope_dim=args.qk_pos_emb_head_dim,
                    v_head_dim=args.v_head_dim, kv_lora_rank=args.kv_lora_rank)
