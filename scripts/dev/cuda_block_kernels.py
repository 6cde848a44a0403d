"""One CUDA device, CP=1: check the fused kernels against float64, compare the
candidate block ops, then time and measure peak memory at DeepSeek-V3 head dims.

    python scripts/dev/cuda_block_kernels.py            # < 5 minutes on an H200

1. Every form x kernel (eager, sdpa, auto) x option (recompute, odd block
   sizes, trimming) x causal/non-causal x float32/bfloat16 on small shapes
   against the float64 reference (output and all four grads).
2. Block-op candidates for ``kernel='sdpa'`` with recompute_kv (memory-efficient,
   flash with V padded, cuDNN, eager): correctness on small shapes, then
   laga+blockwise fwd+bwd time at S=2048 with each.
3. explicit SDPA vs laga vs laga+recompute vs laga+blockwise (bf16, 128 heads,
   q/k 192, v 128, d_c 512): median fwd+bwd ms and peak memory above the
   inputs (torch.cuda.max_memory_allocated), with ratios to explicit.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F

from mindspeed_laga import api
from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.kernels import sdpa as sdpa_ops

TOLERANCE = {"float32": 1e-5, "bfloat16": 8 * 2.0 ** -9}
DEVICE = torch.device("cuda")  # --device cpu: a dry run of the script's own logic


# ------------------------------------------------------------- candidate block ops

class CudaFlashPadded:
    """``_scaled_dot_product_flash_attention`` (equal head dims: V zero-padded; half only)."""

    @staticmethod
    def forward(q, key, value, causal, scale):
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, key, F.pad(value, (0, q.shape[-1] - value.shape[-1])), 0.0, causal, False, scale=scale)
        return res[0][..., :value.shape[-1]], res[1]

    @staticmethod
    def backward(q, key, value, causal, scale, d_out, out, lse):
        pad = (0, q.shape[-1] - value.shape[-1])
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            F.pad(d_out, pad), q, key, F.pad(value, pad), F.pad(out, pad), lse.float(), empty, empty,
            q.shape[2], key.shape[2], 0.0, causal, empty, empty, scale=scale)
        return dq, dk, dv[..., :value.shape[-1]]


class CudaCudnn:
    """``_scaled_dot_product_cudnn_attention`` and its backward."""

    @staticmethod
    def forward(q, key, value, causal, scale):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, key, value, None, True, 0.0,
                                                                  causal, False, scale=scale)
        lse = res[1]
        return res[0], lse.reshape(lse.shape[:3]) if lse.dim() == 4 else lse

    @staticmethod
    def backward(q, key, value, causal, scale, d_out, out, lse):
        empty = torch.empty(0, device=q.device)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d_out, q, key, value, out, lse.float().unsqueeze(-1).contiguous(), seed, seed, empty,
            empty, empty, q.shape[2], key.shape[2], 0.0, causal, scale=scale)
        return dq, dk, dv


CANDIDATES = {"efficient": sdpa_ops.CudaEfficient, "flash_padded": CudaFlashPadded,
              "cudnn": CudaCudnn}


# ------------------------------------------------------------- running a case on the device

def run_case(case: eq.Case, full=None):
    """Forward + backward of one case on the device (CP=1) -> out and grads, float64 on CPU."""
    full = full or eq.full_inputs(case.shape, case.seed)
    dtype = eq.DTYPES[case.dtype]
    x = {k: full[k].to(DEVICE, dtype).requires_grad_() for k in eq.INPUTS}
    out = api.FORMS[case.form](*(x[k] for k in eq.INPUTS), softmax_scale=case.shape.softmax_scale,
                               cp_group=None, causal=case.causal, kernel=case.kernel,
                               **dict(case.options))
    out.backward(full["grad_out"].to(DEVICE, dtype))
    return {"out": out.detach().double().cpu(),
            "grads": {k: v.grad.double().cpu() for k, v in x.items()}}


def check(cases):
    """-> list of (label, worst relative error, tolerance) that fail."""
    bad = []
    for case in cases:
        errs = eq.relative_errors(run_case(case), eq.reference(case))
        worst = max(errs.values())
        if not worst <= TOLERANCE[case.dtype]:
            bad.append((case.label() + ("" if case.causal else ",noncausal"), worst))
    return bad


SMALL = eq.MLAShape(seq_len=64)
OPTIONS = {"plain": (), "recompute": (("recompute_kv", True),),
           "block7": (("recompute_kv", True), ("kv_block_size", 7)),
           "block5+trim": (("recompute_kv", True), ("kv_block_size", 5), ("trim_causal_prefix", True))}


def correctness_cases():
    cases = [eq.Case(form=f, kernel=k, dtype=d, causal=c, shape=SMALL)
             for f, k, d, c in itertools.product(("explicit", "absorbed"), ("eager", "sdpa", "auto"),
                                                 ("float32", "bfloat16"), (True, False))]
    cases += [eq.Case(form="laga", cp_algo=a, kernel=k, dtype=d, causal=c, shape=SMALL, options=o)
              for a, k, d, c, o in itertools.product(("allgather", "ulysses"), ("eager", "sdpa", "auto"),
                                                     ("float32", "bfloat16"), (True, False),
                                                     OPTIONS.values())]
    return cases


# ------------------------------------------------------------- time and peak memory

_INPUTS = {}


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def measure(case: eq.Case, repeat: int = 3):
    """Median fwd+bwd seconds and peak bytes above the inputs (of the last run)."""
    key = (case.shape, case.seed)
    if key not in _INPUTS:
        _INPUTS.clear()
        _INPUTS[key] = eq.full_inputs(case.shape, case.seed)
    full = _INPUTS[key]
    dtype = eq.DTYPES[case.dtype]
    base_inputs = {k: full[k].to(DEVICE, dtype) for k in eq.INPUTS}
    grad_out = full["grad_out"].to(DEVICE, dtype)
    cuda = DEVICE.type == "cuda"
    times, peak = [], 0
    for i in range(repeat + 1):
        x = {k: v.clone().requires_grad_() for k, v in base_inputs.items()}
        _sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        out = api.FORMS[case.form](*(x[k] for k in eq.INPUTS), softmax_scale=case.shape.softmax_scale,
                                   cp_group=None, causal=case.causal, kernel=case.kernel,
                                   **dict(case.options))
        out.backward(grad_out)
        _sync()
        if i:  # the first run warms up
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() - base if cuda else 1
        del out, x
    return statistics.median(times), peak


def v3_shape(seq_len):
    return eq.MLAShape(seq_len=seq_len, batch=1, heads=128, qk_head_dim=128, rope_dim=64,
                       v_head_dim=128, kv_lora_rank=512)


def variants(seq_len, block):
    shape = v3_shape(seq_len)
    base = dict(dtype="bfloat16", shape=shape)
    return {
        "explicit": eq.Case(form="explicit", kernel="sdpa", **base),
        "laga": eq.Case(form="laga", kernel="sdpa", **base),
        "laga+recompute": eq.Case(form="laga", kernel="sdpa", options=(("recompute_kv", True),), **base),
        "laga+blockwise": eq.Case(form="laga", kernel="sdpa", options=(("recompute_kv", True),
                                                                       ("kv_block_size", block)), **base),
    }


def table(seq_len, block, extra=()):
    rows = dict(variants(seq_len, block))
    rows.update(extra)
    results = {name: measure(case) for name, case in rows.items()}
    t0, p0 = results["explicit"]
    print(f"\nS={seq_len}, bf16, 128 heads, q/k 192, v 128, d_c 512, CP=1, kv_block_size={block}")
    print(f"{'variant':28s} {'ms':>9s} {'time/expl':>9s} {'peak MiB':>9s} {'peak/expl':>9s}")
    for name, (t, p) in results.items():
        print(f"{name:28s} {1e3 * t:9.2f} {t / t0:9.2f} {p / 2 ** 20:9.0f} {p / p0:9.2f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="2048,8192")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--device", default="cuda", help="cpu: a dry run (no candidates, no memory)")
    args = p.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":
        assert torch.cuda.is_available(), "needs a CUDA device"
        print(torch.__version__, torch.cuda.get_device_name())
    t_start = time.time()

    if not args.skip_check:
        cases = correctness_cases()
        bad = check(cases)
        print(f"[1] {len(cases)} cases vs float64: {len(cases) - len(bad)} pass" +
              "".join(f"\n    FAIL {label}: {err:.2e}" for label, err in bad), flush=True)

    if DEVICE.type == "cuda":
        compare_candidates()
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        extra = {"laga+blockwise (eager)": eager_blockwise(seq_len)} if seq_len <= 2048 else {}
        table(seq_len, seq_len // 8, extra)
    print(f"\n{time.time() - t_start:.0f} s")


def eager_blockwise(seq_len):
    return eq.Case(form="laga", kernel="eager", dtype="bfloat16", shape=v3_shape(seq_len),
                   options=(("recompute_kv", True), ("kv_block_size", seq_len // 8)))


def compare_candidates():
    """[2] candidates for the CUDA block op, each put in place of the default in turn."""
    default = sdpa_ops.BACKENDS["cuda"]
    block_cases = [eq.Case(form="laga", kernel="sdpa", dtype="bfloat16", causal=c, shape=SMALL,
                           options=OPTIONS["block7"]) for c in (True, False)]
    for name, ops in CANDIDATES.items():
        sdpa_ops.BACKENDS["cuda"] = ops
        try:
            bad = check(block_cases)
            status = "exact" if not bad else f"WRONG ({bad[0][1]:.1e})"
            if not bad:
                t, peak = measure(variants(2048, 512)["laga+blockwise"])
                status += f", laga+blockwise S=2048 {1e3 * t:.2f} ms, peak {peak / 2 ** 20:.0f} MiB"
        except Exception as exc:  # a candidate this torch/GPU does not run is reported, not fatal
            status = f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        print(f"[2] block op {name:13s} {status}", flush=True)
    sdpa_ops.BACKENDS["cuda"] = default
    t = measure(eager_blockwise(2048))[0]
    print(f"[2] block op eager         laga+blockwise S=2048 {1e3 * t:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
