"""No silent no-op: a built model without an MLA module LAGA patches is refused by name
(patches/mindspeed_llm/model_check.py); one with it, or with no attention at all, passes.

Stand-in modules carry the host's class names here; DeepSeek-V4's real spec built by the
real host on two ranks is tests/loop/test_families_loop.py::test_deepseek4_refused_on_every_rank.
"""
import pytest
import torch

from mindspeed_laga.patches.mindspeed_llm.model_check import (check_laga_applies,
                                                              laga_model_check_wrapper)


def _named(name, base=torch.nn.Module):
    return type(name, (base,), {})


CustomMLASelfAttention = _named("CustomMLASelfAttention")


def _model(*attention_classes):
    layers = torch.nn.ModuleList(cls() for cls in attention_classes)
    return torch.nn.Sequential(torch.nn.Linear(2, 2), layers)


def test_deepseek4_attention_is_refused_naming_it_and_why():
    with pytest.raises(ValueError) as refused:
        check_laga_applies([_model(_named("DeepSeek4SelfAttention"))])
    message = str(refused.value)
    assert "--mla-latent-all-gather does not apply" in message
    assert "DeepSeek4SelfAttention" in message and "CustomMLASelfAttention" in message
    assert "one shared compressed KV head, 512 wide" in message
    assert "Drop --mla-latent-all-gather" in message


def test_deepseek4_mtp_attention_has_deepseek4s_reason():
    deepseek4 = _named("DeepSeek4SelfAttention")
    with pytest.raises(ValueError, match=r"DeepSeek4MTPSelfAttention: DeepSeek-V4 attends over"):
        check_laga_applies(_model(deepseek4, _named("DeepSeek4MTPSelfAttention", deepseek4)))


def test_a_non_mla_spec_is_refused():
    with pytest.raises(ValueError, match=r"its attention is SelfAttention \(SelfAttention: LAGA "
                                         r"replaces the forward of MindSpeed-LLM's"):
        check_laga_applies(_model(_named("SelfAttention")))


@pytest.mark.parametrize("model", [
    [_model(CustomMLASelfAttention)],
    # LongCat's two MLA per layer, a subclass (the patched forward is inherited), and a
    # second chunk (virtual pipeline) holding the MLA
    [_model(CustomMLASelfAttention, CustomMLASelfAttention)],
    [_model(_named("LongCatMLA", CustomMLASelfAttention))],
    [_model(), _model(CustomMLASelfAttention)],
    [_model()],  # a pipeline stage of no-op layers: no attention to check
], ids=["mla", "two-per-layer", "subclass", "second-chunk", "no-attention"])
def test_models_with_mla_pass(model):
    check_laga_applies(model)


def test_the_wrapper_checks_what_get_model_returns():
    built = [_model(_named("DeepSeek4SelfAttention"))]
    get_model = laga_model_check_wrapper(lambda provider, *a, **k: built)
    with pytest.raises(ValueError, match="DeepSeek4SelfAttention"):
        get_model(None)
    assert laga_model_check_wrapper(lambda *a, **k: [_model(CustomMLASelfAttention)])(None)
