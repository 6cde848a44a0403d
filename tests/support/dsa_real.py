"""LAGA's sparse MLA against MindSpeed-LLM's *real* ``CustomMLASelfAttention`` with the
DSA indexer (DeepSeek-V3.2, GLM-5), on CPU, in float64.

Run by tests/mindspeed/test_dsa_real.py with the master sources (the environment of
tests/support/mindspeed_llm_real.py, whose helpers it uses), or directly the same way.
The module is built from the host's argument pipeline with ``--enable-dsa-indexer``
(its non-fused path: no fused indexer, no sparse flash attention) and cast to float64
but for the indexer's LayerNorm, which the host keeps in float32 (its forward casts the
input to float32). Two stand-ins for what CPU lacks: scipy's ``hadamard`` (Sylvester's
construction, what scipy documents) for the indexer's rotation, and, during the host's
own forward only, ``Tensor.scatter_`` taking the host's -1 picks as NPU does (the last
column; every such row masks that column causally anyway), where CPU torch raises.

What it checks (exit status 0 = all passed), per case at CP = 2 and 4 through the patched
forward and at CP = 1 through LAGA's path called directly, against the host's own forward
at CP = 1: the output, the hidden-states grad and every parameter grad (the indexer's
included; summed over CP ranks, with the host's indexer-loss scale set to 1/CP as
Megatron's average over CP makes it), the top-k picks (exactly, as sets: the host's
``torch.topk`` orders tied scores as it likes) and the indexer loss
(the mean of the ranks' losses, as the host's tracker averages them over CP).
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from support.mindspeed_llm_real import (BATCH, MODEL, SEED, SEQ, _assemble,  # noqa: E402
                                        _build, _rope_table, prepare)
from support.mindspeed_llm_standin import forward_backward  # noqa: E402

TOLERANCE = 1e-6  # float32 where the host forces it (indexer scores, its loss, complex rope)
DSA = ["--q-lora-rank", "24", "--qk-layernorm", "--enable-dsa-indexer", "--index-n-heads", "4",
       "--index-head-dim", "16", "--index-topk", "6", "--indexer-loss-coeff", "0.5",
       "--use-flash-attn", "--mla-fa-without-pad"]
CASES = {
    # the 128K tune's algorithm: zigzag; the indexer's Hadamard rotation, complex rope
    "dsa-kvallgather": ["--context-parallel-algo", "kvallgather_cp_algo"],
    # the 16K tune's algorithm: contiguous; mm-split, no rotation, Megatron's rope
    "dsa-ulysses-mmsplit": ["--context-parallel-algo", "ulysses_cp_algo", "--mla-mm-split",
                            "--no-use-sparse-c8-indexer", "--apply-rope-no-in-complex"],
}


def _install_hadamard():
    import scipy.linalg

    from support.npu_host import sylvester_hadamard
    scipy.linalg.hadamard = sylvester_hadamard


@contextlib.contextmanager
def _patched(name, replacement):
    """Tensor.<name> replaced by replacement(the original) inside the block."""
    original = getattr(torch.Tensor, name)
    setattr(torch.Tensor, name, replacement(original))
    try:
        yield
    finally:
        setattr(torch.Tensor, name, original)


def _npu_float_cast():
    """NPU's dtype cast hands back a contiguous tensor (npu_host.npu_float)."""
    from support.npu_host import npu_float
    return _patched("float", npu_float)


def _npu_scatter():
    """The host's -1 picks in ``scatter_`` as NPU takes them (npu_host.npu_scatter_)."""
    from support.npu_host import npu_scatter_
    return _patched("scatter_", npu_scatter_)


def _picks_of_laga(recorded):
    """Wrap the adapter's core call so the run's picks are kept."""
    from mindspeed_laga.patches.mindspeed_llm import dsa
    core = dsa.sparse_laga_attention

    def recording(*args, **kwargs):
        result = core(*args, **kwargs)
        recorded.append(result.topk_indices)
        return result

    dsa.sparse_laga_attention = recording
    return core


def _run(module, forward, inputs, cp_size, host_forward=False):
    """forward_backward plus the picks and the tracked indexer loss."""
    from mindspeed_llm.tasks.models.transformer import dsa_indexer
    from mindspeed_laga.patches.mindspeed_llm import dsa

    dsa_indexer.DSAIndexerLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0 / cp_size)
    dsa_indexer.DSAIndexerLossLoggingHelper.tracker.clear()
    picks = []
    if host_forward:
        hook = module.dsa_indexer.register_forward_hook(lambda m, i, out: picks.append(out[1]))
        with _npu_scatter():
            res = forward_backward(module, forward, *inputs)
        hook.remove()
    else:
        core = _picks_of_laga(picks)
        try:
            res = forward_backward(module, forward, *inputs)
        finally:
            dsa.sparse_laga_attention = core
    (topk,) = picks
    loss = dsa_indexer.DSAIndexerLossLoggingHelper.tracker["values"][0].item()
    partition = {n: None for n, _ in module.named_parameters()}
    return dict(res, topk=topk, loss=loss, partition=partition)


def worker(rank, world_size, cases, cp_sizes):
    """{CP size: {case: results}} at TP = 1 (CP 1 in a bigger world: data-parallel
    copies). At CP 1: the host's forward and LAGA's path; else the patched forward."""
    prepare()
    _install_hadamard()
    with _npu_float_cast():
        return {cp: _cases(cases, cp) for cp in cp_sizes}


def _cases(cases, cp_size):
    """Every case at CP = ``cp_size``."""
    from megatron.core import parallel_state

    from mindspeed_laga import layout as layouts
    from mindspeed_laga.features.laga_args import laga_settings
    from mindspeed_laga.patches.mindspeed_llm.forward import (laga_mla_forward_wrapper,
                                                              laga_self_attention)

    results = {}
    for name, extra in cases.items():
        args, module = _build(MODEL + DSA + extra, 1, cp_size, False)
        try:
            module.double()
            module.dsa_indexer.k_norm.float()  # the host's float32 LayerNorm
            cp_rank = parallel_state.get_context_parallel_rank()
            cp_group = parallel_state.get_context_parallel_group()
            layout = laga_settings(args).layout
            res = results[name] = dict(layout=layout, tp_rank=0, cp_rank=cp_rank, tp_size=1,
                                       sequence_parallel=False, ulysses_degree=1)
            generator = torch.Generator().manual_seed(SEED)
            hidden = torch.randn(SEQ, BATCH, 64, generator=generator, dtype=torch.float64)
            grad_out = torch.randn(SEQ, BATCH, 64, generator=generator, dtype=torch.float64)

            def local(t):
                return layouts.shard(t, layout, cp_size, cp_rank, dim=0)

            inputs = (local(hidden), local(_rope_table(SEQ, 8)), local(grad_out))
            if cp_size == 1:
                res["original"] = _run(module, lambda h, r: module(h, None, rotary_pos_emb=r),
                                       inputs, 1, host_forward=True)
                res["laga"] = _run(module, lambda h, r: laga_self_attention(
                    module, h, r, cp_group, args), inputs, 1)
            else:
                patched = laga_mla_forward_wrapper(type(module).forward)
                res["laga"] = _run(module, lambda h, r: patched(module, h, None, rotary_pos_emb=r),
                                   inputs, cp_size)
        finally:
            parallel_state.destroy_model_parallel()
    return results


def _compare(label, per_rank, name, ref):
    from mindspeed_laga import layout as layouts

    got = _assemble(per_rank, name, "laga")
    runs = [r[name]["laga"] for r in per_rank]
    layout = per_rank[0][name]["layout"]
    picks = layouts.unshard([r["topk"] for r in runs], layout, dim=1)
    # as sets: the host's torch.topk orders tied scores (an index head's relu of zero
    # leaves whole rows of them) as it likes, LAGA by position
    assert torch.equal(picks.sort(-1).values, ref["topk"].long().sort(-1).values), \
        f"{label}: top-k picks differ"
    loss = sum(r["loss"] for r in runs) / len(runs)
    assert ref["loss"] > 0 and abs(loss - ref["loss"]) <= TOLERANCE * ref["loss"], (label, loss)
    assert got["param_grads"].keys() == ref["param_grads"].keys(), label
    assert any(k.startswith("dsa_indexer.") for k in ref["param_grads"]), label
    errors = {"output": got["output"], "hidden_grad": got["hidden_grad"],
              **got["param_grads"]}
    want = {"output": ref["output"], "hidden_grad": ref["hidden_grad"], **ref["param_grads"]}
    worst = max(((g - want[k]).abs().max() / want[k].abs().max()).item()
                for k, g in errors.items())
    print(f"{label}: max relative error {worst:.2e}, loss {loss:.6f} vs {ref['loss']:.6f}")
    assert worst <= TOLERANCE, label


def check_dsa() -> None:
    from mindspeed_laga.tools.spawn import run_on_ranks
    two = run_on_ranks(worker, 2, CASES, (1, 2), timeout_s=900)
    single, two = [two[0][1]], [r[2] for r in two]
    four = [r[4] for r in run_on_ranks(worker, 4, CASES, (4,), timeout_s=900)]
    for name in CASES:
        ref = single[0][name]["original"]
        _compare(f"{name}: LAGA at CP=1 vs the host's forward", single, name, ref)
        _compare(f"{name}: LAGA at CP=2 vs the host's forward at CP=1", two, name, ref)
        _compare(f"{name}: LAGA at CP=4 vs the host's forward at CP=1", four, name, ref)


if __name__ == "__main__":
    prepare()
    check_dsa()
    print("real DSA CustomMLASelfAttention: ok")
