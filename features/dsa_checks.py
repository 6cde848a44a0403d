"""Which of MindSpeed-LLM's sparse MLA (DSA) configurations LAGA covers.

LAGA runs the host's DSA with one gather of ``[kv_latent | k_pos_emb | index_key]`` per
layer (patches/mindspeed_llm/dsa.py): its torch path (``bf16_index``,
``generate_sparse_mask``, ``compute_dsa_indexer_loss``) and its fused ops
(``--use-fused-lightning-indexer``, ``--use-fused-lightning-indexer-loss``,
``--use-sparse-flash-attn`` with ``--enable-mla-absorb``), at any tensor-parallel size,
with or without sequence parallelism, and the layers that reuse an earlier layer's picks
(GLM-5.2's ``--index-topk-freq`` / ``--index-skip-topk-offset`` / ``--index-topk-pattern``)
on the releases whose MLA module shares them (:func:`check_index_share`), and packed
documents (``--reset-attention-mask``) with the fused set the host runs them on. What it does not
run is refused here, by flag, with the reason and the fix, before any process group exists.
"""
from __future__ import annotations

from argparse import Namespace

from .laga_args import FLAG, context_parallel_algo

# GLM-5.2's shared picks: the flags of MindSpeed-LLM's index share (its feature registers
# all four; --index-share-for-mtp-iteration is read by no host code, so it changes nothing)
INDEX_SHARE_FLAGS = (("index_topk_freq", "--index-topk-freq"),
                     ("index_skip_topk_offset", "--index-skip-topk-offset"),
                     ("index_topk_pattern", "--index-topk-pattern"),
                     ("index_share_for_mtp_iteration", "--index-share-for-mtp-iteration"))

# (args attribute, flag, why and how to fix); a truthy attribute is rejected with DSA
_DSA_INCOMPATIBLE = (
    ("kv_compress", "--kv-compress",
     "compressed KV (DeepSeek-V4's CSA) gathers a compressed key stream LAGA does not "
     "build: drop {flag} or drop " + FLAG),
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


def index_share_flags(args: Namespace) -> list:
    """The index-share flags this run sets to other than the host's defaults."""
    defaults = {"index_topk_freq": 1, "index_skip_topk_offset": 2}
    return [flag for attr, flag in INDEX_SHARE_FLAGS
            if getattr(args, attr, None) not in (None, False, defaults.get(attr))]


def check_index_share(args: Namespace, release) -> None:
    """Refuse the index share on a MindSpeed-LLM release whose MLA module has none
    (``release.index_share`` False): LAGA reproduces the host's sharing, not its flags."""
    if not getattr(args, "enable_dsa_indexer", False) or release.index_share:
        return
    set_flags = index_share_flags(args)
    if set_flags:
        raise ValueError(f"{FLAG} with --enable-dsa-indexer and {', '.join(set_flags)} is not "
                         f"supported on MindSpeed-LLM {release.name}: its MLA module shares no "
                         "top-k picks between layers (26.1.0 and master do); install one of "
                         f"those, drop {', '.join(set_flags)}, or drop {FLAG}")
