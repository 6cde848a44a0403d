"""The three forms and LAGA's options on one device (CUDA when present, else CPU)
against the float64 reference, without CP: the check to run on a GPU machine.

    PYTHONPATH=. python scripts/check_single_device.py          # S=512 (env S=...)

Prints the worst relative error (output and all four grads) per form, kernel,
dtype and option beside the tolerance it must stay within (``verify``'s and
``doctor``'s: 1e-5 in float32, 8 bf16 ulps in bfloat16) and ok/FAIL, then one
verdict line; exits 1 when any row fails. Multi-rank checks are
`mindspeed-laga verify` and the tests.
"""
import itertools
import os
import sys

import torch

from mindspeed_laga import api
from mindspeed_laga.kernels.declared.eager import Eager
from mindspeed_laga.kernels.registry import CPU_KERNELS, KERNEL_TYPES
from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.tools.commands.verify import TOLERANCE

OPTIONS = {"": {}, "trim": dict(trim_causal_prefix=True), "recompute": dict(recompute_kv=True),
           "blockwise": dict(recompute_kv=True, kv_block_size=128)}
# Every registered kernel that runs on any device (CPU, CUDA)
KERNELS = tuple(KERNEL_TYPES[n] for n in CPU_KERNELS)
# The recompute paths run the block kernel of the blockwise walk: checked here with the
# eager one (the fused block ops are `mindspeed-laga doctor`'s and the tests').
KERNELS_OF = {"recompute": (Eager,), "blockwise": (Eager,)}


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = eq.MLAShape(seq_len=int(os.environ.get("S", 512)), batch=2, heads=16, qk_head_dim=128,
                        rope_dim=64, v_head_dim=128, kv_lora_rank=512)
    full = eq.full_inputs(shape, 1)
    print(f"device={device} S={shape.seq_len} b=2 n=16 dims 128/64/128/512")
    failed = 0
    for form, kind, dtype, opt in itertools.product(("explicit", "absorbed", "laga"), KERNELS,
                                                    (torch.float32, torch.bfloat16), OPTIONS):
        if (opt and form != "laga") or kind not in KERNELS_OF.get(opt, KERNELS):
            continue
        kernel = kind.name
        ref_in = {k: full[k].to(dtype).double().to(device).requires_grad_() for k in eq.INPUTS}
        ref = eq.mla_attention_reference(*ref_in.values(), softmax_scale=shape.softmax_scale)
        ref.backward(full["grad_out"].to(dtype).double().to(device))
        x = {k: full[k].to(dtype).to(device).detach().clone().requires_grad_() for k in eq.INPUTS}
        out = api.FORMS[form](*x.values(), softmax_scale=shape.softmax_scale, kernel=kernel,
                              **OPTIONS[opt])
        out.backward(full["grad_out"].to(dtype).to(device))
        errs = eq.relative_errors({"out": out.detach().double(),
                                   "grads": {k: t.grad.double() for k, t in x.items()}},
                                  {"out": ref.detach(), "grads": {k: t.grad for k, t in ref_in.items()}})
        worst, tolerance = max(errs.values()), TOLERANCE[str(dtype)[6:]]
        ok = worst <= tolerance  # NaN fails
        failed += not ok
        print(f"{form:9s} {kernel:6s} {str(dtype)[6:]:9s} {opt or '-':10s} "
              f"worst rel err {worst:.2e} (tolerance {tolerance:.1e}) {'ok' if ok else 'FAIL'}")
    print(f"FAILED: {failed} rows above their tolerance" if failed else
          "OK: every form, kernel, dtype and option matches the float64 reference within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
