"""Around LAGA's GLM-5.2 forward for MindSpeed-LLM's FSDP2 backend (tests/support/fsdp2_glm.py
holds the comparison): what it refuses, and the host's own CP path, counted for comparison.

- :func:`refusals`: each call LAGA's forward refuses, on every rank, and the collectives
  they issued (none);
- :func:`host_cp`: the host's ``dsa_forward`` (its CP table's forward for transformers'
  ``GlmMoeDsaAttention``) at CP 2, its collectives per token and its tensors with two dims
  of the sequence's length;
- :func:`hosts_mapping`: what the host's CP table replaces for a ``glm_moe_dsa`` model.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from support.fsdp2_glm import (BATCH, CONFIG, HOST, SEED, SEQ, _parallel_state,  # noqa: E402
                               build_layers, inputs, prepare, rank_rows, set_host_args,
                               watch_shapes)


def refusal_worker(rank, size, roots):
    """{case: the error each call raised} and the collectives all of them issued: what LAGA's
    forward refuses, on every rank, before any collective."""
    prepare(roots)
    importlib.import_module(HOST)
    set_host_args("ulysses", False)
    _parallel_state(size)
    from transformers.models.glm_moe_dsa import configuration_glm_moe_dsa as hf_config
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_model

    from mindspeed_laga.patches.fsdp2.glm_dsa import laga_glm_dsa_forward
    from support.collectives import count_collectives
    config, layers, rope = build_layers()
    hidden, (cos, sin), _ = inputs(config, rope)
    rows = rank_rows("ulysses", size, rank)
    local = (hidden[:, rows], (cos[:, rows], sin[:, rows]), None)
    hf_kwargs = {k: v for k, v in CONFIG.items() if k != "index_topk_pattern"}
    transformers_layer = hf_model.GlmMoeDsaAttention(hf_config.GlmMoeDsaConfig(**hf_kwargs), 0)
    split_layer = _tp_split(build_layers()[1][0], size)
    calls = {
        "a split kv_b_proj": lambda: laga_glm_dsa_forward(split_layer, *local),
        "transformers' class": lambda: laga_glm_dsa_forward(transformers_layer.double(), *local),
        "a KV cache": lambda: laga_glm_dsa_forward(layers[0], *local, past_key_values=object()),
        "a shared layer without picks": lambda: laga_glm_dsa_forward(layers[1], *local),
        "an unknown cp_type": lambda: (set_host_args("ring_attn", False),
                                       laga_glm_dsa_forward(layers[0], *local)),
    }
    errors = {}
    with count_collectives() as counted:
        for name, call in calls.items():
            try:
                call()
                errors[name] = None
            except ValueError as error:
                errors[name] = str(error)
    return errors, counted.kinds()


def _tp_split(layer, size):
    """The layer with its kv_b_proj weight a DTensor split over the ranks (what tensor
    parallelism would hand the forward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (size,))
    weight = distribute_tensor(layer.kv_b_proj.weight.detach(), mesh, [Shard(0)])
    layer.kv_b_proj.weight = torch.nn.Parameter(weight)
    return layer


def refusals(roots, size=2, timeout_s=300.0):
    from mindspeed_laga.tools.spawn import run_on_ranks
    return run_on_ranks(refusal_worker, size, roots, timeout_s=timeout_s)


def host_cp_worker(rank, size, roots):
    """The host's own CP path for GLM-5 (its mapping's ``dsa_forward`` on transformers'
    ``GlmMoeDsaAttention``) on this rank's tokens, counted: {kind: [values per token of each
    call]} forward, and the ops that made a tensor with two dims of the sequence's length."""
    prepare(roots)
    set_host_args("ulysses", False)
    _parallel_state(size)
    from mindspeed_llm.fsdp2.distributed.context_parallel.ulysses_context_parallel import (
        dsa_attention)
    from transformers.models.glm_moe_dsa import configuration_glm_moe_dsa as hf_config
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_model

    from support.collectives import count_collectives
    hf_kwargs = {k: v for k, v in CONFIG.items() if k != "index_topk_pattern"}
    config = hf_config.GlmMoeDsaConfig(**hf_kwargs)
    torch.manual_seed(SEED)
    layer = hf_model.GlmMoeDsaAttention(config, 0)  # float32: the fused attention's widest
    rope = hf_model.GlmMoeDsaRotaryEmbedding(config)
    hidden, _, _ = inputs(config, rope)
    hidden = hidden.float()
    cos, sin = rope(hidden, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1))
    rows = rank_rows("ulysses", size, rank)
    tokens = rows.numel() * BATCH
    torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron's gather allocates there
    with count_collectives() as counted, watch_shapes() as shapes:
        dsa_attention.dsa_forward(layer, hidden[:, rows], (cos[:, rows], sin[:, rows]), None,
                                  None, None)
    per_token = {}
    for call in counted.select():
        itemsize = torch.tensor([], dtype=call.dtype).element_size() if call.dtype else 1
        per_token.setdefault(call.kind, []).append(call.payload / itemsize / tokens)
    return per_token, shapes.square(BATCH, SEQ)


def host_cp(roots, size=2, timeout_s=300.0):
    from mindspeed_laga.tools.spawn import run_on_ranks
    return run_on_ranks(host_cp_worker, size, roots, timeout_s=timeout_s)


def mapped_worker(rank, size, roots):
    """(glm52's forward replaced?, transformers' forward replaced?) after the host's own CP
    table is applied to a ``glm_moe_dsa`` model, as ``cp_size`` > 1 applies it."""
    prepare(roots)
    host = importlib.import_module(HOST)
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_model

    from mindspeed_llm.fsdp2.distributed.context_parallel import context_parallel_manager as cpm
    before = host.GlmMoeDsaAttention.forward, hf_model.GlmMoeDsaAttention.forward
    model = SimpleNamespace(config=SimpleNamespace(model_type="glm_moe_dsa"))
    manager = cpm.ContextParallelMappingManager()
    manager.apply_transformers_modules(model, cpm.CPTypeConfig("ulysses"))
    return (host.GlmMoeDsaAttention.forward is not before[0],
            hf_model.GlmMoeDsaAttention.forward is not before[1])


def hosts_mapping(roots, timeout_s=300.0):
    from mindspeed_laga.tools.spawn import run_on_ranks
    return run_on_ranks(mapped_worker, 1, roots, timeout_s=timeout_s)[0]
