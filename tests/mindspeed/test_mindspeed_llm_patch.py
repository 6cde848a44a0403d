"""The LAGA wrapper of MindSpeed-LLM's ``CustomMLASelfAttention.forward``.

Against the stand-in class of tests/support/mindspeed_llm_standin.py (same submodules
and forward math as the real class), on spawned gloo ranks with megatron-core's
``parallel_state``:

- CP = 1: the wrapped forward *is* the original (bit-identical, original
  called); the LAGA path itself (``laga_self_attention``) matches the original
  forward's output, input grad and every parameter grad.
- CP = 2: the wrapped forward takes the LAGA path (the original is not
  called, the only all-gather moves kv_lora_rank + rope dim values per token)
  and, unsharded, matches the CP = 1 original on the full sequence: output,
  hidden-states grad, and every parameter grad summed over the CP ranks (as
  Megatron's dp x cp reduction does). Evaluation, packed sequences and a
  disabled flag run the original forward.

Each case varies what the wrapper must reproduce: q_lora_rank set or not,
fused ``linear_kv_up_proj`` or ``--mla-mm-split``, ``--qk-layernorm``, the
q/kv-lora scales, yarn's softmax mscale, all three mapped CP algorithms, and
the ``--moe-fb-overlap`` all-to-all hooks.

The real class: tests/support/mindspeed_llm_real.py, on the real sources of every
tested release pair (``release_host_sources``, tests/support/thirdparty.py).
"""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mindspeed_laga import layout as layouts
from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME
from mindspeed_laga.tools.spawn import run_on_ranks

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

SEQ, BATCH, SEED = 16, 2, 1234
STANDIN_RELEASE = BY_NAME["master"]  # the stand-in's forward is master's
TOLERANCE = 1e-5  # float32, relative to the largest reference magnitude

CASES = {
    "qlora-fused-kvallgather-eager": dict(
        config={}, args=dict(qk_layernorm=True, context_parallel_algo="kvallgather_cp_algo",
                             mla_laga_kernel="eager")),
    "noqlora-mmsplit-ulysses-yarn": dict(
        config=dict(q_lora_rank=None), args=dict(
            mla_mm_split=True, context_parallel_algo="ulysses_cp_algo",
            rope_scaling_type="yarn", rope_scaling_factor=40.0, rope_scaling_mscale_all_dim=1.0)),
    "qlora-mmsplit-scaled-megatron-fboverlap": dict(
        config={}, args=dict(qk_layernorm=True, mla_mm_split=True, enable_mla_scale_q_lora=True,
                             enable_mla_scale_kv_lora=True,
                             context_parallel_algo="megatron_cp_algo",
                             rope_scaling_type="yarn", rope_scaling_factor=4.0,
                             rope_scaling_mscale_all_dim=0.7), a2a=True),
    # the options of docs/BEYOND.md, all on, through the feature's flags
    "qlora-fused-kvallgather-recompute-blockwise-trim-overlap": dict(
        config={}, args=dict(qk_layernorm=True, context_parallel_algo="kvallgather_cp_algo",
                             mla_laga_recompute_kv=True, mla_laga_kv_block_size=3,
                             mla_laga_trim_causal_prefix=True, mla_laga_overlap=True)),
    "noqlora-mmsplit-ulysses-recompute-overlap": dict(
        config=dict(q_lora_rank=None), args=dict(
            mla_mm_split=True, context_parallel_algo="ulysses_cp_algo", mla_laga_recompute_kv=True,
            mla_laga_kv_block_size=4, mla_laga_overlap=True)),
}


def megatron_args(case, config):
    args = dict(mla_latent_all_gather=True, mla_laga_kernel="auto", qk_layernorm=False,
                mla_mm_split=False, enable_mla_scale_q_lora=False, enable_mla_scale_kv_lora=False,
                rope_scaling_type=None, rope_scaling_factor=1.0, rope_scaling_mscale_all_dim=None,
                qk_head_dim=config.qk_head_dim, qk_pos_emb_head_dim=config.qk_pos_emb_head_dim)
    args.update(case["args"])
    return SimpleNamespace(**args)


# --- spawned ranks --------------------------------------------------------------------------

A2A_CALLS = {"forward": 0, "backward": 0}


def _install_fb_overlap_standin():
    """The two MindSpeed functions the --moe-fb-overlap path calls, counting calls."""
    import types

    module = types.ModuleType(
        "mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules.attention")

    def launch_async_all2all():
        A2A_CALLS["forward"] += 1

    def launch_async_all2all_hook(_grad):
        A2A_CALLS["backward"] += 1

    module.launch_async_all2all = launch_async_all2all
    module.launch_async_all2all_hook = launch_async_all2all_hook
    sys.modules[module.__name__] = module


def _run(module, forward, hidden, rope, grad_out):
    from support.mindspeed_llm_standin import forward_backward
    return forward_backward(module, forward, hidden, rope, grad_out)


def worker(rank, world, cases):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from support import mindspeed_llm_standin as standin
    from mindspeed_laga import count_bytes
    from mindspeed_laga.features.laga_args import laga_settings
    from mindspeed_laga.patches.mindspeed_llm.forward import (laga_mla_forward_wrapper, laga_self_attention)

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    _install_fb_overlap_standin()
    wrapped = laga_mla_forward_wrapper(standin.StandinMLASelfAttention.forward, STANDIN_RELEASE)
    results = {}
    try:
        for name, case in cases.items():
            config = standin.mla_config(**case["config"])
            args = megatron_args(case, config)
            standin.install_megatron_args(args)
            torch.manual_seed(SEED)
            module = standin.StandinMLASelfAttention(config)
            module.a2a_hooked_on_attention = case.get("a2a", False)
            hidden = torch.randn(SEQ, BATCH, config.hidden_size)
            grad_out = torch.randn(SEQ, BATCH, config.hidden_size)
            rope = standin.rope_table(SEQ, config.qk_pos_emb_head_dim)
            res = results[name] = {}
            calls = lambda: module.original_calls  # noqa: E731
            original = lambda h, r: module.forward(h, None, rotary_pos_emb=r)  # noqa: E731
            patched = lambda h, r: wrapped(module, h, None, rotary_pos_emb=r)  # noqa: E731
            if world == 1:
                res["original"] = _run(module, original, hidden, rope, grad_out)
                before = calls()
                res["wrapped"] = _run(module, patched, hidden, rope, grad_out)
                res["wrapped_called_original"] = calls() - before
                res["laga"] = _run(module, lambda h, r: laga_self_attention(
                    module, h, r, dist.group.WORLD, args, release=STANDIN_RELEASE),
                    hidden, rope, grad_out)
                continue
            layout = laga_settings(args).layout
            shard = lambda t: layouts.shard(t, layout, world, rank, dim=0)  # noqa: E731
            A2A_CALLS.update(forward=0, backward=0)
            before = calls()
            with count_bytes() as counter:
                res["wrapped"] = _run(module, patched, shard(hidden), shard(rope),
                                      shard(grad_out))
            res["wrapped_called_original"] = calls() - before
            res["all_gather_forward_bytes"] = counter.bytes(kind="all_gather", direction="forward")
            res["a2a_calls"] = dict(A2A_CALLS)
            res["fallbacks"] = _fallbacks(module, wrapped, args, shard(hidden), shard(rope))
    finally:
        parallel_state.destroy_model_parallel()
    return results


def _fallbacks(module, wrapped, args, hidden, rope):
    """How often the original forward ran for each call LAGA must not take."""
    counts = {}
    with torch.no_grad():
        before = module.original_calls
        module.eval()
        wrapped(module, hidden, None, rotary_pos_emb=rope)
        module.train()
        counts["eval"] = module.original_calls - before
        before = module.original_calls
        wrapped(module, hidden, None, rotary_pos_emb=rope, packed_seq_params=object())
        counts["packed"] = module.original_calls - before
        before = module.original_calls
        args.mla_latent_all_gather = False
        wrapped(module, hidden, None, rotary_pos_emb=rope)
        args.mla_latent_all_gather = True
        counts["flag_off"] = module.original_calls - before
    return counts


# --- tests ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cp1():
    return run_on_ranks(worker, 1, CASES)[0]


@pytest.fixture(scope="module")
def cp2():
    return run_on_ranks(worker, 2, CASES)


def _relative_errors(got, ref):
    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    errors = {"output": rel(got["output"], ref["output"]),
              "hidden_grad": rel(got["hidden_grad"], ref["hidden_grad"])}
    assert got["param_grads"].keys() == ref["param_grads"].keys()
    for name, grad in ref["param_grads"].items():
        errors[name] = rel(got["param_grads"][name], grad)
    return errors


def _unshard(per_rank, name, layout):
    parts = [r[name]["wrapped"] for r in per_rank]
    return dict(output=layouts.unshard([p["output"] for p in parts], layout),
                hidden_grad=layouts.unshard([p["hidden_grad"] for p in parts], layout),
                param_grads={k: sum(p["param_grads"][k] for p in parts)
                             for k in parts[0]["param_grads"]})


def _layout(name):
    algo = CASES[name]["args"]["context_parallel_algo"]
    return "contiguous" if algo == "ulysses_cp_algo" else "zigzag"


@pytest.mark.parametrize("name", CASES)
def test_cp1_wrapped_forward_is_the_original(cp1, name):
    res = cp1[name]
    assert res["wrapped_called_original"] == 1
    assert torch.equal(res["wrapped"]["output"], res["original"]["output"])
    assert torch.equal(res["wrapped"]["hidden_grad"], res["original"]["hidden_grad"])


@pytest.mark.parametrize("name", CASES)
def test_cp1_laga_path_matches_original_math(cp1, name):
    errors = _relative_errors(cp1[name]["laga"], cp1[name]["original"])
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"{name}: {bad}"


@pytest.mark.parametrize("name", CASES)
def test_cp2_laga_matches_cp1_original(cp1, cp2, name):
    assert all(r[name]["wrapped_called_original"] == 0 for r in cp2)
    errors = _relative_errors(_unshard(cp2, name, _layout(name)), cp1[name]["original"])
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"{name}: {bad}"


@pytest.mark.parametrize("name", CASES)
def test_cp2_all_gathers_only_the_latent(cp2, name):
    from support.mindspeed_llm_standin import mla_config
    config = mla_config(**CASES[name]["config"])
    latent_bytes = (SEQ // 2) * BATCH * (config.kv_lora_rank + config.qk_pos_emb_head_dim) * 4
    assert [r[name]["all_gather_forward_bytes"] for r in cp2] == [latent_bytes] * 2


@pytest.mark.parametrize("name", CASES)
def test_cp2_falls_back_to_the_original(cp2, name):
    for r in cp2:
        assert r[name]["fallbacks"] == {"eval": 1, "packed": 1, "flag_off": 1}


def test_cp2_fb_overlap_all_to_all_is_launched_once_each_way(cp2):
    for r in cp2:
        assert r["qlora-mmsplit-scaled-megatron-fboverlap"]["a2a_calls"] == {
            "forward": 1, "backward": 1}
        assert r["qlora-fused-kvallgather-eager"]["a2a_calls"] == {"forward": 0, "backward": 0}


# --- the real class, on every tested release ----------------------------------------------

@pytest.mark.hosts  # half a minute a release, master's too: the Ascend leg's matrix
def test_real_custom_mla_self_attention(release_host_sources):
    """tests/support/mindspeed_llm_real.py on one release pair's sources: the release LAGA
    identifies shows the pair's facts, and every case matches the real forward."""
    release, sources = release_host_sources
    script = Path(__file__).resolve().parents[1] / "support" / "mindspeed_llm_real.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=dict(os.environ, **sources, LAGA_EXPECT_RELEASE=release),
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    # the host shows facts, not a name: a release with another's facts is identified as it
    assert f"facts: {BY_NAME[release].facts()}\n" in proc.stdout, proc.stdout[-4000:]
    assert "real CustomMLASelfAttention: ok" in proc.stdout, proc.stdout[-4000:]


# --- host release guard ---------------------------------------------------------------------

class CustomMLASelfAttention:
    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        """A MindSpeed-LLM forward of no tested release: it never reads the kv-lora scale
        and de-interleaves no rope."""
        compressed_kv_norm = self.kv_layernorm(hidden_states)
        return self.linear_proj(compressed_kv_norm)


_untested_forward = CustomMLASelfAttention.forward


def test_wrapping_an_untested_forward_names_the_tested_releases():
    from mindspeed_laga.patches.mindspeed_llm.host import SUPPORTED_MINDSPEED_LLM
    from mindspeed_laga.patches.mindspeed_llm.releases import RELEASES
    from mindspeed_laga.patches.common import UnsupportedHostError
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper
    with pytest.raises(UnsupportedHostError) as info:
        laga_mla_forward_wrapper(_untested_forward)
    message = str(info.value)
    assert SUPPORTED_MINDSPEED_LLM == tuple(r.name for r in RELEASES)
    for name in SUPPORTED_MINDSPEED_LLM:
        assert f"MindSpeed-LLM {name} (" in message, name
    assert "-mla_scale_kv_lora" in message and "--mla-latent-all-gather" in message


def test_another_features_unwrapped_wrapper_is_left_to_the_module_check():
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper

    def other_feature_wrapper(self, *args, **kwargs):  # no functools.wraps: source unknown
        return _untested_forward(self, *args, **kwargs)

    laga_mla_forward_wrapper(other_feature_wrapper)  # no false rejection at patch time


def test_the_standin_class_is_no_release_and_is_refused_on_its_first_call():
    from mindspeed_laga.patches.common import UnsupportedHostError
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_self_attention
    from support.mindspeed_llm_standin import StandinMLASelfAttention, mla_config
    module = StandinMLASelfAttention.__new__(StandinMLASelfAttention)
    with pytest.raises(UnsupportedHostError, match="StandinMLASelfAttention is not a tested"):
        laga_self_attention(module, None, None, cp_group=object(), megatron_args=None)
    assert mla_config  # (the stand-in tests name its release: master)


def test_a_module_missing_an_attribute_is_named_before_any_collective():
    from mindspeed_laga.patches.common import UnsupportedHostError
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_self_attention
    module = SimpleNamespace(linear_qkv=None)  # what an older class would lack is the rest
    with pytest.raises(UnsupportedHostError, match="mla_scale_kv_lora"):
        # a cp_group that would fail if touched: the guard runs first
        laga_self_attention(module, None, None, cp_group=object(), megatron_args=None,
                            release=STANDIN_RELEASE)
    with pytest.raises(UnsupportedHostError) as info:  # 2.x reads no latent scale
        laga_self_attention(module, None, None, cp_group=object(), megatron_args=None,
                            release=BY_NAME["2.3.0"])
    assert "mla_scale" not in str(info.value) and "q_rank" in str(info.value)
