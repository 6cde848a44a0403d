"""patch_megatron_mla / unpatch_megatron_mla: install, restore, argument checks, host
version guard, attention dropout (in-process).

The training behaviour of the patched forward is proven in test_megatron_e2e.py.
"""
from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.core")

import mindspeed_laga  # noqa: E402
from mindspeed_laga.patches.megatron_core import host as megatron_host  # noqa: E402
from mindspeed_laga.patches.megatron_core import mla as megatron_mla, patch as megatron_patch  # noqa: E402

pytestmark = pytest.mark.mcore  # the leg that runs it (tests/conftest.py)


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
    (dict(layout="striped"), ["layout='striped'"]),
    (dict(softmax_scale=0.1), ["softmax_scale", "set by the patched forward"]),
    (dict(cp_group=None), ["cp_group"]),
    (dict(block_size=4), ["block_size", "not accepted by laga_attention"]),
    (dict(form="explicit", trim_causal_prefix=True),
     ["trim_causal_prefix", "explicit_attention"]),
    (dict(latent_gather=object()), ["latent_gather", "overlap_latent_gather=True"]),
    (dict(overlap_latent_gather=1), ["overlap_latent_gather=1"]),
    (dict(form="explicit", overlap_latent_gather=True), ["overlap_latent_gather", "form='laga'"]),
    (dict(ulysses_degree=2), ["ulysses_degree=2", "cp_algo='hybrid'"]),
    (dict(cp_algo="ulysses", ulysses_degree=2), ["ulysses_degree=2", "cp_algo='ulysses'"]),
    (dict(cp_algo="hybrid"), ["cp_algo='hybrid'", "ulysses_degree=U"]),
    (dict(cp_algo="hybrid", ulysses_degree=0), ["ulysses_degree=0", "positive int"]),
    (dict(cp_algo="hybrid", ulysses_degree=2.0), ["ulysses_degree=2.0", "positive int"]),
    (dict(cp_algo="hybrid", ulysses_degree=2, ulysses_group=None), ["ulysses_group"]),
    (dict(cu_seqlens=[0, 8]), ["cu_seqlens", "set by the patched forward"]),
    (dict(layout="doc_zigzag"), ["layout='doc_zigzag'", "packed_seq_params"]),
    # the core options' values, checked at patch time (not on the first forward)
    (dict(recompute_kv="yes", kv_block_size=-4, check_ranks=0),
     ["patch_megatron_mla: check_ranks must be True, False or None, got 0"]),
    (dict(recompute_kv="yes"), ["patch_megatron_mla: recompute_kv must be True or False, got 'yes'"]),
    (dict(recompute_kv=True, kv_block_size=-4), ["kv_block_size must be a positive int", "-4"]),
    (dict(recompute_kv=True, kv_block_size=True), ["kv_block_size must be a positive int"]),
    (dict(kv_block_size=8), ["kv_block_size needs recompute_kv=True"]),
    (dict(trim_causal_prefix=1), ["trim_causal_prefix must be True or False, got 1"]),
    (dict(form="explicit", pad_v="no"), ["pad_v must be True or False"]),
])
def test_bad_arguments_raise_before_patching(mla, kwargs, words):
    cls, original = mla
    with pytest.raises(ValueError) as info:
        mindspeed_laga.patch_megatron_mla(**kwargs)
    for word in words:
        assert word in str(info.value)
    assert cls.forward is original  # nothing installed


def test_positional_arguments_and_the_legacy_settings_name(mla):
    settings = mindspeed_laga.patch_megatron_mla("ulysses", "eager", "explicit", "contiguous")
    assert (settings.cp_algo, settings.kernel, settings.form, settings.layout) == (
        "ulysses", "eager", "explicit", "contiguous")


def test_ulysses_without_layout_takes_megatrons_zigzag_split(mla):
    settings = mindspeed_laga.patch_megatron_mla(cp_algo="ulysses")
    assert (settings.cp_algo, settings.layout) == ("ulysses", "zigzag")
    # the split megatron's own get_batch_on_this_cp_rank produces: 2P chunks, r and 2P-1-r
    from megatron.core.utils import get_batch_on_this_cp_rank
    from mindspeed_laga import layout as layouts
    import inspect
    import unittest.mock as mock
    P, s = 2, 8
    tokens = torch.arange(2 * P * s).view(1, -1)
    takes_group = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
    for r in range(P):
        if takes_group:  # 0.18+: the CP group is an argument, its size/rank from torch.distributed
            sizes = (mock.patch("torch.distributed.get_world_size", return_value=P),
                     mock.patch("torch.distributed.get_rank", return_value=r))
            args = dict(is_hybrid_cp=False, cp_group=object())
        else:  # 0.16.1, 0.17: from parallel_state
            sizes = (mock.patch("megatron.core.parallel_state.get_context_parallel_world_size",
                                return_value=P),
                     mock.patch("megatron.core.parallel_state.get_context_parallel_rank",
                                return_value=r))
            args = {}
        with sizes[0], sizes[1]:
            got = get_batch_on_this_cp_rank({"tokens": tokens.clone()}, **args)["tokens"].view(-1)
        expected = layouts.positions(settings.layout, P, r, got.numel())
        assert got.tolist() == expected.tolist()


class _ThirdPartyWrapper:
    """Another library wrapping whatever MLASelfAttention.forward is (functools.wraps style)."""

    def __init__(self, inner):
        self.inner = inner
        self.__dict__.update(getattr(inner, "__dict__", {}))  # copies laga_settings, as wraps does

    def __get__(self, obj, cls=None):
        return self if obj is None else (lambda *a, **k: self.inner(obj, *a, **k))


def test_unpatch_refuses_when_a_wrapper_sits_over_the_patch(mla):
    cls, original = mla
    mindspeed_laga.patch_megatron_mla()
    ours = cls.__dict__["forward"]
    cls.forward = _ThirdPartyWrapper(ours)
    with pytest.raises(RuntimeError, match="no longer LAGA's forward.*remove that wrapper"):
        mindspeed_laga.unpatch_megatron_mla()
    with pytest.raises(RuntimeError, match="no longer LAGA's forward"):
        mindspeed_laga.patch_megatron_mla()  # re-patching would drop the wrapper too
    cls.forward = ours  # the other library removes its wrapper
    assert mindspeed_laga.unpatch_megatron_mla() is True and cls.forward is original


def test_patch_survives_a_reload_without_double_wrapping(mla):
    import importlib
    cls, original = mla
    mindspeed_laga.patch_megatron_mla()
    importlib.reload(megatron_mla)
    reloaded = importlib.reload(megatron_patch)
    try:
        settings = mindspeed_laga.patch_megatron_mla(cp_algo="ulysses")
        assert cls.forward.__wrapped__ is original and settings.cp_algo == "ulysses"
        assert reloaded.patched_settings() is settings
        assert mindspeed_laga.unpatch_megatron_mla() is True
        assert cls.forward is original and "forward" not in cls.__dict__
    finally:
        mindspeed_laga.unpatch_megatron_mla()


def test_unsupported_megatron_core_is_named(mla, monkeypatch):
    cls, original = mla
    monkeypatch.setattr(megatron_host, "megatron_core_version", lambda: "0.9.0")
    with pytest.raises(megatron_host.UnsupportedHostError) as info:
        mindspeed_laga.patch_megatron_mla()
    assert "megatron-core 0.9.0 is installed" in str(info.value)
    assert "0.16.1" in str(info.value)
    assert cls.forward is original


def test_megatron_core_lacking_a_function_is_named(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils
    monkeypatch.delattr(rope_utils, "_apply_rotary_pos_emb_bshd")
    with pytest.raises(megatron_host.UnsupportedHostError, match="_apply_rotary_pos_emb_bshd"):
        megatron_host.check_megatron_core(megatron_host.SUPPORTED_MEGATRON_CORE[0])


def test_installed_megatron_core_is_supported():
    assert megatron_host.check_megatron_core() in megatron_host.SUPPORTED_MEGATRON_CORE


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def _patched_forward_on(training, dropout, cp_size=2):
    calls = []

    def original(self, hidden_states, attention_mask=None):
        calls.append(hidden_states)
        return "original"

    forward = megatron_mla.make_forward(original, megatron_patch.make_settings())
    module = SimpleNamespace(training=training, config=SimpleNamespace(attention_dropout=dropout),
                             pg_collection=SimpleNamespace(cp=_Group(cp_size)))
    return forward, module, calls


def test_attention_dropout_in_training_raises_naming_the_fix():
    forward, module, calls = _patched_forward_on(training=True, dropout=0.1)
    with pytest.raises(ValueError, match=r"attention_dropout=0\.1.*attention_dropout=0\.0"):
        forward(module, torch.zeros(2, 1, 4))
    assert calls == []  # no fallback to the original forward: it would train with dropout


def test_attention_dropout_where_lagas_does_not_run_is_left_alone():
    # CP size 1: the patch hands every call to the original forward, dropout included
    forward, module, calls = _patched_forward_on(training=True, dropout=0.1, cp_size=1)
    assert forward(module, torch.zeros(2, 1, 4)) == "original" and len(calls) == 1
    # evaluation: no dropout is applied, so nothing differs
    _, module, _ = _patched_forward_on(training=False, dropout=0.1)
    megatron_mla.check_attention_dropout(module)


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


# ----------------------------------------------------------------- what differs between releases

def test_mla_rope_is_deinterleaved_rope_on_this_release():
    """releases.apply_mla_rope with the installed release's keyword: MLA's rope is the
    rotate-half rope on the de-interleaved channels (pairs 0,2,4.. then 1,3,5..), scaled by
    mscale; and it does not warn (0.19 deprecates the 0.16.1 keyword)."""
    import warnings
    from mindspeed_laga.patches.megatron_core import releases as megatron_releases
    gen = torch.Generator().manual_seed(0)
    s, b, n, d = 5, 2, 3, 4
    x = torch.randn(s, b, n, d, generator=gen)
    freqs = torch.randn(s, 1, 1, d, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = megatron_releases.apply_mla_rope(x, freqs, rotary_interleaved=False, mscale=0.7)
    t = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    rotated = torch.cat([-t[..., d // 2:], t[..., :d // 2]], dim=-1)
    expected = t * torch.cos(freqs) * 0.7 + rotated * torch.sin(freqs) * 0.7
    torch.testing.assert_close(got, expected)


def test_down_projection_is_the_modules_own_where_it_has_one():
    """0.17+ (and its fused q/kv down-projection subclass) project in _qkv_down_projection;
    0.16.1 modules have none, and the inlined projection is used."""
    from mindspeed_laga.patches.megatron_core import releases as megatron_releases
    hidden = torch.randn(3, 1, 8)
    fused = SimpleNamespace(_qkv_down_projection=lambda h: ("q", h * 2))
    q, kv = megatron_releases.qkv_down_projection(fused, hidden, tp_group=None)
    assert q == "q" and torch.equal(kv, hidden * 2)
    weight = torch.randn(6, 8)
    plain = SimpleNamespace(config=SimpleNamespace(q_lora_rank=None),
                            linear_kv_down_proj=lambda h: (h @ weight.T, None))
    q, kv = megatron_releases.qkv_down_projection(plain, hidden, tp_group=None)
    assert q is hidden and torch.equal(kv, hidden @ weight.T)


# ----------------------------------------------------------------- hybrid CP settings

def test_hybrid_settings_carry_the_degree_and_the_hybrid_zigzag(mla):
    settings = mindspeed_laga.patch_megatron_mla(cp_algo="hybrid", ulysses_degree=2)
    assert (settings.cp_algo, settings.ulysses_degree, settings.layout) == ("hybrid", 2, "zigzag")
    assert mindspeed_laga.patch_megatron_mla().ulysses_degree == 1


@pytest.mark.parametrize("degree, cp, heads, words", [
    (3, 4, 6, ["ulysses_degree=3", "does not divide", "context-parallel size 4"]),
    (2, 4, 3, ["ulysses_degree=2", "3 attention heads", "divides the heads"]),
])
def test_hybrid_shape_errors_name_the_fix(degree, cp, heads, words):
    from mindspeed_laga.patches.megatron_core import hybrid as megatron_hybrid
    with pytest.raises(ValueError) as info:
        megatron_hybrid.check_hybrid_shape(degree, cp, heads)
    for word in words:
        assert word in str(info.value)
    megatron_hybrid.check_hybrid_shape(2, 4, 4)  # fine


# ----------------------------------------------------------------- packed (THD) calls

def _thd_params(real, padded=None, kv=None, max_seqlen=8):
    from megatron.core.packed_seq_params import PackedSeqParams
    t = lambda b: None if b is None else torch.tensor(b, dtype=torch.int32)  # noqa: E731
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=t(real), cu_seqlens_kv=t(kv or real),
                           cu_seqlens_q_padded=t(padded), cu_seqlens_kv_padded=t(padded),
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


@pytest.mark.parametrize("kwargs, hidden, causal, algo, layout, words", [
    (dict(real=[0, 8, 16], kv=[0, 16]), (8, 1, 4), True, "allgather", "zigzag",
     ["cu_seqlens_kv=[0, 16]", "cu_seqlens_q=[0, 8, 16]"]),
    (dict(real=[0, 8, 16]), (4, 2, 4), True, "allgather", "zigzag", ["micro-batch 1"]),
    (dict(real=[0, 5, 13], padded=[0, 8, 16]), (8, 1, 4), False, "allgather", "zigzag",
     ["causal", "pad tokens"]),
    (dict(real=[0, 8, 16]), (8, 1, 4), True, "hybrid", "zigzag", ["cp_algo='hybrid'"]),
    (dict(real=[0, 8, 16]), (8, 1, 4), True, "ulysses", "contiguous", ["layout='contiguous'"]),
    (dict(real=[0, 5, 13]), (8, 1, 4), True, "allgather", "zigzag",
     ["end at 13", "16 tokens", "cu_seqlens_q_padded"]),
])
def test_packed_call_errors_name_the_argument(kwargs, hidden, causal, algo, layout, words):
    from mindspeed_laga.patches.megatron_core import thd as megatron_thd
    with pytest.raises(ValueError) as info:
        megatron_thd.packed_batch(_thd_params(**kwargs), torch.zeros(hidden), 2, causal, algo,
                                  layout)
    for word in words:
        assert word in str(info.value)


def test_packed_call_takes_the_padded_boundaries():
    from mindspeed_laga.patches.megatron_core import thd as megatron_thd
    packed = megatron_thd.packed_batch(_thd_params([0, 5, 13], [0, 8, 16]), torch.zeros(8, 1, 4),
                                       2, True, "allgather", "zigzag")
    assert (packed.documents, packed.padded, packed.rope_rows) == ((0, 8, 16), True, 8)


@pytest.mark.parametrize("max_seqlen", [12, 24])
@pytest.mark.parametrize("cp", [1, 2])
def test_packed_rope_positions_follow_megatrons_thd_rope(max_seqlen, cp):
    """The rope rows LAGA picks are those megatron's _apply_rotary_pos_emb_thd applies:
    a table whose row i holds i, passed through megatron's own function."""
    from megatron.core.models.common.embeddings import rope_utils
    from mindspeed_laga.patches.megatron_core import thd as megatron_thd
    bounds = [0, 8, 20, 24]
    params = _thd_params([0, 6, 20, 23], bounds, max_seqlen=max_seqlen)
    for rank in range(cp):
        local = 24 // cp
        packed = megatron_thd.packed_batch(params, torch.zeros(local, 1, 4), cp, True,
                                           "allgather", "zigzag")
        positions, rows = megatron_thd.packed_rope_positions(packed, cp, rank, local)
        table = torch.arange(max(rows, max_seqlen), dtype=torch.float64)
        freqs = table.view(-1, 1, 1, 1).expand(-1, 1, 1, 2).contiguous()
        seen = []

        def spy(t, f, **kwargs):
            seen.append(f.reshape(f.shape[0], -1)[:, 0])
            return t

        group = SimpleNamespace(size=lambda: cp, rank=lambda: rank)
        with mock.patch.object(rope_utils, "_apply_rotary_pos_emb_bshd", spy):
            rope_utils._apply_rotary_pos_emb_thd(torch.zeros(local, 1, 2),
                                                 torch.tensor(bounds), freqs[:max_seqlen],
                                                 cp_group=group)
        # 0.16.1 applies one table to the whole split, 0.19 one call per sequence
        applied = torch.cat(seen).long().tolist()
        assert positions.tolist() == applied, (rank, positions, applied)


@pytest.mark.parametrize("cp_algo, degree", [("allgather", None), ("hybrid", 2)])
def test_attention_dropout_still_raises_on_packed_and_hybrid_calls(cp_algo, degree):
    """Neither a THD call nor hybrid CP gets past the dropout check (nor falls back)."""
    calls = []

    def original(self, hidden_states, attention_mask=None, packed_seq_params=None):
        calls.append(hidden_states)
        return "original"

    settings = megatron_patch.make_settings(cp_algo=cp_algo, ulysses_degree=degree)
    forward = megatron_mla.make_forward(original, settings)
    module = SimpleNamespace(training=True, config=SimpleNamespace(attention_dropout=0.1),
                             pg_collection=SimpleNamespace(cp=_Group(2)))
    with pytest.raises(ValueError, match=r"attention_dropout=0\.0"):
        forward(module, torch.zeros(8, 1, 4), None,
                packed_seq_params=_thd_params([0, 8, 16]))
    assert calls == []
