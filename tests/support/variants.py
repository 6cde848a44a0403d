"""Every attention path a test sweeps, by name: LAGA (plain, trimming the causal prefix,
recomputing K/V by segment and by key block), explicit and absorbed; and the kernel and
CP-algorithm axes, from the registries."""
from __future__ import annotations

from mindspeed_laga import absorbed_attention, explicit_attention, laga_attention
from mindspeed_laga.cp_algos import ALGOS
from mindspeed_laga.kernels.registry import CPU_KERNELS as _CPU_KERNELS, KERNEL_NAMES, KERNEL_TYPES
from mindspeed_laga.vocab.names import CP_ALGOS


def attention_variants(kv_block_size: int) -> dict:
    """{name: (form, its keyword options)}; ``kv_block_size``: the blockwise rebuild's block,
    chosen by the test against its sequence length."""
    return {
        "laga": (laga_attention, {}),
        "laga+trim": (laga_attention, {"trim_causal_prefix": True}),
        "laga+recompute": (laga_attention, {"recompute_kv": True}),
        "laga+blockwise": (laga_attention, {"recompute_kv": True, "kv_block_size": kv_block_size}),
        "explicit": (explicit_attention, {}),
        "absorbed": (absorbed_attention, {}),
    }


# ---- the kernel and CP-algorithm axes, read from the registries (a new kernel or
# algorithm joins every sweep below without a test edit)

# Every registered kernel, in the CLI's order (the npu one runs through the stand-in
# torch_npu where a test installs it).
KERNELS = KERNEL_NAMES
# The kernels that run on CPU tensors: a CPU sweep's kernel axis.
CPU_KERNELS = _CPU_KERNELS
# The CP algorithms of the tables (``in_tables``): the plain equivalence axis.
PLAIN_ALGOS = CP_ALGOS
# The others, which plan, bench and verify offer on their own (hybrid: it needs a 1 < U < P):
# swept from CP 4 on, so an algorithm outside the tables still reaches equivalence cases.
OWN_ALGOS = tuple(n for n, a in ALGOS.items() if not a.in_tables)
# Those that take a Ulysses degree U (a sweep gives them U = 2).
DEGREE_ALGOS = tuple(n for n, a in ALGOS.items() if a.takes_ulysses_degree)


def algos_for(cp: int) -> tuple:
    """The CP algorithms a sweep at CP size ``cp`` runs (those outside the tables from CP 4
    on)."""
    return PLAIN_ALGOS + (OWN_ALGOS if cp >= 4 else ())


def runs_on_accelerator(kernel: str) -> bool:
    """Whether ``kernel`` runs on one device type only (npu: the stand-in, float32 there)."""
    return KERNEL_TYPES[kernel].device is not None
