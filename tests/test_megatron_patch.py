"""patch_megatron_mla / unpatch_megatron_mla: install, restore, argument checks (in-process).

The training behaviour of the patched forward is proven in test_megatron_e2e.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

import mindspeed_laga  # noqa: E402
from mindspeed_laga import megatron_patch  # noqa: E402
from mindspeed_laga.patches import megatron_mla  # noqa: E402


@pytest.fixture
def mla():
    from megatron.core.transformer.multi_latent_attention import (MLASelfAttention,
                                                                  MultiLatentAttention)
    mindspeed_laga.unpatch_megatron_mla()
    yield MLASelfAttention, MultiLatentAttention.forward
    mindspeed_laga.unpatch_megatron_mla()


def test_patch_installs_and_unpatch_restores(mla):
    cls, original = mla
    assert cls.forward is original and "forward" not in cls.__dict__
    settings = mindspeed_laga.patch_megatron_mla(cp_algo="allgather")
    assert cls.forward is not original and cls.forward.__wrapped__ is original
    assert cls.forward.laga_settings is settings and megatron_patch.patched_settings() is settings
    assert mindspeed_laga.unpatch_megatron_mla() is True
    assert cls.forward is original and "forward" not in cls.__dict__
    assert mindspeed_laga.unpatch_megatron_mla() is False  # not patched: no-op
    assert megatron_patch.patched_settings() is None


def test_patch_is_idempotent_and_replaces_settings(mla):
    cls, original = mla
    mindspeed_laga.patch_megatron_mla(cp_algo="allgather")
    second = mindspeed_laga.patch_megatron_mla(cp_algo="ulysses", layout="contiguous",
                                               form="explicit")
    assert cls.forward.__wrapped__ is original  # never wraps our own forward
    assert (second.cp_algo, second.layout, second.form) == ("ulysses", "contiguous", "explicit")
    assert second.core is mindspeed_laga.explicit_attention
    mindspeed_laga.unpatch_megatron_mla()
    assert cls.forward is original


def test_defaults_and_pass_through_options(mla):
    settings = mindspeed_laga.patch_megatron_mla()
    assert (settings.form, settings.cp_algo, settings.layout, settings.kernel) == \
        ("laga", "allgather", "zigzag", "auto")
    assert settings.core is mindspeed_laga.laga_attention
    assert settings.core_options == {} and settings.overlap_latent_gather is False
    options = dict(trim_causal_prefix=True, recompute_kv=True, kv_block_size=64,
                   check_ranks=False)
    settings = mindspeed_laga.patch_megatron_mla(overlap_latent_gather=True, **options)
    assert settings.core_options == options and settings.overlap_latent_gather is True


@pytest.mark.parametrize("kwargs, words", [
    (dict(cp_algo="ring"), ["cp_algo='ring'", "allgather"]),
    (dict(kernel="flash"), ["kernel='flash'", "sdpa"]),
    (dict(form="absorbed"), ["form='absorbed'", "absorbed_attention"]),
    (dict(cp_algo="ulysses"), ["layout=", "zigzag", "contiguous"]),
    (dict(layout="striped"), ["layout='striped'"]),
    (dict(softmax_scale=0.1), ["softmax_scale", "set by the patched forward"]),
    (dict(cp_group=None), ["cp_group"]),
    (dict(block_size=4), ["block_size", "not accepted by laga_attention"]),
    (dict(form="explicit", trim_causal_prefix=True),
     ["trim_causal_prefix", "explicit_attention"]),
    (dict(latent_gather=object()), ["latent_gather", "overlap_latent_gather=True"]),
    (dict(overlap_latent_gather=1), ["overlap_latent_gather=1"]),
    (dict(form="explicit", overlap_latent_gather=True), ["overlap_latent_gather", "form='laga'"]),
])
def test_bad_arguments_raise_before_patching(mla, kwargs, words):
    cls, original = mla
    with pytest.raises(ValueError) as info:
        mindspeed_laga.patch_megatron_mla(**kwargs)
    for word in words:
        assert word in str(info.value)
    assert cls.forward is original  # nothing installed


def test_npu_kernel_needs_torch_npu(mla):
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed")
    except ImportError:
        pass
    with pytest.raises(ValueError, match="torch_npu"):
        mindspeed_laga.patch_megatron_mla(kernel="npu")


# ----------------------------------------------------------------- the TE fused kv norm

def _module(fused, normalization="RMSNorm"):
    config = SimpleNamespace(layernorm_zero_centered_gamma=False, layernorm_epsilon=1e-5,
                             normalization=normalization)
    return SimpleNamespace(kv_layernorm=torch.nn.Identity(), linear_kv_up_proj=fused,
                           config=config)


def test_kv_norm_uses_the_plain_kv_layernorm():
    x = torch.randn(3, 2, 8)
    norm = torch.nn.LayerNorm(8)
    module = SimpleNamespace(kv_layernorm=norm, linear_kv_up_proj=SimpleNamespace(),
                             config=SimpleNamespace())
    torch.testing.assert_close(megatron_mla._kv_norm(module, x), norm(x))


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_kv_norm_applies_te_fused_norm(normalization, zero_centered):
    """TE's spec fuses kv_layernorm into linear_kv_up_proj: the latent must still be normed."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 8, generator=gen)
    weight, bias = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    fused = SimpleNamespace(layer_norm_weight=weight, layer_norm_bias=bias, eps=1e-6,
                            normalization=normalization, zero_centered_gamma=zero_centered)
    gain = weight + 1 if zero_centered else weight
    if normalization == "RMSNorm":
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain
    else:
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        expected = (x - mean) * torch.rsqrt(var + 1e-6) * gain + bias
    got = megatron_mla._kv_norm(_module(fused, normalization), x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
