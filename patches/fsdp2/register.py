"""LAGA's forwards entered in the FSDP2 backend's own CP mapping table, at run time.

The backend applies CP by replacing functions and methods named in
``mindspeed_llm/fsdp2/distributed/context_parallel/context_parallel_mappings.py``:
``MODEL_CP_CONFIG`` groups model ids, each group naming templates of
``COMMON_CP_MAPPINGS`` and per-model replacements. ``context_parallel_manager`` reads
both dicts when it parallelizes the model (``apply_cp_modules``, CP size > 1), so LAGA
adds its own group to them once the table module is imported, and moves the covered
model ids out of the host's groups; no host file changes. The group keeps the host's
CP cross-entropy template (the loss is summed over CP as before) and replaces the whole
attention module's forward: the latent is what crosses the wire, so LAGA's forward
starts before the host's per-head Q/K/V exist.
"""
from __future__ import annotations

import importlib
import sys

from ..after_import import after_import
from ..common import UnsupportedHostError

MAPPINGS = "mindspeed_llm.fsdp2.distributed.context_parallel.context_parallel_mappings"
GROUP = "laga"
LOSS_TEMPLATE = "fixed_cross_entropy"
# model id -> (the method the host's table replaces, LAGA's forward for it)
FORWARDS = {
    "deepseek_v3": (
        "transformers.models.{model_id}.modeling_{model_id}.DeepseekV3Attention.forward",
        "mindspeed_laga.patches.fsdp2.deepseek_v3.laga_forward"),
    # GLM-5/5.2: the backend's own model (model_id glm52), not transformers' class the host's
    # own table names
    "glm_moe_dsa": (
        "mindspeed_llm.fsdp2.models.glm52.modeling_glm_moe_dsa.GlmMoeDsaAttention.forward",
        "mindspeed_laga.patches.fsdp2.glm_dsa.laga_glm_dsa_forward"),
}


def register(model_ids) -> None:
    """Put ``model_ids`` (keys of :data:`FORWARDS`) into LAGA's group of the host's table
    now, or as soon as the table module is imported."""
    model_ids = tuple(model_ids)
    unknown = [m for m in model_ids if m not in FORWARDS]
    if unknown:
        raise ValueError(f"mindspeed_laga: no FSDP2 forward for {unknown}; known: {list(FORWARDS)}")
    module = sys.modules.get(MAPPINGS)
    if module is not None:
        add_laga_group(module, model_ids)
        return
    after_import(MAPPINGS, lambda m: add_laga_group(m, model_ids))


def add_laga_group(mappings, model_ids) -> None:
    """LAGA's group in ``MODEL_CP_CONFIG``: the models, the host's CP loss, LAGA's forwards;
    the models leave the host's groups (a model id maps to one group)."""
    table, templates = mappings.MODEL_CP_CONFIG, mappings.COMMON_CP_MAPPINGS
    if LOSS_TEMPLATE not in templates:
        raise UnsupportedHostError(f"mindspeed_laga: the FSDP2 CP table ({MAPPINGS}) has no "
                                   f"{LOSS_TEMPLATE!r} template; it is not 26.1.0's")
    group = table.setdefault(GROUP, {"models": set(), "cp_to_att_template": {LOSS_TEMPLATE},
                                     "model_specific": {}})
    for model_id in model_ids:
        for name, other in table.items():
            if name != GROUP:
                other["models"].discard(model_id)
                other.get("model_specific", {}).pop(model_id, None)
        group["models"].add(model_id)
        group["model_specific"][model_id] = [FORWARDS[model_id]]


def forward_of(model_id: str):
    """LAGA's forward for a model id (imported), e.g. to check it exists before training."""
    path, name = FORWARDS[model_id][1].rsplit(".", 1)
    return getattr(importlib.import_module(path), name)
