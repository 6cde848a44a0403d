"""LoRA adapters on MindSpeed-LLM's real ``CustomMLASelfAttention``, with and without LAGA.

The module is built as tests/support/mindspeed_llm_real.py builds it (real sources,
real argument pipeline), then wrapped the way MindSpeed-LLM's ``--lora-target-modules``
wraps a model: its own ``model_provider_func_wrapper`` (mindspeed_llm/training/training.py:
peft's ``LoraParallelLinear`` swapped for ``LoraParallelLinearMoE``, with ``--lora-fusion``
its forward for CCLoRA's, then ``LoraConfig`` + ``get_peft_model`` and the
``sequence_parallel`` mark on every ``nn.Linear`` weight), or with peft alone
(``WRAPPERS["peft"]``: the same ``LoraConfig``, peft's own ``LoraParallelLinear``).
Every adapter weight is then set from a fixed full-size tensor (this TP rank's slice),
``lora_B`` non-zero, so the delta is in the model.

Each case runs at CP = 1 through the module itself (the reference: LAGA never runs)
and at CP > 1 through LAGA's patched forward; the test puts the ranks' shards together
with mindspeed_llm_real's ``_assemble`` and compares output, hidden-states grad and
every parameter grad (the adapters' included). Needs ``peft`` (CI's Ascend leg).
"""
from __future__ import annotations

import contextlib
import os
import sys
import zlib

import torch

if not __package__:  # run as a script (check_refusals): tests/ is where support lives
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import mindspeed_llm_real as real  # noqa: E402

LORA = ["--lora-r", "4", "--lora-alpha", "8"]
WRAPPERS = ("mindspeed", "peft")  # the host's model_provider_func_wrapper, or peft alone
KV_UP_FUSED = ["--lora-target-modules", "linear_qkv", "linear_kv_up_proj", "linear_proj"]
KV_UP_SPLIT = ["--mla-mm-split", "--lora-target-modules", "linear_qkv", "linear_qk_nope",
               "linear_kv_nope", "linear_v"]
QLORA = ["--q-lora-rank", "24", "--qk-layernorm"]
# the releases whose --qlora flag exists, by the facts they own (a release with another's
# facts, ``same_as``, is that release to every check)
WITH_QLORA = ("2.2.0", "2.3.0", "26.0.0")
# name -> (argv beyond mindspeed_llm_real.MODEL, wrapper, every weight trainable)
CASES = {
    "moe-fused-kvallgather": (QLORA + KV_UP_FUSED + ["--context-parallel-algo",
                                                     "kvallgather_cp_algo"], "mindspeed", False),
    "moe-mmsplit-ulysses": (QLORA + KV_UP_SPLIT + ["--context-parallel-algo", "ulysses_cp_algo"],
                            "mindspeed", False),
    "cclora-fused-ulysses": (QLORA + KV_UP_FUSED[:3] + ["--lora-fusion", "--context-parallel-algo",
                                                        "ulysses_cp_algo"], "mindspeed", False),
    "cclora-mmsplit-megatron": (KV_UP_SPLIT + ["--lora-fusion", "--context-parallel-algo",
                                               "megatron_cp_algo"], "mindspeed", False),
    # peft's own LoraParallelLinear; every weight trained, so the base weight's grad
    # through the effective weight is compared too
    "peft-fused-megatron-alltrained": (QLORA + KV_UP_FUSED + ["--context-parallel-algo",
                                                              "megatron_cp_algo"], "peft", True),
}
# TP = 2 (with and without sequence parallelism); CCLoRA's row-parallel and
# sequence-parallel paths call NPU-only ops, so it runs at TP = 2 without SP, on K/V only
TP_CASES = ("moe-fused-kvallgather", "moe-mmsplit-ulysses")
TP_CCLORA_CASES = {"cclora-fused-kvallgather-kvonly": (
    QLORA + ["--lora-target-modules", "linear_kv_up_proj", "--lora-fusion",
             "--context-parallel-algo", "kvallgather_cp_algo"], "mindspeed", False)}


@contextlib.contextmanager
def lora_wrapped(args, module, wrapper, all_trained=False):
    """``module`` with LoRA adapters as MindSpeed-LLM (or peft alone) adds them; the
    class-level swaps the host makes (peft's LoraParallelLinear, CCLoRA's forward) are
    undone on exit, so the next case in this process starts from peft as installed."""
    from peft.tuners.lora import tp_layer
    from mindspeed_llm.tasks.posttrain.lora.lora_moe import LoraParallelLinearMoE
    saved = tp_layer.LoraParallelLinear, LoraParallelLinearMoE.__dict__["forward"]
    try:
        if wrapper == "mindspeed":
            from mindspeed_llm.training.training import model_provider_func_wrapper
            model_provider_func_wrapper(lambda *a, **k: module)()
        else:
            _peft_alone(args, module)
        if all_trained:
            for p in module.parameters():
                p.requires_grad_(True)
        yield module
    finally:
        tp_layer.LoraParallelLinear = saved[0]
        LoraParallelLinearMoE.forward = saved[1]


def _peft_alone(args, module):
    from megatron.training.arguments import core_transformer_config_from_args
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                        target_modules=args.lora_target_modules, lora_dropout=0.0, bias="none",
                        megatron_config=core_transformer_config_from_args(args),
                        megatron_core="megatron.core")
    get_peft_model(module, config)


def set_adapter_weights(module, tp_size, tp_rank):
    """Every lora_A / lora_B from a full-size tensor seeded by its name (this TP rank's
    slice of a TP-sharded one), so every TP layout holds the same adapter."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_" not in name:
                continue
            sharded = getattr(param, "tensor_model_parallel", False)
            dim = param.partition_dim if sharded else None
            shape = list(param.shape)
            if dim is not None:
                shape[dim] *= tp_size
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
            param.copy_(full if dim is None else full.chunk(tp_size, dim)[tp_rank])


def worker(rank, world_size, tp_size, sequence_parallel, cases):
    """Each case at CP = world/TP: at CP = 1 the module's own forward, else the patched one."""
    real.prepare()
    from megatron.core import parallel_state

    from mindspeed_laga import layout as layouts
    from mindspeed_laga.features.laga_args import laga_settings
    from mindspeed_laga.patches.mindspeed_llm.forward import laga_mla_forward_wrapper

    results = {}
    for name, (extra, wrapper, all_trained) in cases.items():
        cp_size = world_size // tp_size
        args, module = real._build(real.MODEL + LORA + extra, tp_size, cp_size, sequence_parallel)
        try:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            cp_rank = parallel_state.get_context_parallel_rank()
            layout = laga_settings(args).layout
            with lora_wrapped(args, module, wrapper, all_trained):
                set_adapter_weights(module, tp_size, tp_rank)
                generator = torch.Generator().manual_seed(real.SEED)
                hidden = torch.randn(real.SEQ, real.BATCH, 64, generator=generator)
                grad_out = torch.randn(real.SEQ, real.BATCH, 64, generator=generator)

                def local(t):
                    t = layouts.shard(t, layout, cp_size, cp_rank, dim=0)
                    return t.chunk(tp_size)[tp_rank] if sequence_parallel else t

                rope = layouts.shard(real._rope_table(real.SEQ, 8), layout, cp_size, cp_rank, dim=0)
                if cp_size == 1:
                    forward = lambda h, r: module(h, None, rotary_pos_emb=r)  # noqa: E731
                else:
                    patched = laga_mla_forward_wrapper(type(module).forward)
                    forward = lambda h, r: patched(module, h, None, rotary_pos_emb=r)  # noqa: E731
                run = real._run(module, forward, local(hidden), rope, local(grad_out))
                results[name] = dict(
                    run=run, layout=layout, tp_rank=tp_rank, cp_rank=cp_rank, tp_size=tp_size,
                    sequence_parallel=sequence_parallel, ulysses_degree=1,
                    wrapped={n: type(m).__name__ for n, m in module.named_children()
                             if hasattr(m, "base_layer")},
                    forwards={n: type(m).forward.__qualname__ for n, m in module.named_children()
                              if hasattr(m, "base_layer")})
        finally:
            parallel_state.destroy_model_parallel()
    return results


def worker_jobs(rank, world_size, jobs):
    return [worker(rank, world_size, tp, sp, cases) for tp, sp, cases in jobs]


def run_jobs(world_size, jobs):
    """[per-rank results of each job]: the (tp_size, sequence_parallel, cases) jobs in one
    spawn of ``world_size`` gloo ranks."""
    from mindspeed_laga.tools.spawn import run_on_ranks
    per_rank = run_on_ranks(worker_jobs, world_size, jobs, timeout_s=600)
    return [[ranks[j] for ranks in per_rank] for j in range(len(jobs))]


def assemble(per_rank, name):
    """The full-sequence output and grads of a case from every rank's shard."""
    reshaped = [{name: dict(r[name], laga=r[name]["run"])} for r in per_rank]
    return real._assemble(reshaped, name, "laga")


def max_relative_error(got, ref):
    return real._max_relative_error(got, ref)


# --- start-up refusals, through the release's real argument pipeline ----------------------

def check_refusals() -> None:
    """On the sources in the environment: LoRA on the K/V up-projection validates; --qlora
    (where the release has it) and LU-LoRA on those modules are refused naming the flag."""
    real.prepare()
    release = real.host_release()
    base = real.MODEL + LORA + QLORA + ["--context-parallel-size", "2",
                                        "--context-parallel-algo", "megatron_cp_algo"]
    args = real.megatron_args(base + KV_UP_FUSED, world_size=2)
    assert args.lora_target_modules == KV_UP_FUSED[1:] and args.mla_latent_all_gather
    refused = [(["--lu-lora-final-layer-index", "0"] + KV_UP_SPLIT, "--lu-lora-final-layer-index")]
    if release.facts_owner in WITH_QLORA:
        refused.append((["--qlora"] + KV_UP_FUSED, "--qlora"))
    for extra, flag in refused:
        try:
            real.megatron_args(base + extra, world_size=2)
        except ValueError as exc:
            assert flag in str(exc) and "--mla-latent-all-gather" in str(exc), exc
            print(f"{flag}: refused: {exc}")
        else:
            raise AssertionError(f"{flag} was not refused on {release.name}")
    print(f"facts: {release.facts()}\nrefusals: ok")


if __name__ == "__main__":
    check_refusals()
