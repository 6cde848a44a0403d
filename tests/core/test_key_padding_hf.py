"""Key padding against Hugging Face's attention with a padding mask (transformers: the
Ascend leg's venv; skipped where it is not installed).

Hugging Face's DeepSeek-V3 ``eager_attention_forward`` with the additive 4-D mask its
``masking_utils.eager_mask`` builds from the tokenizer's 1-D attention mask is an
implementation of padded causal attention written by others: it checks the float64
reference the other key-padding tests use (tests/support/key_padding.py), and LAGA's three
forms, every kernel (npu through the torch_npu stand-in) at CP 1, 2 and 4 directly,
outputs and every grad. A row that sees no key gets, there as here by default, the mean
of every value (a softmax over one constant: the dtype's minimum everywhere). Its
gradients differ on purpose: Hugging Face adds the minimum to the scores, so autograd
differentiates scores the rounding has already erased and hands such rows' queries and
keys a gradient; Megatron (-10000 written over the scores) and LAGA hand them none. The
comparisons therefore give those rows a zero output gradient (``quiet_empty_rows``);
their output is compared, and their gradients are checked against the float64 reference
and, in tests/support/mindspeed_llm_real.py, against the host's own attention."""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga.cp_algos import ALGOS
from support import case_runs
from support.variants import KERNELS, algos_for, runs_on_accelerator
from support.key_padding import (D_N, D_V, HEADS, SCALE, assemble, full_inputs, grad_out,
                                 padding_mask, reference, run_case, worker)

pytestmark = pytest.mark.ascend  # the leg with transformers (tests/conftest.py)
transformers = pytest.importorskip("transformers")


def hugging_face(mask_1d: torch.Tensor):
    """Output and grads of Hugging Face's eager attention on the full inputs in float32
    (its softmax runs in float32 whatever the input dtype, so float64 gains nothing and its
    dtype-minimum mask would overflow there)."""
    from transformers.masking_utils import eager_mask
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import eager_attention_forward

    x = full_inputs(batch=mask_1d.shape[0])
    names = ("query", "kv_latent", "k_pos_emb", "kv_up_weight")
    inputs = {k: x[k].float().requires_grad_() for k in names}
    q, kv, kpe, w = (inputs[k] for k in names)
    seq, b = kv.shape[:2]
    # DeepSeek-V3's layout: [b, heads, seq, dim]; kv_b_proj rows per head: k_nope then v
    kv_b = torch.nn.functional.linear(kv, w).view(seq, b, HEADS, D_N + D_V)
    k_nope, value = kv_b.split([D_N, D_V], dim=-1)
    key = torch.cat([k_nope, kpe[:, :, None].expand(-1, -1, HEADS, -1)], dim=-1)
    bnsd = [t.permute(1, 2, 0, 3) for t in (q, key, value)]
    mask = eager_mask(batch_size=b, cache_position=torch.arange(seq), kv_length=seq,
                      attention_mask=mask_1d.bool(), dtype=torch.float32)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 1, False
    out, _ = eager_attention_forward(module, *bnsd, mask, scaling=SCALE)
    out = out.reshape(b, seq, -1).transpose(0, 1)  # [seq, b, heads * d_v]
    out.backward(grad_out(x, dict(side=_side(mask_1d), quiet_empty_rows=True)).float())
    return out.detach().double(), {k: v.grad.double() for k, v in inputs.items()}


def _side(mask_1d):
    """Which padding of tests/support/key_padding.py this 1-D mask (1 = token) is."""
    return next(side for side in ("right", "left", "none")
                if torch.equal((~padding_mask(side)).long(), mask_1d))


def relative_error(got, want) -> float:
    """Largest error over output and grads, each relative to its largest reference value."""
    pairs = [(got[0], want[0])] + [(got[1][k], want[1][k]) for k in want[1]]
    errs = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in pairs]
    return float("nan") if any(e != e for e in errs) else max(errs)  # a NaN fails


TOLERANCE = 2e-5  # against float32 attention, relative to the largest value


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_reference_is_hugging_faces_padded_attention(side):
    mask = padding_mask(side)
    assert relative_error(reference(mask, quiet_empty_rows=True),
                          hugging_face((~mask).long())) <= TOLERANCE


def cases(cp):
    """Every form with every kernel once, the padding side and the algorithm alternating."""
    algos = algos_for(cp)
    out = []
    for i, (form, kernel) in enumerate((f, k) for f in ("explicit", "absorbed", "laga")
                                       for k in KERNELS):
        algo = algos[i % len(algos)]
        out.append(dict(form=form, cp_algo=algo, kernel=kernel, side=("right", "left")[i % 2],
                        layout="contiguous" if algo == "ulysses" else "zigzag", causal=True,
                        empty_rows="mean", options={}, quiet_empty_rows=True,
                        dtype=torch.float32 if runs_on_accelerator(kernel) else torch.float64))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_laga_matches_hugging_faces_padded_attention(cp):
    todo = cases(cp)
    per_case = case_runs.per_case(run_case, worker, cp, todo, npu_standin=True)
    failures = []
    for case, per_rank in zip(todo, per_case):
        want_out, want_grads = hugging_face((~padding_mask(case["side"])).long())
        degree = 2 if ALGOS[case["cp_algo"]].takes_ulysses_degree else 1
        out, grads = assemble(per_rank, case["layout"], cp, degree)
        err = relative_error((out, grads), (want_out, want_grads))
        if not err <= TOLERANCE:
            failures.append(f"{case['form']}-{case['kernel']}-{case['cp_algo']}-{case['side']}: "
                            f"{err:.2e}")
    assert not failures, "\n".join(failures)
