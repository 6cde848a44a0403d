"""LAGA against MindSpeed-LLM's *real* ``CustomMLASelfAttention`` and argument pipeline, on CPU.

Run by tests/mindspeed/test_mindspeed_llm_patch.py with the sources of the ``host_sources``
fixture (tests/support/thirdparty.py), or directly:

    MINDSPEED_LLM_SRC=/src/MindSpeed-LLM MINDSPEED_SRC=/src/MindSpeed \\
    MEGATRON_SRC=/src/Megatron-LM  # checked out at tag core_v0.12.1
    python tests/support/mindspeed_llm_real.py

(six, regex, pyyaml, tqdm and einops must be importable, e.g. via PYTHONPATH.)
The sources go first on sys.path, so Megatron core_v0.12.1 shadows an installed
megatron-core. Following docs/HOSTS.md, section 'MindSpeed-LLM on CPU': ``TRAINING_BACKEND=none`` (no
MindSpeed patches, no ``transfer_to_npu``), stub modules for what is missing
(torch_npu, transformer_engine, scipy, torchair, acl, apex; any attribute is a
class that also passes decorated functions through), ``torch.cuda.current_device``
-> CPU, a no-op RNG-tracker fork, a CPU default causal mask, and Megatron's
device-arch probe answered without CUDA.

What it checks (exit status 0 = all passed):

1. The real argument pipeline: ``mindspeed_laga.launch.install_laga_feature``
   puts ``LAGAFeature`` last in MindSpeed-LLM's real features list; Megatron's
   strict ``parse_args`` with MindSpeed-LLM's ``process_args_v2`` accepts
   ``--mla-latent-all-gather``; MindSpeed-LLM's validation runs LAGA's checks
   (``--enable-mla-absorb`` -> LAGA's ValueError). ``LAGAFeature`` subclasses
   MindSpeed's ``MindSpeedFeature`` and is applied by its ``is_need_apply``;
   MindSpeed's real patch manager installs the wrapper on
   ``CustomMLASelfAttention.forward``.
2. Numerics, per case, with the arguments produced by that pipeline and the
   module built from ``get_mla_self_attn_submodules`` (transformer_impl local),
   against the real forward (real ``MlaDotProductAttention`` core, hence its
   softmax scale incl. yarn mscale): output, hidden-states grad and every
   parameter grad (TP shards concatenated, replicated grads summed over SP
   ranks, all summed over CP ranks as Megatron's reduction does). Runs: the LAGA
   path at TP = CP = 1; the patched forward at CP = 2 for all three mapped
   algorithms (config.context_parallel_size = 1, as MindSpeed sets it while building its CP attention, so the patch must not read it); TP = 2
   with sequence parallelism and CP = 2; TP = 2 without it at CP = 1 and 2
   (reference: the real forward at TP = 2, see ``check_numerics``).
3. Packed documents (``--reset-attention-mask --reset-position-ids``, micro-batch 1,
   random document ends, one document crossing the rank boundary) at CP = 2 for all
   three algorithms, fed as MindSpeed feeds the attention (``set_actual_seq_len`` as
   MindSpeed-LLM's loader leaves it, ``packed_seq_params`` with this rank's position
   ids, MindSpeed-LLM's THD rope), against the real forward at CP = 1 with Megatron's
   explicit document mask (the local core attention's CPU path: MindSpeed's own
   document attention is NPU-only) and rope at the reset positions.
4. ``hybrid_cp_algo`` at CP = 4 with ``--ulysses-degree-in-cp 2`` (MindSpeed's own
   hybrid groups; the layout checked against its ``get_batch_on_this_cp_rank``)
   against the real forward at CP = 1. The documents' tokens per rank come from that
   function too, so LAGA's layout mapping is checked by the host's own split.
5. Fine-tuning without packing (the ``sft-*`` cases): the SFT trainer's causal +
   key-padding mask from MindSpeed-LLM's own ``get_tune_attention_mask``, right and
   left padding, micro-batch 2 with a different pad length per sample, handed whole to
   every rank as every mapped algorithm keeps it: LAGA at CP = 2 (ulysses, kvallgather,
   megatron) and CP = 4 (hybrid) against the real forward at CP = 1 with that mask
   (whose unfused softmax gives left padding's pad rows the mean of every value).
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from types import SimpleNamespace

import torch
from torch import nn

SEQ, BATCH, SEED, TOLERANCE = 16, 2, 1234, 1e-5
MODEL = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
         "--multi-latent-attention", "--kv-lora-rank", "32", "--qk-head-dim", "16",
         "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--disable-bias-linear",
         "--normalization", "RMSNorm", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--lr", "1e-4", "--train-iters", "1", "--transformer-impl", "local",
         "--use-cpu-initialization", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
         "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--attention-dropout", "0",
         "--hidden-dropout", "0",
         "--mla-latent-all-gather"]
CASES = {
    "qlora-fused-kvallgather": ["--q-lora-rank", "24", "--qk-layernorm",
                                "--context-parallel-algo", "kvallgather_cp_algo"],
    "qlora-mmsplit-scaled-ulysses-yarn": [
        "--q-lora-rank", "24", "--qk-layernorm", "--mla-mm-split", "--enable-mla-scale-q-lora",
        "--enable-mla-scale-kv-lora", "--context-parallel-algo", "ulysses_cp_algo",
        "--rope-scaling-type", "yarn", "--rope-scaling-factor", "40",
        "--rope-scaling-mscale-all-dim", "1.0"],
    "noqlora-fused-megatron": ["--context-parallel-algo", "megatron_cp_algo"],
}
TP_CASES = ("qlora-fused-kvallgather", "qlora-mmsplit-scaled-ulysses-yarn")
# packed documents (--reset-attention-mask, micro-batch 1, positions reset per document);
# the same documents for every algorithm, each a multiple of 2*CP = 4 tokens (what
# MindSpeed's pad_data leaves for megatron_cp_algo) and one crossing the middle of the
# sequence (the rank boundary of the contiguous split)
# (Megatron needs the alltoall MoE dispatcher for the variable lengths this implies)
DOCUMENTS = ["--reset-attention-mask", "--reset-position-ids", "--moe-token-dispatcher-type",
             "alltoall"]
DOC_CASES = {
    "documents-ulysses": ["--q-lora-rank", "24", "--qk-layernorm", "--context-parallel-algo",
                          "ulysses_cp_algo"] + DOCUMENTS,
    "documents-kvallgather": ["--q-lora-rank", "24", "--mla-mm-split", "--context-parallel-algo",
                              "kvallgather_cp_algo"] + DOCUMENTS,
    "documents-megatron": ["--context-parallel-algo", "megatron_cp_algo"] + DOCUMENTS,
}
# --attention-mask-type general (the long-context recipes): documents of a fixed length
# (--fix-sub-seq-length: MindSpeed's own get_actual_seq_len makes the ends, 6, 12, 16, so
# they fall inside the CP ranks' slices), cut contiguously by MindSpeed's general splitters
# for every algorithm, the ends neither padded nor scaled; master only (the recipes' release)
GENERAL = ["--attention-mask-type", "general", "--fix-sub-seq-length", "6"] + DOCUMENTS
GENERAL_CASES = {
    "general-ulysses": ["--q-lora-rank", "24", "--mla-mm-split", "--context-parallel-algo",
                        "ulysses_cp_algo"] + GENERAL,
    "general-megatron": ["--context-parallel-algo", "megatron_cp_algo"] + GENERAL,
}
# SFT without packing: the trainer's causal + key-padding mask (get_tune_attention_mask,
# whole under every mapped algorithm), micro-batch 2 with a different pad length per sample;
# left padding leaves query rows that see no key (the host's softmax averages every value)
SFT_PADS = {"right": (3, 6), "left": (5, 2)}
SFT_CASES = {
    "sft-right-ulysses": ["--q-lora-rank", "24", "--qk-layernorm", "--context-parallel-algo",
                          "ulysses_cp_algo"],
    "sft-left-ulysses": ["--context-parallel-algo", "ulysses_cp_algo"],
    "sft-left-kvallgather": ["--q-lora-rank", "24", "--mla-mm-split", "--context-parallel-algo",
                             "kvallgather_cp_algo"],
    "sft-right-megatron": ["--context-parallel-algo", "megatron_cp_algo"],
    "sft-left-megatron": ["--q-lora-rank", "24", "--context-parallel-algo", "megatron_cp_algo"],
}
# hybrid_cp_algo: CP = 4 = ring 2 x Ulysses 2, at TP = 1
HYBRID = ["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2"]
HYBRID_CASES = {"hybrid-u2": ["--q-lora-rank", "24", "--qk-layernorm"] + HYBRID,
                "sft-left-hybrid-u2": HYBRID}  # the SFT mask (SFT_PADS) under hybrid
GENERAL_HYBRID_CASES = {"general-hybrid-u2": ["--q-lora-rank", "24"] + HYBRID + GENERAL}
# 2.2.0 and 2.3.0: no kvallgather_cp_algo, no --enable-mla-scale-*-lora or
# --enable-mla-absorb in their parsers
OLD_RELEASES = ("2.3.0", "2.2.0")
STUBBED = ("torch_npu", "transformer_engine", "scipy", "torchair", "acl", "apex")
STUB_ATTRS = {"transformer_engine": {"__version__": "2.2.0"}, "torch_npu": {"__version__": "2.7.1"}}


# --- environment ----------------------------------------------------------------------------

def _stub_attribute(owner, name, base):
    """``owner.name`` for a stub: a new subclass of ``base``, kept on ``owner`` so that every
    use of the name gets the same class (dunders stay missing, as Python's probes expect)."""
    if name.startswith("__"):
        raise AttributeError(name)
    value = _StubMeta(name, (base,), {})
    setattr(owner, name, value)
    return value


class _StubMeta(type):
    def __getattr__(cls, name):
        return _stub_attribute(cls, name, cls)


class Stub(nn.Module, metaclass=_StubMeta):
    """Any attribute of a stub module: subclassable, callable, a pass-through decorator."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) else Stub()


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        return _stub_attribute(self, name, Stub)


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates a StubModule for every module under the given (missing) top-level names."""

    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StubModule(spec.name)
        module.__path__, module.__file__ = [], f"/stub/{spec.name.replace('.', '/')}.py"
        module.__dict__.update(STUB_ATTRS.get(spec.name, {}))
        return module

    def exec_module(self, module):
        pass


def prepare(register_laga: bool = True) -> None:
    """Sources first on sys.path, stubs for what is missing, the launcher's feature
    registration (unless the script runs under ``python -m mindspeed_laga.launch``,
    which did it already), CPU shims (idempotent)."""
    for key in ("MEGATRON_SRC", "MINDSPEED_SRC", "MINDSPEED_LLM_SRC"):
        if os.environ[key] not in sys.path:
            sys.path.insert(0, os.environ[key])
    # a spawned rank may have imported an installed megatron-core before this ran
    # (unpickling its arguments): forget it, so core_v0.12.1 is the one imported
    megatron_src = os.path.realpath(os.environ["MEGATRON_SRC"])
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        origin = getattr(sys.modules[name], "__file__", None) or ""
        if not os.path.realpath(origin).startswith(megatron_src):
            del sys.modules[name]
    os.environ["TRAINING_BACKEND"] = "none"
    _mindspeed_llm_without_adaptor()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asserts it with CP
    if not any(isinstance(f, StubFinder) for f in sys.meta_path):
        missing = {r for r in STUBBED if importlib.util.find_spec(r) is None}
        sys.meta_path.insert(0, StubFinder(missing))
        if register_laga:
            from mindspeed_laga.launch import install_laga_feature
            install_laga_feature()  # what `python -m mindspeed_laga.launch` does first
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core import tensor_parallel
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils
    import megatron.training.arguments as megatron_arguments

    tracker = SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: tracker

    def cpu_causal_mask(sq):
        return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)

    transformer_utils.get_default_causal_mask = cpu_causal_mask
    fused_softmax.get_default_causal_mask = cpu_causal_mask
    megatron_arguments.get_device_arch_version = lambda: 9


def _mindspeed_llm_without_adaptor() -> None:
    """What ``TRAINING_BACKEND=none`` does on releases that honour it (26.0.0 and newer):
    the ``mindspeed_llm`` package without its ``__init__``, which on 2.2.0 and 2.3.0
    always imports ``megatron_adaptor_v2`` (MindSpeed's patches, ``transfer_to_npu``,
    ``transformers``). Submodules then import from the source tree as usual."""
    if "mindspeed_llm" in sys.modules:
        return
    root = os.path.join(os.environ["MINDSPEED_LLM_SRC"], "mindspeed_llm")
    with open(os.path.join(root, "__init__.py")) as f:
        if "TRAINING_BACKEND" in f.read():
            return  # it skips the adaptor itself
    package = types.ModuleType("mindspeed_llm")
    package.__path__, package.__file__ = [root], os.path.join(root, "__init__.py")
    package.__spec__ = importlib.machinery.ModuleSpec("mindspeed_llm", None, is_package=True)
    package.__spec__.submodule_search_locations = [root]
    sys.modules["mindspeed_llm"] = package


def host_release():
    """The release LAGA's own identification reads from the sources on sys.path."""
    from mindspeed_laga.patches.mindspeed_llm.releases import identify
    return identify(os.path.join(os.environ["MINDSPEED_LLM_SRC"], "mindspeed_llm"),
                    os.path.join(os.environ["MINDSPEED_SRC"], "mindspeed"))


def release_cases(release):
    """The cases as this release's parser takes them: on 2.2.0/2.3.0 kvallgather becomes
    megatron_cp_algo (the documents case of it is dropped, megatron's is there), the
    latent scales go, and 2.3.0 adds plm rope (de-interleaved like yarn in its forward).
    2.2.0 refuses packed documents (check_documents_refused)."""
    if release.name not in OLD_RELEASES:
        return {**CASES, **SFT_CASES}, TP_CASES, DOC_CASES, HYBRID_CASES

    def old(argv):
        argv = ["megatron_cp_algo" if a == "kvallgather_cp_algo" else a for a in argv]
        return [a for a in argv if not a.startswith("--enable-mla-scale")]

    cases = {name.replace("kvallgather", "megatron-fused"): old(argv)
             for name, argv in {**CASES, **SFT_CASES}.items()}
    if "plm" in release.rope_deinterleave:
        cases["qlora-fused-ulysses-plm"] = [
            "--q-lora-rank", "24", "--qk-layernorm", "--context-parallel-algo", "ulysses_cp_algo",
            "--rope-scaling-type", "plm"]
    tp_cases = tuple(n.replace("kvallgather", "megatron-fused") for n in TP_CASES)
    docs = {name: argv for name, argv in DOC_CASES.items()
            if release.takes_documents(argv[argv.index("--context-parallel-algo") + 1])}
    return cases, tp_cases, docs, HYBRID_CASES


def megatron_args(argv, world_size):
    """Megatron core_v0.12.1's parse_args + MindSpeed-LLM's features, then their validation."""
    from megatron.training.arguments import parse_args, validate_args
    from mindspeed_llm.training.arguments import process_args_v2, validate_args_v2_decorator

    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    try:
        args = parse_args(process_args_v2)
        with contextlib.redirect_stdout(None):  # it prints every argument
            return validate_args_v2_decorator(validate_args)(args)
    finally:
        sys.argv = saved


# --- 1. argument pipeline and patch manager -------------------------------------------------

def check_pipeline(release) -> None:
    from mindspeed.features_manager.feature import MindSpeedFeature
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from mindspeed.patch_utils import MindSpeedPatchesManager

    from mindspeed_laga.features import LAGAFeature
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper

    base = MODEL + release_cases(release)[0][next(iter(release_cases(release)[0]))]
    args = megatron_args(base + ["--context-parallel-size", "2"], world_size=2)
    features = MindSpeedFeaturesManager.FEATURES_LIST
    assert isinstance(features[-1], LAGAFeature), [type(f).__name__ for f in features[-3:]]
    assert issubclass(LAGAFeature, MindSpeedFeature)
    assert args.mla_latent_all_gather and args.context_parallel_size == 2
    assert features[-1].is_need_apply(args)  # MindSpeed's rule, with the parsed --optimization-level
    rejected = "--mla-zero-memory" if release.name in OLD_RELEASES else "--enable-mla-absorb"
    try:
        megatron_args(base + ["--context-parallel-size", "2", rejected], world_size=2)
    except ValueError as exc:
        assert rejected in str(exc), exc
    else:
        raise AssertionError(f"{rejected} was not rejected")

    from mindspeed_llm.tasks.models.transformer import multi_latent_attention as mla
    original = mla.CustomMLASelfAttention.forward
    features[-1].register_patches(MindSpeedPatchesManager, args)
    MindSpeedPatchesManager.apply_patches()
    try:
        patched = mla.CustomMLASelfAttention.forward
        assert patched.__wrapped__ is original and patched.__code__ is \
            laga_mla_forward_wrapper(original).__code__
        from mindspeed_laga.patches.mindspeed_llm.host import check_mindspeed_llm_forward
        assert check_mindspeed_llm_forward(patched) is release  # read from the host's module
    finally:  # remove_patches skips modules named *mindspeed* (docs/HOSTS.md, section "MindSpeed's feature machinery")
        MindSpeedPatchesManager.remove_patches()
        mla.CustomMLASelfAttention.forward = original
    print("pipeline: ok")


# --- 2. numerics ----------------------------------------------------------------------------

def _build(argv, tp_size, cp_size, sequence_parallel):
    args, (module,) = build_layers(argv, tp_size, cp_size, sequence_parallel, (1,))
    return args, module


def build_layers(argv, tp_size, cp_size, sequence_parallel, layer_numbers):
    """The args and one module per (1-based) layer number, each initialized from its own
    seed (SEED + layer number - 1: layer 1 is the one ``_build`` builds)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.global_vars import set_args
    from mindspeed_llm.tasks.models.transformer import multi_latent_attention as mla

    parallel = ["--context-parallel-size", str(cp_size), "--tensor-model-parallel-size",
                str(tp_size)] + (["--sequence-parallel"] if sequence_parallel else [])
    if cp_size == 1 and HYBRID[1] in argv:  # the reference: the same model without CP
        argv = [a for a in argv if a not in HYBRID]
    args = megatron_args(argv + parallel, tp_size * cp_size)
    set_args(args)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                             context_parallel_size=cp_size)
    if args.context_parallel_algo == "hybrid_cp_algo":  # MindSpeed's Ulysses and ring groups
        from mindspeed.core.context_parallel.model_parallel_utils import (
            initialize_context_parallel_group_for_hybrid_cp)
        initialize_context_parallel_group_for_hybrid_cp(tp_size, 1, cp_size, {})
    config = core_transformer_config_from_args(args)
    config.context_parallel_size = 1  # what code sees while MindSpeed's CP attention is built: the patch must not depend on the config
    submodules = _submodules(mla, args)
    modules = []
    for layer_number in layer_numbers:
        # with CPU initialization every TP rank slices the same master weights
        torch.manual_seed(SEED + layer_number - 1)
        module = mla.CustomMLASelfAttention(config, submodules, layer_number=layer_number,
                                            attn_mask_type=AttnMaskType.causal)
        # 2.2.0's MlaDotProductAttention sizes the output of its local (CPU) path for all
        # heads, not this TP rank's (on NPU its flash path runs instead): the CPU reference
        # at TP > 1 needs the per-rank size
        per_rank = module.num_attention_heads_per_partition * args.v_head_dim
        if getattr(module.core_attention, "hidden_size_per_partition", per_rank) != per_rank:
            module.core_attention.hidden_size_per_partition = per_rank
        modules.append(module)
    return args, modules


def _submodules(mla, args):
    """The MLA submodules of MindSpeed-LLM's DeepSeek spec (local implementation): its
    own builder, or on 2.2.0 (which builds them in the spec module, at import, from the
    global args) the same host classes put together here."""
    if hasattr(mla, "get_mla_self_attn_submodules"):
        return mla.get_mla_self_attn_submodules(
            qk_layernorm=args.qk_layernorm, mla_mm_split=args.mla_mm_split,
            enable_dsa_indexer=bool(getattr(args, "enable_dsa_indexer", False)))
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from mindspeed_llm.core.transformer.custom_layers.transformer_engine import PTNorm
    from mindspeed_llm.tasks.models.transformer.mla_dot_product_attention import (
        MlaDotProductAttention)
    norm = PTNorm if args.qk_layernorm else IdentityOp
    common = dict(linear_qkv=mla.LinearNoTP, core_attention=MlaDotProductAttention,
                  linear_proj=RowParallelLinear, q_layernorm=norm, kv_layernorm=norm)
    if args.mla_mm_split:
        return mla.MLASelfAttentionWithMMSplitSubmodules(
            linear_qk_nope=ColumnParallelLinear, linear_qk_rope=ColumnParallelLinear,
            linear_kv_nope=ColumnParallelLinear, linear_v=ColumnParallelLinear, **common)
    return mla.CustomMLASelfAttentionSubmodules(
        linear_q_up_proj=ColumnParallelLinear, linear_kv_up_proj=ColumnParallelLinear, **common)


def _run(module, forward, hidden, rope, grad_out):
    from support.mindspeed_llm_standin import forward_backward
    return dict(forward_backward(module, forward, hidden, rope, grad_out),
                # TP-sharded weights: the dim to concatenate over TP ranks; others are summed
                partition={n: (p.partition_dim if getattr(p, "tensor_model_parallel", False)
                               else None) for n, p in module.named_parameters()})


def worker(rank, world_size, tp_size, sequence_parallel, cases, cp=None):
    """CP = ``cp``, or world/TP (a smaller CP makes data-parallel copies); this rank's
    tokens: the CP layout's shard, then, under sequence parallelism, its TP slice. At
    CP = 1: the real forward and the LAGA path (called directly); at CP > 1: the patched
    forward, which takes the LAGA path. A hybrid case runs at TP = 1 whatever ``tp_size``
    says (so it shares a world size's job)."""
    prepare()
    from megatron.core import parallel_state

    from mindspeed_laga import layout as layouts
    from mindspeed_laga.features.laga_args import laga_settings
    from mindspeed_laga.patches.mindspeed_llm.forward import (laga_mla_forward_wrapper, laga_self_attention)

    results = {}
    for name, extra in cases.items():
        tp, sp = (1, False) if HYBRID[1] in extra else (tp_size, sequence_parallel)
        cp_size = cp or world_size // tp
        args, module = _build(MODEL + extra, tp, cp_size, sp)
        try:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            cp_rank = parallel_state.get_context_parallel_rank()
            cp_group = parallel_state.get_context_parallel_group()
            layout = laga_settings(args).layout
            degree = 1 if cp_size == 1 else int(getattr(args, "ulysses_degree_in_cp", None) or 1)
            res = results[name] = dict(softmax_scale=module.core_attention.softmax_scale,
                                       layout=layout, tp_rank=tp_rank, cp_rank=cp_rank,
                                       tp_size=tp, sequence_parallel=sp, ulysses_degree=degree)
            if args.reset_attention_mask:
                res.update(_documents_case(module, args, cp_size, cp_rank, layout))
                continue
            generator = torch.Generator().manual_seed(SEED)
            hidden = torch.randn(SEQ, BATCH, 64, generator=generator)
            grad_out = torch.randn(SEQ, BATCH, 64, generator=generator)

            def local(t):
                t = layouts.shard(t, layout, cp_size, cp_rank, dim=0, ulysses_degree=degree)
                return t.chunk(tp)[tp_rank] if sp else t

            if degree > 1:  # the hybrid layout is MindSpeed's own split of the batch
                tokens = _host_cp_split(dict(tokens=torch.arange(SEQ)[None]))["tokens"][0]
                assert torch.equal(tokens, local(torch.arange(SEQ))), tokens
            inputs = (local(hidden), layouts.shard(_rope_table(SEQ, 8), layout, cp_size, cp_rank,
                                                   dim=0, ulysses_degree=degree), local(grad_out))
            mask = sft_mask(args, name)  # None but for the SFT cases: the whole mask, every rank
            if cp_size == 1:
                res["original"] = _run(module, lambda h, r: module(h, mask, rotary_pos_emb=r),
                                       *inputs)
                res["laga"] = _run(module, lambda h, r: laga_self_attention(
                    module, h, r, cp_group, args, attention_mask=mask), *inputs)
            else:
                patched = laga_mla_forward_wrapper(type(module).forward)
                res["laga"] = _run(module, lambda h, r: patched(module, h, mask, rotary_pos_emb=r),
                                   *inputs)
        finally:
            parallel_state.destroy_model_parallel()
    return results


def sft_mask(args, name):
    """For an ``sft-<side>-*`` case: the SFT trainer's mask, built by MindSpeed-LLM's own
    ``get_tune_attention_mask`` from the tokenizer's 1-D attention mask (1 = token) with
    ``SFT_PADS[side]`` padding tokens per sample; None for the other cases."""
    if not name.startswith("sft-"):
        return None
    from mindspeed_llm.training.utils import get_tune_attention_mask

    side = name.split("-")[1]
    mask_1d = torch.ones(BATCH, SEQ, dtype=torch.long)
    for i, n in enumerate(SFT_PADS[side]):
        mask_1d[i, SEQ - n:] = 0 if side == "right" else 1
        mask_1d[i, :n] = 0 if side == "left" else 1
    args.stage, args.tokenizer_padding_side = "sft", side
    return get_tune_attention_mask(mask_1d)


def worker_jobs(rank, world_size, jobs):
    """Several (tp_size, sequence_parallel, cases[, cp]) jobs of ``worker`` in one spawn."""
    return [worker(rank, world_size, *job) for job in jobs]


def _jobs(world_size, jobs):
    """[per-rank results of each job]: the jobs run in one spawn of ``world_size`` ranks."""
    from mindspeed_laga.tools.spawn import run_on_ranks
    per_rank = run_on_ranks(worker_jobs, world_size, jobs)
    return [[ranks[j] for ranks in per_rank] for j in range(len(jobs))]


def document_ends(seq_len, generator):
    """Random document ends (multiples of 4, the last one seq_len), one document
    crossing the middle of the sequence."""
    while True:
        cuts = sorted(set((torch.randperm(seq_len // 4 - 1, generator=generator)[:2] + 1)
                          .mul(4).tolist()))
        ends = cuts + [seq_len]
        starts = [0] + cuts
        if any(a < seq_len // 2 < b for a, b in zip(starts, ends)):
            return ends


def _document_mask(ends, seq_len):
    """[1, 1, s, s], True = masked: causal inside each document, nothing across."""
    doc = torch.zeros(seq_len, dtype=torch.long)
    for end in ends[:-1]:
        doc[end:] += 1
    same = doc[:, None] == doc[None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return ~(same & causal)[None, None]


def _documents_case(module, args, cp_size, cp_rank, layout):
    """One packed sequence (micro-batch 1). At CP = 1 the real forward with Megatron's
    explicit attention mask (how its local core attention applies --reset-attention-mask
    on CPU) and rope at the reset positions; at CP > 1 the patched forward fed as
    MindSpeed feeds it: document ends from MindSpeed-LLM's loader (``pad_data``, divided
    by ``get_ring_degree``) in ``set_actual_seq_len``, this rank's tokens from MindSpeed's
    ``get_batch_on_this_cp_rank``, ``packed_seq_params`` carrying their position ids, the
    full rope table, and MindSpeed-LLM's THD rope."""
    from mindspeed.core.context_parallel.get_batch_utils import (get_ring_degree,
                                                                 set_actual_seq_len)
    from mindspeed.core.context_parallel.utils import pad_data

    from mindspeed_laga import layout as layouts
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper

    generator = torch.Generator().manual_seed(SEED)
    hidden = torch.randn(SEQ, 1, 64, generator=generator)
    grad_out = torch.randn(SEQ, 1, 64, generator=generator)
    general = args.attention_mask_type == "general"
    ends = _fixed_ends(args) if general else document_ends(SEQ, generator)
    starts = torch.tensor([0] + ends[:-1])
    position_ids = torch.arange(SEQ) - starts[torch.bucketize(torch.arange(SEQ), torch.tensor(ends),
                                                              right=True)]
    table = _rope_table(SEQ, 8)
    cu_seqlens = [0] + ends
    res = dict(cu_seqlens=cu_seqlens)
    if cp_size == 1:
        mask = _document_mask(ends, SEQ)
        res["original"] = _run(module, lambda h, r: module(h, mask, rotary_pos_emb=r), hidden,
                               table[position_ids], grad_out)
        return res

    actual_seq_len = torch.tensor(ends)
    if args.context_parallel_algo == "megatron_cp_algo" and not general:  # MindSpeed-LLM's get_batch_on_this_tp_rank
        actual_seq_len = pad_data(actual_seq_len, {}, cp_size, args.tensor_model_parallel_size)
        actual_seq_len //= get_ring_degree()
    set_actual_seq_len(actual_seq_len)
    _install_thd_rope()

    # this rank's tokens as MindSpeed's own get_batch_on_this_cp_rank splits them (the
    # results are put back together with LAGA's layout, so a wrong mapping fails)
    # (it splits [b, s] token tensors: split the token indices and take those rows)
    split = _host_cp_split(dict(tokens=torch.arange(SEQ)[None], position_ids=position_ids[None]))
    tokens = split["tokens"][0]
    assert torch.equal(split["position_ids"][0], position_ids[tokens])
    assert torch.equal(tokens, layouts.shard(torch.arange(SEQ), layout, cp_size, cp_rank, dim=0,
                                             cu_seqlens=cu_seqlens))
    packed = SimpleNamespace(qkv_format="thd", cu_seqlens_q=actual_seq_len,
                             cu_seqlens_kv=actual_seq_len, position_ids=position_ids[tokens][:, None])
    patched = laga_mla_forward_wrapper(type(module).forward)
    try:
        res["laga"] = _run(module, lambda h, r: patched(module, h, None, rotary_pos_emb=r,
                                                        packed_seq_params=packed),
                           hidden[tokens], table, grad_out[tokens])
    finally:
        set_actual_seq_len(None)
    return res


def _fixed_ends(args):
    """--fix-sub-seq-length: the ends MindSpeed's collate puts in actual_seq_len."""
    from mindspeed.core.transformer.flash_attention.reset_attention_mask.utils import (
        get_actual_seq_len)
    return get_actual_seq_len(SEQ, args.fix_sub_seq_length).tolist()


def check_documents_refused(release) -> None:
    """A release that cannot apply rope to packed documents (2.2.0): LAGA refuses
    --reset-attention-mask at validation, naming the release, and the reason holds, since
    the host's own forward fails on such a batch (run below at CP = 1)."""
    from mindspeed_laga.tools.spawn import run_on_ranks

    refused = [name for name in DOC_CASES if name not in release_cases(release)[2]]
    refused = refused[-1:] if "documents-megatron" in refused else refused[:1]  # one parses
    argv = MODEL + DOC_CASES[refused[0]] + ["--context-parallel-size", "2"]
    try:
        megatron_args(argv, world_size=2)
    except ValueError as exc:
        assert "--reset-attention-mask" in str(exc) and release.name in str(exc), exc
    else:
        raise AssertionError(f"{refused[0]} was not refused on {release.name}")
    print(f"{refused[0]} on {release.name}: refused")
    if "megatron_cp_algo" in release.document_algos:
        return
    error = run_on_ranks(_host_documents_worker, 1)[0]
    assert "position_ids" in error, error
    print(f"documents on {release.name}: the host's own forward fails: {error}")


def _host_documents_worker(rank, world_size):
    """The host's forward at CP = 1 on one packed sequence, fed as the release's GPT forward
    feeds it (its packed_seq_params; the THD rope its reset-attention-mask feature installs)."""
    prepare()
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from mindspeed.core.transformer.flash_attention.reset_attention_mask.adaptor import (
        apply_rotary_pos_emb_thd)

    argv = [a for a in MODEL + DOC_CASES["documents-megatron"] if a != "--mla-latent-all-gather"]
    args, module = _build(argv, 1, 1, False)
    try:
        rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
        rotary._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
        ends = torch.tensor([4, 12, SEQ])
        packed = PackedSeqParams(cu_seqlens_q=ends, cu_seqlens_kv=ends)
        packed.position_ids = torch.arange(SEQ)[:, None]
        hidden = torch.randn(SEQ, 1, 64)
        try:
            module(hidden, None, rotary_pos_emb=_rope_table(SEQ, 8), packed_seq_params=packed)
        except AttributeError as exc:
            return f"AttributeError: {exc}"
        return "the host's forward ran"
    finally:
        parallel_state.destroy_model_parallel()


def _host_cp_split(batch):
    """MindSpeed's real ``get_batch_on_this_cp_rank`` on [b, s, ...] tensors; its
    per-document split moves an index to 'npu', which is the CPU here."""
    from mindspeed.core.context_parallel.get_batch_utils import get_batch_on_this_cp_rank

    to = torch.Tensor.to

    def to_cpu_for_npu(self, *args, **kwargs):
        args = tuple("cpu" if a == "npu" else a for a in args)
        return to(self, *args, **kwargs)

    torch.Tensor.to = to_cpu_for_npu
    try:
        return get_batch_on_this_cp_rank(dict(batch))
    finally:
        torch.Tensor.to = to


def _install_thd_rope():
    """What MindSpeed-LLM's reset-attention-mask feature patches: its THD rope (under
    --reset-position-ids it looks up the table at packed_seq_params.position_ids)."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    from mindspeed_llm.core.models.common.embeddings.rotary_pos_embedding import (
        apply_rotary_pos_emb_thd)
    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
    rotary._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd


def _rope_table(seq_len, dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def _assemble(per_rank, name, which, tp_size=None, sequence_parallel=None):
    """Full-sequence output and grads of run ``which`` from every rank's shard
    (TP size and sequence parallelism: the case's own, as the worker recorded them)."""
    from mindspeed_laga import layout as layouts

    first = per_rank[0][name]
    tp_size, sequence_parallel = first["tp_size"], first["sequence_parallel"]
    cp_size = len(per_rank) // tp_size
    by_rank = {(r[name]["cp_rank"], r[name]["tp_rank"]): r[name][which] for r in per_rank}
    layout = first["layout"]

    def sequence(key):
        tp_parts = range(tp_size) if sequence_parallel else [0]  # else TP ranks hold copies
        return layouts.unshard([torch.cat([by_rank[(c, t)][key] for t in tp_parts])
                                for c in range(cp_size)], layout,
                               cu_seqlens=first.get("cu_seqlens") if cp_size > 1 else None,
                               ulysses_degree=first["ulysses_degree"])

    grads = {}
    for key in by_rank[(0, 0)]["param_grads"]:
        dim = by_rank[(0, 0)]["partition"][key]
        per_cp = []
        for c in range(cp_size):
            parts = [by_rank[(c, t)]["param_grads"][key] for t in range(tp_size)]
            if dim is not None:
                per_cp.append(torch.cat(parts, dim=dim))
            else:  # replicated: partial sums under SP, copies without
                per_cp.append(sum(parts) if sequence_parallel else parts[0])
        grads[key] = sum(per_cp)  # Megatron reduces over dp x cp
    return dict(output=sequence("output"), hidden_grad=sequence("hidden_grad"), param_grads=grads)


def _max_relative_error(got, ref):
    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    assert got["param_grads"].keys() == ref["param_grads"].keys()
    errors = [rel(got["output"], ref["output"]), rel(got["hidden_grad"], ref["hidden_grad"])]
    errors += [rel(got["param_grads"][k], g) for k, g in ref["param_grads"].items()]
    return max(errors)


def check_numerics(release) -> None:
    """Every run against the real forward. With sequence parallelism (or TP = 1) the
    reference is TP = CP = 1 on one rank. Without it, MindSpeed-LLM's forward leaves the
    rope key's grad partial per TP rank (it never all-reduces it), so the reference is the
    real forward at the same TP and CP = 1."""
    def check(label, got, ref):
        error = _max_relative_error(got, ref)
        print(f"{label}: max relative error {error:.2e}")
        assert error <= TOLERANCE, label

    CASES, TP_CASES, DOC_CASES, HYBRID_CASES = release_cases(release)  # noqa: N806
    tp_names = {k: CASES[k] for k in TP_CASES[:1]}
    general, general_hybrid = ((GENERAL_CASES, GENERAL_HYBRID_CASES) if release.name == "master"
                               else ({}, {}))
    # two spawns (each rank's start-up imports the hosts once, some 10 s): in the world of 2
    # every case at TP = CP = 1 (two data-parallel copies: rank 0's is the reference, and a
    # world of 1 would pay the imports once more), CP = 2 with documents and TP = 2 at
    # CP = 1; in the world of 4 TP = 2 x CP = 2 with and without SP and hybrid (TP = 1, CP = 4)
    cp1, two, tp2 = _jobs(2, [(1, False, {**CASES, **DOC_CASES, **HYBRID_CASES, **general,
                                          **general_hybrid}, 1),
                              (1, False, {**CASES, **DOC_CASES, **general}), (2, False, tp_names)])
    single = cp1[:1]
    four = _jobs(4, [(2, True, {**{k: CASES[k] for k in TP_CASES}, **HYBRID_CASES,
                                **general_hybrid}), (2, False, tp_names)])
    for name in {**CASES, **HYBRID_CASES}:
        print(f"{name}: softmax_scale {single[0][name]['softmax_scale']:.6f}")
        check(f"{name}: LAGA vs real forward, TP=CP=1", _assemble(single, name, "laga"),
              single[0][name]["original"])
    for per_rank in (two, four[0]):
        for name in per_rank[0]:
            first = per_rank[0][name]
            where = (f"TP={first['tp_size']} CP={len(per_rank) // first['tp_size']} "
                     f"SP={first['sequence_parallel']} U={first['ulysses_degree']}")
            check(f"{name}: LAGA at {where} vs real forward, TP=CP=1",
                  _assemble(per_rank, name, "laga"), single[0][name]["original"])
    tp2_cp2 = four[1]
    for name in tp_names:
        ref = _assemble(tp2, name, "original", 2, False)
        check(f"{name}: LAGA at TP=2 CP=1 vs real forward at TP=2",
              _assemble(tp2, name, "laga", 2, False), ref)
        check(f"{name}: LAGA at TP=2 CP=2 vs real forward at TP=2",
              _assemble(tp2_cp2, name, "laga", 2, False), ref)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    prepare()
    found = host_release()
    print(f"release: {found.name}\nfacts: {found.facts()}")
    expected = os.environ.get("LAGA_EXPECT_RELEASE")  # a release with the same facts is it
    from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME
    assert expected is None or BY_NAME[expected].facts() == found.facts(), \
        f"identified {found.found()}, expected {expected}'s facts: {BY_NAME[expected].facts()}"
    check_pipeline(found)
    if found.document_algos is not None:
        check_documents_refused(found)
    check_numerics(found)
    print("real CustomMLASelfAttention: ok")
