"""The absorbed attention over the picks in plain torch, shared by the stage kernels: the
torch kernel runs it, and any kernel whose loss reads what it does not keep recomputes its
probabilities here (a kernel module imports this one, never another kernel module)."""
from __future__ import annotations

import torch

from .stage import AbsorbedStats


def attention_probs(call, query, kv_up_weight, picks):
    """[b, n, s, k] the attention's probabilities at the picks, without gradient (for the
    torch loss behind another attention kernel)."""
    with torch.no_grad():
        return torch.softmax(absorbed_scores(call, query, kv_up_weight, picks.indices)[1], dim=-1)


def all_keys_probs(call, query, kv_up_weight, indices):
    """[b, n, s, k] float32 without gradient: each head's softmax over every key of the
    sequence, no mask (causal or sparse), read at ``indices`` (valid positions): the
    target MindSpeed-LLM's torch loss computes behind its sparse flash attention (its
    ``get_attn_scores`` with no mask: scores in the inputs' dtype, softmax in float32).
    One head at a time, so the [b, s, S] scores are held once."""
    with torch.no_grad():
        n, qk_head_dim = query.shape[2], call.qk_head_dim
        w_uk = kv_up_weight.view(n, qk_head_dim + call.v_head_dim, -1)[:, :qk_head_dim]
        heads = []
        for head in range(n):
            q_latent = query[:, :, head, :qk_head_dim] @ w_uk[head]            # [s, b, d_c]
            scores = (torch.einsum("sbc,Sbc->bsS", q_latent, call.latent)
                      + torch.einsum("sbr,Sbr->bsS", query[:, :, head, qk_head_dim:],
                                     call.k_pe)) * call.softmax_scale
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
            heads.append(torch.gather(probs, -1, indices))
        return torch.stack(heads, dim=1)


def absorbed_scores(call, query, kv_up_weight, indices):
    """(q_latent [b, n, s, d_c], scores [b, n, s, k] scaled and masked, the picked
    latent keys [b, s, k, d_c]) of each query over its picked keys."""
    s, b, n, _ = query.shape
    qk_head_dim = call.qk_head_dim
    weight = kv_up_weight.view(n, qk_head_dim + call.v_head_dim, -1)
    w_uk = weight[:, :qk_head_dim]
    q_nope, q_pe = torch.split(query, [qk_head_dim, query.shape[-1] - qk_head_dim], dim=-1)
    q_latent = torch.einsum("sbnd,ndc->bnsc", q_nope, w_uk)
    batch = torch.arange(b, device=query.device).view(b, 1, 1)
    picked = indices.clamp(min=0)
    latent_sel = call.latent.transpose(0, 1)[batch, picked]  # [b, s, k, d_c]
    k_pe_sel = call.k_pe.transpose(0, 1)[batch, picked]      # [b, s, k, d_r]
    scores = (torch.einsum("bnsc,bskc->bnsk", q_latent, latent_sel)
              + torch.einsum("sbnr,bskr->bnsk", q_pe, k_pe_sel)) * call.softmax_scale
    scores = scores.masked_fill(~(indices >= 0).unsqueeze(1), float("-inf"))
    return q_latent, scores, latent_sel


def picked_output(call, probs, latent_sel, kv_up_weight, query_shape):
    """[s, b, n*d_v]: the probabilities over the picked latents, through W_UV."""
    s, b, n, _ = query_shape
    w_uv = kv_up_weight.view(n, call.qk_head_dim + call.v_head_dim, -1)[:, call.qk_head_dim:]
    out_latent = torch.einsum("bnsk,bskc->sbnc", probs, latent_sel)
    output = torch.einsum("sbnc,nvc->sbnv", out_latent, w_uv)
    return output.reshape(s, b, n * call.v_head_dim)


def softmax_stats(q_latent, query, qk_head_dim, scores) -> AbsorbedStats:
    """The fused loss's view of this attention: BSND query parts and softmax max/sum."""
    scores = scores.detach()
    row_max = scores.amax(dim=-1, keepdim=True)  # finite: every query has a valid pick
    row_sum = torch.exp(scores - row_max).sum(dim=-1)

    def bsn(stat):  # [b, n, s] -> [b, 1, s, n]
        return stat.float().transpose(1, 2).unsqueeze(1).contiguous()

    q_rope = query[..., qk_head_dim:].detach().transpose(0, 1)
    return AbsorbedStats(q_latent.detach().transpose(1, 2), q_rope, bsn(row_max.squeeze(-1)),
                         bsn(row_sum))
