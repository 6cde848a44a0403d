"""The FSDP2 backend LAGA was written for, the models it covers there, and its CP group.

MindSpeed-LLM's FSDP2 backend (``train_fsdp2.py``, ``mindspeed_llm/fsdp2/``) builds on
MindSpeed's ``mindspeed/fsdp`` in 26.1.0; master's imports an external ``fsdp_turbo``
package instead and older releases have no CP mapping table. The release is told by
``patches/mindspeed_llm/releases.py`` (read from source, nothing imported) and the backend
by the files it holds. Every check here runs in the launcher, on every rank, before the
process group exists, and names the key and the fix.
"""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Optional

from ..common import UnsupportedHostError

KEY = "parallel.mla_latent_all_gather"  # the YAML key (and its --parallel.… override)
FSDP2_RELEASES = ("26.1.0",)
# files of mindspeed_llm/ that make up the backend's CP: the mapping table, its manager,
# and the parallel state that holds the CP group
BACKEND_FILES = (
    os.path.join("fsdp2", "distributed", "context_parallel", "context_parallel_mappings.py"),
    os.path.join("fsdp2", "distributed", "context_parallel", "context_parallel_manager.py"),
    os.path.join("fsdp2", "distributed", "parallel_state.py"),
)
ENGINE = os.path.join("fsdp2", "distributed", "mindspeed_parallel_engine.py")
# model_type (config.json) -> the LAGA form that covers it on this backend
MODELS = {"deepseek_v3": "dense", "glm_moe_dsa": "sparse"}
# model_type -> the model.model_id whose model class LAGA's forward is written for (GLM-5.2:
# MindSpeed-LLM's own glm52 model, whose indexer scores with the ReLU the sparse form applies)
MODEL_IDS = {"glm_moe_dsa": "glm52"}
# parallel.cp_type -> (LAGA's CP algorithm, the layout of the host's split): ulysses slices the
# sequence contiguously and splits heads, ring gives rank r chunks r and 2P-1-r
CP_TYPES = {"ulysses": ("ulysses", "contiguous"), "ring": ("allgather", "zigzag")}
LAGA_ALGOS = tuple(sorted({algo for algo, _ in CP_TYPES.values()}))


def _refuse(what: str, fix: str, error=ValueError):
    raise error(f"{KEY}: {what}; {fix}")


def check_release() -> str:
    """The installed MindSpeed-LLM is a tested release with the FSDP2 backend on MindSpeed's
    ``mindspeed/fsdp``; returns its name."""
    from ..mindspeed_llm.releases import UnknownHostRelease, installed_release

    spec = importlib.util.find_spec("mindspeed_llm")
    if spec is None or not spec.submodule_search_locations:
        _refuse("MindSpeed-LLM is not importable", "put MindSpeed-LLM 26.1.0 on PYTHONPATH",
                UnsupportedHostError)
    root = list(spec.submodule_search_locations)[0]
    missing = [f for f in BACKEND_FILES if not os.path.isfile(os.path.join(root, f))]
    if missing:
        _refuse(f"this MindSpeed-LLM ({root}) has no FSDP2 context parallelism "
                f"(missing mindspeed_llm/{missing[0]})",
                f"use MindSpeed-LLM {' or '.join(FSDP2_RELEASES)}, or drop the key",
                UnsupportedHostError)
    with open(os.path.join(root, ENGINE), encoding="utf-8") as f:
        if "fsdp_turbo" in f.read():
            _refuse("this MindSpeed-LLM's FSDP2 backend builds on fsdp_turbo (master), which "
                    "LAGA is not written for",
                    f"use MindSpeed-LLM {' or '.join(FSDP2_RELEASES)}, or drop the key",
                UnsupportedHostError)
    try:
        release = installed_release()
    except UnknownHostRelease as exc:
        _refuse(str(exc), f"use MindSpeed-LLM {' or '.join(FSDP2_RELEASES)}, or drop the key",
                UnsupportedHostError)
    if release.name not in FSDP2_RELEASES:
        _refuse(f"MindSpeed-LLM {release.name}'s FSDP2 backend is not covered",
                f"use MindSpeed-LLM {' or '.join(FSDP2_RELEASES)}, or drop the key",
                UnsupportedHostError)
    return release.name


def model_config(model_path: str) -> dict:
    """The model folder's config.json (the launcher reads it before the host does)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        _refuse(f"model.model_name_or_path {model_path!r} has no config.json",
                "point model.model_name_or_path at a local HF model folder")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check_model(config: dict) -> str:
    """The model has MLA and LAGA covers its attention here; returns the form."""
    model_type = config.get("model_type")
    if model_type not in MODELS:
        has_mla = config.get("kv_lora_rank") is not None
        _refuse(f"model_type {model_type!r} " + ("is an MLA model LAGA does not cover on this "
                                                 "backend" if has_mla else "has no MLA "
                                                 "(kv_lora_rank)"),
                f"LAGA covers {', '.join(f'{m} ({f} form)' for m, f in MODELS.items())}; "
                "drop the key")
    if not config.get("kv_lora_rank"):
        _refuse(f"model_type {model_type!r} without kv_lora_rank has no latent to gather",
                "drop the key")
    if float(config.get("attention_dropout") or 0.0) > 0.0:
        _refuse(f"attention_dropout={config['attention_dropout']} in the model config: LAGA "
                "does not compute attention dropout", "set attention_dropout to 0 or drop the key")
    return MODELS[model_type]


def check_model_id(model_type: str, model_id) -> None:
    """A model LAGA covers through one model class of the backend names it by model_id."""
    want = MODEL_IDS.get(model_type)
    if want is not None and model_id != want:
        _refuse(f"model_type {model_type!r} is covered as MindSpeed-LLM's own {want} model, "
                f"not with model.model_id {model_id!r}", f"set model.model_id: {want}")


def cp_algo(cp_type: str):
    """(LAGA's CP algorithm, the batch layout) for the backend's ``parallel.cp_type``."""
    if cp_type not in CP_TYPES:
        _refuse(f"parallel.cp_type {cp_type!r} is not one LAGA maps",
                f"set parallel.cp_type to {' or '.join(CP_TYPES)}")
    return CP_TYPES[cp_type]


def cp_group():
    """The backend's CP process group: ``ParallelState().get_group("cp")``, where its own CP
    attention and loss take it (None when the CP size is 1)."""
    from mindspeed_llm.fsdp2.distributed.parallel_state import ParallelState

    state = ParallelState()
    return state.get_group("cp") if state.get_group_size("cp") > 1 else None


def cp_type() -> Optional[str]:
    """The run's ``parallel.cp_type`` as the backend reads it (its global arguments)."""
    from mindspeed_llm.fsdp2.utils.global_vars import get_args

    return getattr(get_args(), "cp_type", None)
