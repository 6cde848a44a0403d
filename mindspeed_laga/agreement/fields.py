"""The one table of what CP ranks agree on: each field's name, its int64 code and how a
difference is shown. Adding a field: one ``Field`` here, one line in a row builder."""
from __future__ import annotations

import struct
from typing import Callable, Dict, NamedTuple, Optional, Sequence

import torch

from ..kernels.registry import KERNELS  # noqa: F401 -- also the rows' code of kernel
from ..vocab.names import ATTN_CP_ALGOS, EMPTY_ROWS, FORMS, LAYOUTS

UNKNOWN = -1
CONTENT = -2  # a code left to the device-side content digest (content.content_code)
# The dtypes the forms run (float8 and the rest are refused by name), as codes.
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# A call's tensors in requires-grad bit order (bit i: input i needs a gradient); the dense
# forms use the first four, sparse MLA all seven.
INPUTS = ("query", "kv_latent", "k_pos_emb", "kv_up_weight", "index_query", "index_key",
          "index_weights")
# What a row comes from: a dense form, the overlapped gather, sparse MLA, or a settle.
STAGES = ("attention", "start_latent_gather", "sparse_attention", "settle")


def float_bits(x: float) -> int:
    """The exact bits of a float64 as a signed int64 (so 0.1 and 0.1+1ulp differ)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(n)))[0]


def dtype_code(dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else UNKNOWN


def choice_code(choices: Sequence[str], value) -> int:
    return choices.index(value) if isinstance(value, str) and value in choices else UNKNOWN


def grad_pattern(tensors: Dict[str, object]) -> int:
    """Which of ``tensors`` (keys from INPUTS) need a gradient, as bits (0 outside grad mode)."""
    bits = 0
    for name, t in tensors.items() if torch.is_grad_enabled() else ():  # no genexpr: per call
        bits |= 1 << INPUTS.index(name) if isinstance(t, torch.Tensor) and t.requires_grad else 0
    return bits


class Field(NamedTuple):
    name: str
    label: str = ""                    # how the message names it ("" : its name)
    show: Callable[[int], object] = int  # a code as the message shows it
    names: Optional[Sequence[str]] = None  # the choices a code indexes


_F, _B = bits_float, bool
_grads = lambda bits: [name for i, name in enumerate(INPUTS) if bits >> i & 1]  # noqa: E731
_dtype = lambda code: str(DTYPES[code]) if 0 <= code < len(DTYPES) else code  # noqa: E731
TABLE = (
    Field("rejected", show=_B), Field("stage", names=STAGES), Field("check_ranks", show=_B),
    Field("form", names=FORMS), Field("cp_algo", names=ATTN_CP_ALGOS),
    Field("layout", names=LAYOUTS), Field("causal", show=_B), Field("softmax_scale", show=_F),
    Field("local_len", "the local sequence length"), Field("micro_batch", "the micro-batch"),
    Field("heads", "the heads"), Field("qk_head_dim", "the qk_head_dim"),
    Field("rope_dim", "the qk_pos_emb_head_dim"), Field("v_head_dim", "the v_head_dim"),
    Field("kv_lora_rank", "the kv_lora_rank"), Field("dtype", "the dtype", _dtype),
    Field("requires_grad", "which inputs need grads (requires_grad under grad mode)", _grads),
    Field("recompute_kv", show=_B), Field("kv_block_size"), Field("trim_causal_prefix", show=_B),
    Field("latent_gather", show=_B), Field("documents", "documents (cu_seqlens)"),
    Field("ulysses_degree", "the size of ulysses_group"),
    Field("key_padding", "key_padding_mask (which keys are padding; shown: padding keys per "
                         "sample)"),
    Field("empty_rows", names=EMPTY_ROWS),
    Field("kv_up_linear", "kv_up_linear (the up-projection: F.linear, or the FP8 recipe and "
                          "scales of the host's matmul)"),
    Field("given_topk", "topk_indices (given picks: their k; 0: the indexer picks)"),
    Field("index_topk"), Field("index_heads", "the index heads (index_query.shape[2])"),
    Field("index_head_dim", "the index head dim (index_key.shape[-1])"), Field("loss_target"),
    Field("loss_coeff", "indexer_loss_coeff", _F), Field("indexer_kernel"),
    Field("attention_kernel"), Field("loss_kernel"),
    Field("kernel", "kernel (the attention kernel)", names=KERNELS),
    # the later calls' (schedule.py): their rows' digest; on the device, unread: their key
    # padding's digest and the flags of inputs found wrong (bit i: FLAGS[i])
    Field("calls"), Field("content"), Field("flags"),
)
FIELDS = tuple(f.name for f in TABLE)
DIGESTS = ("calls", "content", "flags")  # compared apart from the call's own values
# What a call can find wrong on the device only (no read), and how the message says it.
FLAGS = {"topk_indices": "held picks no query may attend (outside [0, S), past the query's "
                         "position or before its document's start) or a row of only -1",
         "latent": "gathered in a later call differed in band (the calls' codes or a rank's "
                   "verdict, compared on the device)"}
BY_NAME, _ABSENT = {f.name: f for f in TABLE}, dict.fromkeys(FIELDS, UNKNOWN)


def label(name: str) -> str:
    return BY_NAME[name].label or name


def show(name: str, code: int, names: Optional[Dict[str, Sequence[str]]] = None):
    """A code as the message shows it (``names``: a row builder's choices for a field)."""
    if code == UNKNOWN:
        return "unknown"
    f = BY_NAME[name]
    choices = (names or {}).get(name, f.names)
    if choices is not None:
        return choices[code] if 0 <= code < len(choices) else code
    return f.show(code)


def row_of(values: Dict[str, int]) -> tuple:
    """``values`` as a full row (UNKNOWN where absent): what a later call records."""
    return tuple({**_ABSENT, **values}.values())  # in FIELDS order: _ABSENT's keys come first
