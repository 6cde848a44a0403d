"""Pieces the three forms share: up-projection, key assembly, layouts, ordering."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import torch
import torch.nn.functional as F

from .. import comm, layout as layouts
from ..agreement import inband
from ..cp_algos import AllGather
from ..vocab.attn_setup import AttnSetup


def all_heads(setup: AttnSetup) -> AttnSetup:
    """The same setup seen from a rank that keeps every head (before a ulysses all-to-all)."""
    return replace(setup, cp_algo=AllGather.name)


def split_label(setup: AttnSetup) -> str:
    """The byte counter's name of the group heads are split over."""
    return setup.algo.split_label


def seq_to_heads(x: torch.Tensor, setup: AttnSetup, tag: str) -> torch.Tensor:
    """All-to-all to head-split over the split group (ulysses: CP group; hybrid: Ulysses group)."""
    return comm.seq_to_heads(x, setup.split_group, tag, split_label(setup))


def heads_to_seq(x: torch.Tensor, setup: AttnSetup, tag: str) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`."""
    return comm.heads_to_seq(x, setup.split_group, tag, split_label(setup))


def up_weight_rows(kv_up_weight: torch.Tensor, setup: AttnSetup) -> torch.Tensor:
    """Rows of linear_kv_up_proj.weight for this rank's heads (a view)."""
    first, count = setup.head_slice()
    if count == setup.dims.heads:
        return kv_up_weight
    per_head = setup.dims.qk_head_dim + setup.dims.v_head_dim
    return kv_up_weight[first * per_head:(first + count) * per_head]


def split_up_weight(kv_up_weight: torch.Tensor, setup: AttnSetup):
    """W_UK [n, d_n, d_c] and W_UV [n, d_v, d_c] for this rank's heads (views)."""
    d = setup.dims
    rows = up_weight_rows(kv_up_weight, setup)
    w = rows.view(-1, d.qk_head_dim + d.v_head_dim, d.kv_lora_rank)
    return w[:, :d.qk_head_dim], w[:, d.qk_head_dim:]


def rebuild_kv(kv_latent: torch.Tensor, k_pos_emb: torch.Tensor, weight_rows: torch.Tensor,
               qk_head_dim: int, v_head_dim: int, linear=None, first_row: int = 0):
    """Megatron's MLA up-projection: kv_latent [S, b, d_c] and the shared rope key
    [S, b, d_r] -> key [S, b, h, d_n + d_r], value [S, b, h, d_v] (a view of the
    up-projection output), for the heads whose rows ``weight_rows`` holds.
    ``linear``: the matmul ``(latent, weight_rows, first_row) -> kv`` (None: F.linear),
    ``first_row``: where ``weight_rows`` start in the whole weight."""
    kv = (linear(kv_latent, weight_rows, first_row) if linear is not None
          else F.linear(kv_latent, weight_rows))
    kv = kv.view(*kv.shape[:2], -1, qk_head_dim + v_head_dim)
    k_nope, value = torch.split(kv, [qk_head_dim, v_head_dim], dim=-1)
    k_pe = k_pos_emb.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)
    return torch.cat([k_nope, k_pe], dim=-1), value


def up_project(kv_latent: torch.Tensor, k_pos_emb: torch.Tensor, kv_up_weight: torch.Tensor,
               setup: AttnSetup, linear=None):
    """Key and value of this rank's heads, both kept by the attention for backward
    (``linear``: as in :func:`rebuild_kv`)."""
    d = setup.dims
    first_head, _ = setup.head_slice()
    key, value = rebuild_kv(kv_latent, k_pos_emb, up_weight_rows(kv_up_weight, setup),
                            d.qk_head_dim, d.v_head_dim, linear,
                            first_head * (d.qk_head_dim + d.v_head_dim))
    # V gets its own storage: a view would keep the whole up-projection output
    # (k_nope's half too) alive; k_nope is consumed by the key concatenation.
    return key, value.contiguous()


def empty_fill(value: torch.Tensor, setup: AttnSetup):
    """What a query row that sees no key returns (``setup.empty_rows``), [b, h, 1, d_v] from
    the position-ordered values [S, b, h, d_v] of every position: their mean ("mean", a
    softmax over one constant) or None (zero, or no key padding: no row is empty)."""
    if setup.key_padding is None or setup.empty_rows != "mean":
        return None
    return value.mean(dim=0).unsqueeze(2)  # [b, h, d_v] -> [b, h, 1, d_v]


def empty_fill_latent(kv_all: torch.Tensor, kv_up_weight: torch.Tensor, setup: AttnSetup):
    """:func:`empty_fill` from the gathered latent [S, b, d_c]: the mean of the values is
    the up-projection of the mean latent (linear), so no value outside the rebuilt keys is
    ever built."""
    if setup.key_padding is None or setup.empty_rows != "mean":
        return None
    _, w_uv = split_up_weight(kv_up_weight, setup)  # [h, d_v, d_c]
    return torch.einsum("bc,nvc->bnv", kv_all.mean(dim=0), w_uv).unsqueeze(2)


def take_ranges(x: torch.Tensor, ranges) -> torch.Tensor:
    """The rows of position ranges [(lo, hi), ...] of a position-ordered tensor, in order
    (a view when there is one range)."""
    if len(ranges) == 1:
        lo, hi = ranges[0]
        return x[lo:hi]
    return torch.cat([x[lo:hi] for lo, hi in ranges])


def to_bnsd(x: torch.Tensor) -> torch.Tensor:
    """[S, b, h, d] -> [b, h, S, d]."""
    return x.permute(1, 2, 0, 3)


def from_bnsd(x: torch.Tensor) -> torch.Tensor:
    """[b, h, S, d] -> [S, b, h, d]."""
    return x.permute(2, 0, 1, 3)


def flatten_heads(x: torch.Tensor) -> torch.Tensor:
    """[s, b, h, d] -> [s, b, h*d], the input of linear_proj."""
    return x.reshape(*x.shape[:2], -1)


@lru_cache(maxsize=64)
def _order_index(layout: str, cp_size: int, local_len: int, documents, device: str, *,
                 ulysses_degree: int = 1) -> torch.Tensor:
    return layouts.to_position_order(layout, cp_size, local_len, documents,
                                     ulysses_degree=ulysses_degree).to(device)


def to_position_order(x: torch.Tensor, setup: AttnSetup) -> torch.Tensor:
    """A rank-order gather ([P*s, ...], CP rank order) -> global position order."""
    if layouts.is_identity(setup.layout, setup.cp_size):
        return x
    idx = _order_index(setup.layout, setup.cp_size, setup.local_len, setup.documents,
                       str(x.device), ulysses_degree=setup.ulysses_degree)
    return x.index_select(0, idx)


class _ConcatLatent(torch.autograd.Function):
    """``[kv_latent, k_pos_emb]`` whose backward hands each input a contiguous gradient.

    The gradients of the two halves of a concatenation are strided slices;
    Megatron's ``copy_to_tensor_model_parallel_region`` (core 0.12.1 and
    0.16.1) skips its TP all-reduce on a strided gradient, so the latent's
    gradient must leave LAGA contiguous. One function for the concatenation and
    both copies: a later call launches as little as it can.
    """

    @staticmethod
    def forward(ctx, kv_latent, k_pos_emb):
        ctx.width = kv_latent.shape[-1]
        return torch.cat([kv_latent, k_pos_emb], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        kv, pe = torch.split(grad, [ctx.width, grad.shape[-1] - ctx.width], dim=-1)
        return kv.contiguous(), pe.contiguous()


def concat_latent(kv_latent: torch.Tensor, k_pos_emb: torch.Tensor) -> torch.Tensor:
    """``[kv_latent, k_pos_emb]`` [s, b, d_c + d_r], handing back contiguous grads."""
    return _ConcatLatent.apply(kv_latent, k_pos_emb)


def gathered_latent(kv_latent: torch.Tensor, k_pos_emb: torch.Tensor, setup: AttnSetup) -> torch.Tensor:
    """All-gather ``[kv_latent, k_pos_emb]`` (d_c + d_r per token), in position order."""
    latent = concat_latent(kv_latent, k_pos_emb)
    if setup.cp_size == 1:
        return latent
    return to_position_order(inband.gather_seq(latent, setup.cp_group, "latent"), setup)


def split_latent(latent: torch.Tensor, setup: AttnSetup):
    """[S, b, d_c + d_r] -> kv part [S, b, d_c], rope key [S, b, d_r]."""
    return torch.split(latent, [setup.dims.kv_lora_rank, setup.dims.rope_dim], dim=-1)
