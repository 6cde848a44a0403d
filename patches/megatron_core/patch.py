"""Install LAGA on megatron-core's ``MLASelfAttention`` (Megatron-LM without MindSpeed).

    import mindspeed_laga
    mindspeed_laga.patch_megatron_mla(cp_algo="allgather")   # before the first forward
    ...
    mindspeed_laga.unpatch_megatron_mla()                    # the original again

The batch layout is a fact about the data pipeline that the tensors do not
reveal. ``layout`` defaults to ``"zigzag"`` for both ``cp_algo`` values: the
split megatron's own ``get_batch_on_this_cp_rank`` produces (2*CP chunks, rank
r holding chunks r and 2*CP-1-r) and its CP-sliced rope table assumes. A
pipeline that shards contiguously (rank r holds tokens [r*s, (r+1)*s), as
MindSpeed's ulysses does) passes ``layout="contiguous"``; a wrong declaration
would train on wrong positions.

``form="explicit"`` runs the explicit core instead (per-head K/V on the wire),
the baseline LAGA is measured against. Extra keywords go to the core unchanged
(``trim_causal_prefix``, ``recompute_kv``, ``kv_block_size``, ``check_ranks``),
so options the core gains later need no change here; unknown ones, and bad
values of known ones, raise at patch time. The one per-call core option, ``latent_gather``, is driven by
``overlap_latent_gather=True``.
"""
from __future__ import annotations

import inspect

from mindspeed_laga import checks
from mindspeed_laga.api import explicit_attention, laga_attention
from mindspeed_laga.options import AttnOptions
from mindspeed_laga.kernels.registry import KERNEL_TYPES, KERNELS
from mindspeed_laga.vocab.names import ATTN_CP_ALGOS, LAYOUTS

from .host import SUPPORTED_MEGATRON_CORE, check_megatron_core
from .hybrid import check_ulysses_degree
from .mla import MegatronPatchSettings, make_forward

TRAINING_FORMS = {"laga": laga_attention, "explicit": explicit_attention}
# Set by the patched forward from the module and the patch settings.
_FORWARD_OWNED = ("query", "kv_latent", "k_pos_emb", "kv_up_weight", "softmax_scale", "cp_group",
                  "cp_algo", "layout", "causal", "kernel", "latent_gather", "qk_head_dim",
                  "v_head_dim", "ulysses_group", "cu_seqlens")

# On the class, not in this module, so a reload of this module still finds it:
# (whether the class had its own "forward" before the patch, the original, the installed one)
_SAVED_ATTR = "_laga_saved_forward"


def _mla_class(check_version=True):
    try:
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    except ImportError as exc:
        raise ImportError("patch_megatron_mla needs megatron-core (pip install "
                          "'mindspeed-laga[megatron]', tested with megatron-core "
                          f"{', '.join(SUPPORTED_MEGATRON_CORE)})") from exc
    if check_version:
        check_megatron_core()
    return MLASelfAttention


def _check_layout(layout):
    """None -> zigzag, the split of megatron's get_batch_on_this_cp_rank, for every cp_algo."""
    if layout is None:
        return "zigzag"
    if layout not in LAYOUTS:
        raise ValueError(f"patch_megatron_mla(layout={layout!r}) is unknown; use one of "
                         f"{LAYOUTS}")
    return layout


def _check_core_options(form: str, core, core_options: dict):
    if "latent_gather" in core_options:
        raise ValueError("patch_megatron_mla: latent_gather is a per-call handle; pass "
                         "overlap_latent_gather=True and the patched forward starts the gather")
    owned = sorted(set(core_options) & set(_FORWARD_OWNED))
    if owned:
        raise ValueError(f"patch_megatron_mla: {owned} are set by the patched forward from the "
                         "module and the patch arguments; remove them")
    accepted = [name for name, p in inspect.signature(core).parameters.items()
                if p.kind == p.KEYWORD_ONLY and name not in _FORWARD_OWNED]
    unknown = sorted(set(core_options) - set(accepted))
    if unknown:
        raise ValueError(f"patch_megatron_mla: option(s) {unknown} are not accepted by "
                         f"{core.__name__} (form={form!r}); it accepts {accepted}")
    try:  # their values too, now rather than on the first forward
        checks.check_option_values(AttnOptions(form=form, softmax_scale=None, **core_options))
    except ValueError as exc:
        raise ValueError(f"patch_megatron_mla: {exc}") from None


def make_settings(cp_algo="allgather", kernel="auto", form="laga", layout=None,
                  overlap_latent_gather=False, *, ulysses_degree=None, **core_options):
    """Validate the patch arguments (ValueError naming the argument) -> MegatronPatchSettings."""
    if cp_algo not in ATTN_CP_ALGOS:
        raise ValueError(f"patch_megatron_mla(cp_algo={cp_algo!r}) is unknown; use one of "
                         f"{ATTN_CP_ALGOS}")
    degree = check_ulysses_degree(cp_algo, ulysses_degree)
    if kernel not in KERNELS:
        raise ValueError(f"patch_megatron_mla(kernel={kernel!r}) is unknown; use one of {KERNELS}")
    if kernel != "auto":  # e.g. npu: torch_npu
        KERNEL_TYPES[kernel].check_installed()
    if form not in TRAINING_FORMS:
        raise ValueError(
            f"patch_megatron_mla(form={form!r}) is not a training form; use one of "
            f"{tuple(TRAINING_FORMS)} (the absorbed form is for measurements: call "
            "mindspeed_laga.absorbed_attention directly)")
    layout = _check_layout(layout)
    if layout == "doc_zigzag":
        raise ValueError("patch_megatron_mla(layout='doc_zigzag') is not a batch layout to "
                         "declare: packed (THD) batches are split per document automatically "
                         "(packed_seq_params); use 'zigzag' or 'contiguous'")
    if not isinstance(overlap_latent_gather, bool):
        raise ValueError(f"patch_megatron_mla(overlap_latent_gather={overlap_latent_gather!r}) "
                         "must be True or False")
    if overlap_latent_gather and form != "laga":
        raise ValueError("patch_megatron_mla(overlap_latent_gather=True) needs form='laga': "
                         f"form={form!r} gathers no latent")
    core = TRAINING_FORMS[form]
    _check_core_options(form, core, core_options)
    return MegatronPatchSettings(form=form, core=core, cp_algo=cp_algo, layout=layout,
                                 kernel=kernel, core_options=dict(core_options),
                                 overlap_latent_gather=overlap_latent_gather,
                                 ulysses_degree=degree)


def patch_megatron_mla(cp_algo="allgather", kernel="auto", form="laga", layout=None,
                       overlap_latent_gather=False, *, ulysses_degree=None, **core_options):
    """Route megatron-core's ``MLASelfAttention.forward`` through LAGA (idempotent).

    ``overlap_latent_gather``: start the latent all-gather right after
    ``kv_latent`` and the rotated ``k_pos_emb`` exist, so the query projection
    hides it (and the dq work hides its reduce-scatter in backward).
    ``cp_algo="hybrid"`` with ``ulysses_degree=U``: heads split inside the U
    consecutive CP ranks (the group is built on the first forward), the latent
    over the whole CP group; batches split by the hybrid zigzag
    (``layout.shard(..., ulysses_degree=U)``, docs/MEGATRON.md).
    Calling it again replaces the settings; the original forward is kept once,
    also across a reload of this module. Returns the validated settings.
    """
    settings = make_settings(cp_algo, kernel, form, layout, overlap_latent_gather,
                             ulysses_degree=ulysses_degree, **core_options)
    cls = _mla_class()
    saved = _our_saved(cls, "patch_megatron_mla")
    if saved is None:
        # In 0.16.1 to 0.19.2 MLASelfAttention inherits forward from MultiLatentAttention.
        saved = ("forward" in cls.__dict__, cls.forward)
    installed = make_forward(saved[1], settings)
    cls.forward = installed
    setattr(cls, _SAVED_ATTR, (saved[0], saved[1], installed))
    return settings


def _our_saved(cls, caller: str):
    """The saved state when our forward is the class's forward; None when not patched.

    Raises when something was installed over our forward: replacing or removing
    it would silently drop that wrapper, or leave it calling a stale forward.
    """
    saved = cls.__dict__.get(_SAVED_ATTR)
    if saved is None:
        return None
    current = cls.__dict__.get("forward")
    if current is not saved[2]:
        raise RuntimeError(
            f"mindspeed_laga.{caller}: MLASelfAttention.forward is no longer LAGA's forward "
            f"(now {getattr(current, '__qualname__', current)!r}, installed over it by other "
            "code); remove that wrapper first (restore the forward it wrapped), then call "
            f"{caller} again")
    return saved


def unpatch_megatron_mla():
    """Restore the original ``MLASelfAttention.forward``; False when not patched.

    Refuses (RuntimeError) when another wrapper was installed over LAGA's forward.
    """
    cls = _mla_class(check_version=False)
    saved = _our_saved(cls, "unpatch_megatron_mla")
    if saved is None:
        return False
    had_own, original, _installed = saved
    if had_own:
        cls.forward = original
    else:
        del cls.forward
    delattr(cls, _SAVED_ATTR)
    return True


def patched_settings():
    """The active settings, or None when MLASelfAttention is not patched."""
    cls = _mla_class(check_version=False)
    saved = cls.__dict__.get(_SAVED_ATTR)
    return None if saved is None else saved[2].laga_settings
