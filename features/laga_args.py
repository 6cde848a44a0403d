"""LAGA's command-line flags and what they mean for the core.

Every LAGA flag is registered here, in one argument group, and reaches the
patch through :func:`laga_settings`.

MindSpeed's ``--context-parallel-algo`` decides both the collective pattern
and the batch layout (``get_batch_on_this_cp_rank``); LAGA must use the same
layout, so the algorithm maps to a (cp_algo, layout) pair of the core:

- ``ulysses_cp_algo``: heads split over CP, rank r holds the contiguous
  slice r -> ("ulysses", "contiguous").
- ``kvallgather_cp_algo`` and ``megatron_cp_algo``: queries stay local, the
  batch is the load-balanced 2*CP-chunk zigzag -> ("allgather", "zigzag").
  For the ring algorithm LAGA replaces the ring with one latent all-gather.
- ``hybrid_cp_algo`` with ``--ulysses-degree-in-cp U``: Ulysses groups of U
  consecutive CP ranks inside a ring; each rank holds a contiguous piece of
  its ring rank's zigzag chunk pair -> ("hybrid", "zigzag") with MindSpeed's
  hybrid Ulysses group.

With ``--reset-attention-mask`` (packed documents, micro-batch 1) MindSpeed's
``get_batch_on_this_cp_rank`` splits the batch differently:
``ulysses_cp_algo`` and ``kvallgather_cp_algo`` cut it into CP contiguous
slices (-> "contiguous"), ``megatron_cp_algo`` cuts every document into 2*CP
chunks (-> "doc_zigzag"). Hybrid is not covered with documents.

With ``--attention-mask-type general`` and ``--reset-attention-mask`` (the
long-context recipes: documents from the data's EOD, or of a fixed length with
``--fix-sub-seq-length``) MindSpeed's ``get_batch_on_this_cp_rank`` and
``get_pos_emb_on_this_cp_rank`` cut the batch and the positions into CP
contiguous slices for every algorithm it allows there: ulysses directly,
megatron and hybrid through their ``_general`` splitters (hybrid: ring slice,
then Ulysses piece, i.e. slice r*U+u) -> "contiguous" each; the document
boundaries are MindSpeed's ``actual_seq_len`` as the loader made it (neither
padded nor divided by the ring degree). MindSpeed-LLM refuses
``kvallgather_cp_algo`` with ``general`` itself.
"""
from __future__ import annotations

from argparse import ArgumentParser, Namespace
from dataclasses import dataclass
from typing import Optional

from mindspeed_laga.cp_algos import ALGOS, AllGather
from mindspeed_laga.kernels.registry import TRAINING_KERNELS

FEATURE_NAME = "mla-latent-all-gather"
FLAG = "--" + FEATURE_NAME
# The kernels the training flag offers (kernels/registry.py: each says whether it is one).
KERNEL_CHOICES = TRAINING_KERNELS

# MindSpeed --context-parallel-algo -> (core cp_algo, core layout): each registered
# algorithm with a host counterpart (``host_algo``; "" = none, nothing maps to it) at its
# default layout, and the host's ring, whose split and attention LAGA's all-gather replaces
CP_ALGO_MAP = {
    **{a.host_algo: (a.name, a.default_layout) for a in ALGOS.values() if a.host_algo},
    "megatron_cp_algo": (AllGather.name, AllGather.default_layout),
}
# the same under --reset-attention-mask (MindSpeed's get_batch_on_this_cp_rank)
DOCUMENT_CP_ALGO_MAP = {
    "ulysses_cp_algo": ("ulysses", "contiguous"),
    "kvallgather_cp_algo": ("allgather", "contiguous"),
    "megatron_cp_algo": ("allgather", "doc_zigzag"),
}
# the same under --attention-mask-type general with --reset-attention-mask
GENERAL_CP_ALGO_MAP = {
    "ulysses_cp_algo": ("ulysses", "contiguous"),
    "megatron_cp_algo": ("allgather", "contiguous"),
    "hybrid_cp_algo": ("hybrid", "contiguous"),
}
# MindSpeed's default when --context-parallel-algo is not given
DEFAULT_CP_ALGO = "megatron_cp_algo"


def register_laga_args(parser: ArgumentParser) -> None:
    group = parser.add_argument_group(title="mla latent all-gather (LAGA)")
    group.add_argument(FLAG, action="store_true", default=False,
                       help="MLA under context parallelism: all-gather the kv latent and rope key "
                            "(kv_lora_rank + qk_pos_emb_head_dim values per token) instead of "
                            "per-head K/V, and rebuild K/V locally with linear_kv_up_proj.")
    group.add_argument("--mla-laga-kernel", choices=KERNEL_CHOICES, default="auto",
                       help="LAGA attention kernel: npu = torch_npu.npu_fusion_attention, "
                            "eager = plain matmul/softmax, auto = npu on NPU tensors, "
                            "else torch's scaled_dot_product_attention (eager with "
                            "--mla-laga-recompute-kv).")
    group.add_argument("--mla-laga-recompute-kv", action="store_true", default=False,
                       help="keep only the gathered latent for backward and rebuild K/V there "
                            "(attention runs blockwise with an online softmax)")
    group.add_argument("--mla-laga-kv-block-size", type=int, default=None, metavar="KEYS",
                       help="with --mla-laga-recompute-kv: rebuild and attend this many keys at "
                            "a time, so full-sequence K/V never exist (default: one block)")
    group.add_argument("--mla-laga-trim-causal-prefix", action="store_true", default=False,
                       help="rebuild only the keys this rank's queries can see under the causal "
                            "mask")
    group.add_argument("--mla-laga-overlap", action="store_true", default=False,
                       help="start the latent all-gather before the query projection and "
                            "overlap its backward reduce-scatter with the dq work")


def laga_options() -> dict:
    """dest -> (flag, default) of every ``--mla-laga-*`` option: they act only with
    ``--mla-latent-all-gather`` (read from the parser they are registered on)."""
    parser = ArgumentParser(add_help=False)
    register_laga_args(parser)
    return {a.dest: (a.option_strings[0], a.default) for a in parser._actions
            if a.option_strings and a.option_strings[0].startswith("--mla-laga-")}


def options_without_laga(args: Namespace, argv) -> list:
    """The ``--mla-laga-*`` options this run gives (typed in ``argv``, or set away from
    their defaults) although ``--mla-latent-all-gather`` is off."""
    typed = {token.split("=", 1)[0] for token in argv or () if isinstance(token, str)}
    return [flag for dest, (flag, default) in laga_options().items()
            if flag in typed or getattr(args, dest, default) != default]


def context_parallel_algo(args: Namespace) -> str:
    """MindSpeed's --context-parallel-algo of this run (its default when unset)."""
    return getattr(args, "context_parallel_algo", None) or DEFAULT_CP_ALGO


def cp_algo_map(documents: bool = False, general: bool = False) -> dict:
    """MindSpeed --context-parallel-algo -> (core cp_algo, core layout) for this batch split;
    ``documents``: under --reset-attention-mask; ``general``: with --attention-mask-type
    general (covered with documents only)."""
    if general:
        return GENERAL_CP_ALGO_MAP if documents else {}
    return DOCUMENT_CP_ALGO_MAP if documents else CP_ALGO_MAP


def cp_algo_and_layout(context_parallel_algo: str, documents: bool = False,
                       general: bool = False):
    """(core cp_algo, core layout) for a MindSpeed --context-parallel-algo, or None."""
    return cp_algo_map(documents, general).get(context_parallel_algo)


def general_mask(args: Namespace) -> bool:
    """--attention-mask-type general (MindSpeed's mask type; its default is causal)."""
    return getattr(args, "attention_mask_type", None) == "general"


@dataclass(frozen=True)
class MindSpeedLAGASettings:
    """What the patched MindSpeed-LLM forward needs from the validated flags."""

    cp_algo: str
    layout: str
    kernel: str
    recompute_kv: bool = False
    kv_block_size: Optional[int] = None
    trim_causal_prefix: bool = False
    overlap: bool = False
    pad_v: bool = False
    # --reset-attention-mask: documents from MindSpeed's actual_seq_len
    documents: bool = False
    # whether MindSpeed's loader divided those ends by the ring degree (causal masks);
    # under --attention-mask-type general they are the loader's own
    loader_scaled_ends: bool = True

    def core_options(self) -> dict:
        """Keywords of ``laga_attention`` besides the tensors, scale and group."""
        return dict(cp_algo=self.cp_algo, layout=self.layout, kernel=self.kernel,
                    recompute_kv=self.recompute_kv, kv_block_size=self.kv_block_size,
                    trim_causal_prefix=self.trim_causal_prefix, pad_v=self.pad_v)



def laga_settings(args: Namespace) -> MindSpeedLAGASettings:
    """Settings for the core; ``validate_args`` has already rejected unmapped algorithms."""
    algo = context_parallel_algo(args)
    documents = bool(getattr(args, "reset_attention_mask", False))
    general = general_mask(args)
    mapped = cp_algo_and_layout(algo, documents, general)
    if mapped is None:
        supported = cp_algo_map(documents, general)
        raise ValueError(f"{FLAG} does not support --context-parallel-algo {algo}"
                         f"{' with --reset-attention-mask' if documents else ''}; "
                         f"use one of {sorted(supported)}")
    cp_algo, layout = mapped
    return MindSpeedLAGASettings(cp_algo=cp_algo, layout=layout, documents=documents,
                                 loader_scaled_ends=documents and not general,
                                 kernel=getattr(args, "mla_laga_kernel", None) or "auto",
                                 recompute_kv=bool(getattr(args, "mla_laga_recompute_kv", False)),
                                 kv_block_size=getattr(args, "mla_laga_kv_block_size", None),
                                 trim_causal_prefix=bool(getattr(args, "mla_laga_trim_causal_prefix",
                                                                 False)),
                                 overlap=bool(getattr(args, "mla_laga_overlap", False)),
                                 pad_v=npu_pads_v(args))


def npu_pads_v(args: Namespace) -> bool:
    """MindSpeed-LLM zero-pads V to the q/k head dim for its fused attention unless
    ``--mla-fa-without-pad`` (its own flag, read from its parsed args) is given;
    LAGA's kernel "npu" does the same so both run the op on the same shapes."""
    return not bool(getattr(args, "mla_fa_without_pad", False))
