"""Install LAGA on megatron-core's ``MLASelfAttention`` (Megatron-LM without MindSpeed).

    import mindspeed_laga
    mindspeed_laga.patch_megatron_mla(cp_algo="allgather")   # before the first forward
    ...
    mindspeed_laga.unpatch_megatron_mla()                    # the original again

The batch layout is a fact about the data pipeline that the tensors do not
reveal, so the patch never guesses it:

- ``cp_algo="allgather"``: ``layout`` defaults to ``"zigzag"``, the layout of
  megatron's ``get_batch_on_this_cp_rank`` (and of its CP-sliced rope table).
- ``cp_algo="ulysses"``: ``layout`` must be given. MindSpeed-style ulysses
  pipelines shard contiguously, Megatron-LM's shards zigzag; both are correct
  if declared, and a wrong declaration would train on wrong positions.

``form="explicit"`` runs the explicit core instead (per-head K/V on the wire),
the baseline LAGA is measured against. Extra keywords go to the core unchanged
(``trim_causal_prefix``, ``recompute_kv``, ``kv_block_size``, ``check_ranks``),
so options the core gains later need no change here; unknown ones raise at
patch time. The one per-call core option, ``latent_gather``, is driven by
``overlap_latent_gather=True``.
"""
from __future__ import annotations

import inspect

from . import layout as layouts
from .api import explicit_attention, laga_attention
from .validate import CP_ALGOS, KERNELS

TRAINING_FORMS = {"laga": laga_attention, "explicit": explicit_attention}
# Set by the patched forward from the module and the patch settings.
_FORWARD_OWNED = ("query", "kv_latent", "k_pos_emb", "kv_up_weight", "softmax_scale", "cp_group",
                  "cp_algo", "layout", "causal", "kernel", "latent_gather")

# (class, whether it had its own "forward" before we patched, the original forward)
_SAVED = None


def _mla_class():
    try:
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    except ImportError as exc:
        raise ImportError("patch_megatron_mla needs megatron-core (pip install "
                          "'mindspeed-laga[megatron]', tested with megatron-core 0.16.1)") from exc
    return MLASelfAttention


def _check_layout(cp_algo: str, layout):
    if layout is None:
        if cp_algo == "allgather":
            return "zigzag"
        raise ValueError(
            "patch_megatron_mla(cp_algo='ulysses') needs layout= : the patch cannot tell how "
            "your batches are split. Pass layout='zigzag' for megatron's "
            "get_batch_on_this_cp_rank, or layout='contiguous' if rank r holds tokens "
            "[r*s, (r+1)*s) (e.g. mindspeed_laga.layout.shard(batch, 'contiguous', P, r, dim=1))")
    if layout not in layouts.LAYOUTS:
        raise ValueError(f"patch_megatron_mla(layout={layout!r}) is unknown; use one of "
                         f"{layouts.LAYOUTS}")
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


def make_settings(cp_algo="allgather", kernel="auto", form="laga", layout=None,
                  overlap_latent_gather=False, **core_options):
    """Validate the patch arguments (ValueError naming the argument) -> LAGASettings."""
    from .patches.megatron_mla import LAGASettings
    if cp_algo not in CP_ALGOS:
        raise ValueError(f"patch_megatron_mla(cp_algo={cp_algo!r}) is unknown; use one of "
                         f"{CP_ALGOS}")
    if kernel not in KERNELS:
        raise ValueError(f"patch_megatron_mla(kernel={kernel!r}) is unknown; use one of {KERNELS}")
    if kernel == "npu":
        from .kernels import npu
        npu.require_torch_npu()
    if form not in TRAINING_FORMS:
        raise ValueError(
            f"patch_megatron_mla(form={form!r}) is not a training form; use one of "
            f"{tuple(TRAINING_FORMS)} (the absorbed form is for measurements: call "
            "mindspeed_laga.absorbed_attention directly)")
    layout = _check_layout(cp_algo, layout)
    if not isinstance(overlap_latent_gather, bool):
        raise ValueError(f"patch_megatron_mla(overlap_latent_gather={overlap_latent_gather!r}) "
                         "must be True or False")
    if overlap_latent_gather and form != "laga":
        raise ValueError("patch_megatron_mla(overlap_latent_gather=True) needs form='laga': "
                         f"form={form!r} gathers no latent")
    core = TRAINING_FORMS[form]
    _check_core_options(form, core, core_options)
    return LAGASettings(form=form, core=core, cp_algo=cp_algo, layout=layout, kernel=kernel,
                        core_options=dict(core_options),
                        overlap_latent_gather=overlap_latent_gather)


def patch_megatron_mla(cp_algo="allgather", kernel="auto", form="laga", layout=None,
                       overlap_latent_gather=False, **core_options):
    """Route megatron-core's ``MLASelfAttention.forward`` through LAGA (idempotent).

    ``overlap_latent_gather``: start the latent all-gather right after
    ``kv_latent`` and the rotated ``k_pos_emb`` exist, so the query projection
    hides it (and the dq work hides its reduce-scatter in backward).
    Calling it again replaces the settings; the original forward is kept once.
    Returns the validated settings.
    """
    global _SAVED
    from .patches.megatron_mla import make_forward
    settings = make_settings(cp_algo, kernel, form, layout, overlap_latent_gather,
                             **core_options)
    cls = _mla_class()
    if _SAVED is None:
        # In 0.16.1 MLASelfAttention inherits forward from MultiLatentAttention.
        _SAVED = (cls, "forward" in cls.__dict__, cls.forward)
    cls.forward = make_forward(_SAVED[2], settings)
    return settings


def unpatch_megatron_mla():
    """Restore the original ``MLASelfAttention.forward``; a no-op when not patched."""
    global _SAVED
    if _SAVED is None:
        return False
    cls, had_own, original = _SAVED
    if had_own:
        cls.forward = original
    elif "forward" in cls.__dict__:
        del cls.forward
    _SAVED = None
    return True


def patched_settings():
    """The active settings, or None when MLASelfAttention is not patched."""
    if _SAVED is None:
        return None
    return getattr(_SAVED[0].__dict__.get("forward"), "laga_settings", None)
