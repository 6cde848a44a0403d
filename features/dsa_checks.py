"""Which of MindSpeed-LLM's sparse MLA (DSA) configurations LAGA covers.

LAGA runs the host's DSA with one gather of ``[kv_latent | k_pos_emb | index_key]`` per
layer (patches/mindspeed_llm/dsa.py): its torch path (``bf16_index``,
``generate_sparse_mask``, ``compute_dsa_indexer_loss``) and its fused ops
(``--use-fused-lightning-indexer``, ``--use-fused-lightning-indexer-loss``,
``--use-sparse-flash-attn`` with ``--enable-mla-absorb``), at any tensor-parallel size,
with or without sequence parallelism. What it does not run is refused here, by flag,
with the reason and the fix, before any process group exists.
"""
from __future__ import annotations

from argparse import Namespace

from .laga_args import FLAG, context_parallel_algo

_SHARE = ("a layer that reuses another layer's top-k (GLM-5.2's index share) reads the "
          "host's per-rank cache of picks, which LAGA's global-position picks do not fill: "
          "drop {flag} or drop " + FLAG)

# (args attribute, flag, why and how to fix); a truthy attribute is rejected with DSA
_DSA_INCOMPATIBLE = (
    ("kv_compress", "--kv-compress",
     "compressed KV (DeepSeek-V4's CSA) gathers a compressed key stream LAGA does not "
     "build: drop {flag} or drop " + FLAG),
    ("index_topk_pattern", "--index-topk-pattern", _SHARE),
    ("index_share_for_mtp_iteration", "--index-share-for-mtp-iteration", _SHARE),
)
# what MindSpeed-LLM's DSA needs with packed documents (its TND layout): it refuses the
# run without them itself; LAGA names them first
_DOCUMENT_FLAGS = (("use_fused_lightning_indexer", "--use-fused-lightning-indexer"),
                   ("use_fused_lightning_indexer_loss", "--use-fused-lightning-indexer-loss"),
                   ("use_sparse_flash_attn", "--use-sparse-flash-attn"))
DSA_CP_ALGOS = ("ulysses_cp_algo", "kvallgather_cp_algo")


def check_dsa(args: Namespace) -> bool:
    """Raise ``ValueError`` for the DSA configurations LAGA does not run; True: DSA."""
    if not getattr(args, "enable_dsa_indexer", False):
        return False
    for attr, flag, why in _DSA_INCOMPATIBLE:
        if getattr(args, attr, None):
            raise ValueError(f"{FLAG} with --enable-dsa-indexer and {flag} is not supported: "
                             + why.format(flag=flag))
    _check_documents(args)
    freq = int(getattr(args, "index_topk_freq", None) or 1)
    if freq != 1:
        raise ValueError(f"{FLAG} with --enable-dsa-indexer and --index-topk-freq {freq} is "
                         "not supported: " + _SHARE.format(flag="--index-topk-freq"))
    if getattr(args, "use_sparse_flash_attn", False) and not getattr(args, "enable_mla_absorb",
                                                                     False):
        raise ValueError(f"{FLAG} with --enable-dsa-indexer and --use-sparse-flash-attn needs "
                         "--enable-mla-absorb: the host's sparse flash attention takes the "
                         "absorbed query (the latent's width per head), which its "
                         "non-absorbed path does not build; add --enable-mla-absorb "
                         "--mla-mm-split, as the DSA recipes do, or drop --use-sparse-flash-attn")
    algo = context_parallel_algo(args)
    if algo not in DSA_CP_ALGOS:
        raise ValueError(f"{FLAG} with --enable-dsa-indexer and --context-parallel-algo {algo} "
                         "is not supported: the host runs DSA under "
                         f"{' and '.join(DSA_CP_ALGOS)} only, and a ring or hybrid split would "
                         "move more than LAGA's one gather (DSA's top-k needs every key first: "
                         "two forward passes, 1.5x the bytes; hybrid adds the heads' "
                         "all-to-alls, docs/SPARSE_MLA.md); use --context-parallel-algo "
                         f"kvallgather_cp_algo (the same zigzag split, one gather) or drop {FLAG}")
    return True


def _check_documents(args: Namespace) -> None:
    """--reset-attention-mask: LAGA cuts the picks, the attention and the loss at the
    documents on any path, but MindSpeed-LLM runs packed DSA with its fused ops only."""
    if not getattr(args, "reset_attention_mask", False):
        return
    missing = [flag for attr, flag in _DOCUMENT_FLAGS if not getattr(args, attr, False)]
    if missing:
        raise ValueError(f"{FLAG} with --enable-dsa-indexer and --reset-attention-mask needs "
                         f"{' '.join(missing)}: MindSpeed-LLM runs DSA on packed documents (its "
                         "TND layout) with its fused indexer, indexer loss and sparse flash "
                         "attention only, and refuses the run without them; add "
                         f"{' '.join(missing)} (with --enable-mla-absorb --mla-mm-split) or drop "
                         "--reset-attention-mask")
