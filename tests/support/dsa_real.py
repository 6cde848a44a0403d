"""LAGA's sparse MLA against MindSpeed-LLM's *real* ``CustomMLASelfAttention`` with the
DSA indexer (DeepSeek-V3.2, GLM-5), on CPU, in float64.

Run by tests/mindspeed/test_dsa_real.py with the master sources (the environment of
tests/support/mindspeed_llm_real.py, whose helpers it uses), or directly the same way.
The module is built from the host's argument pipeline with ``--enable-dsa-indexer``
(its torch path, and its fused NPU ops on the stand-ins of tests/support/fake_dsa_ops.py,
taking float64 as the whole process allows them: ``FAKE_TORCH_NPU_WIDE_DTYPES``) and cast
to float64
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

The packed cases (``PACKED_CASES``: --reset-attention-mask, with the fused set the host
needs for packed DSA) run LAGA at CP 2 and 4 on one sequence of documents, against the
host's own forward run on each document alone at CP 1 (what a packed document must
compute), in the same jobs as the other cases.
"""
from __future__ import annotations

import contextlib
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from support.mindspeed_llm_real import (BATCH, MODEL, SEED, SEQ, _assemble,  # noqa: E402
                                        _rope_table, build_layers, prepare)
from support.mindspeed_llm_standin import forward_backward  # noqa: E402

# float32 where the host forces it (indexer scores, its loss, complex rope, the index key's
# LayerNorm, whose grads CP sums from the ranks' float32 parts)
TOLERANCE = 2e-6
# the indexer loss is a KL divergence near 0 (5e-4 here): the host's float32 softmax of its
# target rounds relative to the target, which moves the loss by up to ~3e-6 of itself
LOSS_TOLERANCE = 1e-5
# the fused indexer's grads come back in bfloat16 (the op's dtype: the host casts its
# inputs), and under CP each rank's op returns its queries' part of an index key's grad,
# rounded before the sum over ranks: those grads (the index key's projection and norm)
# agree to bf16's precision, 2^-8
BF16_KEY_GRADS = ("dsa_indexer.wk.", "dsa_indexer.k_norm.")
BF16_TOLERANCE = 1e-2
DSA = ["--q-lora-rank", "24", "--qk-layernorm", "--enable-dsa-indexer", "--index-n-heads", "4",
       "--index-head-dim", "16", "--index-topk", "6", "--indexer-loss-coeff", "0.5",
       "--use-flash-attn", "--mla-fa-without-pad"]
# the dims the fused ops take (fake_dsa_ops.py): latent 512, rope 64, index head 128,
# query and index heads powers of two from 8
FUSED_DIMS = ["--kv-lora-rank", "512", "--qk-pos-emb-head-dim", "64", "--index-head-dim", "128",
              "--num-attention-heads", "8", "--index-n-heads", "8"]
ABSORBED = ["--use-sparse-flash-attn", "--enable-mla-absorb", "--mla-mm-split"]
FUSED_INDEXER = ["--use-fused-lightning-indexer", "--use-fused-lightning-indexer-loss"]
CASES = {
    # the 128K tune's algorithm: zigzag; the indexer's Hadamard rotation, complex rope
    "dsa-kvallgather": ["--context-parallel-algo", "kvallgather_cp_algo"],
    # the 16K tune's algorithm: contiguous; mm-split, no rotation, Megatron's rope
    "dsa-ulysses-mmsplit": ["--context-parallel-algo", "ulysses_cp_algo", "--mla-mm-split",
                            "--no-use-sparse-c8-indexer", "--apply-rope-no-in-complex"],
    # the 128K tune's fused set: every op fused, the absorbed path, zigzag
    "dsa-fused-kvallgather": ["--context-parallel-algo", "kvallgather_cp_algo"] + FUSED_DIMS
    + ABSORBED + FUSED_INDEXER,
    # the 16K tune's: the fused indexer in the non-absorbed path (its loss stays torch)
    "dsa-fused-indexer-ulysses": ["--context-parallel-algo", "ulysses_cp_algo"] + FUSED_DIMS
    + FUSED_INDEXER,
    # GLM-5's: sparse flash attention in the absorbed path, the torch indexer and loss
    "dsa-sparse-flash-ulysses": ["--context-parallel-algo", "ulysses_cp_algo"] + FUSED_DIMS
    + ABSORBED,
    # GLM-5.2's: its fused set with shared picks (a chain of layers, CHAINS)
    "dsa-share-glm52": ["--context-parallel-algo", "kvallgather_cp_algo", "--num-layers", "4",
                        "--index-topk-freq", "4", "--index-skip-topk-offset", "3"]
    + FUSED_DIMS + ABSORBED + FUSED_INDEXER,
}
# the cases run as a chain of layers (each one's output the next one's hidden states), by
# global layer number: under GLM-5.2's freq 4, offset 3, layer L reuses the picks of
# L - (max(L - 3, 0) % 4): 2 computes alone, 3 computes and stores, 4 loads 3's (its MTP
# layer, global layer 1 at PP 1, computes its own, as 2 does)
CHAINS = {"dsa-share-glm52": (2, 3, 4)}
# run at CP 4 too (the contiguous split's chunking is CP 2's; zigzag's differs with CP)
CP4_CASES = ("dsa-kvallgather", "dsa-ulysses-mmsplit", "dsa-fused-kvallgather",
             "dsa-share-glm52")
# run at TP 2 with sequence parallelism too (the host's own CP 1 at TP 2 as reference)
TP_CASES = ("dsa-fused-kvallgather",)


def _install_hadamard():
    import scipy.linalg

    from support.npu_host import sylvester_hadamard
    scipy.linalg.hadamard = sylvester_hadamard


@contextlib.contextmanager
def _patched(owner, name, wrap):
    """``owner.name`` replaced by ``wrap(the original)`` inside the block."""
    original = getattr(owner, name)
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _npu_einsum(native):
    """NPU's einsum hands back a contiguous tensor; CPU's may be a permuted view, and the
    host's absorbed path then fails to ``view`` its output (W_UV's einsum)."""
    def einsum(*args, **kwargs):
        return native(*args, **kwargs).contiguous()

    return einsum


@contextlib.contextmanager
def _npu_host_forward():
    """What the host's own forward relies on NPU for (support/npu_host.py's stand-ins: int32
    and -1 picks in scatter_ and gather), and NPU's contiguous einsum."""
    from support.npu_host import npu_gather, npu_scatter_
    with _patched(torch.Tensor, "scatter_", npu_scatter_), \
            _patched(torch, "gather", npu_gather), _patched(torch, "einsum", _npu_einsum):
        yield


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


def _run(module, forward, inputs, cp_size, layers, host_forward=False):
    """forward_backward plus the picks (of each indexer call, or each core call) and the
    tracked indexer loss of each of ``layers`` (0: a layer that tracks none)."""
    from mindspeed_llm.tasks.models.transformer import dsa_indexer
    from mindspeed_laga.patches.mindspeed_llm import dsa

    dsa_indexer.DSAIndexerLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0 / cp_size)
    dsa_indexer.DSAIndexerLossLoggingHelper.tracker.clear()
    picks = []
    # a fresh rope tensor: it carries the host's holder of shared picks, which must not
    # leak from one run into the next
    inputs = (inputs[0], inputs[1].clone(), inputs[2])
    if host_forward:  # both host paths pick through forward_with_scores
        scores = dsa_indexer.DSAIndexer.forward_with_scores

        def recording(*args, **kwargs):
            indices, values = scores(*args, **kwargs)
            picks.append(indices)
            return indices, values

        dsa_indexer.DSAIndexer.forward_with_scores = staticmethod(recording)
        try:
            with _npu_host_forward():
                res = forward_backward(module, forward, *inputs)
        finally:
            dsa_indexer.DSAIndexer.forward_with_scores = staticmethod(scores)
    else:
        core = _picks_of_laga(picks)
        try:
            res = forward_backward(module, forward, *inputs)
        finally:
            dsa.sparse_laga_attention = core
    tracked = dsa_indexer.DSAIndexerLossLoggingHelper.tracker["values"]
    loss = tracked[[layer - 1 for layer in layers]].double()
    partition = {n: None for n, _ in module.named_parameters()}
    return dict(res, topk=picks, loss=loss, partition=partition)


def _through(layers, call, hidden, rope):
    """The layers one after the other: each one's output the next one's hidden states."""
    for layer in layers:
        hidden, bias = call(layer, hidden, rope)
        assert bias is None
    return hidden, None


def worker(rank, world_size, runs):
    """{(case, TP, CP): results} for ``runs`` [(case, TP, CP)] (TP x CP <= the world: the rest
    are data-parallel copies). At CP 1: the host's forward and LAGA's path; else the
    patched forward."""
    prepare()
    _install_hadamard()
    _install_fused_ops()
    from support.npu_host import npu_float
    with _patched(torch.Tensor, "float", npu_float):  # NPU's cast: a contiguous copy
        return {(name, tp, cp): _packed_case(name, cp) if name in PACKED_CASES
                else _case(name, CASES[name], tp, cp) for name, tp, cp in runs}


def _install_fused_ops():
    """The DSA op stand-ins on prepare()'s torch_npu stub, float64 allowed (the module is)."""
    import torch_npu

    from support import fake_dsa_ops
    for name, op in fake_dsa_ops.OPS.items():
        setattr(torch_npu, name, op)
    os.environ[fake_dsa_ops.WIDE_ENV] = "1"


def _mla_attention_on_custom():
    """``MlaDotProductAttention`` as a MindSpeed-LLM run builds it: its module executed while
    Megatron's ``DotProductAttention`` is MindSpeed-LLM's ``CustomDotProductAttention`` (the
    flash-attention feature's patch at CP 1), whose forward takes the absorbed path's
    ``topk_indices`` and runs the sparse flash attention op."""
    import importlib.util

    import megatron.core.transformer.dot_product_attention as dot_product_attention
    from mindspeed_llm.core.transformer.custom_dot_product_attention import (
        CustomDotProductAttention)

    spec = importlib.util.find_spec(
        "mindspeed_llm.tasks.models.transformer.mla_dot_product_attention")
    module = importlib.util.module_from_spec(spec)
    plain = dot_product_attention.DotProductAttention
    dot_product_attention.DotProductAttention = CustomDotProductAttention
    try:
        spec.loader.exec_module(module)
    finally:
        dot_product_attention.DotProductAttention = plain
    return module.MlaDotProductAttention


def _case(name, extra, tp_size, cp_size):
    """One case at TP x CP; this rank's tokens: the CP layout's shard, then its TP slice
    under sequence parallelism (on with TP > 1, as the DSA recipes run)."""
    from megatron.core import parallel_state

    from mindspeed_laga import layout as layouts
    from mindspeed_laga.features.laga_args import laga_settings
    from mindspeed_laga.patches.mindspeed_llm.forward import (laga_mla_forward_wrapper,
                                                              laga_self_attention)

    from mindspeed_llm.tasks.models.transformer import multi_latent_attention as mla

    sequence_parallel = tp_size > 1
    plain = mla.MlaDotProductAttention
    if "--enable-mla-absorb" in extra:  # the absorbed path attends through the patched class
        mla.MlaDotProductAttention = _mla_attention_on_custom()
    layer_numbers = CHAINS.get(name, (1,))
    try:
        args, modules = build_layers(MODEL + DSA + extra, tp_size, cp_size, sequence_parallel,
                                     layer_numbers)
    finally:
        mla.MlaDotProductAttention = plain
    module = modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
    # MindSpeed's attention_mask_on_cpu (its CP feature's flag): the flash-attention path's
    # causal mask built on the CPU, not on "npu"
    args.attention_mask_on_cpu = True
    try:
        module.double()
        for layer in modules:
            if hasattr(layer.dsa_indexer, "k_norm"):  # a Share layer has no indexer
                layer.dsa_indexer.k_norm.float()  # the host's float32 LayerNorm
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        cp_rank = parallel_state.get_context_parallel_rank()
        cp_group = parallel_state.get_context_parallel_group()
        layout = laga_settings(args).layout
        res = dict(layout=layout, tp_rank=tp_rank, cp_rank=cp_rank, tp_size=tp_size,
                   sequence_parallel=sequence_parallel, ulysses_degree=1,
                   # each layer's source of picks (itself: it computes them)
                   sources=[getattr(m, "_dsa_source_layer", None) or n
                            for m, n in zip(modules, layer_numbers)])
        # the host's sparse flash attention at CP 1 passes one actual length whatever the
        # batch (its recipes run micro-batch 1), which the op takes for batch 1 only
        batch = 1 if "--use-sparse-flash-attn" in extra else BATCH
        generator = torch.Generator().manual_seed(SEED)
        hidden = torch.randn(SEQ, batch, 64, generator=generator, dtype=torch.float64)
        grad_out = torch.randn(SEQ, batch, 64, generator=generator, dtype=torch.float64)

        def local(t, split_tp=True):
            t = layouts.shard(t, layout, cp_size, cp_rank, dim=0)
            return t.chunk(tp_size)[tp_rank] if sequence_parallel and split_tp else t

        rope = local(_rope_table(SEQ, args.qk_pos_emb_head_dim), split_tp=False)
        inputs = (local(hidden), rope, local(grad_out))
        def run(call, size, host_forward=False):
            return _run(module, lambda h, r: _through(modules, call, h, r), inputs, size,
                        layer_numbers, host_forward)

        if cp_size == 1:
            res["original"] = run(lambda m, h, r: m(h, None, rotary_pos_emb=r), 1, True)
            res["laga"] = run(lambda m, h, r: laga_self_attention(m, h, r, cp_group, args), 1)
        else:
            patched = laga_mla_forward_wrapper(type(modules[0]).forward)
            res["laga"] = run(lambda m, h, r: patched(m, h, None, rotary_pos_emb=r), cp_size)
        return res
    finally:
        parallel_state.destroy_model_parallel()


def _compare(label, per_rank, name, ref):
    """``per_rank``'s LAGA run against ``ref`` (the host at CP 1)."""
    # the non-absorbed path's fused indexer: its grads through the bf16 op (the absorbed
    # path's fused loss computes them itself, in the inputs' dtype)
    extra = CASES.get(name) or PACKED_CASES[name]
    bf16_key_grads = ("--use-fused-lightning-indexer" in extra
                      and "--enable-mla-absorb" not in extra)
    from mindspeed_laga import layout as layouts

    got = _assemble(per_rank, name, "laga")
    first = [r[name] for r in per_rank if r[name]["tp_rank"] == 0]
    runs = [r["laga"] for r in sorted(first, key=lambda r: r["cp_rank"])]
    assert len(runs[0]["topk"]) == len(ref["topk"]), label  # one core call per layer
    for layer, want in enumerate(ref["topk"]):
        picks = layouts.unshard([r["topk"][layer] for r in runs], first[0]["layout"], dim=1)
        # as sets: the host's torch.topk orders tied scores (an index head's relu of zero
        # leaves whole rows of them) as it likes, LAGA by position
        assert torch.equal(picks.sort(-1).values, want.long().sort(-1).values), \
            f"{label}: top-k picks of layer {layer} differ"
    loss = sum(r[name]["laga"]["loss"] for r in per_rank) / len(per_rank)
    computing = ref["loss"] != 0  # a Share layer tracks no indexer loss, on either side
    assert computing.any() and (ref["loss"][computing] > 0).all(), (label, ref["loss"])
    assert torch.equal(loss[~computing], ref["loss"][~computing]), (label, loss, ref["loss"])
    assert ((loss - ref["loss"]).abs() <= LOSS_TOLERANCE * ref["loss"]).all(), \
        (label, loss, ref["loss"])
    assert got["param_grads"].keys() == ref["param_grads"].keys(), label
    assert any("dsa_indexer." in k for k in ref["param_grads"]), label
    errors = {"output": got["output"], "hidden_grad": got["hidden_grad"],
              **got["param_grads"]}
    want = {"output": ref["output"], "hidden_grad": ref["hidden_grad"], **ref["param_grads"]}
    relative = {k: ((g - want[k]).abs().max() / want[k].abs().max()).item()
                for k, g in errors.items()}
    bf16 = {k for k in relative if k.startswith(BF16_KEY_GRADS)} if bf16_key_grads else set()
    worst = max(v for k, v in relative.items() if k not in bf16)
    shown = ", ".join(f"{g:.6f} vs {w:.6f}" for g, w in zip(loss.tolist(), ref["loss"].tolist()))
    print(f"{label}: max relative error {worst:.2e}, loss {shown}"
          + (f"; bf16 key grads {max(relative[k] for k in bf16):.2e}" if bf16 else ""))
    assert worst <= TOLERANCE, (label, sorted(relative.items(), key=lambda kv: -kv[1])[:4])
    assert all(relative[k] <= BF16_TOLERANCE for k in bf16), (label, relative)


def _reference(per_rank, name):
    """The host's forward at CP 1, assembled over its TP ranks, its picks and loss."""
    ref = _assemble(per_rank, name, "original")
    case = per_rank[0][name]
    # the host's indexer runs in its Compute layers only: each layer's picks are its
    # source's (the indexer calls come in layer order)
    computed = dict(zip(sorted(set(case["sources"])), case["original"]["topk"]))
    ref["topk"] = [computed[source] for source in case["sources"]]
    ref["loss"] = sum(r[name]["original"]["loss"] for r in per_rank) / len(per_rank)
    return ref


def _job(world_size, runs):
    """{(case, TP, CP): [each rank's results, the first TP x CP ranks]}."""
    from mindspeed_laga.tools.spawn import run_on_ranks
    results = run_on_ranks(worker, world_size, runs, timeout_s=900)
    return {key: [{key[0]: r[key]} for r in results[:key[1] * key[2]]] for key in runs}


def check_dsa(names=None) -> None:
    """Every case (or those of ``names``) at CP 1 and 2 (and 4: ``CP4_CASES`` and the
    packed cases), and the TP cases at TP 2; the packed cases share the jobs."""
    names = list(names or [*CASES, *PACKED_CASES])
    tp_names = [n for n in TP_CASES if n in names]
    two = _job(2, [(n, 1, cp) for n in names for cp in (1, 2)] + [(n, 2, 1) for n in tp_names])
    four_names = [n for n in (*CP4_CASES, *PACKED_CASES) if n in names]
    four = _job(4, [(n, 1, 4) for n in four_names] + [(n, 2, 2) for n in tp_names])
    for name in names:
        ref = _reference(two[(name, 1, 1)], name)
        if name not in PACKED_CASES:  # (packed: LAGA runs at CP > 1 only)
            _compare(f"{name}: LAGA at CP=1 vs the host's forward", two[(name, 1, 1)], name, ref)
        _compare(f"{name}: LAGA at CP=2 vs the host's forward at CP=1", two[(name, 1, 2)], name,
                 ref)
        if name in four_names:
            _compare(f"{name}: LAGA at CP=4 vs the host's forward at CP=1", four[(name, 1, 4)],
                     name, ref)
    for name in tp_names:
        ref = _reference(two[(name, 2, 1)], name)
        _compare(f"{name}: LAGA at TP=2 (SP) CP=2 vs the host's forward at TP=2 CP=1",
                 four[(name, 2, 2)], name, ref)


# --- packed documents (--reset-attention-mask) -------------------------------------------

# the host's DSA runs packed documents with its fused set only (its own refusal); the
# ends cut CP 2's and CP 4's contiguous slices (8s, 4s), a document of 5 < 6 picks
PACKED_ENDS = [5, 11, 16]
PACKED_FLAGS = FUSED_DIMS + ABSORBED + FUSED_INDEXER
PACKED_CASES = {
    # the 128K tune's algorithm; under --reset-attention-mask ulysses_cp_algo splits the
    # batch the same contiguous way and LAGA runs the same call for it
    "dsa-packed-kvallgather": ["--context-parallel-algo", "kvallgather_cp_algo"] + PACKED_FLAGS,
}
DOCUMENTS = ["--reset-attention-mask", "--micro-batch-size", "1"]


def _packed_inputs():
    """(hidden, grad_out, rope at each token's position inside its document), one sequence."""
    generator = torch.Generator().manual_seed(SEED)
    hidden = torch.randn(SEQ, 1, 64, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(SEQ, 1, 64, generator=generator, dtype=torch.float64)
    starts = [0] + PACKED_ENDS[:-1]
    positions = torch.cat([torch.arange(end - start) for start, end in zip(starts, PACKED_ENDS)])
    return hidden, grad_out, positions


def _packed_case(name, cp_size):
    """At CP 1 the host's own forward on each document alone (the reference: what packed
    documents mean, each its own sequence; its indexer loss weighted by the document's
    share of the rows, as the packed mean weights it); at CP > 1 the patched forward with
    the documents as MindSpeed feeds them (``set_actual_seq_len``, ``packed_seq_params``)."""
    from megatron.core import parallel_state
    from mindspeed.core.context_parallel.get_batch_utils import set_actual_seq_len

    from mindspeed_laga import layout as layouts
    from mindspeed_laga.features.laga_args import laga_settings
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper
    from mindspeed_llm.tasks.models.transformer import multi_latent_attention as mla

    extra = PACKED_CASES[name] + (DOCUMENTS if cp_size > 1 else [])
    plain = mla.MlaDotProductAttention
    mla.MlaDotProductAttention = _mla_attention_on_custom()
    try:
        args, (module,) = build_layers(MODEL + DSA + extra, 1, cp_size, False, (1,))
    finally:
        mla.MlaDotProductAttention = plain
    args.attention_mask_on_cpu = True
    try:
        module.double()
        module.dsa_indexer.k_norm.float()
        hidden, grad_out, positions = _packed_inputs()
        rope = _rope_table(SEQ, args.qk_pos_emb_head_dim)[positions]
        layout = laga_settings(args).layout if cp_size > 1 else "contiguous"
        cp_rank = parallel_state.get_context_parallel_rank()
        res = dict(layout=layout, tp_rank=0, cp_rank=cp_rank, tp_size=1,
                   sequence_parallel=False, ulysses_degree=1, sources=[1])  # one layer
        if cp_size == 1:
            res["original"] = _per_document(module, hidden, rope, grad_out)
            return res
        set_actual_seq_len(torch.tensor(PACKED_ENDS))
        ends = torch.tensor(PACKED_ENDS)
        packed = SimpleNamespace(qkv_format="thd", cu_seqlens_q=ends, cu_seqlens_kv=ends)
        patched = laga_mla_forward_wrapper(type(module).forward)

        def local(t):
            return layouts.shard(t, layout, cp_size, cp_rank, dim=0)

        try:  # the whole sequence's rope, as every rank's layer gets it under
            # --reset-attention-mask in MindSpeed-LLM's loop (all 64 rows at CP 2 there)
            res["laga"] = _run(module, lambda h, r: patched(module, h, None, rotary_pos_emb=r,
                                                            packed_seq_params=packed),
                               (local(hidden), rope, local(grad_out)), cp_size, (1,))
        finally:
            set_actual_seq_len(None)
        return res
    finally:
        parallel_state.destroy_model_parallel()


def _per_document(module, hidden, rope, grad_out):
    """The host's forward on each document alone, put together as one packed run: outputs
    and hidden grads concatenated, parameter grads summed, picks shifted to the packed
    positions, the loss the row-weighted mean."""
    runs, picks, loss = [], [], 0.0
    for start, end in zip([0] + PACKED_ENDS[:-1], PACKED_ENDS):
        rows = slice(start, end)
        share = (end - start) / SEQ
        run = _run(module, lambda h, r: module(h, None, rotary_pos_emb=r),
                   (hidden[rows], rope[rows], grad_out[rows]), 1 / share, (1,),
                   host_forward=True)
        runs.append(run)
        (topk,) = run["topk"]  # the one layer's picks
        topk = topk.long()
        picks.append(torch.where(topk >= 0, topk + start, topk))
        loss += share * run["loss"]
    grads = {k: sum(r["param_grads"][k] for r in runs) for k in runs[0]["param_grads"]}
    return dict(output=torch.cat([r["output"] for r in runs]),
                hidden_grad=torch.cat([r["hidden_grad"] for r in runs]), param_grads=grads,
                topk=[torch.cat(picks, dim=1)], loss=loss,
                partition={n: None for n in runs[0]["partition"]})


if __name__ == "__main__":  # python tests/support/dsa_real.py [CASE ...]
    prepare()
    check_dsa(sys.argv[1:])
    print("real DSA CustomMLASelfAttention: ok")
