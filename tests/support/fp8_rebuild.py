"""LAGA's K/V rebuild under FP8, on MindSpeed's real ``TEColumnParallelLinear`` on CPU.

The MX-FP8 ops come from the torch_npu stand-in (tests/support/fake_npu_quant.py, installed
with tests/support/npu_host.py); the module, its ``fp8_meta``, ``fp8_autocast`` and the
mxfp8 recipe are MindSpeed's own (the master pair's sources, ``host_sources``). One MLA
core per rank: latent [S, b, d_c] -> ``linear_kv_up_proj`` -> per-head K/V (+ the shared
rope key) -> causal attention of the given queries -> [S, b, n*d_v]; a fixed random
projection of the output is the loss. Compared with the host at CP = 1 (the module called
on the whole sequence, FP8), each variant's output and the gradients of the query, the
latent, the rope key and the weight (max |a - b| / max |b|):

- ``host_cp``: the host's own CP = P ulysses run: each rank calls the module on its own
  tokens, K/V all-to-all (data movement only) -> the same attention;
- ``laga_fp8``: LAGA at CP = P (ulysses, real ``laga_attention`` on gloo ranks), K/V rebuilt
  through the module's FP8 matmul (patches/mindspeed_llm/fp8.py), the chosen path;
- ``laga_bf16_rebuild``: the same, K/V rebuilt from the module's weight without FP8
  (``F.linear``), the higher-precision alternative;
- ``laga_fp8_scale_1pct``: ``laga_fp8`` with a 1% softmax-scale error (sharpness);
- ``laga_no_fp8`` vs ``host_no_fp8``: both without FP8 (what LAGA's own kernel and the
  CP sums contribute at this dtype, FP8 aside).

:func:`adapter_run` then checks the MindSpeed-LLM adapter end to end (forward.py's wrapped
forward on tests/support/mindspeed_llm_standin.py's MLA with this FP8 module as its
``linear_kv_up_proj``).

Run directly for the figures of docs/INTEGRATION.md, section "FP8" (host sources as in
tests/support/thirdparty.py)::

    eval "$(.venv310/bin/python tests/support/thirdparty.py)"
    .venv310/bin/python tests/support/fp8_rebuild.py 4 bfloat16
"""
from __future__ import annotations

import os
import sys
from argparse import Namespace
from types import SimpleNamespace

import torch

if not __package__:  # run as a script: tests/ is where support lives
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS, QK, V, ROPE, LATENT = 4, 32, 32, 16, 64  # head dims: multiples of the MX block
SEQ, BATCH = 128, 2
SEED = 1234


def _host(world_size: int) -> None:
    """MindSpeed's sources, the NPU host stand-in, Megatron's groups (CP = all ranks)."""
    for key in ("MEGATRON_SRC", "MINDSPEED_SRC"):
        if os.environ[key] not in sys.path:
            sys.path.insert(0, os.environ[key])
    from support import npu_host
    npu_host.install()
    from megatron.core import parallel_state
    from megatron.training.global_vars import set_args

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    set_args(Namespace(fp8="e4m3", fp8_recipe="mxfp8", gradient_accumulation_fusion=False,
                       te_comparison_with_cpu=False, te_comparison_with_bf16=False,
                       use_ascend_mc2=False))


def _module(dtype):
    from megatron.core.transformer import TransformerConfig
    from mindspeed.te.pytorch.module.linear import TEColumnParallelLinear

    config = TransformerConfig(num_layers=1, hidden_size=LATENT, num_attention_heads=HEADS,
                               use_cpu_initialization=True, params_dtype=dtype)
    torch.manual_seed(SEED)
    return TEColumnParallelLinear(LATENT, HEADS * (QK + V), config=config,
                                  init_method=lambda w: torch.nn.init.normal_(w, std=0.125),
                                  gather_output=False, bias=False, skip_bias_add=True,
                                  is_expert=False)


def _inputs(dtype):
    g = torch.Generator().manual_seed(SEED)
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    return dict(query=rand(SEQ, BATCH, HEADS, QK + ROPE), kv_latent=rand(SEQ, BATCH, LATENT),
                k_pos_emb=rand(SEQ, BATCH, ROPE), probe=rand(SEQ, BATCH, HEADS * V))


def _fp8(enabled):
    import contextlib
    if not enabled:
        return contextlib.nullcontext()
    from mindspeed.te.pytorch.fp8.constants import Format
    from mindspeed.te.pytorch.fp8.fp8 import fp8_autocast
    from mindspeed.te.pytorch.fp8.recipes import MXFP8BlockScaling
    return fp8_autocast(enabled=True, fp8_recipe=MXFP8BlockScaling(fp8_format=Format.E4M3))


def _attention(query, kv, k_pos_emb, scale):
    """The host's core attention at CP = 1 (float32 softmax, output in the input dtype)."""
    s, b = kv.shape[:2]
    kv = kv.view(s, b, HEADS, QK + V)
    key = torch.cat([kv[..., :QK], k_pos_emb.unsqueeze(2).expand(-1, -1, HEADS, -1)], dim=-1)
    q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, kv[..., QK:]))
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.permute(2, 0, 1, 3).reshape(s, b, HEADS * V).to(query.dtype)


def _leaves(inputs):
    return {k: t.clone().requires_grad_(k != "probe") for k, t in inputs.items()}


def host_run(module, inputs, chunks: int, fp8: bool):
    """The host: the module on each of ``chunks`` contiguous token blocks (CP = chunks)."""
    module.zero_grad(set_to_none=True)
    x = _leaves(inputs)
    with _fp8(fp8):
        kv = torch.cat([module(part)[0] for part in x["kv_latent"].chunk(chunks)])
        out = _attention(x["query"], kv, x["k_pos_emb"], (QK + ROPE) ** -0.5)
    (out.float() * x["probe"].float()).sum().backward()
    return _result(out, x, module.weight.grad)


def _result(out, x, weight_grad):
    return dict(output=out.detach(), query=x["query"].grad, kv_latent=x["kv_latent"].grad,
                k_pos_emb=x["k_pos_emb"].grad, weight=weight_grad)


def laga_run(module, inputs, rank, world_size, fp8, rebuild_fp8, scale_error=1.0):
    """LAGA at CP = world_size (ulysses), this rank's tokens; gathered to whole tensors."""
    from mindspeed_laga import laga_attention
    from mindspeed_laga.patches.mindspeed_llm.fp8 import kv_up_linear

    module.zero_grad(set_to_none=True)
    local = {k: t.chunk(world_size)[rank] for k, t in inputs.items()}
    x = _leaves(local)
    attention = SimpleNamespace(mla_mm_split=False, linear_kv_up_proj=module)
    with _fp8(fp8):
        linear = kv_up_linear(attention) if rebuild_fp8 else None
        assert (linear is not None) == (fp8 and rebuild_fp8)
        out = laga_attention(x["query"], x["kv_latent"], x["k_pos_emb"], module.weight,
                             softmax_scale=(QK + ROPE) ** -0.5 * scale_error,
                             cp_group=torch.distributed.group.WORLD, cp_algo="ulysses",
                             layout="contiguous", kernel="eager", qk_head_dim=QK, v_head_dim=V,
                             kv_up_linear=linear)
    (out.float() * x["probe"].float()).sum().backward()
    weight_grad = module.weight.grad.clone()
    torch.distributed.all_reduce(weight_grad)  # Megatron's dp x cp reduction
    got = _result(out, x, weight_grad)
    return {k: (v if k == "weight" else _gather(v)) for k, v in got.items()}


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def relative_errors(got, ref):
    return {k: ((got[k].float() - ref[k].float()).abs().max()
                / ref[k].float().abs().max()).item() for k in ref}


def worker(rank, world_size, dtype_name, adapter=False):
    """{variant: {tensor: error vs the host at CP = 1}} on rank 0 (None elsewhere); with
    ``adapter``, also ``"adapter"``: :func:`adapter_run`'s result."""
    _host(world_size)
    dtype = getattr(torch, dtype_name)
    module, inputs = _module(dtype), _inputs(dtype)
    ref = host_run(module, inputs, 1, fp8=True)
    runs = {
        "host_cp": host_run(module, inputs, world_size, fp8=True),
        "laga_fp8": laga_run(module, inputs, rank, world_size, True, True),
        "laga_bf16_rebuild": laga_run(module, inputs, rank, world_size, True, False),
        "laga_fp8_scale_1pct": laga_run(module, inputs, rank, world_size, True, True, 1.01),
    }
    errors = {name: relative_errors(run, ref) for name, run in runs.items()}
    no_fp8 = host_run(module, inputs, 1, fp8=False)
    errors["laga_no_fp8"] = relative_errors(
        laga_run(module, inputs, rank, world_size, False, False), no_fp8)
    errors["fp8_vs_no_fp8"] = relative_errors(ref, no_fp8)  # what FP8 changes at all
    if rank == 0:
        errors["peft_wraps_te_linear"] = _peft_wraps(module)
        errors["wrapped_fp8_module"] = _wrapped_refusal(module)
    if adapter:
        errors["adapter"] = adapter_run(rank, world_size)
    return errors if rank == 0 else None


def _wrapped_refusal(module):
    """The error kv_up_linear raises for a LoRA-wrapped FP8 K/V module (None: no error)."""
    from mindspeed_laga.patches.lora import UnsupportedLoRAError
    from mindspeed_laga.patches.mindspeed_llm.fp8 import kv_up_linear

    wrapper = torch.nn.Module()
    wrapper.base_layer = module
    try:
        with _fp8(True):
            kv_up_linear(SimpleNamespace(mla_mm_split=False, linear_kv_up_proj=wrapper))
    except UnsupportedLoRAError as refused:
        return str(refused)
    return None


def _peft_wraps(module):
    """Whether peft's LoRA wraps MindSpeed's TE linear (MindSpeed-LLM's --lora-target-modules
    goes through peft); the error text when it refuses, None when peft is absent."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        return None
    from support.npu_host import NpuHostError
    holder = torch.nn.Module()
    holder.linear_kv_up_proj = module
    try:
        get_peft_model(holder, LoraConfig(r=4, lora_alpha=8,
                                          target_modules=["linear_kv_up_proj"]))
    except ValueError as refused:
        return str(refused)
    except NpuHostError:  # no peft here: what imported is the host stand-ins' placeholder
        return None
    return True


def adapter_run(rank, world_size):
    """The MindSpeed-LLM adapter end to end (after :func:`_host`): the MLA of
    tests/support/mindspeed_llm_standin.py with MindSpeed's FP8 ``linear_kv_up_proj``, its
    original forward at CP = 1 against the
    LAGA-wrapped forward at CP = world_size (ulysses), both inside ``fp8_autocast``, float32.
    Returns {output, hidden grad, every parameter grad: error} on rank 0 and whether the
    wrapped forward took the LAGA path."""
    from support import mindspeed_llm_standin as standin
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper
    from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME

    config = standin.mla_config(kv_lora_rank=LATENT, qk_head_dim=QK, v_head_dim=V,
                                qk_pos_emb_head_dim=ROPE, heads=HEADS)
    args = _adapter_args(world_size)
    torch.manual_seed(SEED)
    module = standin.StandinMLASelfAttention(config)
    module.linear_kv_up_proj = _module(torch.float32)
    g = torch.Generator().manual_seed(SEED)
    hidden, probe = (torch.randn(SEQ, BATCH, config.hidden_size, generator=g) for _ in range(2))
    rope = standin.rope_table(SEQ, ROPE)
    with _fp8(True):
        ref = standin.forward_backward(
            module, lambda h, r: module.forward(h, None, rotary_pos_emb=r), hidden, rope, probe)
    wrapped = laga_mla_forward_wrapper(standin.StandinMLASelfAttention.forward, BY_NAME["master"])
    local = [t.chunk(world_size)[rank] for t in (hidden, rope, probe)]
    before = module.original_calls
    with _fp8(True):
        got = standin.forward_backward(
            module, lambda h, r: wrapped(module, h, None, rotary_pos_emb=r), *local)
    laga_ran = module.original_calls == before
    grads = {name: grad.clone() for name, grad in got["param_grads"].items()}
    for grad in grads.values():
        torch.distributed.all_reduce(grad)  # Megatron's dp x cp reduction
    got = dict(output=_gather(got["output"]), hidden=_gather(got["hidden_grad"]), **grads)
    want = dict(output=ref["output"], hidden=ref["hidden_grad"], **ref["param_grads"])
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return dict(errors=relative_errors(got, want), laga_ran=laga_ran) if rank == 0 else None


def _adapter_args(world_size):
    from megatron.training.global_vars import get_args

    args = get_args()  # _host's FP8 fields, plus what the stand-in and the adapter read
    for name, value in dict(mla_latent_all_gather=True, mla_laga_kernel="eager",
                            qk_layernorm=False, mla_mm_split=False, enable_mla_scale_q_lora=False,
                            enable_mla_scale_kv_lora=False, rope_scaling_type=None,
                            rope_scaling_factor=1.0, rope_scaling_mscale_all_dim=None,
                            qk_head_dim=QK, qk_pos_emb_head_dim=ROPE, v_head_dim=V,
                            context_parallel_size=world_size,
                            context_parallel_algo="ulysses_cp_algo").items():
        setattr(args, name, value)
    return args


def _table(errors):
    names = ("output", "query", "kv_latent", "k_pos_emb", "weight")
    lines = ["| variant | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for variant, row in errors.items():
        if isinstance(row, dict):
            lines.append(f"| {variant} | " + " | ".join(f"{row[n]:.2e}" for n in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    from mindspeed_laga.tools.spawn import run_on_ranks

    world, dtype_name = int(sys.argv[1]), sys.argv[2]
    if "--json" in sys.argv:  # for the test: every error, adapter run included, as JSON
        import json
        print(json.dumps(run_on_ranks(worker, world, dtype_name, True, timeout_s=900)[0]))
        sys.exit(0)
    result = run_on_ranks(worker, world, dtype_name, timeout_s=900)[0]
    print(f"CP {world} ulysses, {dtype_name}, S={SEQ} b={BATCH} n={HEADS} d_n={QK} d_v={V} "
          f"d_r={ROPE} d_c={LATENT}; max error relative to the host's CP 1 FP8 run")
    print(_table(result))
    print("peft on MindSpeed's TE linear:", result["peft_wraps_te_linear"])
