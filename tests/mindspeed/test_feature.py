"""LAGAFeature on a real argparse parser: flags, is_need_apply, every validation
error, the --context-parallel-algo mapping and patch registration.

The parser (tests/support/laga_parser.py) holds LAGA's own flags plus the upstream
flags the checks read, with their upstream names, defaults and destinations.
"""
import argparse
import ast
import importlib.util
import logging
import os
from pathlib import Path

import pytest
from support.laga_parser import parse
from support.thirdparty import RELEASE_NAMES

from mindspeed_laga.features import LAGAFeature
from mindspeed_laga.features.laga_args import laga_options, laga_settings
from mindspeed_laga.features.laga_feature import GET_MODEL, MLA_FORWARD
from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper
from mindspeed_laga.patches.mindspeed_llm.model_check import laga_model_check_wrapper

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

VALID = ["--multi-latent-attention", "--disable-bias-linear", "--attention-dropout", "0.0",
         "--num-attention-heads", "8", "--seq-length", "64", "--context-parallel-size", "2",
         "--mla-latent-all-gather"]


def validate(argv):
    feature = LAGAFeature()
    args = parse(argv, feature)
    feature.validate_args(args)
    return args


class RecordingPatchManager:
    """Records register_patch calls the way MindSpeedPatchesManager receives them."""

    def __init__(self):
        self.calls = []

    def register_patch(self, orig_func_name, new_func=None, force_patch=False, create_dummy=False):
        self.calls.append((orig_func_name, new_func, force_patch))


# --- flags and is_need_apply ---------------------------------------------------------------

def test_flags_default_off_and_parse():
    args = parse([])
    assert args.mla_latent_all_gather is False and args.mla_laga_kernel == "auto"
    args = parse(["--mla-latent-all-gather", "--mla-laga-kernel", "eager"])
    assert args.mla_latent_all_gather is True and args.mla_laga_kernel == "eager"


def test_option_flags_reach_the_core():
    args = validate(VALID + ["--mla-laga-recompute-kv", "--mla-laga-kv-block-size", "512",
                             "--mla-laga-trim-causal-prefix", "--mla-laga-overlap"])
    settings = laga_settings(args)
    assert settings.overlap is True
    assert settings.core_options() == dict(
        cp_algo="allgather", layout="zigzag", kernel="auto", recompute_kv=True,
        kv_block_size=512, trim_causal_prefix=True, pad_v=True)
    plain = laga_settings(validate(VALID))
    assert (plain.recompute_kv, plain.kv_block_size, plain.trim_causal_prefix, plain.overlap) == (
        False, None, False, False)


# each --mla-laga-* option as a user gives it (argparse's type applied)
GIVEN = {"--mla-laga-kernel": ["eager"], "--mla-laga-recompute-kv": [],
         "--mla-laga-kv-block-size": ["512"], "--mla-laga-trim-causal-prefix": [],
         "--mla-laga-overlap": []}


def test_every_laga_option_has_a_case():
    assert sorted(GIVEN) == sorted(flag for flag, _ in laga_options().values())


@pytest.mark.parametrize("flag", sorted(GIVEN))
def test_a_laga_option_without_the_flag_is_refused_naming_both(flag):
    without = [a for a in VALID if a != "--mla-latent-all-gather"]
    with pytest.raises(ValueError) as info:
        validate(without + [flag, *GIVEN[flag]])
    message = str(info.value)
    assert flag in message and "add --mla-latent-all-gather" in message, message
    assert f"drop {flag}" in message, message
    validate(without)  # nothing given: LAGA off, nothing to refuse


def test_a_laga_option_typed_at_its_default_is_refused_too(monkeypatch):
    """``--mla-laga-kernel auto`` equals the default: what the user typed still counts."""
    without = [a for a in VALID if a != "--mla-latent-all-gather"]
    argv = without + ["--mla-laga-kernel", "auto"]
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    with pytest.raises(ValueError, match="--mla-laga-kernel acts only with"):
        validate(argv)


def test_unknown_kernel_is_rejected_by_the_parser():
    with pytest.raises(SystemExit):
        parse(["--mla-laga-kernel", "flash"])


def test_feature_name_and_is_need_apply():
    feature = LAGAFeature()
    assert feature.feature_name == "mla_latent_all_gather"
    assert not feature.is_need_apply(parse([]))
    assert feature.is_need_apply(parse(["--mla-latent-all-gather"]))
    # optimization level 2 feature: off when the user asks for level 1
    level_1 = parse(["--mla-latent-all-gather", "--optimization-level", "1"])
    assert not feature.is_need_apply(level_1)


# --- validation ----------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["ulysses_cp_algo", "kvallgather_cp_algo", "megatron_cp_algo"])
def test_supported_configurations_validate(algo):
    validate(VALID + ["--context-parallel-algo", algo])
    validate(VALID + ["--context-parallel-algo", algo, "--reset-attention-mask",
                      "--reset-position-ids", "--micro-batch-size", "1"])


GENERAL = ["--attention-mask-type", "general", "--reset-attention-mask", "--micro-batch-size",
           "1", "--shape-order", "BNSD"]
# MindSpeed's get_batch_on_this_cp_rank cuts the batch contiguously for each (the _general
# splitters of megatron and hybrid included); the ends are the loader's, not scaled
GENERAL_CASES = {
    "ulysses_cp_algo": ([], ("ulysses", "contiguous")),
    "megatron_cp_algo": ([], ("allgather", "contiguous")),
    "hybrid_cp_algo": (["--context-parallel-size", "4", "--ulysses-degree-in-cp", "2"],
                       ("hybrid", "contiguous")),
}


@pytest.mark.parametrize("algo", list(GENERAL_CASES))
def test_general_masks_with_documents_validate_and_map_contiguously(algo):
    extra, mapped = GENERAL_CASES[algo]
    args = validate(VALID + GENERAL + ["--context-parallel-algo", algo] + extra)
    settings = laga_settings(args)
    assert (settings.cp_algo, settings.layout) == mapped
    assert settings.documents and not settings.loader_scaled_ends


def test_causal_documents_keep_the_loaders_scaled_ends():
    args = validate(VALID + ["--reset-attention-mask", "--micro-batch-size", "1",
                             "--context-parallel-algo", "megatron_cp_algo"])
    assert laga_settings(args).loader_scaled_ends and laga_settings(args).layout == "doc_zigzag"


def test_tnd_shape_order_is_accepted_with_documents():
    # MindSpeed-LLM's training_basic feature sets --shape-order TND under --reset-attention-mask
    validate(VALID + ["--reset-attention-mask", "--micro-batch-size", "1", "--shape-order", "TND"])


def test_hybrid_validates_with_a_ulysses_degree_dividing_heads_and_cp():
    # 8 heads, TP 2 x U 2 = 4 divides them; CP 4 = ring 2 x U 2
    validate(VALID[:-3] + ["--context-parallel-size", "4", "--context-parallel-algo",
                           "hybrid_cp_algo", "--ulysses-degree-in-cp", "2",
                           "--tensor-model-parallel-size", "2", "--mla-latent-all-gather"])


def test_disabled_feature_validates_nothing():
    validate(["--enable-mla-absorb", "--reset-attention-mask", "--context-parallel-size", "2"])


# (extra arguments, text the error must contain); each must fail only because of them
REJECTED = [
    (["--enable-mla-absorb"], "--enable-mla-absorb"),
    (["--use-sparse-flash-attn"], "--use-sparse-flash-attn"),
    (["--enable-dsa-indexer"], "--context-parallel-algo megatron_cp_algo"),
    (["--reset-attention-mask", "--micro-batch-size", "2"], "--micro-batch-size 1"),
    (["--neat-pack"], "--neat-pack"),
    (["--shape-order", "TND"], "--shape-order TND"),
    # general masks: with documents only, and with the algorithms MindSpeed splits for them
    (["--attention-mask-type", "general"], "--reset-attention-mask only"),
    (["--attention-mask-type", "general", "--context-parallel-algo", "kvallgather_cp_algo",
      "--reset-attention-mask", "--micro-batch-size", "1"],
     "--attention-mask-type general and --context-parallel-algo kvallgather_cp_algo"),
    (["--tp-2d"], "--tp-2d"),
    (["--mla-up-proj-tp-overlap"], "--mla-up-proj-tp-overlap"),
    (["--recompute-mla-up-proj"], "--recompute-mla-up-proj"),
    (["--mla-zero-memory"], "--mla-zero-memory"),
    (["--mla-swap-core-attn-out"], "--mla-swap-core-attn-out"),
    (["--add-qkv-bias"], "--add-qkv-bias"),
    (["--fp8-format", "hybrid"], "--fp8-recipe delayed"),  # Megatron's default recipe
    (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], "--fp8-recipe tensorwise"),
    (["--fp8-format", "hif8", "--fp8-recipe", "tensorwise"], "one scale per tensor"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], "--fp8-recipe blockwise"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8-32x32"], "--fp8-recipe mxfp8-32x32"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-reuse-quantized-weight"],
     "--fp8-reuse-quantized-weight"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--mla-laga-recompute-kv"],
     "--mla-laga-recompute-kv"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--qk-head-dim", "48"],
     "--qk-head-dim a multiple of 32"),
    (["--recompute-granularity", "selective"], "--recompute-granularity selective"),
    (["--context-parallel-algo", "hybrid_cp_algo"], "--ulysses-degree-in-cp"),
    (["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2",
      "--reset-attention-mask", "--micro-batch-size", "1"], "--reset-attention-mask"),
    # 8 heads over TP 4 x U 4 = 16 (CP 8 = ring 2 x U 4)
    (["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "4",
      "--context-parallel-size", "8", "--tensor-model-parallel-size", "4"],
     "--ulysses-degree-in-cp 4"),
    # hybrid zigzag: 2 x CP = 8 chunks; 68 % 8 != 0
    (["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2",
      "--context-parallel-size", "4", "--seq-length", "68"], "--seq-length 68"),
    # documents, megatron_cp: every document in 2 x CP chunks -> seq 2 x CP divisible
    (["--context-parallel-algo", "megatron_cp_algo", "--reset-attention-mask",
      "--micro-batch-size", "1", "--context-parallel-size", "4", "--seq-length", "68"],
     "2 x --context-parallel-size"),
    (["--context-parallel-algo", "hybrid_adaptive_cp_algo"], "hybrid_adaptive_cp_algo"),
    # 8 heads over TP 2 x CP 8 = 16
    (["--context-parallel-algo", "ulysses_cp_algo", "--tensor-model-parallel-size", "2",
      "--context-parallel-size", "8"], "--num-attention-heads 8"),
    # zigzag: 2 x CP = 8 chunks; 68 % 8 != 0
    (["--context-parallel-algo", "kvallgather_cp_algo", "--context-parallel-size", "4",
      "--seq-length", "68"], "--seq-length 68"),
    (["--context-parallel-algo", "megatron_cp_algo", "--context-parallel-size", "4",
      "--seq-length", "68"], "2 x --context-parallel-size"),
    # contiguous: CP chunks; 66 % 4 != 0
    (["--context-parallel-algo", "ulysses_cp_algo", "--context-parallel-size", "4",
      "--seq-length", "66"], "--seq-length 66"),
    (["--mla-laga-kv-block-size", "512"], "needs --mla-laga-recompute-kv"),
    (["--attention-dropout", "0.05"], "--attention-dropout 0.0"),
    (["--mla-laga-recompute-kv", "--mla-laga-kv-block-size", "0"], "--mla-laga-kv-block-size 0"),
    (["--qlora", "--lora-target-modules", "linear_qkv"], "--qlora"),
    (["--lu-lora-final-layer-index", "2", "--lora-target-modules", "linear_qkv",
      "linear_kv_up_proj"], "--lu-lora-final-layer-index"),
    (["--lu-lora-final-layer-index", "2", "--lora-target-modules", "self_attention.linear_v"],
     "self_attention.linear_v"),
]


@pytest.mark.parametrize("extra,needle", REJECTED, ids=[" ".join(e) for e, _ in REJECTED])
def test_unsupported_combinations_raise_value_error_naming_the_flag(extra, needle):
    with pytest.raises(ValueError) as info:
        validate(VALID + extra)
    message = str(info.value)
    assert needle in message and "--mla-latent-all-gather" in message


# sparse MLA (DSA): LAGA runs the host's torch path and its fused ops, heads never split
DSA = ["--enable-dsa-indexer", "--context-parallel-algo", "kvallgather_cp_algo"]
DSA_REJECTED = [
    (["--use-sparse-flash-attn"], "--enable-mla-absorb"),
    (["--kv-compress"], "--kv-compress"),
    (["--kv-compress", "--use-sparse-flash-attn", "--enable-mla-absorb"], "--kv-compress"),
    # packed documents: the host's DSA runs them with its fused ops only
    (["--reset-attention-mask", "--micro-batch-size", "1"], "--use-fused-lightning-indexer-loss"),
    (["--reset-attention-mask", "--micro-batch-size", "1", "--use-fused-lightning-indexer"],
     "--use-sparse-flash-attn"),
    (["--context-parallel-algo", "megatron_cp_algo"], "megatron_cp_algo"),
    (["--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2"],
     "hybrid_cp_algo"),
]
# the host's DSA configurations LAGA runs: its fused ops, the absorbed path, TP with SP
DSA_RUNS = [
    ["--use-fused-lightning-indexer"],
    ["--use-fused-lightning-indexer", "--use-fused-lightning-indexer-loss",
     "--use-sparse-flash-attn", "--enable-mla-absorb"],
    ["--use-sparse-flash-attn", "--enable-mla-absorb"],
    ["--enable-mla-absorb"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    # packed documents, with the fused set the host's DSA needs for them
    ["--use-fused-lightning-indexer", "--use-fused-lightning-indexer-loss",
     "--use-sparse-flash-attn", "--enable-mla-absorb", "--reset-attention-mask",
     "--micro-batch-size", "1"],
    # GLM-5.2's shared picks (the host release is checked apart: test_index_share_...)
    ["--index-topk-freq", "4", "--index-skip-topk-offset", "3", "--index-share-for-mtp-iteration"],
    ["--index-topk-pattern", "CSCS"],
]


@pytest.mark.parametrize("extra", DSA_RUNS, ids=[" ".join(e) for e in DSA_RUNS])
def test_dsa_validates_with_the_hosts_fused_ops_and_tp(extra):
    assert validate(VALID + DSA + extra).mla_latent_all_gather


def test_absorb_and_sparse_flash_attention_stay_refused_without_dsa():
    for extra, needle in ((["--enable-mla-absorb"], "non-absorbed"),
                          (["--use-sparse-flash-attn"], "dense causal")):
        with pytest.raises(ValueError, match=needle):
            validate(VALID + extra)


@pytest.mark.parametrize("algo", ["ulysses_cp_algo", "kvallgather_cp_algo"])
def test_dsa_validates_under_the_hosts_two_algorithms(algo):
    # 8 heads at CP 16 under ulysses: LAGA's DSA path splits no head
    validate(VALID[:-3] + ["--context-parallel-size", "16", "--seq-length", "128",
                           "--enable-dsa-indexer", "--context-parallel-algo", algo,
                           "--mla-latent-all-gather"])


@pytest.mark.parametrize("extra,needle", DSA_REJECTED, ids=[" ".join(e) for e, _ in DSA_REJECTED])
def test_dsa_refusals_name_the_flag(extra, needle):
    with pytest.raises(ValueError) as info:
        validate(VALID + DSA + extra)
    message = str(info.value)
    assert needle in message and "--enable-dsa-indexer" in message, message
    assert "--mla-latent-all-gather" in message


SHARE = ["--index-topk-freq", "4", "--index-skip-topk-offset", "3"]


@pytest.mark.parametrize("release", RELEASE_NAMES)
def test_index_share_runs_where_the_host_has_it_and_is_refused_by_name_elsewhere(release):
    from mindspeed_laga.features.dsa_checks import check_index_share
    from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME
    args = validate(VALID + DSA + SHARE + ["--index-topk-pattern", "CSCS"])
    if BY_NAME[release].index_share:
        check_index_share(args, BY_NAME[release])
        return
    with pytest.raises(ValueError) as info:
        check_index_share(args, BY_NAME[release])
    message = str(info.value)
    for flag in ("--index-topk-freq", "--index-skip-topk-offset", "--index-topk-pattern",
                 release, "--mla-latent-all-gather"):
        assert flag in message, message
    # the host's defaults set nothing
    check_index_share(validate(VALID + DSA), BY_NAME[release])


@pytest.mark.parametrize("fp8_format", ["e4m3", "hybrid"])
def test_mxfp8_validates(fp8_format):
    """MX scaling: LAGA rebuilds K/V through the module's own FP8 matmul."""
    validate(VALID + ["--fp8-format", fp8_format, "--fp8-recipe", "mxfp8", "--qk-head-dim", "128",
                      "--v-head-dim", "128"])


@pytest.mark.parametrize("targets", [["linear_qkv", "linear_kv_up_proj", "linear_proj"],
                                     ["linear_kv_nope", "linear_v", "linear_qk_nope"]])
def test_lora_on_the_kv_up_projection_validates(targets):
    """Plain LoRA there is read exactly (patches/lora.py); LU-LoRA elsewhere is called as a
    module, so only its combination with a K/V up-projection target is refused."""
    validate(VALID + ["--lora-target-modules", *targets])
    validate(VALID + ["--lu-lora-final-layer-index", "2", "--lora-target-modules",
                      "linear_qkv", "linear_proj", "kv_up_proj"])


def test_zigzag_divisibility_is_the_only_failure_of_the_seq_length_cases():
    # 68 tokens fit contiguous CP=4 (17 each) but not the zigzag 8 chunks
    validate(VALID + ["--context-parallel-algo", "ulysses_cp_algo", "--context-parallel-size",
                      "4", "--seq-length", "68"])


def test_bias_is_rejected_unless_disabled():
    argv = [a for a in VALID if a != "--disable-bias-linear"]
    with pytest.raises(ValueError, match="--disable-bias-linear"):
        validate(argv)


def test_megatrons_default_attention_dropout_is_rejected():
    # a script that never mentions --attention-dropout gets Megatron's 0.1
    argv = VALID[:VALID.index("--attention-dropout")] + VALID[VALID.index("--attention-dropout") + 2:]
    with pytest.raises(ValueError) as info:
        validate(argv)
    assert "--attention-dropout 0.1" in str(info.value)
    assert "Pass --attention-dropout 0.0" in str(info.value)


def test_optimization_level_below_the_features_warns_and_skips_validation(caplog):
    feature = LAGAFeature()
    args = parse(VALID + ["--optimization-level", "1", "--enable-mla-absorb"], feature)
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning) as warned:
        feature.validate_args(args)  # not applied, so the absorb conflict is not raised
    message = str(warned[0].message)
    assert "--mla-latent-all-gather is not applied" in message
    assert "--optimization-level 1" in message and "--optimization-level 2" in message
    assert any("is not applied" in r.getMessage() for r in caplog.records)
    assert not feature.is_need_apply(args)  # what MindSpeed's features manager checks


def test_multi_latent_attention_is_required_at_every_cp_size():
    for cp in ("1", "2"):
        argv = [a for a in VALID if a != "--multi-latent-attention"]
        argv[argv.index("--context-parallel-size") + 1] = cp
        with pytest.raises(ValueError, match="--multi-latent-attention"):
            validate(argv)


def test_cp_size_one_is_a_logged_no_op(caplog):
    argv = list(VALID)
    argv[argv.index("--context-parallel-size") + 1] = "1"
    with caplog.at_level(logging.WARNING):
        validate(argv + ["--enable-mla-absorb"])  # LAGA never runs, so nothing to reject
    assert any("no effect" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu present")
def test_npu_kernel_without_torch_npu_is_rejected():
    with pytest.raises(ValueError, match="--mla-laga-kernel npu"):
        validate(VALID + ["--mla-laga-kernel", "npu"])


# --- cp-algo mapping -----------------------------------------------------------------------

@pytest.mark.parametrize("algo,expected", [
    ("ulysses_cp_algo", ("ulysses", "contiguous")),
    ("kvallgather_cp_algo", ("allgather", "zigzag")),
    ("megatron_cp_algo", ("allgather", "zigzag")),
    ("hybrid_cp_algo", ("hybrid", "zigzag")),
])
def test_cp_algo_mapping(algo, expected):
    settings = laga_settings(parse(VALID + ["--context-parallel-algo", algo,
                                            "--mla-laga-kernel", "eager"]))
    assert (settings.cp_algo, settings.layout, settings.kernel) == expected + ("eager",)
    assert settings.documents is False


# MindSpeed's get_batch_on_this_cp_rank under --reset-attention-mask (causal):
# ulysses and kvallgather take CP contiguous slices, megatron_cp zigzags every document
@pytest.mark.parametrize("algo,expected", [
    ("ulysses_cp_algo", ("ulysses", "contiguous")),
    ("kvallgather_cp_algo", ("allgather", "contiguous")),
    ("megatron_cp_algo", ("allgather", "doc_zigzag")),
])
def test_cp_algo_mapping_with_documents(algo, expected):
    args = validate(VALID + ["--context-parallel-algo", algo, "--reset-attention-mask",
                             "--reset-position-ids", "--micro-batch-size", "1"])
    settings = laga_settings(args)
    assert (settings.cp_algo, settings.layout, settings.documents) == expected + (True,)


def test_document_layouts_are_mindspeeds(host_sources):
    """The branch of MindSpeed's get_batch_on_this_cp_rank each algo takes under
    --reset-attention-mask, read from its source: ulysses/kvallgather -> the
    contiguous split, the others -> the per-document (eod padding) zigzag."""
    root = Path(host_sources["MINDSPEED_SRC"])
    source = (root / "mindspeed" / "core" / "context_parallel" / "get_batch_utils.py").read_text()
    branch = source[source.index("if args.reset_attention_mask and"):]
    branch = branch[:branch.index("elif")]
    assert "['ulysses_cp_algo', 'kvallgather_cp_algo']" in branch
    assert "_get_batch_on_this_cp_rank_in_ulysses_cp(batch)" in branch
    assert "_get_batch_on_this_cp_rank_in_megatron_cp_eod_padding" in branch


def test_default_cp_algo_maps_like_megatron_cp_algo():
    args = argparse.Namespace(mla_laga_kernel="auto")  # no --context-parallel-algo registered
    assert (laga_settings(args).cp_algo, laga_settings(args).layout) == ("allgather", "zigzag")


def test_unmapped_cp_algo_has_no_settings():
    with pytest.raises(ValueError, match="hybrid_adaptive_cp_algo"):
        laga_settings(parse(VALID + ["--context-parallel-algo", "hybrid_adaptive_cp_algo"]))
    with pytest.raises(ValueError, match="hybrid_cp_algo with --reset-attention-mask"):
        laga_settings(parse(VALID + ["--context-parallel-algo", "hybrid_cp_algo",
                                     "--reset-attention-mask"]))


# --- patch registration --------------------------------------------------------------------

def test_register_patches_wraps_the_mindspeed_llm_mla_forward():
    manager = RecordingPatchManager()
    LAGAFeature().register_patches(manager, parse(VALID))
    assert manager.calls == [(MLA_FORWARD, laga_mla_forward_wrapper, False),
                             (GET_MODEL, laga_model_check_wrapper, False)]
    # MindSpeed stacks functions named *wrapper around the target instead of replacing it
    assert laga_mla_forward_wrapper.__name__.endswith("wrapper")
    assert laga_model_check_wrapper.__name__.endswith("wrapper")


def test_patch_target_exists_in_mindspeed_llm_source(release_host_sources):
    """The dotted name resolves to a method in each release's own MindSpeed-LLM source."""
    root = Path(release_host_sources[1]["MINDSPEED_LLM_SRC"])
    module, cls, method = MLA_FORWARD.rsplit(".", 2)
    tree = ast.parse((root / (module.replace(".", "/") + ".py")).read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    assert cls in classes
    assert method in {f.name for f in classes[cls].body if isinstance(f, ast.FunctionDef)}


def test_parser_default_attention_dropout_is_megatrons(host_sources):
    """tests/support/laga_parser.py declares --attention-dropout with Megatron's own default."""
    root = Path(host_sources["MEGATRON_SRC"])
    tree = ast.parse((root / "megatron" / "training" / "arguments.py").read_text())
    defaults = [kw.value.value for call in ast.walk(tree) if isinstance(call, ast.Call)
                and call.args and isinstance(call.args[0], ast.Constant)
                and call.args[0].value == "--attention-dropout"
                for kw in call.keywords if kw.arg == "default"]
    assert defaults == [parse([]).attention_dropout]


def test_register_patches_reads_early_string_args():
    # MindSpeed-LLM applies patches with parse_known_args: Megatron flags arrive as strings
    manager = RecordingPatchManager()
    LAGAFeature().register_patches(manager, argparse.Namespace(context_parallel_size="2"))
    assert [c[0] for c in manager.calls] == [MLA_FORWARD, GET_MODEL]


def test_register_patches_is_a_no_op_at_cp_size_one():
    manager = RecordingPatchManager()
    LAGAFeature().register_patches(manager, argparse.Namespace(context_parallel_size="1"))
    LAGAFeature().register_patches(manager, argparse.Namespace())
    assert manager.calls == []
