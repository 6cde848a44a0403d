"""The DSA op stand-ins (tests/support/fake_dsa_ops.py) against MindSpeed-LLM's own
non-fused torch path, forward and backward, and their argument checks.

The references come from the host's functions run in a subprocess
(tests/support/dsa_host_reference.py): ``bf16_index`` + ``topk`` for the indexer,
``generate_sparse_mask`` + dense softmax attention for the sparse attention,
``get_attn_scores`` + ``compute_dsa_indexer_loss`` for the KL loss; the host's own fused
callers run there on the stand-ins too. The host forces
float32 on the index scores; the attention runs in float64 (``wide_dtypes``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import fake_dsa_ops, fake_torch_npu
from support.dsa_host_reference import B, HEADS, INDEX_HEADS, S, SCALE, TOPK

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

FakeNpuError = fake_torch_npu.FakeNpuError
indexer = fake_dsa_ops.npu_lightning_indexer
sfa = fake_dsa_ops.npu_sparse_flash_attention
kl_loss = fake_dsa_ops.npu_sparse_lightning_indexer_grad_kl_loss


@pytest.fixture(scope="module")
def host(host_sources, tmp_path_factory):
    path = tmp_path_factory.mktemp("dsa") / "host.pt"
    script = Path(__file__).resolve().parents[1] / "support" / "dsa_host_reference.py"
    proc = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True,
                          env=dict(os.environ, **host_sources), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return torch.load(path)


def bsnd(x):
    """Megatron's [S, B, ...] -> the ops' [B, S, ...]."""
    return x.transpose(0, 1).contiguous()


def run_indexer(x, dtype=torch.float32, **kw):
    q, k, w = (bsnd(x[n]).to(dtype).requires_grad_() for n in ("index_q", "index_k", "weights"))
    with fake_dsa_ops.wide_dtypes():
        idx, val = indexer(q, k, w, sparse_count=TOPK, sparse_mode=3, return_value=True, **kw)
    return q, k, w, idx, val


def close(got, want, rtol):
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err < rtol, f"max error {err:.2e} relative to the largest value"


# ------------------------------------------------------------ npu_lightning_indexer

def test_indexer_picks_the_hosts_top_k_and_scores(host):
    x, want = host["inputs"], host["host"]
    _, _, _, idx, val = run_indexer(x)
    assert idx.dtype == torch.int32 and tuple(idx.shape) == (B, S, 1, TOPK)
    assert torch.equal(idx[:, :, 0].long(), want["indices"])
    valid = want["indices"] >= 0
    close(val[:, :, 0][valid], want["scores"][valid], 1e-6)
    assert torch.isinf(val[:, :, 0][~valid]).all() and (val[:, :, 0][~valid] < 0).all()


def test_indexer_values_backward_matches_the_host(host):
    x, want = host["inputs"], host["host"]
    q, k, w, idx, val = run_indexer(x)
    valid = idx[:, :, 0] >= 0
    (torch.where(valid, val[:, :, 0], 0.0) * x["probe"].float()).sum().backward()
    close(q.grad, bsnd(want["d_index_q"]), 1e-5)
    close(k.grad, bsnd(want["d_index_k"]), 1e-5)
    close(w.grad, bsnd(want["d_weights"]), 1e-5)


def test_indexer_counts_causality_from_the_lower_right_vertex(host):
    """The kvallgather call: a late chunk of queries against the keys up to its end."""
    x = host["inputs"]
    _, _, _, full, _ = run_indexer(x)
    q, k, w = (bsnd(x[n]).float() for n in ("index_q", "index_k", "weights"))
    with fake_dsa_ops.wide_dtypes():
        part, _ = indexer(q[:, 8:12], k[:, :12], w[:, 8:12], sparse_count=TOPK, sparse_mode=3)
    assert torch.equal(part, full[:, 8:12])


def test_indexer_tnd_treats_each_sequence_alone(host):
    x = host["inputs"]
    q, k, w = (bsnd(x[n]).float() for n in ("index_q", "index_k", "weights"))
    cu = torch.tensor([5, 16], dtype=torch.int32)
    with fake_dsa_ops.wide_dtypes():
        packed, _ = indexer(q[0], k[0], w[0], actual_seq_lengths_query=cu, actual_seq_lengths_key=cu,
                            layout_query="TND", layout_key="TND", sparse_count=TOPK)
        first, _ = indexer(q[:1, :5], k[:1, :5], w[:1, :5], sparse_count=TOPK)
        second, _ = indexer(q[:1, 5:], k[:1, 5:], w[:1, 5:], sparse_count=TOPK)
    assert tuple(packed.shape) == (S, 1, TOPK)
    assert torch.equal(packed[:5], first[0]) and torch.equal(packed[5:], second[0])


def test_indexer_ties_go_to_the_lower_key_index():
    q = torch.ones(1, 4, 8, 128, dtype=torch.bfloat16)
    k = torch.ones(1, 4, 1, 128, dtype=torch.bfloat16)
    w = torch.ones(1, 4, 8, dtype=torch.bfloat16)
    idx, val = indexer(q, k, w, sparse_count=3, return_value=True)
    assert idx[0, :, 0].tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2]]
    assert val.dtype == torch.bfloat16
    assert indexer(q, k, w, sparse_count=3)[1].numel() == 0  # no values unless asked


def _indexer_args(**change):
    args = {"query": torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16),
            "key": torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16),
            "weights": torch.zeros(1, 4, 8, dtype=torch.bfloat16), "sparse_count": 2}
    args.update(change)
    return args


@pytest.mark.parametrize("change, words", [
    ({"query": torch.zeros(1, 4, 8, 128)}, "dtype"),
    ({"weights": torch.zeros(1, 4, 8, dtype=torch.float16)}, "dtype"),
    ({"query": torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)}, "head dim"),
    ({"key": torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)}, "N2 must be 1"),
    ({"weights": torch.zeros(1, 4, 4, dtype=torch.bfloat16)}, "weights must be"),
    ({"sparse_count": 0}, "sparse_count"),
    ({"sparse_count": 2049}, "sparse_count"),
    ({"sparse_mode": 1}, "sparse_mode"),
    ({"pre_tokens": 100}, "pre_tokens"),
    ({"layout_key": "TND"}, "layout_key"),
    ({"layout_query": "BNSD", "layout_key": "BNSD"}, "layout_query"),
    ({"actual_seq_lengths_query": torch.tensor([4])}, "int32"),
])
def test_indexer_rejects_what_the_op_rejects(change, words):
    with pytest.raises(FakeNpuError, match=words):
        indexer(**_indexer_args(**change))


def test_the_environment_switch_takes_wide_dtypes_too(monkeypatch):
    args = _indexer_args(query=torch.zeros(1, 4, 8, 128), key=torch.zeros(1, 4, 1, 128),
                         weights=torch.zeros(1, 4, 8))
    with pytest.raises(FakeNpuError, match="dtype"):
        indexer(**args)
    monkeypatch.setenv(fake_dsa_ops.WIDE_ENV, "1")
    assert indexer(**args)[0].shape == (1, 4, 1, 2)


def test_indexer_tnd_needs_cumulative_lengths():
    args = _indexer_args(query=torch.zeros(4, 8, 128, dtype=torch.bfloat16),
                         key=torch.zeros(4, 1, 128, dtype=torch.bfloat16),
                         weights=torch.zeros(4, 8, dtype=torch.bfloat16), layout_query="TND",
                         layout_key="TND")
    with pytest.raises(FakeNpuError, match="required with layout TND"):
        indexer(**args)
    with pytest.raises(FakeNpuError, match="end at the token count"):
        indexer(**args, actual_seq_lengths_query=torch.tensor([3], dtype=torch.int32),
                actual_seq_lengths_key=torch.tensor([3], dtype=torch.int32))


# ------------------------------------------------------------ npu_sparse_flash_attention

def run_sfa(x, indices, **kw):
    leaves = {n: bsnd(x[n]).requires_grad_() for n in ("q", "q_rope", "latent", "k_rope")}
    with fake_dsa_ops.wide_dtypes():
        out, smax, ssum = sfa(leaves["q"], leaves["latent"], leaves["latent"],
                              indices.unsqueeze(2).to(torch.int32), SCALE,
                              query_rope=leaves["q_rope"], key_rope=leaves["k_rope"], attention_mode=2,
                              return_softmax_lse=True, **kw)
    return leaves, out, smax, ssum


def test_sparse_attention_matches_the_hosts_sparse_mask(host):
    x, want = host["inputs"], host["host"]
    leaves, out, _, _ = run_sfa(x, want["indices"])
    close(out, bsnd(want["out"]), 1e-12)
    (out * bsnd(x["grad_out"])).sum().backward()
    for name in ("q", "q_rope", "latent", "k_rope"):  # key and value are one tensor: grads add
        close(leaves[name].grad, bsnd(want[f"d_{name}"]), 1e-12)


def test_sparse_attention_softmax_stats_rebuild_the_probabilities(host):
    x, want = host["inputs"], host["host"]
    _, _, smax, ssum = run_sfa(x, want["indices"])
    assert smax.dtype == torch.float32 and tuple(smax.shape) == (B, 1, S, HEADS)
    query = torch.cat([x["q"], x["q_rope"]], -1).permute(1, 2, 0, 3)
    key = torch.cat([x["latent"], x["k_rope"]], -1).permute(1, 2, 0, 3)
    scores = (query @ key.transpose(-1, -2) * SCALE).masked_fill(want["mask"], float("-inf"))
    lse = torch.logsumexp(scores, -1).transpose(1, 2).unsqueeze(1)  # [B, 1, S, N]
    close(smax.double() + ssum.double().log(), lse, 1e-6)


def _sfa_args(**change):
    bf = torch.bfloat16
    args = {"query": torch.zeros(1, 4, 8, 512, dtype=bf), "key": torch.zeros(1, 4, 1, 512, dtype=bf),
            "value": torch.zeros(1, 4, 1, 512, dtype=bf),
            "sparse_indices": torch.tensor([0, 1, -1, -1], dtype=torch.int32).expand(1, 4, 1, 4).contiguous(),
            "scale_value": 0.1, "query_rope": torch.zeros(1, 4, 8, 64, dtype=bf),
            "key_rope": torch.zeros(1, 4, 1, 64, dtype=bf), "attention_mode": 2}
    args.update(change)
    return args


def test_sparse_attention_takes_bf16_and_returns_the_documented_outputs():
    out, smax, ssum = sfa(**_sfa_args(return_softmax_lse=True))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (1, 4, 8, 512)
    assert tuple(smax.shape) == tuple(ssum.shape) == (1, 1, 4, 8)
    assert sfa(**_sfa_args())[1].numel() == 0


@pytest.mark.parametrize("change, error, words", [
    ({"attention_mode": 0}, FakeNpuError, "attention_mode"),
    ({"query": torch.zeros(1, 4, 8, 512)}, FakeNpuError, "dtype"),
    ({"query": torch.zeros(1, 4, 6, 512, dtype=torch.bfloat16),
      "query_rope": torch.zeros(1, 4, 6, 64, dtype=torch.bfloat16)}, FakeNpuError, "query heads"),
    ({"key": torch.zeros(1, 4, 1, 576, dtype=torch.bfloat16),
      "value": torch.zeros(1, 4, 1, 576, dtype=torch.bfloat16)}, FakeNpuError, "head dim"),
    ({"key_rope": torch.zeros(1, 4, 1, 32, dtype=torch.bfloat16)}, FakeNpuError, "head dim"),
    ({"sparse_indices": torch.zeros(1, 4, 1, 4, dtype=torch.int64)}, FakeNpuError, "int32"),
    ({"sparse_indices": torch.full((1, 4, 1, 4), 4, dtype=torch.int32)}, FakeNpuError, r"\[0, 4\)"),
    ({"sparse_indices": torch.tensor([-1, 0, -1, -1], dtype=torch.int32).expand(1, 4, 1, 4).contiguous()},
     FakeNpuError, "valid entries first"),
    ({"sparse_mode": 2}, FakeNpuError, "sparse_mode"),
    ({"query_rope": None}, FakeNpuError, "query_rope"),
    ({"sparse_block_size": 2}, NotImplementedError, "block"),
    ({"layout_kv": "PA_BSND"}, NotImplementedError, "PageAttention"),
])
def test_sparse_attention_rejects_what_the_op_rejects(change, error, words):
    with pytest.raises(error, match=words):
        sfa(**_sfa_args(**change))


# ------------------------------------------------------------ npu_sparse_lightning_indexer_grad_kl_loss

def run_kl(x, indices, **change):
    _, _, smax, ssum = run_sfa(x, indices)
    args = dict(query=bsnd(x["q"]), key=bsnd(x["latent"]), query_index=bsnd(x["index_q"]),
                key_index=bsnd(x["index_k"]), weights=bsnd(x["weights"]),
                sparse_indices=indices.unsqueeze(2).to(torch.int32), softmax_max=smax, softmax_sum=ssum,
                scale_value=SCALE, query_rope=bsnd(x["q_rope"]), key_rope=bsnd(x["k_rope"]))
    args.update(change)
    with fake_dsa_ops.wide_dtypes():
        return kl_loss(**args)


def test_kl_loss_and_its_grads_match_the_hosts_indexer_loss(host):
    """The op sums over queries; the host's torch loss is the mean (its fused caller divides)."""
    x, want = host["inputs"], host["host"]
    d_qi, d_ki, d_w, loss = run_kl(x, want["indices"])
    assert loss.dtype == torch.float32 and tuple(loss.shape) == (1,)
    close(loss / (B * S), want["loss"].reshape(1), 1e-5)
    close(d_qi / (B * S), bsnd(want["loss_d_index_q"]), 1e-4)
    close(d_ki / (B * S), bsnd(want["loss_d_index_k"]), 1e-4)
    close(d_w / (B * S), bsnd(want["loss_d_weights"]), 1e-4)


def test_kl_loss_grads_are_those_of_the_summed_loss(host):
    """Autograd-free check of dI = softmax(I) - p through d_weights on one query row."""
    x, want = host["inputs"], host["host"]
    row = 9
    _, _, d_w, _ = run_kl(x, want["indices"])
    idx = want["indices"][0, row]
    qi, ki, w = x["index_q"][row, 0], x["index_k"][:, 0, 0], x["weights"][row, 0]
    relu = torch.relu(qi @ ki[idx].T)                        # [heads, K]
    y = torch.softmax((relu * w[:, None]).sum(0), -1)
    query = torch.cat([x["q"][row, 0], x["q_rope"][row, 0]], -1)
    key = torch.cat([x["latent"][:, 0, 0], x["k_rope"][:, 0, 0]], -1)
    p = torch.softmax(query @ key[idx].T * SCALE, -1).sum(0)
    p = p / p.sum()
    close(d_w[0, row], relu @ (y - p), 1e-6)


@pytest.mark.parametrize("change, words", [
    ({"sparse_mode": 0}, "sparse_mode"),
    ({"softmax_max": torch.zeros(B, 1, S, HEADS, dtype=torch.float64)}, "softmax_max"),
    ({"softmax_sum": torch.zeros(B, 1, S, 4)}, "softmax_sum"),
    ({"layout": "SBH"}, "layout"),
])
def test_kl_loss_rejects_what_the_op_rejects(host, change, words):
    x, want = host["inputs"], host["host"]
    with pytest.raises(FakeNpuError, match=words):
        run_kl(x, want["indices"], **change)


def test_kl_loss_takes_only_the_documented_head_counts(host):
    x, want = host["inputs"], host["host"]
    few = {n: x[n][:, :, :4] for n in ("index_q", "weights")}
    with pytest.raises(FakeNpuError, match="index heads"):
        run_kl(x, want["indices"], query_index=bsnd(few["index_q"]), weights=bsnd(few["weights"]))
    assert INDEX_HEADS in fake_dsa_ops.KL_INDEX_HEADS


def test_kl_loss_takes_bf16_without_the_test_switch(host):
    x, want = host["inputs"], host["host"]
    _, _, smax, ssum = run_sfa(x, want["indices"])
    bf = {n: bsnd(x[n]).to(torch.bfloat16) for n in ("q", "latent", "index_q", "index_k", "weights",
                                                      "q_rope", "k_rope")}
    out = kl_loss(bf["q"], bf["latent"], bf["index_q"], bf["index_k"], bf["weights"],
                  want["indices"].unsqueeze(2).to(torch.int32), smax, ssum, SCALE,
                  query_rope=bf["q_rope"], key_rope=bf["k_rope"])
    assert [t.dtype for t in out] == [torch.bfloat16] * 3 + [torch.float32]
    with pytest.raises(FakeNpuError, match="dtype"):
        kl_loss(bsnd(x["q"]), bf["latent"], bf["index_q"], bf["index_k"], bf["weights"],
                want["indices"].unsqueeze(2).to(torch.int32), smax, ssum, SCALE)


# ------------------------------------------------------------ the host's fused callers on the stand-ins

def test_the_hosts_fused_indexer_picks_what_its_torch_path_picks(host):
    """``fused_lightning_indexer`` casts to bf16: its picks equal the torch path's on the
    same bf16-rounded inputs; the kvallgather twin at CP 1 (two query halves against key
    prefixes, causality from the lower-right vertex) equals the torch path unrounded (it
    hands the op the model's dtype, float32 here, taken under the wide switch)."""
    want = host["host"]
    assert want["fused_indices"].dtype == torch.int32
    assert torch.equal(want["fused_indices"].long(), want["rounded_torch_indices"])
    assert torch.equal(want["kvallgather_indices"].long(), want["indices"])


def test_the_hosts_kvallgather_sparse_attention_equals_its_sparse_mask(host):
    """``fused_sparse_flash_attention_kvallgather`` at CP 1 (float64 under the wide switch)
    against the dense attention under ``generate_sparse_mask``, output and grads."""
    want = host["host"]
    close(want["fused_out"], want["out"], 1e-12)
    for name in ("q", "q_rope", "latent", "k_rope"):
        close(want[f"fused_d_{name}"], want[f"d_{name}"], 1e-12)


def test_the_hosts_fused_indexer_loss_equals_its_torch_loss(host):
    """``fused_sparse_lightning_indexer_kl_loss`` (LILossTrain: the op's summed loss over
    B*S, its grads scaled by the caller) against ``compute_dsa_indexer_loss``."""
    want = host["host"]
    close(want["fused_loss"].reshape(1), want["loss"].reshape(1), 1e-5)
    for name in ("index_q", "index_k", "weights"):
        close(want[f"fused_loss_d_{name}"], want[f"loss_d_{name}"], 1e-5)


def test_the_standin_torch_npu_carries_the_dsa_ops():
    module = fake_torch_npu._build()
    for name, op in fake_dsa_ops.OPS.items():
        assert getattr(module, name) is op
