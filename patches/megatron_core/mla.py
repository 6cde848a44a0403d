"""LAGA forward for megatron-core ``MLASelfAttention`` (0.16.1 to 0.19.2; no MindSpeed).

Installed by :func:`mindspeed_laga.patch_megatron_mla` (``patches/megatron_core/patch.py``). A forward
call the LAGA path covers (CP > 1, no inference context, packed sequences
only as THD, no attention mask, nothing from :func:`uncovered_reason`) does:

1. the module's own down-projections, TP gathers and norms -> ``q_compressed``
   (after ``q_layernorm``), ``kv_latent`` (after ``kv_layernorm``), ``k_pos_emb``;
2. rope on ``k_pos_emb`` (and, after the module's own ``linear_q_up_proj`` or
   ``linear_q_proj``, on ``q_pe``) at each token's *global* position. The
   table is the module's rotary embedding for the full sequence, indexed with
   the declared batch layout, so zigzag gives exactly what megatron's
   CP-sliced table gives and contiguous is right too;
3. with ``overlap_latent_gather``, the latent all-gather starts before the
   query projection (which then hides it);
4. the core (``laga_attention`` or ``explicit_attention``) with
   ``linear_kv_up_proj.weight`` (this TP rank's heads; under a LoRA adapter the weight
   its forward applies, patches/lora.py) and the CP group;
5. the module's own ``linear_proj``.

THD calls (``packed_seq_params``) pass the documents and megatron's
per-document split to the core (``thd.py``); ``cp_algo="hybrid"``
passes the Ulysses group the patch builds (``hybrid.py``, ``comm.ulysses_group``).

Every other call runs the original forward unchanged, each a case where the
original computes the configured model (docs/MEGATRON.md lists them); attention
dropout in training, which LAGA does not compute, raises instead. The K/V up-projection
happens inside the core, which is why ``forward`` is replaced rather than
``core_attention``: the rotated ``k_pos_emb`` never leaves the original forward.
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from mindspeed_laga import layout as layouts
from mindspeed_laga import agreement, comm
from mindspeed_laga.cp_algos import algo
from mindspeed_laga.kernels.registry import KERNELS
from mindspeed_laga.vocab.names import ATTN_CP_ALGOS, FORMS, LAYOUTS

from . import releases
from ..common import check_weight_once, first_call, open_micro_batch, start_gather
from ..lora import base_layer, effective_weight
from .hybrid import check_hybrid_shape
from .thd import PackedBatch, is_thd, packed_batch, packed_rope_positions


@dataclass(frozen=True)
class MegatronPatchSettings:
    """What :func:`patch_megatron_mla` validated; read by every patched forward call."""

    form: str                 # "laga" or "explicit"
    core: Callable            # laga_attention or explicit_attention
    cp_algo: str              # "allgather", "ulysses" or "hybrid"
    layout: str               # the batch layout: "zigzag" or "contiguous"
    kernel: str
    core_options: Dict = field(default_factory=dict)
    overlap_latent_gather: bool = False  # start the latent gather before the query projection
    ulysses_degree: int = 1   # hybrid: CP ranks per Ulysses group (1: not hybrid)


_WARNED = set()


def _warn_once(reason: str):
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"mindspeed_laga: MLASelfAttention runs its original forward under CP: "
                      f"{reason}", stacklevel=3)


# ----------------------------------------------------------------- what the LAGA path covers

def cp_group_of(module):
    """The module's CP group (megatron's pg_collection, which defaults to parallel_state's)."""
    pgs = getattr(module, "pg_collection", None)
    if pgs is not None and getattr(pgs, "cp", None) is not None:
        return pgs.cp
    from megatron.core import parallel_state
    return parallel_state.get_context_parallel_group()


def _causal(module) -> Optional[bool]:
    return _mask_causal().get(module.attn_mask_type)


@lru_cache(maxsize=1)
def _mask_causal() -> Dict:
    """megatron's mask types LAGA covers -> ``causal``."""
    from megatron.core.transformer.enums import AttnMaskType
    return {AttnMaskType.causal: True, AttnMaskType.no_mask: False}


def uncovered_reason(module, args: Dict) -> Optional[str]:
    """Why this call must run the original forward, or None when LAGA covers it (checked
    in turn: a covered call, every later one, builds no message)."""
    get = args.get
    if get("inference_context") is not None or get("inference_params") is not None:
        return "inference (an inference context is set)"
    if get("key_value_states") is not None:
        return "cross-attention inputs"
    if get("packed_seq_params") is not None and not is_thd(args["packed_seq_params"]):
        return "packed_seq_params with a qkv_format other than 'thd'"
    if get("attention_mask") is not None:
        return ("an explicit attention_mask (LAGA builds the causal mask from positions; pass "
                "None, e.g. Megatron-LM's --no-create-attention-mask-in-dataloader)")
    for name in _ROPE_FROM_OUTSIDE:
        if get(name) is not None:
            return "rope tables or an attention bias from outside"
    if get("rotary_pos_cos_sin"):
        return "rope tables or an attention bias from outside"
    cfg = module.config
    if getattr(cfg, "cache_mla_latents", False):
        return "cache_mla_latents"
    if _causal(module) is None:
        return f"attn_mask_type={module.attn_mask_type}"
    if getattr(module, "recompute_up_proj", False):
        return "recompute of mla_up_proj"
    if module.training and getattr(module, "checkpoint_core_attention", False):
        return "recompute of core_attn"
    for name in _OFFLOADS:
        if getattr(module, name, False):
            return "activation offloading"
    variant = getattr(cfg, "experimental_attention_variant", None)
    if variant is not None:
        return f"experimental_attention_variant={variant}"
    if bool(getattr(cfg, "fp8", None)) or bool(getattr(cfg, "fp4", None)):
        return "fp8/fp4"
    return None


_ROPE_FROM_OUTSIDE = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "attention_bias")
_OFFLOADS = ("offload_qkv_linear", "offload_core_attention", "offload_attn_proj")


# ----------------------------------------------------------------- the module's own pieces

def _tp_group(module):
    group = getattr(module, "tp_group", None)
    return group if group is not None else module.pg_collection.tp


def _down_project(module, hidden_states):
    """hidden -> q_compressed [.., q_lora_rank or hidden], kv_compressed [.., d_c], k_pos_emb.

    Mirrors the original's TP handling: a column-parallel down-projection gives
    a TP-split last dim that is gathered (and, with sequence parallelism, the
    latents go back to s/TP tokens while k_pos_emb keeps s).
    """
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region)
    cfg = module.config
    tp_group = _tp_group(module)
    q_compressed, kv_combined = releases.qkv_down_projection(module, hidden_states, tp_group)
    split = [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim]
    if kv_combined.size(-1) != sum(split):
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=tp_group)
        kv_compressed, k_pos_emb = torch.split(kv_combined, split, dim=-1)
        if cfg.sequence_parallel:
            kv_compressed = scatter_to_sequence_parallel_region(kv_compressed, group=tp_group)
    else:
        kv_compressed, k_pos_emb = torch.split(kv_combined, split, dim=-1)
        if cfg.sequence_parallel and tp_group.size() > 1:
            k_pos_emb = gather_from_sequence_parallel_region(k_pos_emb, group=tp_group)
    return q_compressed, kv_compressed, k_pos_emb


def _kv_norm(module, kv_compressed):
    """kv_layernorm, or the norm TE fuses into linear_kv_up_proj (TE spec, qk_layernorm).

    The fused norm's math is applied here because the core takes the latent
    *after* the norm and the up-projection weight separately.
    """
    kv = module.kv_layernorm(kv_compressed)
    fused = base_layer(module.linear_kv_up_proj)  # (under a LoRA wrapper, if any)
    weight = getattr(fused, "layer_norm_weight", None)
    if weight is None:
        return kv
    if getattr(fused, "zero_centered_gamma", module.config.layernorm_zero_centered_gamma):
        weight = weight + 1
    eps = getattr(fused, "eps", module.config.layernorm_epsilon)
    kind = getattr(fused, "normalization", module.config.normalization)
    if kind == "RMSNorm":
        return F.rms_norm(kv, (kv.shape[-1],), weight, eps)
    return F.layer_norm(kv, (kv.shape[-1],), weight, getattr(fused, "layer_norm_bias", None), eps)


def _latent_to_tp_region(module, kv_latent):
    """The latent as linear_kv_up_proj's input would be: all s tokens, dgrad summed over TP.

    The core multiplies it by this TP rank's rows of the weight, so its grad
    is a per-TP-rank partial sum, reduced as ColumnParallelLinear reduces its
    input grad (all-reduce, or reduce-scatter under sequence parallelism).
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    tp_group = _tp_group(module)
    if tp_group.size() == 1:
        return kv_latent
    if module.config.sequence_parallel:
        return gather_from_sequence_parallel_region(kv_latent, True, group=tp_group)
    return comm.sum_grad(kv_latent, tp_group)


def _query_heads(module, q_compressed):
    """[s, b, n_local, qk_head_dim + qk_pos_emb_head_dim], before rope."""
    proj = module.linear_q_up_proj if module.config.q_lora_rank is not None else module.linear_q_proj
    q, _ = proj(q_compressed)
    return q.view(*q.shape[:-1], module.num_attention_heads_per_partition, module.q_head_dim)


def _rope_at_positions(module, local_len: int, settings: MegatronPatchSettings, cp_group):
    """The module's rope table at this rank's global positions, and yarn's mscale."""
    size, rank = cp_group.size(), cp_group.rank()
    # packed_seq=True: the full table, without megatron's (zigzag) CP slice.
    table = module.rotary_pos_emb(local_len * size, packed_seq=True)
    table, mscale = table if isinstance(table, tuple) else (table, 1.0)
    positions = _positions(settings.layout, size, rank, local_len, settings.ulysses_degree,
                           table.device)
    return _rows_of(module, table, positions), mscale


@lru_cache(maxsize=64)
def _positions(layout: str, size: int, rank: int, local_len: int, ulysses_degree: int,
               device) -> torch.Tensor:
    """This rank's global positions (made once per layout and length, not per call)."""
    with torch.inference_mode(False):
        return layouts.positions(layout, size, rank, local_len,
                                 ulysses_degree=ulysses_degree).to(device)


def _rows_of(module, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``table``'s rows at ``positions``, kept on the module while megatron hands back the
    same table (its rotary embedding caches it): selected once, not per call."""
    kept = getattr(module, "_laga_rope_rows", None)
    if kept is not None and kept[0] is table and kept[1] is positions:
        return kept[2]
    rows = table.index_select(0, positions)
    if not torch.is_inference_mode_enabled() and not table.requires_grad:
        module._laga_rope_rows = (table, positions, rows)
    return rows


def _rope_at_packed_positions(module, local_len: int, packed: PackedBatch, cp_group):
    """The rope table at megatron's THD positions of this rank's tokens, and mscale."""
    positions, rows = packed_rope_positions(packed, cp_group.size(), cp_group.rank(), local_len)
    table = module.rotary_pos_emb(rows, packed_seq=True)
    table, mscale = table if isinstance(table, tuple) else (table, 1.0)
    return table.index_select(0, positions.to(table.device)), mscale


def _call_layout(settings: MegatronPatchSettings, packed: Optional[PackedBatch]) -> Dict:
    """The core's layout keywords: the declared split, or megatron's per-document THD split."""
    if packed is None:
        return {"layout": settings.layout}
    return {"layout": "doc_zigzag", "cu_seqlens": packed.documents}


def _apply_rope(module, x, table, mscale):
    return releases.apply_mla_rope(x, table, module.config.rotary_interleaved, mscale)


def _core_options(settings: MegatronPatchSettings, first: bool) -> Dict:
    """The core's keywords; by default the ranks check a module in full on its first call
    (:func:`check_first_call` has checked the settings and kv_up_weight then) and agree
    once per micro-batch after (``check_ranks=None``: mindspeed_laga/agreement/)."""
    options = dict(settings.core_options)
    options.setdefault("check_ranks", True if first else None)
    return options


def check_first_call(module, settings: MegatronPatchSettings, cp_group) -> bool:
    """On a module's first covered call, before any group is built or any collective runs:
    every CP rank must have the same patch settings and the same kv_up_weight (one
    exchange; ValueError on every rank otherwise). A rank patched with another
    ``cp_algo``/``ulysses_degree`` would otherwise wait to build a Ulysses group its peers
    never build. Returns whether this is the module's first call."""
    first = first_call(module)
    if settings.core_options.get("check_ranks") is not False:
        open_micro_batch(module, cp_group)
    if first and settings.core_options.get("check_ranks", True) is not False:
        check_weight_once(True, lambda: kv_up_weight_of(module), cp_group, {
            "patch_megatron_mla(form=)": (settings.form, FORMS),
            "patch_megatron_mla(cp_algo=)": (settings.cp_algo, ATTN_CP_ALGOS),
            "patch_megatron_mla(ulysses_degree=)": (settings.ulysses_degree, None),
            "patch_megatron_mla(layout=)": (settings.layout, LAYOUTS),
            "patch_megatron_mla(kernel=)": (settings.kernel, KERNELS),
            "patch_megatron_mla(overlap_latent_gather=)": (settings.overlap_latent_gather,
                                                           (False, True))})
    return first


def kv_up_weight_of(module):
    """linear_kv_up_proj's weight, or under a LoRA adapter (peft) the weight its forward
    applies: base plus delta (patches/lora.py); an adapter LAGA cannot read raises."""
    return effective_weight(module.linear_kv_up_proj, "linear_kv_up_proj")


def check_attention_dropout(module) -> None:
    """LAGA's attention has no dropout: a model configured with it is rejected, not changed."""
    dropout = getattr(module.config, "attention_dropout", 0.0)
    if module.training and dropout:
        raise ValueError(
            f"mindspeed_laga.patch_megatron_mla: the model has attention_dropout={dropout}, which "
            "LAGA's attention does not apply; set attention_dropout=0.0 in the TransformerConfig "
            "(--attention-dropout 0.0), as DeepSeek-V3 trains, or unpatch")


def laga_attention_block(module, hidden_states, settings: MegatronPatchSettings, cp_group,
                         packed: Optional[PackedBatch] = None, ulysses_group=None,
                         first: bool = False):
    """The covered path: hidden [s, b, h] -> (linear_proj output, bias).

    ``packed``: a THD call (documents, megatron's per-document split and rope
    positions); ``ulysses_group``: hybrid CP's group of this rank; ``first``: the module's
    first call (:func:`check_first_call`).
    """
    cfg = module.config
    kv_up_weight = kv_up_weight_of(module)  # first: an adapter it cannot read raises here
    q_compressed, kv_compressed, k_pos_emb = _down_project(module, hidden_states)
    if cfg.q_lora_rank is not None:
        q_compressed = module.q_layernorm(q_compressed)
    kv_latent = _latent_to_tp_region(module, _kv_norm(module, kv_compressed))
    if packed is None:
        table, mscale = _rope_at_positions(module, kv_latent.shape[0], settings, cp_group)
    else:
        table, mscale = _rope_at_packed_positions(module, kv_latent.shape[0], packed, cp_group)
    k_pos_emb = _apply_rope(module, k_pos_emb.unsqueeze(2), table, mscale).squeeze(2)
    options = _core_options(settings, first)
    if ulysses_group is not None:
        options["ulysses_group"] = ulysses_group
    handle = start_gather(settings.overlap_latent_gather, kv_latent, k_pos_emb, cp_group,
                          options["check_ranks"])
    gather = {} if handle is None else {"latent_gather": handle}
    query = _query_heads(module, q_compressed)
    q_nope, q_pe = torch.split(query, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
    query = torch.cat([q_nope, _apply_rope(module, q_pe, table, mscale)], dim=-1)
    out = settings.core(query, kv_latent, k_pos_emb, kv_up_weight,
                        softmax_scale=module.softmax_scale, cp_group=cp_group,
                        cp_algo=settings.cp_algo, causal=_causal(module),
                        kernel=settings.kernel, qk_head_dim=cfg.qk_head_dim,
                        v_head_dim=cfg.v_head_dim, **_call_layout(settings, packed), **options,
                        **gather)
    return module.linear_proj(out)


# ----------------------------------------------------------------- the replacement forward

def _covered_call(module, args: Dict, settings: MegatronPatchSettings, cp_group) -> Dict:
    """Per-call keywords of laga_attention_block: THD documents, hybrid's Ulysses group.

    Every check raises on every CP rank before any collective (or group) exists.
    """
    hidden_states = args["hidden_states"]
    extra = {}
    params = args.get("packed_seq_params")
    if is_thd(params):
        # read from the device once per micro-batch: every layer gets the same tensors
        extra["packed"] = agreement.memo(
            cp_group, _thd_key(params, hidden_states, _causal(module)),
            lambda: packed_batch(params, hidden_states, cp_group.size(), _causal(module),
                                 settings.cp_algo, settings.layout))
    if algo(settings.cp_algo).takes_ulysses_degree:
        check_hybrid_shape(settings.ulysses_degree, cp_group.size(),
                           module.num_attention_heads_per_partition)
        extra["ulysses_group"] = comm.ulysses_group(cp_group, settings.ulysses_degree)
    return extra


def _thd_key(params, hidden_states, causal: bool) -> tuple:
    """What packed_batch reads, by tensor metadata (agreement.tensor_key): no device read."""
    fields = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
              "max_seqlen_q", "max_seqlen_kv")
    values = [getattr(params, name, None) for name in fields]
    return ("thd", tuple(hidden_states.shape), causal) + tuple(
        agreement.tensor_key(v) if isinstance(v, torch.Tensor) else v for v in values)


def binder(signature: inspect.Signature) -> Callable:
    """``bind(self, args, kwargs)``: the call's arguments by name, as
    ``signature.bind(self, *args, **kwargs).arguments`` gives them (those passed, no
    defaults), without inspect's cost on every call; a call it does not read plainly
    (too many, unknown or repeated names, a required one missing, a ``*args``
    signature) goes to ``signature.bind``, which also raises its TypeError."""
    params = list(signature.parameters.values())
    plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
    positional = tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)
    names = frozenset(p.name for p in params)
    required = tuple(p.name for p in params if p.default is p.empty)

    def bind(self, args, kwargs) -> Dict:
        if plain and len(args) < len(positional):
            arguments = dict(zip(positional, (self,) + args))
            if (names.issuperset(kwargs) and arguments.keys().isdisjoint(kwargs)
                    and all(n in arguments or n in kwargs for n in required)):
                arguments.update(kwargs)
                return arguments
        return signature.bind(self, *args, **kwargs).arguments

    return bind


def make_forward(original: Callable, settings: MegatronPatchSettings) -> Callable:
    """A drop-in ``MLASelfAttention.forward`` that routes covered calls through LAGA."""
    bind = binder(inspect.signature(original))

    def forward(self, *args, **kwargs):
        cp_group = cp_group_of(self)
        if cp_group is None or cp_group.size() == 1:
            return original(self, *args, **kwargs)
        check_attention_dropout(self)
        arguments = bind(self, args, kwargs)
        reason = uncovered_reason(self, arguments)
        if reason is None:
            first = check_first_call(self, settings, cp_group)
            return laga_attention_block(self, arguments["hidden_states"], settings, cp_group,
                                        first=first,
                                        **_covered_call(self, arguments, settings, cp_group))
        if settings.layout != "zigzag":
            # The original forward slices rope zigzag (megatron's batch layout): with
            # other batches it would run and be silently wrong.
            raise ValueError(
                f"patch_megatron_mla(layout={settings.layout!r}) cannot hand this call back to "
                f"megatron's original MLA forward ({reason}): that forward assumes the zigzag "
                "layout of get_batch_on_this_cp_rank. Remove the cause or use zigzag batches "
                "with layout='zigzag'.")
        if settings.ulysses_degree > 1:
            raise ValueError(
                f"patch_megatron_mla(cp_algo='hybrid', ulysses_degree={settings.ulysses_degree}) "
                f"cannot hand this call back to megatron's original MLA forward ({reason}): "
                "hybrid batches are split by the hybrid zigzag, which that forward does not "
                "know. Remove the cause or use cp_algo='allgather'/'ulysses'.")
        if self.training:
            _warn_once(reason)
        return original(self, *args, **kwargs)

    forward.__wrapped__ = original
    forward.laga_settings = settings
    forward.__name__ = "laga_mla_forward"
    forward.__doc__ = f"LAGA MLA forward ({settings.form}, {settings.cp_algo}, {settings.layout})."
    return forward
