"""A CPU stand-in for the torch_npu MX-FP8 ops MindSpeed's TE modules call (``--fp8-recipe
mxfp8``): ``npu_dynamic_mx_quant``, ``npu_dynamic_mx_quant_with_dual_axis`` and
``npu_quant_matmul`` with e8m0 block scales, plus the dtype names ``float8_e8m0fnu`` and
``hifloat8``.

Semantics, from the public documentation (our own code, nothing copied):

- CANN ops-nn ``aclnnDynamicMxQuant`` (and ``DynamicMxQuantWithDualAxis``, which does the
  same on the -1 and the -2 axis at once): the input is split along ``axis`` into blocks
  of 32 values; per block ``shared_exp = floor(log2(max|V|)) - emax`` (emax 8 for
  FLOAT8_E4M3FN, 15 for FLOAT8_E5M2), ``mxscale = 2**shared_exp`` (stored as
  FLOAT8_E8M0), and each value becomes ``cast_to_dst_type(V / mxscale, round_mode)``;
  round_mode "rint" (round half to even) is the default and the only one here. A block
  whose largest value lands in [max normal, 2**(emax+1)) after scaling saturates to the
  largest normal (the OCP MX conversion; e4m3fn has no infinity). An all-zero block gets
  the smallest scale, 2**-127. The input is float16, bfloat16 or float32.
- op-plugin ``DynamicMxQuantKernelNpuOpApi.cpp`` / ``...WithDualAxis...``: block size 32
  (``BLOCK_SIZE_BASE_NUM``), scales paired (``ALIGN_NUM = 2``): the scale tensor has the
  input's shape with the quantized axis replaced by ``ceil(ceil(d / 32) / 2)`` and one
  trailing axis of 2 (the pad of an odd block count is the smallest scale, never read);
  dual axis needs at least 2 dimensions and returns ``(y1, scale1, y2, scale2)`` for the
  -1 and the -2 axis. MindSpeed's own CPU check (``MXFP8TensorCpu.padding_cpu_scale``)
  reads the scales with this layout.
- ``aclnnQuantMatmulV5``, the FLOAT8 x FLOAT8 case with FLOAT8_E8M0 ``x1Scale``/``x2Scale``
  and ``groupSizes [1, 1, 32]``: ``out[m, n] = sum_k x1[m, k] * x1Scale[m, k // 32] *
  x2[k, n] * x2Scale[k // 32, n]``, accumulated in float32 and cast to ``output_dtype``
  (float16, bfloat16 or float32); x1 is [M, K] with its scale [M, ceil(K/64), 2], x2 is
  [K, N] with its scale [ceil(K/64), N, 2] (MindSpeed passes ``w.t()`` and
  ``scale.transpose(0, 1)``: strided views are accepted, as on the device).

Every ``npu_quant_matmul`` call is counted in ``COUNTS`` (``torch_npu.quant_counts``), so a
real-loop test can show that FP8 matmuls ran. Anything else these ops can do (FLOAT4, other
round modes, ``scale_alg`` 1, block sizes other than 32, HiFloat8, per-tensor or per-block
INT8/FP8 matmul modes) raises ``NotImplementedError``; wrong shapes and dtypes raise
``FakeQuantError``, as the device op rejects them.
"""
from __future__ import annotations

import collections
import math

import torch

BLOCK = 32
PAIR = 2  # scales come in pairs along the quantized axis
SCALE_DTYPE = getattr(torch, "float8_e8m0fnu", None)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# dtype -> (emax: exponent of the largest normal, largest normal)
FP8 = {torch.float8_e4m3fn: (8, 448.0), torch.float8_e5m2: (15, 57344.0)}
MIN_EXP, MAX_EXP = -127, 127  # e8m0: 2**-127 .. 2**127 (255 is NaN)
COUNTS = collections.Counter()  # op name -> calls (the real-loop recorder reports them)


class FakeQuantError(RuntimeError):
    """A call the device op would reject (shape, dtype, argument)."""


class HiFloat8:
    """``torch_npu.hifloat8``: a name only; the ops here refuse it."""

    def __repr__(self):
        return "torch_npu.hifloat8"


hifloat8 = HiFloat8()


def _check_input(x, name):
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        raise FakeQuantError(f"{name}: x must be a float16/bfloat16/float32 tensor, got "
                             f"{getattr(x, 'dtype', type(x))}")


def _check_dst(dst_type, round_mode, scale_alg, dst_type_max):
    if dst_type is hifloat8:
        raise NotImplementedError("fake torch_npu: HiFloat8 quantization is not covered")
    if dst_type not in FP8:
        raise FakeQuantError(f"dst_type must be torch.float8_e4m3fn or torch.float8_e5m2 "
                             f"here, got {dst_type}")
    if round_mode != "rint":
        raise NotImplementedError(f"fake torch_npu: round_mode {round_mode!r} (only 'rint')")
    if scale_alg not in (None, 0):
        raise NotImplementedError(f"fake torch_npu: scale_alg {scale_alg} (only 0)")
    if dst_type_max not in (None, 0, 0.0):
        raise NotImplementedError("fake torch_npu: dst_type_max (only the type's own max)")


def _scale_exponents(blocks: torch.Tensor, dst_type) -> torch.Tensor:
    """Per block (last axis of ``blocks``, float32): floor(log2(amax)) - emax, in e8m0 range."""
    emax, _ = FP8[dst_type]
    amax = blocks.abs().amax(dim=-1)
    # frexp: amax = m * 2**e with m in [0.5, 1) -> floor(log2(amax)) = e - 1, exactly
    _, exponent = torch.frexp(amax)
    shared = (exponent - 1 - emax).to(torch.int32)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, MIN_EXP))
    return shared.clamp(MIN_EXP, MAX_EXP)


def _quantize_last_axis(x: torch.Tensor, dst_type):
    """(y, scale exponents [..., ceil(d/32)]) with blocks along the last axis."""
    _, largest = FP8[dst_type]
    d = x.shape[-1]
    blocks = math.ceil(d / BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * BLOCK - d))
    padded = padded.view(*x.shape[:-1], blocks, BLOCK)
    exponents = _scale_exponents(padded, dst_type)
    scaled = torch.ldexp(padded, -exponents.unsqueeze(-1).double()).float()
    scaled = scaled.clamp(-largest, largest)  # saturate (e4m3fn has no infinity)
    y = scaled.to(dst_type).view(*x.shape[:-1], blocks * BLOCK)[..., :d]
    return y.contiguous(), exponents


def _pack_scales(exponents: torch.Tensor) -> torch.Tensor:
    """[..., blocks] exponents -> e8m0 scales [..., ceil(blocks/2), 2] (odd count: padded)."""
    blocks = exponents.shape[-1]
    pairs = math.ceil(blocks / PAIR)
    padded = torch.nn.functional.pad(exponents, (0, pairs * PAIR - blocks), value=MIN_EXP)
    return _to_e8m0(padded.view(*exponents.shape[:-1], pairs, PAIR))


def _to_e8m0(exponents: torch.Tensor) -> torch.Tensor:
    if SCALE_DTYPE is None:
        raise NotImplementedError("fake torch_npu: this torch has no float8_e8m0fnu")
    return (exponents + 127).to(torch.uint8).view(SCALE_DTYPE)


def scale_exponents(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales -> their integer exponents (int32), same shape."""
    if scale.dtype != SCALE_DTYPE:
        raise FakeQuantError(f"an MX scale must be float8_e8m0fnu, got {scale.dtype}")
    return scale.contiguous().view(torch.uint8).to(torch.int32) - 127


def _quantize(x: torch.Tensor, axis: int, dst_type):
    """(y, scale) along axis -1 or -2, scales laid out as the device op returns them."""
    if axis == -1:
        y, exponents = _quantize_last_axis(x, dst_type)
        return y, _pack_scales(exponents)
    y, exponents = _quantize_last_axis(x.transpose(-1, -2), dst_type)
    # exponents [..., K, blocks of M] -> scale [..., ceil(M/64), K, 2]
    packed = _pack_scales(exponents)
    return y.transpose(-1, -2).contiguous(), packed.transpose(-2, -3).contiguous()


def npu_dynamic_mx_quant(input, *, axis=-1, round_mode="rint", dst_type=torch.float8_e4m3fn,
                         block_size=32, scale_alg=None, dst_type_max=0.0):
    _check_input(input, "npu_dynamic_mx_quant")
    _check_dst(dst_type, round_mode, scale_alg, dst_type_max)
    if block_size != BLOCK:
        raise NotImplementedError(f"fake torch_npu: block_size {block_size} (only 32)")
    if not -input.dim() <= axis < input.dim():
        raise FakeQuantError(f"axis {axis} out of range for a {input.dim()}-D input")
    axis = axis - input.dim() if axis >= 0 else axis
    if axis not in (-1, -2):
        raise NotImplementedError(f"fake torch_npu: axis {axis} (only -1 and -2)")
    if axis == -2 and input.dim() < 2:
        raise FakeQuantError("axis -2 needs a 2-D input at least")
    return _quantize(input, axis, dst_type)


def npu_dynamic_mx_quant_with_dual_axis(input, *, round_mode="rint", dst_type=torch.float8_e4m3fn,
                                        scale_alg=0, dst_type_max=None):
    _check_input(input, "npu_dynamic_mx_quant_with_dual_axis")
    _check_dst(dst_type, round_mode, scale_alg, dst_type_max)
    if input.dim() < 2:
        raise FakeQuantError("npu_dynamic_mx_quant_with_dual_axis: the input should be at "
                             "least 2D")
    y1, scale1 = _quantize(input, -1, dst_type)
    y2, scale2 = _quantize(input, -2, dst_type)
    return y1, scale1, y2, scale2


def _check_mx_operand(x, scale, name, k_axis):
    """x [M, K] (k_axis 1) or [K, N] (k_axis 0) in FP8; its scale [M, K/64, 2] / [K/64, N, 2]."""
    if x.dim() != 2 or x.dtype not in FP8:
        raise FakeQuantError(f"npu_quant_matmul: {name} must be a 2-D float8_e4m3fn/e5m2 "
                             f"tensor here, got {x.dtype} {tuple(x.shape)}")
    k = x.shape[k_axis]
    pairs = math.ceil(math.ceil(k / BLOCK) / PAIR)
    want = (x.shape[0], pairs, PAIR) if k_axis == 1 else (pairs, x.shape[1], PAIR)
    if scale is None or tuple(scale.shape) != want:
        raise FakeQuantError(f"npu_quant_matmul: the scale of {name} {tuple(x.shape)} must be "
                             f"{want}, got {None if scale is None else tuple(scale.shape)}")
    return scale_exponents(scale)


def _dequantize(x: torch.Tensor, exponents: torch.Tensor, k_axis: int) -> torch.Tensor:
    """float32 values of x [M, K] / [K, N] with per-32-along-K exponents in paired layout."""
    k = x.shape[k_axis]
    # sizes spelled out: M, N or K may be 0 (an expert with no token)
    slots = exponents.shape[-2 if k_axis == 1 else 0] * PAIR
    if k_axis == 1:
        per_block = exponents.reshape(x.shape[0], slots)
        per_value = per_block.repeat_interleave(BLOCK, dim=1)[:, :k]
    else:
        per_block = exponents.permute(0, 2, 1).reshape(slots, x.shape[1])
        per_value = per_block.repeat_interleave(BLOCK, dim=0)[:k]
    return torch.ldexp(x.float(), per_value.float())


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None, x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None,
                     scale_dtype=None, group_sizes=None):
    """The MX case only: FP8 x1 [M, K] and x2 [K, N] with e8m0 scales per 32 along K."""
    if list(group_sizes or []) != [1, 1, BLOCK] or scale_dtype is None:
        raise NotImplementedError("fake torch_npu: npu_quant_matmul covers the MX mode only "
                                  "(group_sizes [1, 1, 32], e8m0 scales)")
    if SCALE_DTYPE is None or scale_dtype != SCALE_DTYPE or pertoken_scale_dtype != SCALE_DTYPE:
        raise FakeQuantError("npu_quant_matmul: MX mode needs scale_dtype and "
                             "pertoken_scale_dtype float8_e8m0fnu")
    if offset is not None or bias is not None or x1_dtype is not None or x2_dtype is not None:
        raise NotImplementedError("fake torch_npu: offset, bias, x1_dtype, x2_dtype")
    if output_dtype not in OUTPUT_DTYPES:
        raise FakeQuantError(f"npu_quant_matmul: output_dtype {output_dtype} (MX mode: "
                             "float16, bfloat16 or float32)")
    if x1.dim() != 2 or x2.dim() != 2 or x1.shape[1] != x2.shape[0]:
        raise FakeQuantError(f"npu_quant_matmul: x1 {tuple(x1.shape)} and x2 "
                             f"{tuple(x2.shape)} do not chain")
    COUNTS["npu_quant_matmul"] += 1
    e1 = _check_mx_operand(x1, pertoken_scale, "x1", k_axis=1)
    e2 = _check_mx_operand(x2, scale, "x2", k_axis=0)
    out = _dequantize(x1, e1, 1) @ _dequantize(x2, e2, 0)  # float32 accumulation
    return out.to(output_dtype)


def register(module) -> None:
    """Add the ops and dtype names to a torch_npu stand-in module."""
    module.float8_e8m0fnu = SCALE_DTYPE
    module.hifloat8 = hifloat8
    module.npu_dynamic_mx_quant = npu_dynamic_mx_quant
    module.npu_dynamic_mx_quant_with_dual_axis = npu_dynamic_mx_quant_with_dual_axis
    module.npu_quant_matmul = npu_quant_matmul
    module.quant_counts = COUNTS
