"""patches/lora.py: the weight a (LoRA-wrapped) linear applies, and what it refuses.

Against peft's real ``lora.Linear`` (peft 0.7.1, CI's Ascend leg: ``hosts``; skipped
without peft, failed under ``CI=true``): ``x @ effective_weight(m).T`` equals ``m(x)``
and gives ``lora_A``/``lora_B`` (and the base weight) the grads ``m(x)`` gives them,
with several adapters, merged ones, disabled ones; dropout, DoRA, nested adapters and
a forward LAGA does not know raise naming the module. Without peft (every leg): an
unknown wrapper raises by name from the MindSpeed-LLM adapter's weight read, fused
and mm-split, before anything else runs. The CP runs with the real host classes are in
test_lora_real.py.
"""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mindspeed_laga.patches.lora import UnsupportedLoRAError, effective_weight
from support.thirdparty import require_peft
from support.unknown_adapter import UnknownAdapter

pytestmark = pytest.mark.ascend


def test_a_plain_linear_is_its_weight():
    linear = nn.Linear(4, 6, bias=False)
    assert effective_weight(linear) is linear.weight


@pytest.mark.parametrize("mm_split", [False, True])
def test_an_unknown_wrapper_on_the_kv_up_projection_raises_by_name(mm_split):
    from mindspeed_laga.patches.mindspeed_llm.forward import _kv_up_weight
    heads, d_n, d_v, d_c = 2, 3, 4, 5
    module = SimpleNamespace(
        mla_mm_split=mm_split, num_attention_heads_per_partition=heads, qk_head_dim=d_n,
        v_head_dim=d_v, kv_lora_rank=d_c,
        linear_kv_up_proj=UnknownAdapter(nn.Linear(d_c, heads * (d_n + d_v), bias=False)),
        linear_kv_nope=nn.Linear(d_c, heads * d_n, bias=False),
        linear_v=UnknownAdapter(nn.Linear(d_c, heads * d_v, bias=False)))
    with pytest.raises(UnsupportedLoRAError) as info:
        _kv_up_weight(module)
    name = "linear_v" if mm_split else "linear_kv_up_proj"
    message = str(info.value)
    assert f"{name} is wrapped by {UnknownAdapter.__module__}.UnknownAdapter" in message
    assert "--lora-target-modules" in message and "--mla-latent-all-gather" in message


# --- peft's real LoRA layer ------------------------------------------------------------------

@pytest.fixture
def lora():
    require_peft()
    from peft.tuners import lora
    return lora


def _wrapped(lora, dropout=0.0, adapters=("default",)):
    torch.manual_seed(0)
    module = lora.Linear(nn.Linear(8, 12, bias=False), adapters[0], r=3, lora_alpha=6,
                         lora_dropout=dropout)
    for name in adapters[1:]:
        module.update_layer(name, 2, 5, dropout, True)
    with torch.no_grad():
        for p in module.lora_B.parameters():
            p.normal_()  # peft starts lora_B at zero: no delta would be in the model
    return module


def _same_as_forward(module, adapters):
    module.set_adapter(list(adapters))
    x = torch.randn(5, 8)
    grad = torch.randn(5, 12)
    module.zero_grad()
    (module(x) * grad).sum().backward()
    expected = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    output = module(x).detach()
    module.zero_grad()
    got = x @ effective_weight(module).T
    torch.testing.assert_close(got, output, rtol=1e-5, atol=1e-6)
    (got * grad).sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    return expected


@pytest.mark.hosts
def test_one_adapter_is_base_plus_delta_with_the_forwards_grads(lora):
    module = _wrapped(lora)
    grads = _same_as_forward(module, ["default"])
    assert {"lora_A.default.weight", "lora_B.default.weight"} <= grads.keys()


@pytest.mark.hosts
def test_every_active_adapter_counts_and_only_those(lora):
    module = _wrapped(lora, adapters=("a", "b"))
    both = _same_as_forward(module, ["a", "b"])
    assert {"lora_A.a.weight", "lora_B.b.weight"} <= both.keys()
    only_b = _same_as_forward(module, ["b"])
    assert "lora_A.a.weight" not in only_b


@pytest.mark.hosts
def test_merged_adapters_are_not_added_twice_and_disabled_ones_not_at_all(lora):
    module = _wrapped(lora)
    x = torch.randn(5, 8)
    with torch.no_grad():
        unmerged = module(x)
        module.merge()
        torch.testing.assert_close(x @ effective_weight(module).T, unmerged, rtol=1e-5, atol=1e-6)
        module.enable_adapters(False)  # the forward unmerges first, so does the weight
        torch.testing.assert_close(x @ effective_weight(module).T, module.base_layer(x))
        assert not module.merged


@pytest.mark.hosts
def test_lora_dropout_is_refused_naming_the_module(lora):
    with pytest.raises(UnsupportedLoRAError, match="linear_kv_up_proj .*lora_dropout 0.1"):
        effective_weight(_wrapped(lora, dropout=0.1), "linear_kv_up_proj")


@pytest.mark.hosts
def test_lora_dropout_in_eval_mode_is_base_plus_delta(lora):
    """In eval mode the dropout passes its input through: the forward is W x + s B A x."""
    module = _wrapped(lora, dropout=0.1).eval()
    grads = _same_as_forward(module, ["default"])
    assert {"lora_A.default.weight", "lora_B.default.weight"} <= grads.keys()
    with pytest.raises(UnsupportedLoRAError, match="lora_dropout 0.1"):
        effective_weight(module.train(), "linear_kv_up_proj")


@pytest.mark.hosts
def test_dora_and_nested_adapters_are_refused(lora):
    module = _wrapped(lora)
    module.use_dora = {"default": True}  # what peft >= 0.9 records for a DoRA adapter
    with pytest.raises(UnsupportedLoRAError, match="DoRA"):
        effective_weight(module, "linear_v")
    nested = lora.Linear(_wrapped(lora), "outer", r=2, lora_alpha=2)
    with pytest.raises(UnsupportedLoRAError, match="nested"):
        effective_weight(nested, "linear_v")


@pytest.mark.hosts
def test_a_peft_subclass_with_its_own_forward_is_refused(lora):
    class OwnForward(lora.Linear):
        def forward(self, x, *args, **kwargs):
            return super().forward(x) * 2

    module = OwnForward(nn.Linear(8, 12, bias=False), "default", r=3, lora_alpha=6)
    with pytest.raises(UnsupportedLoRAError, match="OwnForward.forward, which LAGA does not"):
        effective_weight(module, "linear_kv_nope")
