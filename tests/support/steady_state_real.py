"""Steady-state counts of MindSpeed-LLM's real ``CustomMLASelfAttention`` under LAGA.

The module is built as tests/support/mindspeed_llm_real.py builds it (real sources, real
argument pipeline), ``LAYERS`` times (layer numbers 1..LAYERS, as a model holds them), and
the layers are called in a chain through LAGA's patched forward, then backward, as one
micro-batch of a training step; ``MICRO_BATCHES`` of them in a row at CP = 2.

Per layer call it records, with the counters of tests/support/collectives.py and
host_syncs.py, the collectives and host reads LAGA causes (tests/support/laga_regions.py:
inside the patched forward, and inside LAGA's autograd backward functions); the host's own
code (its projections' backward, the test's loss) is not counted. Optional ``mutant``: one
``.item()`` per layer call in the adapter (``laga_self_attention``), which a steady-state
check must catch.
"""
from __future__ import annotations

import contextlib

import torch

from support import mindspeed_llm_real as real

LAYERS, MICRO_BATCHES = 3, 3
# name -> (argv beyond mindspeed_llm_real.MODEL, the SFT padding side or None, LoRA)
CASES = {
    "plain-kvallgather": (["--q-lora-rank", "24", "--qk-layernorm", "--context-parallel-algo",
                           "kvallgather_cp_algo"], None, False),
    "plain-megatron": (["--context-parallel-algo", "megatron_cp_algo"], None, False),
    "plain-ulysses": (["--context-parallel-algo", "ulysses_cp_algo"], None, False),
    "sft-right-megatron": (["--context-parallel-algo", "megatron_cp_algo"], "right", False),
    "sft-left-kvallgather": (["--q-lora-rank", "24", "--context-parallel-algo",
                              "kvallgather_cp_algo"], "left", False),
}
# LoRA on the K/V up-projection (peft: CI's Ascend leg only)
LORA_CASES = {
    "lora-kv-up-kvallgather": (["--q-lora-rank", "24", "--lora-r", "4", "--lora-alpha", "8",
                                "--lora-target-modules", "linear_qkv", "linear_kv_up_proj",
                                "linear_proj", "--context-parallel-algo", "kvallgather_cp_algo"],
                               None, True),
}


def _layers(argv):
    """(args, the LAYERS modules): the first from mindspeed_llm_real's build (which sets up
    the parallel state), the others alike with their own layer number."""
    from megatron.training.arguments import core_transformer_config_from_args
    from mindspeed_llm.tasks.models.transformer import multi_latent_attention as mla

    args, first = real._build(argv, 1, 2, False)
    config = core_transformer_config_from_args(args)
    config.context_parallel_size = 1
    layers = [first]
    for number in range(2, LAYERS + 1):
        torch.manual_seed(real.SEED + number)
        layers.append(type(first)(config, real._submodules(mla, args), layer_number=number,
                                  attn_mask_type=first.attn_mask_type))
    return args, torch.nn.ModuleList(layers)


def _mask(args, side):
    if side is None:
        return None
    return real.sft_mask(args, f"sft-{side}-case")


def _with_mutant(forward_module):
    """The adapter with one ``.item()`` per layer call (a per-layer sync a check must catch)."""
    original = forward_module.laga_attention

    def laga_attention(query, *args, **kwargs):
        query.detach().abs().max().item()
        return original(query, *args, **kwargs)

    forward_module.laga_attention = laga_attention
    return original


def _micro_batch(layers, patched, hidden, rope, mask, grad_out, syncs):
    """One forward through every layer, then backward; counted per layer forward."""
    from support.laga_regions import forward_region
    h = hidden.detach().clone().requires_grad_()
    for index, layer in enumerate(layers):
        call = forward_region(syncs, patched, f"laga.forward.{index}")
        h, bias = call(layer, h, mask, rotary_pos_emb=rope)
        assert bias is None
    (h * grad_out).sum().backward()


def worker(rank, world_size, cases, mutant=False):
    real.prepare()
    from megatron.core import parallel_state

    from mindspeed_laga import layout as layouts
    from mindspeed_laga.features.laga_args import laga_settings
    from mindspeed_laga.patches.mindspeed_llm import forward as forward_module
    from support.collectives import count_collectives
    from support.host_syncs import count_host_syncs
    from support.laga_regions import backward_regions

    results = {}
    for name, (extra, side, lora) in cases.items():
        args, layers = _layers(real.MODEL + extra)
        original = _with_mutant(forward_module) if mutant else None
        try:
            with _adapters(args, layers, lora):
                cp_rank = parallel_state.get_context_parallel_rank()
                layout = laga_settings(args).layout
                generator = torch.Generator().manual_seed(real.SEED)
                hidden = torch.randn(real.SEQ, real.BATCH, 64, generator=generator)
                grad_out = torch.randn(real.SEQ, real.BATCH, 64, generator=generator)

                def local(t):
                    return layouts.shard(t, layout, 2, cp_rank, dim=0)

                rope = local(real._rope_table(real.SEQ, 8))
                mask = _mask(args, side)
                patched = forward_module.laga_mla_forward_wrapper(type(layers[0]).forward)
                runs = results[name] = []
                for _ in range(MICRO_BATCHES):
                    with count_host_syncs(everywhere=False) as syncs, \
                            count_collectives(regions=syncs) as calls, backward_regions(syncs):
                        _micro_batch(layers, patched, local(hidden), rope, mask, local(grad_out),
                                     syncs)
                    runs.append(_counts(syncs, calls))
        finally:
            if original is not None:
                forward_module.laga_attention = original
            parallel_state.destroy_model_parallel()
    return results


@contextlib.contextmanager
def _adapters(args, layers, lora: bool):
    """LoRA adapters on the layers as MindSpeed-LLM adds them (tests/support/lora_real.py)."""
    if not lora:
        yield
        return
    from support import lora_real
    with lora_real.lora_wrapped(args, layers, "mindspeed"):
        lora_real.set_adapter_weights(layers, 1, 0)
        yield


def _counts(syncs, calls):
    """Per region (each layer's forward, LAGA's backward, outside LAGA): the collectives as
    (kind, dtype) and the host reads by op."""
    regions = sorted({c.region for c in calls.calls if c.region is not None}
                     | set(r for r in syncs.by_region() if r is not None))
    out = {region: dict(collectives=[(c.kind, str(c.dtype).replace("torch.", ""))
                                     for c in calls.select(region)],
                        syncs=syncs.by_op(region)) for region in regions}
    out["outside"] = dict(collectives=[c.kind for c in calls.select(None)], syncs={})
    return out


def run(cases, mutant=False):
    """Per-rank results of ``worker`` on 2 gloo ranks."""
    from mindspeed_laga.tools.spawn import run_on_ranks
    return run_on_ranks(worker, 2, cases, mutant, timeout_s=600)


def expected_data(cp_algo: str):
    """A layer call's data collectives by phase: allgather-type algorithms gather the
    latent and reduce-scatter its grad; ulysses adds its all-to-alls of Q and O."""
    forward, backward = ["all_gather"], ["reduce_scatter"]
    if cp_algo == "ulysses_cp_algo":
        forward, backward = forward + ["all_to_all"] * 2, backward + ["all_to_all"] * 2
    return sorted(forward), sorted(backward)
