"""The fixes the host's own packed-document DSA run needs before it can serve as the CP 1
reference of LAGA's: MindSpeed-LLM (master) runs DSA under ``--reset-attention-mask`` on
its fused ops only, and calls each of the three ops in a way the op rejects or misreads,
so as shipped its packed DSA cannot run at CP 1, nor under ulysses at any CP (the same
calls; its kvallgather functions were not tried), LAGA or not.

- ``npu_lightning_indexer`` (``dsa_indexer.fused_lightning_indexer``) gets the 4-D BSND
  tensors ``[1, T, N, D]`` (weights ``[1, T, N]``) with ``layout_query="TND"``, and its
  picks are read back as ``[1, T, 1, K]``. The op takes TND inputs 3-D and returns
  ``[T, 1, K]``; its tiling rejects any other rank ("The shape dim of query must be 3",
  hicann/ops-transformer ``lightning_indexer_tiling.cpp``). Fix: the call without the
  batch axis, the batch axis put back on its outputs.
- The picks of a TND call count from each query's document start, and the host hands
  them unchanged to the two ops below, which read the whole sequence as one block: a
  query of the second document would attend to the first document's keys. Fix: each
  pick shifted by its query's document start (-1 stays).
- ``npu_sparse_flash_attention`` (``custom_dot_product_attention``, its branch for CP 1
  and ulysses, which has no TND case): under TND the module has flattened query, key
  and value to ``[T, N, D]`` and calls the op with ``layout_query="BSND"``, which takes
  them 4-D; and its lengths ``[query.shape[1]]`` then hold the head count, not ``T``, so
  only the first N queries would be computed. Fix: the call on ``[1, T, N, D]`` with the
  lengths ``[T]``, the output back to ``[T, N, D]``.
- ``npu_sparse_lightning_indexer_grad_kl_loss`` (``dsa_indexer.LILossTrain``) gets
  ``layout="BSND"`` with the documents' cumulative ends as ``actual_seq_qlen/klen``,
  where BSND takes one length per sample. Fix: the call without them (one sample, the
  whole sequence), which with every pick inside its query's document is the
  per-document loss.

With these the host's CP 1 run trains packed documents as LAGA's CP 2 run does
(tests/loop/test_dsa_loop.py). :func:`install_indexer` and :func:`install_attention`
give the host's ``dsa_indexer`` and ``custom_dot_product_attention`` modules, and only
them, a ``torch_npu`` with these calls fixed; the loop installs them in the host's own
runs of packed DSA only (``HOST_PACKED_DSA_ENV``, tests/support/loop/dsa_loop.py).
LAGA's sparse stages call ``torch_npu`` from their own modules.
"""
from __future__ import annotations

import types

import torch

HOST_PACKED_DSA_ENV = "LAGA_LOOP_HOST_PACKED_DSA"
INDEXER_MODULE = "mindspeed_llm.tasks.models.transformer.dsa_indexer"
ATTENTION_MODULE = "mindspeed_llm.core.transformer.custom_dot_product_attention"


def install_indexer(module) -> None:
    _proxy(module, npu_lightning_indexer=_indexer,
           npu_sparse_lightning_indexer_grad_kl_loss=_kl_loss)


def install_attention(module) -> None:
    _proxy(module, npu_sparse_flash_attention=_attention)


def _proxy(module, **fixes):
    """module.torch_npu, with each named op wrapped by its fix."""
    real = module.torch_npu
    proxy = types.SimpleNamespace(**{name: getattr(real, name) for name in dir(real)
                                     if not name.startswith("__")})
    for name, fix in fixes.items():
        setattr(proxy, name, fix(getattr(real, name)))
    module.torch_npu = proxy


def _one_sample(tensor, name):
    if tensor.shape[0] != 1:  # packed batches are one sample (micro-batch 1)
        raise ValueError(f"{name}: a packed call of {tensor.shape[0]} samples; the fix takes one")
    return tensor[0]


def _indexer(op):
    def npu_lightning_indexer(query, key, weights, *, layout_query="BSND", **kwargs):
        if layout_query != "TND" or query.dim() != 4:
            return op(query, key, weights, layout_query=layout_query, **kwargs)
        indices, values = op(_one_sample(query, "query"), key[0], weights[0],
                             layout_query=layout_query, **kwargs)
        indices = _sequence_picks(indices, kwargs["actual_seq_lengths_query"])
        return indices.unsqueeze(0), (values.unsqueeze(0) if values.numel() else values)

    return npu_lightning_indexer


def _sequence_picks(indices, ends):
    """[T, 1, K] picks counted from each query's document start -> from the sequence's."""
    ends = torch.as_tensor(ends, dtype=torch.int64).reshape(-1)
    document = torch.searchsorted(ends, torch.arange(indices.shape[0]), right=True)
    starts = torch.cat([ends.new_zeros(1), ends])[document].to(indices.dtype)
    return torch.where(indices >= 0, indices + starts.view(-1, 1, 1), indices)


def _attention(op):
    def npu_sparse_flash_attention(query, key, value, *args, layout_query="BSND", **kwargs):
        if layout_query != "BSND" or query.dim() != 3:
            return op(query, key, value, *args, layout_query=layout_query, **kwargs)
        whole = torch.tensor([query.shape[0]], dtype=torch.int32)
        kwargs.update(actual_seq_lengths_query=whole, actual_seq_lengths_kv=whole)
        out, *rest = op(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), *args,
                        layout_query=layout_query, **kwargs)
        return (_one_sample(out, "attention_out"), *rest)

    return npu_sparse_flash_attention


def _kl_loss(op):
    def npu_sparse_lightning_indexer_grad_kl_loss(*args, layout="BSND", actual_seq_qlen=None,
                                                  actual_seq_klen=None, **kwargs):
        if layout == "BSND":  # one sample: its length is the whole sequence
            actual_seq_qlen = actual_seq_klen = None
        return op(*args, layout=layout, actual_seq_qlen=actual_seq_qlen,
                  actual_seq_klen=actual_seq_klen, **kwargs)

    return npu_sparse_lightning_indexer_grad_kl_loss
