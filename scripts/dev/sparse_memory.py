"""Sparse MLA's torch path: bytes kept from forward to backward, and the peak, against S.

One process (CP 1: this rank's queries are the whole sequence, s = S), the torch kernel
on every stage with the indexer loss, float32, small dims but DeepSeek-V3.2's shape of
the problem (every query scores every key). For each sequence length it runs the call
forward and backward twice, interleaved:

- ``autograd``: the indexer's top-k as plain autograd through ``sparse/indexer.py``'s
  ``index_scores`` and ``top_k`` (what the torch kernel ran before ``IndexerTopK``);
- ``IndexerTopK``: the torch kernel as it is (``sparse/topk_scores.py``).

``saved``: the bytes of the distinct storages autograd keeps for backward
(``torch.autograd.graph.saved_tensors_hooks``), ``of them S_local x S``: the storages of
at least s * S elements (a view counts its whole storage); ``peak``: the CPU allocator's peak over forward and
backward above the level before (``mindspeed_laga.tools.cpu_peak``). Deterministic:
byte counts, not times.

    python scripts/dev/sparse_memory.py [--seq-lens 1024 2048 4096]
"""
from __future__ import annotations

import argparse

import torch

from mindspeed_laga.sparse import indexer, torch_stages
from mindspeed_laga.sparse.form import sparse_laga_attention
from mindspeed_laga.tools.cpu_peak import CpuPeak

# topk * d_c < S: the picked latents [b, s, k, d_c] stay below s * S elements, so the
# "S_local x S" column holds only what grows with both lengths
DIMS = dict(b=1, heads=8, d_n=16, d_r=8, d_v=16, d_c=32, index_heads=4, index_dim=32,
            topk=16)


def autograd_topk(index_query, index_key, index_weights, query_pos, index_topk):
    """The torch indexer's top-k through plain autograd (the path before IndexerTopK)."""
    key_pos = torch.arange(index_key.shape[0], device=index_key.device)
    return indexer.top_k(indexer.index_scores(index_query, index_key, index_weights,
                                              query_pos, key_pos), index_topk, query_pos)


VARIANTS = {"autograd": autograd_topk, "IndexerTopK": torch_stages.indexer_topk}


def inputs(seq_len: int):
    d, g = DIMS, torch.Generator().manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=g).requires_grad_()

    s, b, n = seq_len, d["b"], d["heads"]
    return (randn(s, b, n, d["d_n"] + d["d_r"]), randn(s, b, d["d_c"]), randn(s, b, d["d_r"]),
            randn(n * (d["d_n"] + d["d_v"]), d["d_c"]),
            randn(s, b, d["index_heads"], d["index_dim"]), randn(s, b, d["index_dim"]),
            randn(s, b, d["index_heads"]))


class SavedBytes:
    """The distinct storages autograd saves for backward, and those of S_local x S size."""

    def __init__(self, square: int):
        self.square = square
        self.storages = {}
        self.large = {}

    def pack(self, tensor):  # a view keeps its whole storage alive
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        self.storages[key] = storage.nbytes()
        if storage.nbytes() // tensor.element_size() >= self.square:
            self.large[key] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor


def measure(seq_len: int, topk_fn):
    """(saved bytes, of them S_local x S, peak bytes) of one forward + backward."""
    x = inputs(seq_len)
    saved = SavedBytes(seq_len * seq_len)
    original = torch_stages.indexer_topk
    torch_stages.indexer_topk = topk_fn
    try:
        with CpuPeak() as peak:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                got = sparse_laga_attention(
                    *x, index_topk=DIMS["topk"], softmax_scale=0.1, qk_head_dim=DIMS["d_n"],
                    v_head_dim=DIMS["d_v"], layout="contiguous", indexer_loss_coeff=0.1)
            (got.output.sum() + got.indexer_loss).backward()
            del got
    finally:
        torch_stages.indexer_topk = original
    return sum(saved.storages.values()), sum(saved.large.values()), peak.bytes


def mib(n) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:.1f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    args = parser.parse_args(argv)
    print(f"dims {DIMS}, float32, CP 1 (s = S), torch kernel on every stage, with the loss")
    print("| S | path | saved MiB | of them S_local x S MiB | peak MiB |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for seq_len in args.seq_lens:
        for name, topk_fn in VARIANTS.items():
            saved, large, peak = measure(seq_len, topk_fn)
            print(f"| {seq_len} | {name} | {mib(saved)} | {mib(large)} | {mib(peak)} |")


if __name__ == "__main__":
    main()
