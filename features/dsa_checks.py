"""Which of MindSpeed-LLM's sparse MLA (DSA) configurations LAGA covers.

LAGA runs the host's non-fused DSA path (``bf16_index``, ``generate_sparse_mask``,
``compute_dsa_indexer_loss``) with one gather of ``[kv_latent | k_pos_emb | index_key]``
per layer (patches/mindspeed_llm/dsa.py). What it does not run is refused here, by
flag, with the reason and the fix, before any process group exists.
"""
from __future__ import annotations

from argparse import Namespace

from .laga_args import FLAG, context_parallel_algo

_FUSED = ("LAGA runs the host's non-fused DSA path (bf16_index, generate_sparse_mask, "
          "compute_dsa_indexer_loss); the fused NPU ops are not wired to its gathered keys "
          "yet: drop {flag} or drop " + FLAG)
_SHARE = ("a layer that reuses another layer's top-k (GLM-5.2's index share) reads the "
          "host's per-rank cache of picks, which LAGA's global-position picks do not fill: "
          "drop {flag} or drop " + FLAG)

# (args attribute, flag, why and how to fix); a truthy attribute is rejected with DSA
_DSA_INCOMPATIBLE = (
    ("use_sparse_flash_attn", "--use-sparse-flash-attn", _FUSED),
    ("use_fused_lightning_indexer", "--use-fused-lightning-indexer", _FUSED),
    ("use_fused_lightning_indexer_loss", "--use-fused-lightning-indexer-loss", _FUSED),
    ("enable_mla_absorb", "--enable-mla-absorb",
     "the host's absorbed DSA path attends through npu_sparse_flash_attention only (its "
     "CPU/torch path is the non-absorbed one LAGA runs; the attention is the same "
     "absorbed MQA over the latent either way): drop {flag} or drop " + FLAG),
    ("kv_compress", "--kv-compress",
     "compressed KV (DeepSeek-V4's CSA) gathers a compressed key stream LAGA does not "
     "build: drop {flag} or drop " + FLAG),
    ("index_topk_pattern", "--index-topk-pattern", _SHARE),
    ("index_share_for_mtp_iteration", "--index-share-for-mtp-iteration", _SHARE),
    ("reset_attention_mask", "--reset-attention-mask",
     "the host's DSA with packed documents runs only its fused TND ops, which LAGA does "
     "not wire yet: drop {flag} or drop " + FLAG),
    ("sequence_parallel", "--sequence-parallel",
     "LAGA's DSA path runs at tensor-parallel size 1 (the host's indexer loss sums the "
     "attention over one TP rank's heads only): drop {flag} or drop " + FLAG),
)
DSA_CP_ALGOS = ("ulysses_cp_algo", "kvallgather_cp_algo")


def check_dsa(args: Namespace) -> bool:
    """Raise ``ValueError`` for the DSA configurations LAGA does not run; True: DSA."""
    if not getattr(args, "enable_dsa_indexer", False):
        return False
    for attr, flag, why in _DSA_INCOMPATIBLE:
        if getattr(args, attr, None):
            raise ValueError(f"{FLAG} with --enable-dsa-indexer and {flag} is not supported: "
                             + why.format(flag=flag))
    freq = int(getattr(args, "index_topk_freq", None) or 1)
    if freq != 1:
        raise ValueError(f"{FLAG} with --enable-dsa-indexer and --index-topk-freq {freq} is "
                         "not supported: " + _SHARE.format(flag="--index-topk-freq"))
    tp_size = int(getattr(args, "tensor_model_parallel_size", None) or 1)
    if tp_size != 1:
        raise ValueError(f"{FLAG} with --enable-dsa-indexer and --tensor-model-parallel-size "
                         f"{tp_size} is not supported: LAGA's DSA path runs at TP 1 (the "
                         "host's indexer loss sums the attention over one TP rank's heads "
                         f"only): use --tensor-model-parallel-size 1 or drop {FLAG}")
    algo = context_parallel_algo(args)
    if algo not in DSA_CP_ALGOS:
        raise ValueError(f"{FLAG} with --enable-dsa-indexer and --context-parallel-algo {algo} "
                         "is not supported: the host runs DSA under "
                         f"{' and '.join(DSA_CP_ALGOS)} only; use one of them or drop {FLAG}")
    return True
